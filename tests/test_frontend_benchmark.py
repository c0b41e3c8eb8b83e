"""benchmarks/frontend.py: one front-end process's token rate and CPU per token, against a
leader whose steps a paced stand-in answers (no GPU, no model)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import frontend as bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("api", ["grpc", "http"])
def test_every_stream_gets_every_token_with_and_without_coalescing(tmp_path, monkeypatch, api):
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc1234")
    out = tmp_path / "fe.json"
    argv = ["--seqs", "24", "--output", "12", "--step-ms", "10", "--api", api, "--json", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["api"], r["seqs"], r["coalesce"]) for r in rows] == [(api, 24, True), (api, 24, False)]
    for r in rows:
        assert r["tokens"] == 24 * 12  # run_case raises when a stream failed or came short
        assert r["leader_steps"] >= 12 and r["tok_s"] > 0 and r["frontend_cpu_s"] >= 0
        assert 0 < r["messages_per_token"] <= 1
        # gaps are counted while every stream runs; a loaded machine may start the client
        # processes so far apart that 12 tokens leave no such window
        assert r["gaps"] == 0 or r["gap_p99_s"] >= r["gap_p50_s"] > 0
    assert rows[1]["messages_per_token"] == 1  # one message per token with coalescing off
    assert doc["git"]["commit"] == "abc1234"


def test_messages_are_counted_by_arrival():
    assert bench.messages({"tokens": [0.1, 0.1, 0.1, 0.2, 0.3, 0.3]}) == 3
    assert bench.messages({"tokens": []}) == 0


@pytest.mark.parametrize(
    "argv,what",
    [
        (["--seqs", "x"], "comma list of stream counts"),
        (["--seqs", "0"], "1 .. 8192"),
        (["--step-ms", "0"], "--step-ms must be 0.1 .. 10000"),
        (["--coalesce", "maybe"], "--coalesce is on, off or on,off"),
        (["--coalesce", "on,on"], "--coalesce is on, off or on,off"),
        (["--output", "1"], "--output must be 2 .. 4096"),
        (["--client-procs", "0"], "--client-procs must be 1 .. 64"),
        (["--api", "soap"], "invalid choice: 'soap'"),
    ],
)
def test_bad_flags_are_refused_with_what_is_allowed(capsys, argv, what):
    with pytest.raises(SystemExit) as e:
        bench.parse(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err
