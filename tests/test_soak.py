"""The soak benchmark's short run (benchmarks/soak.py; its 5-minute run is a benchmark, not CI):
2 routers + 2 workers under good streams through HTTP and gRPC, every attack of the front door,
live rebalances and a router killed: no request lost, no token wrong, every attack answered
as the front door answers it, the front end's memory flat. Its latency figures are reported,
not asserted."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_soak_with_attacks_rebalances_and_a_router_killed_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "soak.py"),
        "--minutes",
        "0.5",  # 15 attacks at one every 2 s, 3 rebalances
        "--clean-minutes",
        "0.25",
        "--kill-at",
        "0.3",
        "--rebalance-every",
        "10",
        "--attack-every",
        "2",
        "--http-streams",
        "3",
        "--grpc-streams",
        "1",
        "--no-latency-check",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=850, cwd=REPO)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["cluster_alive"] and r["lost"] == 0 and r["wrong_tokens"] == 0, (r["errors"], done.stdout[-2000:])
    assert r["completed"] > 0 and r["rebalances"] >= 1 and r["router_killed"]
    assert r["attacks"] >= 9 and r["attack_surprises"] == [], r["attack_surprises"]
    assert r["rss_mb_front_end_attack_end"] - r["rss_mb_front_end_attack_start"] < 50
    assert not r["front_end_restarted"]
    assert done.returncode == 0, done.stdout[-3000:]
