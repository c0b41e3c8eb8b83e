"""benchmarks/policy.py runs on its own and refuses a missing trace directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "policy.py"


def test_benchmark_writes_policy_and_reference_side_by_side(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "ernie45-21b-2gpu/zipf1.2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    row = res["synthetic"]["ernie45-21b-2gpu/zipf1.2"]
    assert set(row) == {"policy", "reference"}
    assert {"in_", "next", "moved", "moved_across", "bytes_moved", "ms", "ms_max"} <= set(row["policy"])
    assert set(res["tradeoff"]["ernie45-21b-2gpu/zipf1.2"]) == {"5%", "10%", "20%", "100%", "unlimited"}
    assert row["policy"]["moved"] <= 0.10


def test_benchmark_fails_clearly_without_the_trace_directory(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--traces", str(tmp_path / "nowhere"), "--only", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    assert "no such directory" in run.stderr
