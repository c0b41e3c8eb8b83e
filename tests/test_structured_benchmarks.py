"""The structured-output benchmarks' plumbing on the CPU: benchmarks/structured_step.py --smoke
runs both modes on the tiny shape and writes its JSON; benchmarks/grammar_engines.py measures
both engines at a small vocabulary. No time is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # each starts processes

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("xgrammar")


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_structured_step_smoke_measures_both_modes(tmp_path):
    out = tmp_path / "s.json"
    _run([str(ROOT / "benchmarks" / "structured_step.py"), "--smoke", "--json", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"unconstrained", "half_constrained"}
    assert doc["results"]["half_constrained"]["constrained"] == 4 and doc["vocab_size"] == 512
    assert set(doc["mask_cost_ms"]) == {"step_ms_p50", "step_ms_mean"}


def test_grammar_engines_measures_both_at_a_small_vocabulary(tmp_path):
    pytest.importorskip("llguidance")
    out = tmp_path / "g.json"
    _run([str(ROOT / "benchmarks" / "grammar_engines.py"), "--vocabs", "4000", "--json", str(out)], tmp_path)
    (r,) = json.loads(out.read_text())["results"]
    for engine in ("xgrammar", "llguidance"):
        assert (
            set(r[engine]["compile_s"]) == set(r[engine]["mask_us_per_token"]) == {"flat", "nested", "array_of_objects"}
        )
