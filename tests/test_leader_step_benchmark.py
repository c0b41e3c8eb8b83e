"""benchmarks/leader_step.py: the leader's host work per decode step at several batch sizes."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import leader_step as bench  # noqa: E402


def test_each_batch_size_gets_its_row_of_positive_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc1234")  # git is not asked: no process started
    out = tmp_path / "leader.json"
    assert bench.main(["--seqs", "8,32", "--routers", "2", "--steps", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seqs"], r["routers"], r["steps"]) for r in rows] == [(8, 2, 5), (32, 2, 5)]
    for r in rows:
        assert all(r[f"{p}_ms"] > 0 for p in bench.PARTS)
        assert r["step_loop_ms"] == pytest.approx(r["schedule_ms"] + r["header_wire_ms"] + r["on_results_ms"])
    assert rows[1]["header_bytes"] > rows[0]["header_bytes"]  # a word per decode and more
    assert json.loads(out.read_text())["git"]["commit"] == "abc1234"
    # one co-located rank (the one-GPU server) is a router and the only worker
    assert bench.main(["--seqs", "8", "--routers", "1", "--steps", "5", "--json", str(out)]) == 0
    assert [(r["seqs"], r["routers"]) for r in json.loads(out.read_text())["rows"]] == [(8, 1)]


def test_bad_flags_are_refused_with_what_is_allowed(capsys):
    for argv, what in (
        (["--seqs", "x"], "comma list of sequence counts"),
        (["--seqs", "0"], "1 .. 65536"),
        (["--routers", "0"], "--routers must divide the 16 experts: 1, 2, 4, 8 or 16"),
        (["--routers", "3"], "--routers must divide the 16 experts"),
        (["--steps", "300"], "--steps must be 1 .. 240"),
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and what in capsys.readouterr().err
