"""ERNIE-4.5-MoE equals transformers: logits, greedy generation, cached decoding.

Every variant has a non-zero e_score_correction_bias and init std 0.3 (with 0.02 greedy output
is one repeated token, a useless oracle).
"""

import hf_oracle as hf
import pytest
import torch

from moeserve.models import CheckpointReader, StepBatch, load_model

VARIANTS = {
    # layer 0 dense, layers 1-3 MoE, 2 shared experts (the published 21B-A3B shape, scaled down)
    "dense_first_2_shared": dict(),
    # no shared experts; MoE layers 1 and 2 only (explicit end index), layer 3 dense again
    "no_shared_end_2": dict(moe_num_shared_experts=0, moe_layer_end_index=2),
    # 1 shared expert; every second layer from 0 (interval 2: layers 1 and 3), biases everywhere, untied head
    "one_shared_interval_2_bias": dict(
        moe_num_shared_experts=1,
        moe_layer_start_index=0,
        moe_layer_interval=2,
        use_bias=True,
        tie_word_embeddings=False,
        moe_k=2,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    path = hf.save(hf.build_ernie(seed=1, **VARIANTS[request.param]), tmp_path_factory.mktemp(request.param))
    return hf.load_oracle(path), load_model(path), path, request.param


def test_moe_layers_follow_start_end_interval(case):
    _, model, _, name = case
    expected = {"dense_first_2_shared": (1, 2, 3), "no_shared_end_2": (1, 2), "one_shared_interval_2_bias": (1, 3)}[
        name
    ]
    assert model.config.moe_layer_ids == expected
    assert (
        model.moe_info.num_shared_experts
        == {"dense_first_2_shared": 2, "no_shared_end_2": 0, "one_shared_interval_2_bias": 1}[name]
    )


def test_logits_equal_transformers_within_1e_4(case):
    oracle, model, _, _ = case
    ids = hf.prompts(2, 40)
    with torch.no_grad():
        ref = oracle(ids).logits
    got = model(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4


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
    outs = [model.logits(model.step(seq[:4], StepBatch.prefill(["a"], [4]), cache))]
    for t in range(4, 24):
        outs.append(model.logits(model.step(seq[t : t + 1], StepBatch(("a",), (1,), (t,)), cache)))
    assert (torch.cat(outs) - full).abs().max().item() < 1e-4  # std-0.3 weights: logits ~5, fp32 rounding ~1e-5


def test_tied_embeddings_have_no_lm_head_tensor(case):
    _, model, path, name = case
    with CheckpointReader(path) as r:
        assert r.has("lm_head.weight") == (name == "one_shared_interval_2_bias")
    if name != "one_shared_interval_2_bias":
        assert model.lm_head.weight is model.embed


def test_correction_bias_selects_but_does_not_weigh(tmp_path):
    """The bias changes which experts are chosen; the weights are the unbiased, renormalised softmax."""
    path = hf.save(hf.build_ernie(seed=3), tmp_path / "m")
    model = load_model(path)
    block = model.moe_blocks[0]
    u = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    routed = block.route(u)
    probs = torch.softmax(u @ block.gate_weight.t(), dim=-1)
    unbiased_ids = torch.topk(probs, 4, dim=-1).indices
    changed = (routed.ids.sort(-1).values != unbiased_ids.sort(-1).values).any(-1)
    assert changed.sum() > 10, "the correction bias must change the selection for some tokens"
    expected = probs.gather(-1, routed.ids)
    assert torch.allclose(routed.weights, expected / expected.sum(-1, keepdim=True), atol=1e-6)
    assert routed.weights_on_input is False


def test_mtp_tensors_are_ignored(tmp_path):
    path = hf.save(hf.build_ernie(seed=4), tmp_path / "src")
    tensors = hf.read_all(path)
    tensors["mtp_block.0.self_attn.q_proj.weight"] = torch.randn(64, 64)
    tensors["model.mtp_emb_norm.0.weight"] = torch.randn(64)
    dst = hf.rewrite(path, tmp_path / "with_mtp", tensors)
    with CheckpointReader(dst) as r:
        assert not [n for n in r.names() if "mtp" in n]
    ids = hf.prompts(1, 10)
    assert torch.equal(load_model(dst)(ids), load_model(path)(ids))
