"""``moeserve up`` / ``serve`` over several hosts: the node layout and the flags refused before
anything starts (exit 2, a message saying what is allowed). No process is started here; the
two-host cluster itself is tests/test_cluster_nodes.py."""

import pytest

from moeserve.cli import main
from moeserve.cluster.nodes import NodeLayout, check_layout, config_from_leader, describe_missing
from moeserve.config import ClusterConfig

SECRET = "ab" * 16


def _up(capsys, *flags: str) -> str:
    code = main(["up", "--model", "/nonexistent-model", "--admin-token", "t", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_a_node_starts_its_contiguous_block_of_ranks():
    assert NodeLayout(2, 1, "10.0.0.1", 29500).ranks(16) == range(8, 16)
    assert NodeLayout(3, 0, "10.0.0.1", 29500).ranks(6) == range(0, 2)
    assert describe_missing([2, 3, 5], NodeLayout(3, 0, "a", 1), 6) == "ranks 2, 3 (node 1); rank 5 (node 2)"


def test_workers_per_node_is_the_largest_placement_node_that_never_straddles_two_hosts():
    assert check_layout(16, 16, True, 2) == 8  # 2 nodes x 8 co-located ranks
    assert check_layout(1, 3, False, 2) == 1  # node 0: leader + worker 0; node 1: workers 1, 2
    assert check_layout(2, 4, False, 3) == 2  # a router node, then two nodes of 2 workers
    assert check_layout(16, 16, True, 2, workers_per_node=4) == 4


def test_a_node_whose_flags_disagree_with_node_0s_is_refused_naming_the_fields():
    theirs = ClusterConfig(model_dir="/models/on-node-0", routers=1, workers=3, host="10.0.0.1")

    class Store:
        def wait(self, keys, timeout):
            pass

        def get_now(self, key):
            return theirs.to_json().encode()

    mine = ClusterConfig(model_dir="/models/here", routers=1, workers=3, host="10.0.0.2")
    same = config_from_leader(Store(), mine, 1.0)
    assert (same.model_dir, same.host, same.workers) == ("/models/here", "10.0.0.2", 3)
    with pytest.raises(ValueError, match="workers 2 here, 3 on node 0"):
        config_from_leader(Store(), ClusterConfig(model_dir="/m", routers=1, workers=2), 1.0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1 (--nnodes 2), got 2"),
        (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
        (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
        (
            ["--nnodes", "2", "--master-addr", "10.0.0.1", "--workers", "2"],
            "the 3 ranks (1 router + 2 workers) do not split into 2 nodes of equal size",
        ),
        (
            ["--nnodes", "2", "--master-addr", "10.0.0.1", "--workers", "3", "--workers-per-node", "2"],
            "--workers-per-node 2 does not fit 2 nodes holding [1, 2] workers",
        ),
        (
            ["--nnodes", "2", "--master-addr", "10.0.0.1", "--workers", "3", "--exchange", "nvlink"],
            "--exchange nvlink reaches peers on one host only",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--workers", "3", "--state-dir", "/x"],
            "--state-dir belongs on node 0",
        ),
    ],
)
def test_a_bad_node_combination_is_refused_with_exit_code_2(capsys, monkeypatch, flags, message):
    monkeypatch.setenv("MOESERVE_CONTROL_KEY", SECRET)
    assert message in _up(capsys, *flags)


def test_a_node_without_the_clusters_secret_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("MOESERVE_CONTROL_KEY", raising=False)
    flags = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--workers", "3"]
    assert "every node needs the cluster's secret" in _up(capsys, *flags)
    short = tmp_path / "key"
    short.write_text("abcd\n")
    assert "holds 2 bytes; the secret needs at least 16" in _up(capsys, *flags, "--control-key-file", str(short))
    short.write_text("not hex")
    assert "must be hex digits" in _up(capsys, *flags, "--control-key-file", str(short))


def test_serve_takes_the_node_flags_too(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("MOESERVE_CONTROL_KEY", raising=False)
    (tmp_path / "config.json").write_text("{}")
    code = main(["serve", str(tmp_path), "--nnodes", "2", "--master-addr", "10.0.0.1", "--workers", "3"])
    assert code == 2
    assert "every node needs the cluster's secret" in capsys.readouterr().err
