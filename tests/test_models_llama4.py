"""Llama 4 (text) equals transformers: logits, greedy generation, cached decoding, layouts.

The tiny models use chunk size 8 and floor_scale 4, so that chunked local attention and
attention temperature tuning both act within the test lengths (tests below show they do).
"""

import json
import shutil

import hf_oracle as hf
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL

from moeserve.models import CheckpointReader, load_model

VARIANTS = {
    # every layer MoE; layer 3 NoPE (temperature tuning), layers 0-2 chunked RoPE with llama3 scaling
    "all_moe": dict(interleave_moe_layer_step=1),
    # MoE layers 1 and 3 (dense 0 and 2)
    "interleave_2": dict(interleave_moe_layer_step=2),
    # top-2 (k copies each pre-scaled), no qk-norm, tied embeddings, attention biases, explicit NoPE layers
    "top2_tied_bias": dict(
        num_experts_per_tok=2,
        use_qk_norm=False,
        tie_word_embeddings=True,
        attention_bias=True,
        no_rope_layers=[1, 0, 1, 0],
        moe_layers=[0, 2, 3],
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    path = hf.save(hf.build_llama4(seed=1, **VARIANTS[request.param]), tmp_path_factory.mktemp(request.param))
    return hf.load_oracle(path), load_model(path), path


@pytest.fixture(scope="module")
def all_moe(tmp_path_factory):
    path = hf.save(hf.build_llama4(seed=2), tmp_path_factory.mktemp("all_moe"))
    return hf.load_oracle(path), load_model(path), path


def test_logits_equal_transformers_within_1e_4(case):
    oracle, model, _ = case
    ids = hf.prompts(2, 40)
    with torch.no_grad():
        ref = oracle(ids).logits
    got = model(ids)
    assert got.shape == ref.shape == (2, 40, hf.V)
    assert (got - ref).abs().max().item() < 1e-4


def test_greedy_generation_of_32_tokens_is_token_identical(case):
    oracle, model, _ = case
    ids = hf.prompts(2, 6, seed=1)
    ref = hf.hf_greedy(oracle, ids, 32)
    got = model.generate(ids, max_new_tokens=32, ignore_eos=True)
    assert got.shape == (2, 38)
    assert torch.equal(got, ref)
    assert len(set(got[0, 6:].tolist())) > 4, "the oracle is informative: greedy output is not one repeated token"


def test_cached_decoding_equals_the_full_forward(case):
    _, model, _ = case
    seq = hf.prompts(1, 30, seed=2)[0]
    full = model(seq[None])[0]  # [30, V]
    cache, step_logits = model.new_cache(), []
    from moeserve.models import StepBatch

    h = model.step(seq[:5], StepBatch((7,), (5,), (0,)), cache)
    step_logits.append(model.logits(h))
    for t in range(5, 30):
        h = model.step(seq[t : t + 1], StepBatch((7,), (1,), (t,)), cache)
        step_logits.append(model.logits(h))
    assert (torch.cat(step_logits) - full).abs().max().item() < FP32_LOGITS_ATOL


def _with_config(path, dst, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copy(path / "model.safetensors", dst / "model.safetensors")
    return load_model(dst)


def test_chunked_attention_acts_within_the_test_length(all_moe, tmp_path):
    _, model, path = all_moe
    unchunked = _with_config(path, tmp_path / "m", attention_chunk_size=None, layer_types=None)
    ids = hf.prompts(1, 24, seed=3)
    diff = (model(ids) - unchunked(ids)).abs().amax(dim=-1)[0]  # [T]
    assert diff[:8].max() < 1e-6, "the first chunk (positions 0..7) sees the same keys either way"
    assert diff[8:].min() > 1e-4


def test_temperature_tuning_acts_from_position_floor_scale_minus_1(all_moe, tmp_path):
    _, model, path = all_moe
    untuned = _with_config(path, tmp_path / "m", attn_temperature_tuning=False)
    ids = hf.prompts(1, 12, seed=4)
    diff = (model(ids) - untuned(ids)).abs().amax(dim=-1)[0]
    assert diff[:3].max() < 1e-6, "q is scaled by 1 + 0.1*log1p(floor((pos+1)/4)): identity below pos 3"
    assert diff[3:].min() > 1e-5


def test_llama3_rope_scaling_changes_the_model(all_moe, tmp_path):
    _, model, path = all_moe
    plain = _with_config(path, tmp_path / "m", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ids = hf.prompts(1, 12, seed=5)
    assert (model(ids) - plain(ids)).abs().max() > 1e-3


def test_per_expert_layout_loads_the_same_model(all_moe, tmp_path):
    _, model, path = all_moe
    dst = hf.rewrite(path, tmp_path / "per_expert", hf.llama4_per_expert(hf.read_all(path)))
    with CheckpointReader(dst) as r:
        assert [r.expert_layout(m) for m in range(4)] == ["per_expert"] * 4
    with CheckpointReader(path) as r:
        assert r.expert_layout(0) == "fused"
    ids = hf.prompts(2, 20, seed=6)
    assert torch.equal(load_model(dst)(ids), model(ids))


def test_sharded_checkpoint_matches_transformers(tmp_path):
    path = hf.save(hf.build_llama4(seed=3, interleave_moe_layer_step=2), tmp_path / "sharded", max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    ids = hf.prompts(2, 20, seed=7)
    with torch.no_grad():
        ref = hf.load_oracle(path)(ids).logits
    assert (load_model(path)(ids) - ref).abs().max() < 1e-4


def test_multimodal_published_checkpoint_matches_transformers_text_model(tmp_path):
    """Text weights under language_model., vision tensors present, Scout-style config.json
    (llama4 with text_config, rope_theta + rope_scaling llama3, torch_dtype, attn_temperature_tuning 4)."""
    text = hf.build_llama4(seed=4, interleave_moe_layer_step=1)
    tensors = {f"language_model.{k}": v for k, v in text.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors["vision_model.patch_embedding.linear.weight"] = torch.randn(32, 48, generator=g).to(torch.bfloat16)
    tensors["vision_model.model.layers.0.self_attn.q_proj.weight"] = torch.randn(32, 32, generator=g)
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 32, generator=g)
    b = hf.LLAMA4_BASE
    text_config = {
        "model_type": "llama4_text",
        "torch_dtype": "float32",
        "attn_temperature_tuning": 4,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "moe_layers": [0, 1, 2, 3],
        "no_rope_layers": [1, 1, 1, 0],
        "interleave_moe_layer_step": 1,
        "bos_token_id": 1,
        "eos_token_id": [2, 5, 7],
        "pad_token_id": 9,
        **{
            k: b[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "intermediate_size_mlp",
                "num_local_experts",
                "num_experts_per_tok",
                "attention_chunk_size",
                "floor_scale",
                "attn_scale",
                "max_position_embeddings",
            )
        },
    }
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "torch_dtype": "float32",
        "text_config": text_config,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32},
        "boi_token_index": 200080,
        "eoi_token_index": 200081,
        "image_token_index": 200092,
    }
    path = hf.rewrite(tmp_path, tmp_path / "scout_like", tensors, config)

    with CheckpointReader(path) as reader:
        assert reader.prefix == "language_model."
        assert not [n for n in reader.names() if "vision" in n or "projector" in n]
    model = load_model(path)
    assert model.config.model_type == "llama4" and model.config.eos_token_ids == (2, 5, 7)
    assert model.config.attn_temperature_tuning is True
    assert model.config.rope.type == "llama3"
    ids = hf.prompts(2, 30, seed=8)
    with torch.no_grad():
        ref = text(ids).logits
    assert (model(ids) - ref).abs().max() < 1e-4
    ref_gen = hf.hf_greedy(text, ids[:, :5], 32)
    assert torch.equal(model.generate(ids[:, :5], max_new_tokens=32, ignore_eos=True), ref_gen)
