"""``moeserve demo``: on a fresh cache it writes its checkpoint, runs the cluster, rebalances,
and exits 0 within 2 minutes with balancedness higher after the rebalance than before and
every token equal to the EPLB-off run; a failed check exits 1."""

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from moeserve.cli import main
from moeserve.demo import DemoOptions, DemoResult, DemoUsageError, PhaseLoad

WALL_LIMIT_S = 120


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_on_a_fresh_cache_passes_its_checks_within_two_minutes(tmp_path):
    png = tmp_path / "load.png"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "moeserve", "demo", "--cache-dir", str(tmp_path / "cache"), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=WALL_LIMIT_S + 60,
    )
    wall = time.monotonic() - t0
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert wall < WALL_LIMIT_S, f"the demo took {wall:.0f} s"
    assert "writing a small llama4 checkpoint" in out  # a fresh cache: written, not reused
    before, after = map(float, re.search(r"^  mean\s+([\d.]+)\s+([\d.]+)$", out, re.M).groups())
    assert after > before
    assert re.search(r"^  ok\s+every generated token equals the EPLB-off run", out, re.M)
    assert re.search(r"^moved\s+[1-9]\d* slots", out, re.M)
    assert "docker compose -f" in out and "/metrics" in out
    assert "all checks passed" in out
    if png.exists():
        assert png.read_bytes()[:4] == b"\x89PNG"
        dumps = re.search(r"^load dumps\s+(\S+) (\S+)$", out, re.M).groups()
        again = tmp_path / "again.png"
        p = subprocess.run(
            [sys.executable, "-m", "moeserve", "load", "--plot", str(again), *dumps],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        assert again.read_bytes()[:4] == b"\x89PNG"


def phase(balancedness) -> PhaseLoad:
    b = np.asarray(balancedness, dtype=float)
    return PhaseLoad(
        steps=10,
        load=np.ones((len(b), 8)),
        worker_load=np.ones((len(b), 2)),
        balancedness=b,
        phy2log=np.zeros((len(b), 10), dtype=int),
        version=1,
        seconds=1.0,
        tokens=10,
    )


@pytest.mark.parametrize(
    "mismatches,before,after,state,ok",
    [
        ([], [0.6, 0.8], [0.99, 0.95], "done", True),
        ([3], [0.6, 0.8], [0.99, 0.95], "done", False),  # a token differs
        ([], [0.9, 0.9], [0.9, 0.9], "done", False),  # no gain
        ([], [0.6, 0.8], [0.99, 0.95], "aborted", False),  # the migration did not complete
    ],
)
def test_a_failed_check_fails_the_demo(mismatches, before, after, state, ok):
    r = DemoResult(phase(before), phase(after), 4, 4096, state, mismatches, 48, 1152, [])
    assert r.ok is ok
    assert sum(not c for c, _ in r.checks()) == (0 if ok else 1)


def test_the_demo_exits_1_when_a_check_fails(monkeypatch):
    bad = DemoResult(phase([0.6]), phase([0.5]), 1, 1, "done", [], 2, 2, [])
    monkeypatch.setattr("moeserve.demo.run_demo", lambda opts: bad)
    assert main(["demo", "--no-progress"]) == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(workers=1), "at least 2 workers"),
        (dict(requests=0), "requests"),
        (dict(prompt_len=(5, 2)), "prompt_len"),
    ],
)
def test_demo_options_say_what_is_wrong(kw, match):
    with pytest.raises(DemoUsageError, match=match):
        DemoOptions(**kw)


def test_the_readme_quick_start_is_setup_then_the_demo_and_shows_its_heatmap():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    quick = readme[readme.index("## Quick start") :]
    blocks = re.findall(r"```bash\n(.*?)```", quick, re.S)
    assert blocks[0].strip() == "scripts/setup && .venv/bin/moeserve demo"
    assert blocks[1].strip() == ".ci/run"
    (image,) = re.findall(r"!\[[^\]]*\]\((docs/[^)]+\.png)\)", readme)
    path = Path(__file__).resolve().parent.parent / image
    assert path.read_bytes()[:4] == b"\x89PNG"
