"""benchmarks/attention.py: its cases and FLOP count, and, under Triton's interpreter in fp32,
every candidate tiling its --tune sweeps computes the attention of the reference (torch's SDPA
without cached keys, moeserve's torch path with them), so a tiling the GPU run picks is one
that is right."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import attention as bench  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_cases_parse_and_count_the_pairs_a_causal_or_chunked_layer_attends():
    assert bench.parse_case("prefill:2048") == ("prefill", [2048], [0])
    assert bench.parse_case("prefill:4x2048") == ("prefill", [2048] * 4, [0] * 4)
    assert bench.parse_case("cached:64x2048") == ("cached", [64], [2048])
    assert bench.parse_case("decode:3x10") == ("decode", [1, 1, 1], [10, 10, 10])
    for bad in ("prefill:x", "cached:64", "decode:3", "sdpa:1"):
        with pytest.raises(ValueError, match="expected prefill:N"):
            bench.parse_case(bad)
    assert bench.causal_pairs([4], [0], 0) == 1 + 2 + 3 + 4
    assert bench.causal_pairs([2], [3], 0) == 4 + 5  # positions 3 and 4 see 4 and 5 keys
    assert bench.causal_pairs([6], [0], 4) == 1 + 2 + 3 + 4 + 1 + 2  # chunks of 4 restart


def test_every_candidate_tiling_computes_the_reference_attention(tmp_path):
    out = tmp_path / "attention.json"
    rc = bench.main(
        ["--smoke", "--tune", "--shapes", "tiny_chunked", "--cases", "prefill:2x24,cached:8x40", "--iters", "1"]
        + ["--json", str(out)]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    prefill, cached = res["rows"]
    assert prefill["sdpa"]["s"] > 0 and "sdpa" not in cached  # SDPA only where no key is cached
    # the sdpa prefill backend's own function, as torch picks and forced to each CPU kernel
    assert set(prefill["sdpa_backends"]) == {"default", "math"} and "sdpa_backends" not in cached
    for x in prefill["sdpa_backends"].values():
        assert x["rel_diff"] < 1e-5 and x["s"] > 0 and x["first_call_s"] > 0 and x["steady_call_s"] > 0
    for row in (prefill, cached):
        ran = [r for r in row["runs"] if "s" in r]
        assert len(ran) == 1 + len(bench.CANDIDATES) and not [r for r in row["runs"] if "error" in r]
        assert {tuple(r["tiling"]) for r in ran if not r["today"]} == set(bench.CANDIDATES)
        assert max(r["rel_diff"] for r in ran) < 1e-5  # fp32 (IEEE products)
        assert row["flops"] == 4 * 6 * 16 * row["pairs"]


def test_bad_flags_are_refused_with_what_is_allowed(capsys):
    for argv, message in (
        (["--smoke", "--shapes", "scout"], "unknown shapes ['scout']: allowed tiny, tiny_chunked"),
        (["--smoke", "--cases", "prefill:y"], "expected prefill:N"),
        (["--smoke", "--reps", "0"], "--reps must be 1 .. 1000"),
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_prefill_tiling_switch_reads_four_bounded_integers_and_refuses_the_rest():
    from moeserve.models import attention as A

    env = A.TILING_ENV
    assert A.prefill_tiling_from_env({}) is None and A.prefill_tiling_from_env({env: ""}) is None
    assert A.prefill_tiling_from_env({env: "128,64,8,3"}) == dict(BM=128, BN=64, num_warps=8, num_stages=3)
    for bad, why in (
        ("128,64,8", "allowed four integers"),
        ("128,64,eight,3", "allowed four integers"),
        ("96,64,8,3", "BM 96 is out of range"),
        ("128,512,8,3", "BN 512 is out of range"),
        ("128,64,3,3", "num_warps 3 is out of range"),
        ("128,64,8,0", "num_stages 0 is out of range"),
    ):
        with pytest.raises(ValueError, match=why) as e:
            A.prefill_tiling_from_env({env: bad})
        assert env in str(e.value) and bad in str(e.value)


def test_an_sdpa_kernel_that_does_not_serve_a_case_is_recorded_not_raised(tmp_path, monkeypatch):
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(bench, "sdpa_backends", lambda dev: {"cudnn": SDPBackend.CUDNN_ATTENTION})  # none on a CPU
    out = tmp_path / "attention.json"
    assert bench.main(["--smoke", "--shapes", "tiny", "--cases", "prefill:40", "--iters", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" in row["sdpa_backends"]["cudnn"] and "s" not in row["sdpa_backends"]["cudnn"]
    assert row["sdpa_backends"]["default"]["rel_diff"] < 1e-5
