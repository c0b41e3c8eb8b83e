"""benchmarks/mixed_steps.py: a step carrying one prefill chunk beside decodes, its wall time,
device time and FLOP-aware roofline (the mixed-step latency target). The arithmetic of the roofline
here; the whole run on the CPU (``--smoke``) in the slow set."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import mixed_steps as bench  # noqa: E402

SIZES = dict(  # a two-layer model: one chunked layer (chunk 8), one with a window of 5
    chunked=[True, False],
    chunk=8,
    windows=[None, 5],
    num_layers=2,
    kv_layer_token=10,
    router_bytes=1000,
    lookup_bytes=0,
    dense_params=300,
    vocab_size=10,
    hidden_size=4,  # an LM head of 40 of the 300 dense parameters
    top_k=2,
    num_moe_layers=2,
    expert_params=7,
    attn_flops_per_key=3,
)


def test_a_chunks_causal_pairs_stop_at_its_layers_chunk_and_window():
    # 12 queries: the chunked layer sees 1..8 then 1..4 keys, the windowed one 1..5 then 5 each
    assert bench.chunk_pairs(SIZES, 12) == sum(range(1, 9)) + sum(range(1, 5)) + sum(range(1, 6)) + 7 * 5
    plain = dict(SIZES, chunked=[False, False], windows=[None, None])
    assert bench.chunk_pairs(plain, 12) == 2 * 12 * 13 / 2


def test_a_mixed_steps_classes_count_the_chunk_and_sample_only_the_last_rows():
    weights, c, d, ctx = 5000.0, 12, 3, 4
    classes = bench.mixed_classes(SIZES, weights, c, d, ctx)
    dense_b, dense_f = classes["dense"]
    assert dense_b == 1000 and dense_f == 2 * (c + d) * 300 - 2 * (c - 1) * 40  # the LM head: d + 1 rows
    assert classes["experts"] == (4000, 2 * (c + d) * 2 * 2 * 7)
    att_b, att_f = classes["attention"]
    decode_keys = 2 * 4  # each decode reads 4 keys in both layers (within chunk and window)
    # the chunked layer reads all 12 keys (over two chunks), the windowed one all 12 (12 + 5 - 1 > 12)
    assert bench.chunk_keys(SIZES, c) == 12 + 12
    assert att_b == d * decode_keys * 10 + (12 + 12) * 10  # the decodes' keys, each of the chunk's once
    assert att_f == d * decode_keys * 3 + bench.chunk_pairs(SIZES, c) * 3
    fa = bench.flop_aware(classes, 100.0, 1000.0)  # servinglib.roofline's, as the serving roofline's
    assert fa["step_s"] == pytest.approx(sum(max(b / 100.0, f / 1000.0) for b, f in classes.values()))


def test_a_chunk_after_cached_tokens_counts_the_keys_it_reads_and_the_pairs_it_attends():
    # 4 queries at positions 10..13: the chunked layer (chunk 8) sees from key 8, the windowed one 5
    assert bench.chunk_keys(SIZES, 4, start=10) == (14 - 8) + (4 + 5 - 1)
    assert bench.chunk_pairs(SIZES, 4, start=10) == (3 + 4 + 5 + 6) + 4 * 5
    plain = dict(SIZES, chunked=[False, False], windows=[None, None])
    assert bench.chunk_keys(plain, 4, start=10) == 2 * 14
    assert bench.chunk_pairs(plain, 4, start=10) == 2 * (11 + 12 + 13 + 14)
    cached = bench.mixed_classes(plain, 5000.0, 4, 3, 4, cached=10)
    fresh = bench.mixed_classes(plain, 5000.0, 4, 3, 4)
    assert cached["attention"][1] > fresh["attention"][1] and cached["dense"] == fresh["dense"]


def test_the_wall_and_profile_windows_do_not_overlap():
    for prompts in (24, 40, 200):
        first, last, start, count = bench.windows(prompts)
        assert first == bench.SKIP and last - first >= 4
        assert start >= last + 3 and start + count <= prompts - 5 and count >= 1


def test_one_stall_in_the_wall_window_stretches_the_mean_spacing_not_the_median():
    decodes, prompts = 2, 24
    first, last, _, _ = bench.windows(prompts)
    firsts = [0.003 * i for i in range(prompts)]
    firsts = [t + (0.012 if i > first + 1 else 0.0) for i, t in enumerate(firsts)]  # a 12 ms stall
    times = [[0.0015 * k for k in range(400)] for _ in range(decodes)] + [[t] for t in firsts]
    m = bench.measure(times, decodes, prompts)
    assert m["mixed_step_s"] == pytest.approx(0.003 + 0.012 / (last - first))
    assert m["mixed_step_p50_s"] == pytest.approx(0.003)
    assert m["mixed_gap_p50_s"] == pytest.approx(0.0015) and m["prompts_answered"] == prompts


def test_bad_flags_are_refused_with_what_is_allowed(capsys):
    for argv, what in (
        (["--chunks", "512,x"], "comma list of token counts"),
        (["--chunks", "0"], "1 .. 65536"),
        (["--decodes", "0"], "--decodes must be 1 .. 1024"),
        (["--prompts", "10"], "--prompts must be 24 .. 1000"),
        (["--cached", "20"], "--cached must be a multiple of the block size 16"),
        (["--quantization", "int4"], "--quantization: invalid choice: 'int4'"),
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(["--smoke", *argv])
        assert e.value.code == 2 and what in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_run_measures_one_chunk_per_step(tmp_path):
    out = tmp_path / "mixed.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["shape"] == "tiny" and [r["chunk"] for r in doc["rows"]] == [16, 48]
    assert doc["hbm"]["datasheet_Bps"] is None and doc["hbm"]["device"] == "cpu"  # the copy rate stands in
    assert doc["rates"]["datasheet"] == doc["rates"]["measured_copy"] == doc["hbm"]["measured_copy_Bps"]
    for r in doc["rows"]:
        assert r["prompts_answered"] == r["prompts"] == 24
        # one prompt per step: its first tokens are spaced as the decodes' tokens are
        assert r["mixed_step_s"] > 0 and r["mixed_gaps"] > 0
        assert 0.5 < r["mixed_step_p50_s"] / r["mixed_gap_p50_s"] < 2.0
        assert r["decode_step_p50_s"] > 0
        _, _, _, count = bench.windows(24)
        assert r["profile"]["steps"] == count  # the profile window ran, apart from the wall window
        assert r["roofline"]["classes"]["attention"]["flops"] > 0
        assert r["roofline"]["measured_copy"] is None and r["step_over_flop_aware"] is None  # no matmul peak on a CPU
    # a chunk after a shared prefix the cache holds (one request computes it first): still one a step
    assert bench.main(["--smoke", "--cached", "32", "--chunks", "8", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert r["cached"] == 32 and 0.5 < r["mixed_step_p50_s"] / r["mixed_gap_p50_s"] < 2.0
    # FP8 experts and MLPs (quantized at load): still one prompt a step, the roofline on FP8 bytes
    bf16_weights = doc["weights_read_bytes"]
    assert bench.main(["--smoke", "--quantization", "fp8", "--chunks", "16", "--json", str(out)]) == 0
    fp8 = json.loads(out.read_text())
    (r,) = fp8["rows"]
    assert fp8["quantization"] == "fp8" and 0.5 < r["mixed_step_p50_s"] / r["mixed_gap_p50_s"] < 2.0
    assert fp8["weights_read_bytes"] < 0.8 * bf16_weights
    assert (
        r["roofline"]["classes"]["experts"]["bytes"] < 0.6 * doc["rows"][0]["roofline"]["classes"]["experts"]["bytes"]
    )
