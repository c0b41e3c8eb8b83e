"""The checked-in gRPC code is what `python -m moeserve.rpc.generate` makes of proto/ (CI
fails on drift), and the data plane never imports it."""

import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.rpc.generate import HERE, generate


@pytest.mark.timeout(120)
def test_the_checked_in_code_equals_a_fresh_generation(tmp_path):
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    checked_in = {p.name: p.read_text() for p in sorted(Path(HERE).glob("*_pb2*.py*"))}
    assert sorted(fresh) == sorted(checked_in), "generated files differ: run python -m moeserve.rpc.generate"
    for name, text in fresh.items():
        assert checked_in[name] == text, f"moeserve/rpc/{name} is stale: run python -m moeserve.rpc.generate"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_data_plane_imports_no_grpc_code():
    modules = [
        "moeserve.models",
        "moeserve.cluster",
        "moeserve.cluster.rank",
        "moeserve.router.engine.channel",
        "moeserve.cluster.launcher",
        "moeserve.dataplane.collective",
        "moeserve.router.dispatcher",
        "moeserve.router.runner",
        "moeserve.router.engine.scheduler",
        "moeserve.router.engine.leader",
        "moeserve.router.engine.migration",
        "moeserve.expert_worker.store",
        "moeserve.expert_worker.migration",
    ]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "bad = sorted(m for m in sys.modules if m.startswith(('grpc', 'google.protobuf', 'moeserve.rpc', "
        "'moeserve.services', 'moeserve.client')))\nprint(bad)\nassert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
