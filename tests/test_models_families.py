"""Qwen3-MoE, Mixtral and GPT-OSS equal transformers on checkpoints transformers itself built
and saved (the held-out shape of a published checkpoint: its names, its config spelling):
logits within 1e-4, greedy generation token-identical, cached and paged decoding equal the full
forward. Every variant's init std is 0.2 (informative greedy output) and its norms and biases
are random (tests/hf_oracle.py)."""

import functools
import json

import hf_oracle as hf
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL
from triton_util import needs_triton

from moeserve.models import CheckpointError, CheckpointReader, PagedBatch, StepBatch, load_model
from moeserve.models import attention as attn

BUILD = {"qwen3_moe": hf.build_qwen3_moe, "mixtral": hf.build_mixtral, "gpt_oss": hf.build_gpt_oss}
VARIANTS = {
    # layer 0 dense (mlp_only_layers), norm_topk_prob
    "qwen3_moe/dense_first": ("qwen3_moe", dict()),
    # MoE every second layer (decoder_sparse_step 2: layers 1, 3), no renormalisation, a
    # sliding window of 8, attention biases, tied embeddings
    "qwen3_moe/step2_window_bias_tied": (
        "qwen3_moe",
        dict(
            mlp_only_layers=[],
            decoder_sparse_step=2,
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=8,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral/plain": ("mixtral", dict()),
    "mixtral/window8_top1": ("mixtral", dict(sliding_window=8, num_experts_per_tok=1)),
    # sliding, full, sliding, full; YaRN; the clamp at 2
    "gpt_oss/alternating": ("gpt_oss", dict()),
    # three sliding layers then a full one, plain RoPE, 4 experts of a wider MLP top-3
    "gpt_oss/sliding_default_rope": (
        "gpt_oss",
        dict(
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            num_local_experts=4,
            num_experts_per_tok=3,
            intermediate_size=48,
        ),
    ),
}
MOE_LAYERS = {
    "qwen3_moe/dense_first": (1, 2, 3),
    "qwen3_moe/step2_window_bias_tied": (1, 3),
    "mixtral/plain": (0, 1, 2),
    "mixtral/window8_top1": (0, 1, 2),
    "gpt_oss/alternating": (0, 1, 2, 3),
    "gpt_oss/sliding_default_rope": (0, 1, 2, 3),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = hf.save(BUILD[family](seed=1, **overrides), tmp_path_factory.mktemp(request.param.replace("/", "-")))
    return hf.load_oracle(path), load_model(path), path, request.param


def test_the_family_and_its_moe_layers_are_read_from_the_config(case):
    oracle, model, _, name = case
    assert model.config.family == VARIANTS[name][0]
    assert model.config.moe_layer_ids == MOE_LAYERS[name]
    # where transformers put its sparse blocks
    sparse = tuple(
        i
        for i, layer in enumerate(oracle.model.layers)
        if hasattr(layer.mlp, "experts") or hasattr(layer, "block_sparse_moe")
    )
    assert sparse == MOE_LAYERS[name]


def test_logits_equal_transformers_within_1e_4(case):
    oracle, model, _, _ = case
    ids = hf.prompts(2, 40)
    with torch.no_grad():
        ref = oracle(ids).logits
    got = model(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < FP32_LOGITS_ATOL


def test_greedy_generation_of_32_tokens_is_token_identical(case):
    oracle, model, _, _ = case
    ids = hf.prompts(2, 6, seed=1)
    ref = hf.hf_greedy(oracle, ids, 32)
    got = model.generate(ids, max_new_tokens=32, ignore_eos=True)
    assert torch.equal(got, ref)
    assert len(set(got[0, 6:].tolist())) > 4, "the oracle is informative"


def test_cached_decoding_equals_the_full_forward(case):
    _, model, _, _ = case
    seq = hf.prompts(1, 24, seed=2)[0]
    full = model(seq[None])[0]
    cache = model.new_cache()
    outs = [model.logits(model.step(seq[:5], StepBatch.prefill(["a"], [5]), cache))]
    for t in range(5, 24):
        outs.append(model.logits(model.step(seq[t : t + 1], StepBatch(("a",), (1,), (t,)), cache)))
    assert (torch.cat(outs) - full).abs().max().item() < FP32_LOGITS_ATOL


def _paged_logits(model, seqs, chunks):
    """Each sequence prefilled in ``chunks`` (new tokens per step), all sequences in one paged
    batch per step: the logits of every position [sum of lengths, V] in sequence order."""
    cache, bs = model.new_paged_cache(num_blocks=32, block_size=4), 4
    tables = [list(range(s * 8, s * 8 + 8)) for s in range(len(seqs))]
    done, rows = [0] * len(seqs), [[] for _ in seqs]
    for n in chunks:
        live = [s for s, q in enumerate(seqs) if done[s] < len(q)]
        lens = [min(n, len(seqs[s]) - done[s]) for s in live]
        batch = PagedBatch.build(lens, [done[s] for s in live], [tables[s] for s in live], bs)
        ids = torch.cat([seqs[s][done[s] : done[s] + k] for s, k in zip(live, lens)])
        hidden = model.logits(model.step(ids, batch, cache))
        for s, piece in zip(live, hidden.split(lens)):
            rows[s].append(piece)
            done[s] += piece.shape[0]
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_paged_steps_equal_the_full_forward(case, backend, monkeypatch):
    """Prefill chunks of 5 crossing the window of 8, then decodes, two sequences in each step,
    through the paged cache (the Triton kernel under the interpreter: what a GPU router runs)."""
    _, model, _, _ = case
    monkeypatch.setattr(
        "moeserve.models.layers.paged_attention", functools.partial(attn.paged_attention, backend=backend)
    )
    seqs = [hf.prompts(1, 20, seed=4)[0], hf.prompts(1, 13, seed=5)[0]]
    got = _paged_logits(model, seqs, [5, 5, 1, 1, 1, 1, 5, 5])
    for s, q in enumerate(seqs):
        assert (got[s] - model(q[None])[0]).abs().max().item() < FP32_LOGITS_ATOL


# -- each feature acts in the tiny models (so the equalities above cover it) ------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = hf.save(hf.build_gpt_oss(seed=1), tmp_path_factory.mktemp("gpt_oss"))
    return path, load_model(path)(hf.prompts(1, 32, seed=3))


def _changed(src, dst, config=None, tensors=None, ids=None):
    """Logits of the checkpoint at ``src`` rewritten with config / tensor changes."""
    cfg = json.loads((src / "config.json").read_text())
    t = hf.read_all(src)
    hf.rewrite(src, dst, {**t, **(tensors(t) if tensors else {})}, {**cfg, **(config or {})})
    return load_model(dst)(ids if ids is not None else hf.prompts(1, 32, seed=3))


@pytest.mark.parametrize(
    "change",
    [
        dict(config=dict(sliding_window=4096)),  # the window of 8 acts within 32 tokens
        dict(config=dict(swiglu_limit=100.0)),  # the clamp at 2 acts
        dict(config=dict(rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),  # YaRN acts
        dict(tensors=lambda t: {k: torch.full_like(v, -1e4) for k, v in t.items() if k.endswith("sinks")}),
        dict(tensors=lambda t: {k: torch.zeros_like(v) for k, v in t.items() if k.endswith("router.bias")}),
        dict(tensors=lambda t: {k: torch.zeros_like(v) for k, v in t.items() if k.endswith("_proj_bias")}),
    ],
    ids=["window", "clamp", "yarn", "sinks", "router_bias", "expert_biases"],
)
def test_each_gpt_oss_feature_changes_the_tiny_model(gpt_oss, tmp_path, change):
    path, base = gpt_oss
    assert (_changed(path, tmp_path / "m", **change) - base).abs().max() > 1e-2


def test_qwen3_qk_norm_weights_change_the_tiny_model(tmp_path):
    path = hf.save(hf.build_qwen3_moe(seed=1), tmp_path / "src")
    base = load_model(path)(hf.prompts(1, 32, seed=3))
    ones = _changed(
        path,
        tmp_path / "m",
        tensors=lambda t: {k: torch.ones_like(v) for k, v in t.items() if "_norm." in k and "attn" in k},
    )
    assert (ones - base).abs().max() > 1e-2


def test_an_mxfp4_gpt_oss_checkpoint_is_refused_by_name(tmp_path, capsys):
    """By the loader, and by every command that takes a model as a usage error (exit 2) with the
    same message, before any process starts."""
    from moeserve.cli import main

    path = hf.save(hf.build_gpt_oss(seed=2), tmp_path / "src")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(cfg))
    message = "quant_method 'mxfp4': GPT-OSS's MXFP4 experts are not served yet"
    with pytest.raises(CheckpointError, match=message):
        load_model(path)
    capsys.readouterr()
    for argv in (
        ["serve", str(path)],
        ["up", "--model", str(path)],
        ["generate", "--model", str(path), "--prompt-ids", "1"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"moeserve {argv[0]}: error: " in err and message in err and "serve a bf16 checkpoint" in err


def test_fp8_experts_with_biases_are_refused(tmp_path):
    path = hf.save(hf.build_gpt_oss(seed=2), tmp_path / "src")
    with pytest.raises(CheckpointError, match="FP8 routed experts with biases are not served"):
        load_model(path, quantization="fp8")


def test_gpt_oss_experts_are_held_de_interleaved_with_their_biases(tmp_path):
    oracle = hf.build_gpt_oss(seed=2)
    path = hf.save(oracle, tmp_path / "src")
    with CheckpointReader(path) as r:
        got = r.read_expert(1, 3)
    hf_experts = oracle.model.layers[1].mlp.experts
    gu, b = hf_experts.gate_up_proj[3].detach(), hf_experts.gate_up_proj_bias[3].detach()
    i = gu.shape[1] // 2
    assert torch.equal(got["gate_up"][:, :i], gu[:, 0::2]) and torch.equal(got["gate_up"][:, i:], gu[:, 1::2])
    assert torch.equal(got["gate_up_bias"], torch.cat([b[0::2], b[1::2]]))
    assert torch.equal(got["down_bias"], hf_experts.down_proj_bias[3].detach())
    spec = load_model(path, load_experts=False).moe_info.expert_spec
    assert (spec.activation, spec.has_bias, spec.swiglu_limit) == ("clamped_swiglu", True, 2.0)
    assert set(spec.shapes) == {"gate_up", "down", "gate_up_bias", "down_bias"}
