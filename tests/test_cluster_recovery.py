"""Losing an expert worker loses no request: kill -9 of a worker rank in the middle of 16
streams, and in the middle of a live migration; its replacement re-joins, the routers keep
their KV caches, every stream completes with the single-process tokens (fp32, gloo) and the
workers hold what the placement in force says. Losing a router loses no request either: its
sequences are recomputed on the other router (from that router's prefix cache where it holds
their prefix) and its replacement rejoins; a stranger's write to the store changes nothing."""

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from cluster_util import (
    assert_workers_hold,
    expert_digests,
    moe_info,
    prompts_for,
    random_placement,
    reference_generate,
    reference_model,
    tiny_checkpoint,
)

from moeserve.cluster import LocalCluster
from moeserve.placement import MigrationState

pytestmark = pytest.mark.slow  # every test here starts processes

MAX_TOKENS = 48
STREAMS = 16
SYSTEM_TOKENS = 24
BLOCK_SIZE = 4  # the system prompt fills 6 KV blocks


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("recovery"), "llama4")
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=tuple(3 + i % 7 for i in range(STREAMS)), seed=8)
    system = prompts_for(model.config.vocab_size, lengths=(SYSTEM_TOKENS,), seed=9)[0]
    shared = [system + p for p in prompts]  # one system prompt: full KV blocks the prefix cache shares
    return dict(
        path=path,
        prompts=prompts,
        want=[reference_generate(model, p, MAX_TOKENS) for p in prompts],
        shared=shared,
        want_shared=[reference_generate(model, p, MAX_TOKENS) for p in shared],
        info=moe_info(path),
        digests=expert_digests(path),
    )


def _generate_while(cluster, prompts, action):
    """Generate for every prompt at once in a thread; run ``action`` once tokens flow; return
    the generated ids and the seconds from the action to the end of generation."""
    box = {}
    th = threading.Thread(
        target=lambda: box.update(out=cluster.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True))
    )
    steps = cluster.status().forward_steps
    th.start()
    while cluster.status().forward_steps < steps + 8:  # in the middle of the streams
        time.sleep(0.02)
    t0 = time.monotonic()
    action()
    th.join(240)
    assert not th.is_alive(), "generation did not finish after the worker was replaced"
    return box["out"], time.monotonic() - t0


def _kill_worker(cluster, rank):
    os.kill(cluster.procs[rank].pid, signal.SIGKILL)


def _recovery_s(cluster) -> float:
    """From the leader's log: how long its groups took to re-form after the failed step."""
    with open(cluster.log_paths[0]) as f:
        lines = [ln for ln in f if "re-formed the groups" in ln]
    assert lines, "the leader did not re-form its groups"
    return float(lines[-1].rsplit(" in ", 1)[1].split()[0])


@pytest.mark.timeout(300)
def test_a_worker_killed_in_the_middle_of_16_streams_is_replaced_and_no_token_changes(setup):
    r = 2
    with LocalCluster(setup["path"], routers=1, workers=2, num_redundant_experts=r, enable_eplb=True) as c:
        out, seconds = _generate_while(c, setup["prompts"], lambda: _kill_worker(c, 2))
        assert out == setup["want"]
        assert c.replaced and c.replaced[0][0] == 2 and c.alive
        print(
            f"\nkilled worker rank 2 under {STREAMS} streams: groups re-formed in {_recovery_s(c):.2f} s, "
            f"generation finished {seconds:.2f} s after the kill"
        )
        assert_workers_hold(c, c.placement().phy2log, setup["digests"])
        assert c.generate(setup["prompts"][:2], max_tokens=MAX_TOKENS, ignore_eos=True) == setup["want"][:2]
        _assert_store_only_on_loopback(c)


def _assert_store_only_on_loopback(cluster):
    """The torch.distributed store listens on MASTER_ADDR (127.0.0.1) only, not on every interface."""
    port = int(cluster._envs[0]["MASTER_PORT"])
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5)


