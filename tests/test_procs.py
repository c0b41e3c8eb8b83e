"""moeserve.ops.procs: the children moeserve starts import the parent's moeserve and keep its
environment (PATH: Triton's launcher builds with the compiler and linker found there)."""

import os

import pytest

import moeserve
from moeserve.ops.procs import child_env, module_command, source_root


def test_a_child_keeps_the_parents_environment_and_adds_to_it(monkeypatch):
    monkeypatch.setenv("PATH", "/opt/compilers/bin:/usr/bin")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(MOESERVE_RUN_DIR="/tmp/run", RANK="3")
    assert env["PATH"] == "/opt/compilers/bin:/usr/bin"
    assert env["RANK"] == "3" and env["MOESERVE_RUN_DIR"] == "/tmp/run"
    # the folder this process imported moeserve from comes first, what was there stays
    assert env["PYTHONPATH"].split(os.pathsep) == [source_root(), "/elsewhere"]
    assert os.path.isfile(os.path.join(source_root(), "moeserve", "__init__.py"))
    assert os.path.dirname(moeserve.__file__) == os.path.join(source_root(), "moeserve")


def test_children_run_without_the_working_directory_on_their_path():
    cmd = module_command("moeserve.cluster.rank")
    assert cmd[1:] == ["-P", "-m", "moeserve.cluster.rank"]


@pytest.mark.slow
def test_every_rank_of_a_cluster_has_the_launchers_path(tmp_path):
    """The launcher once handed its ranks only its own extra variables: no PATH, so Triton's
    launcher could not find the linker on a GPU machine (``collect2: cannot find 'ld'``)."""
    from cluster_util import tiny_checkpoint

    from moeserve.cluster.launcher import LocalCluster

    path = tiny_checkpoint(tmp_path / "m", "llama4")
    with LocalCluster(path, routers=1, workers=1, env={"MOESERVE_PROBE": "1"}) as c:
        for proc in c.procs:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert env[b"PATH"] == os.environ["PATH"].encode() and env[b"MOESERVE_PROBE"] == b"1"
