"""The fp32 floor (moeserve.models.probe): a model against itself, each prompt alone vs all
prompts in one paged batch. Large attention scores, not routing, are what lift it above 1e-4:
ERNIE at hidden 1024 with init std 0.3 (the old GPU shape of benchmarks/gpu_correctness.py)
disagrees with itself by ~1e-3 with no routing flip, and by ~1e-5 at std 0.05."""

import numpy as np
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL

from moeserve.models import init_model, load_model
from moeserve.models.probe import compare, decode_alone, decode_batched, floor, recording

WIDE = dict(  # the GPU shape's widths, fewer layers and experts
    hidden_size=1024,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    moe_intermediate_size=128,
    moe_num_experts=8,
    moe_k=2,
    vocab_size=512,
)


def _prompts(vocab: int, count: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(4, 40, count)]


@pytest.mark.parametrize("std, ill", [(0.3, True), (0.05, False)])
def test_large_attention_scores_lift_the_floor_without_any_routing_flip(tmp_path, std, ill):
    model = load_model(init_model(tmp_path / "m", "ernie45", seed=5, initializer_range=std, **WIDE))
    report, _ = floor(model, _prompts(512), 8)
    assert report.flips == ()
    if ill:
        assert report.max_dlogit > 10 * FP32_LOGITS_ATOL
    else:
        assert report.max_dlogit < FP32_LOGITS_ATOL / 5


def test_a_tiny_model_agrees_with_itself_and_the_recorder_sees_every_position(tmp_path):
    model = load_model(init_model(tmp_path / "m", "ernie45", seed=2))
    prompts = _prompts(model.config.vocab_size, 3)
    report, tokens = floor(model, prompts, 6)
    assert report.max_dlogit < FP32_LOGITS_ATOL and report.flips == ()
    logits, routed = decode_alone(model, prompts[0], tokens[0])
    assert logits.shape == (6, model.config.vocab_size)
    assert [tuple(r.shape) for r in routed] == [(len(prompts[0]) + 5, model.config.top_k)] * model.config.num_moe_layers
    assert model.moe_blocks[0].__class__.__name__ != "_Recorded", "recording restores the blocks"


def test_a_flip_is_reported_with_its_position_and_the_gap_before_it(tmp_path):
    model = load_model(init_model(tmp_path / "m", "ernie45", seed=2))
    prompts = _prompts(model.config.vocab_size, 2)
    tokens = [floor(model, [p], 4)[1][0] for p in prompts]
    a = [decode_alone(model, p, t) for p, t in zip(prompts, tokens)]
    b = decode_batched(model, prompts, tokens)
    changed = [list(r) for r in b[1]]
    pos = len(prompts[1]) + 1  # routed with the second generated token: logits rows 0, 1 come before it
    ids = changed[1][0].clone()
    ids[pos] = torch.arange(model.config.top_k) + model.config.num_experts  # an expert set no route picks
    changed[1][0] = ids
    report = compare(prompts, ([x[0] for x in a], [x[1] for x in a]), (b[0], changed))
    assert report.flips == ((1, pos, 0),)
    assert report.max_dlogit_before_flip < FP32_LOGITS_ATOL


def test_recording_lists_the_sorted_ids_of_every_route_call(tmp_path):
    model = load_model(init_model(tmp_path / "m", "llama4", seed=1))
    with recording(model) as calls:
        model(torch.tensor([[5, 6, 7]]))
    assert len(calls) == model.config.num_moe_layers
    assert all(len(c) == 1 and tuple(c[0].shape) == (3, model.config.top_k) for c in calls)