@pytest.mark.timeout(300)
def test_a_worker_killed_in_the_middle_of_a_migration_leaves_a_consistent_placement(setup, tmp_path):
    info = setup["info"]
    r = 2
    target = random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + r, 21)
    with LocalCluster(
        setup["path"],
        routers=1,
        workers=2,
        num_redundant_experts=r,
        enable_eplb=True,
        migration_bytes_per_step=1,
        log_dir=str(tmp_path / "logs"),
    ) as c:  # one move per step
        box = {}

        def kill_during_migration():
            box["mid"] = c.apply_placement(target, wait=False)
            while c.migration(box["mid"]).moves_done < 2:
                time.sleep(0.01)
            _kill_worker(c, 1)

        out, seconds = _generate_while(c, setup["prompts"], kill_during_migration)
        assert out == setup["want"]
        mig = c.migration(box["mid"])
        assert mig.state in (MigrationState.ABORTED, MigrationState.DONE)
        placement = c.placement()
        assert_workers_hold(c, placement.phy2log, setup["digests"])  # what it says is what they hold
        print(
            f"\nkilled worker rank 1 during a migration ({mig.state}): groups re-formed in {_recovery_s(c):.2f} s, "
            f"generation finished {seconds:.2f} s after the kill"
        )
        c.apply_placement(target, wait=True, timeout_s=120)  # the placement can still change
        np.testing.assert_array_equal(c.placement().phy2log, target)
        assert_workers_hold(c, target, setup["digests"])
        assert c.generate(setup["prompts"][:2], max_tokens=MAX_TOKENS, ignore_eos=True) == setup["want"][:2]
    assert not os.path.exists(c.run_dir)  # with log_dir, no run folder is left
    assert "replacement" in (tmp_path / "logs" / "rank1.log").read_text()


@pytest.mark.timeout(300)
def test_a_stranger_cannot_write_the_store_and_the_next_worker_loss_is_survived(setup):
    """One add("generation", 1) from any local process once turned a survivable loss into a
    30 s hang and the cluster's death: the store now admits only holders of the secret."""
    import datetime

    import torch.distributed as dist

    with LocalCluster(setup["path"], routers=1, workers=2, num_redundant_experts=2, enable_eplb=True) as c:
        port = int(c._envs[0]["MASTER_PORT"])
        with pytest.raises(dist.DistNetworkError):
            dist.TCPStore("127.0.0.1", port, 3, False, datetime.timedelta(seconds=3)).add("generation", 1)
        from moeserve.cluster.store import AuthStore, StoreError

        with pytest.raises(StoreError, match="refused"):
            AuthStore("127.0.0.1", port, os.urandom(16), datetime.timedelta(seconds=3)).add("generation", 1)
        out, _ = _generate_while(c, setup["prompts"], lambda: _kill_worker(c, 2))
        assert out == setup["want"]
        assert c.alive and c.status().generation == 1 and c.status().ranks_replaced == {"router": 0, "worker": 1}


def _up_again(cluster, rank, generation, timeout_s=120.0):
    """Wait until ``rank`` is in the world again, at a generation after ``generation``."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = cluster.status()
        if st.generation > generation and rank in st.members:
            return st
        assert time.monotonic() < deadline, f"rank {rank} did not rejoin: {st}"
        time.sleep(0.1)


@pytest.mark.timeout(400)
def test_a_router_killed_in_the_middle_of_16_streams_loses_no_request_and_its_replacement_rejoins(setup, tmp_path):
    """With the prefix cache on and prompts that share a system prompt: the lost router's
    sequences are recomputed on the other, from its cached blocks, with the same tokens."""
    prompts, want = setup["shared"], setup["want_shared"]
    with LocalCluster(
        setup["path"],
        routers=2,
        workers=2,
        num_redundant_experts=2,
        enable_eplb=True,
        block_size=BLOCK_SIZE,
        log_dir=str(tmp_path),
    ) as c:
        out, seconds = _generate_while(c, prompts, lambda: os.kill(c.procs[1].pid, signal.SIGKILL))
        assert out == want  # every stream completes with the single-process tokens
        st = c.status()
        assert st.readmitted > 0 and st.ranks_lost["router"] == 1
        assert st.prefix_cache_hits > 0  # the routers read the system prompt from their caches
        print(f"\nkilled router rank 1 under {STREAMS} streams: generation finished {seconds:.2f} s after the kill")
        info = setup["info"]  # weight moves in the world without the router (its workers' ranks moved down)
        target = random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + 2, 5)
        c.apply_placement(target, wait=True, timeout_s=120)
        assert_workers_hold(c, target, setup["digests"])
        # the launcher's replacement is a member again: admitted between steps of the loss's own
        # generation (1) when it is up after the survivors re-formed, or in a later one when it
        # arrives while they re-form (both seen: the CI run of 2cc2e89 ended at generation 1)
        st = _up_again(c, 1, 0)
        assert st.ranks_replaced["router"] == 1 and st.members == (0, 1, 2, 3)
        assert c.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True) == want
        assert c.status().running == 0
        assert_workers_hold(c, c.placement().phy2log, setup["digests"])
        # a second loss of the same router, now that its replacement runs (and caches) sequences again
        out, _ = _generate_while(c, prompts, lambda: os.kill(c.procs[1].pid, signal.SIGKILL))
        assert out == want
    log0 = (tmp_path / "rank0.log").read_text()
    assert "without [1]" in log0  # the world re-formed without the lost router first
