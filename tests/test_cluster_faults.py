"""Failure handling of a local cluster: a dead rank is reported within bounded time and the
whole cluster goes away; an idle cluster stays up (heartbeats) and still migrates."""

import os
import signal
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

from moeserve.cluster import ClusterError, LocalCluster

pytestmark = pytest.mark.slow  # every test here starts processes

# Idle for longer than every timeout a quiet cluster could trip: the process groups' (10 s here)
# and the store's (60 s at least, moeserve.cluster.rank.open_store).
IDLE_S = float(os.environ.get("MOESERVE_IDLE_TEST_S", "40"))  # 4x the cluster's pg timeout below


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama4"), "llama4")


@pytest.mark.timeout(120)
def test_a_killed_worker_that_is_not_replaced_turns_into_an_error_within_30_s_and_no_process_is_left(path):
    c = LocalCluster(path, routers=1, workers=2, max_restarts=0).start()
    try:
        assert c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
        pids = [p.pid for p in c.procs]
        os.kill(pids[2], signal.SIGKILL)  # ranks: 0 router, 1-2 workers
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="rank 2"):
            while time.monotonic() - t0 < 30:
                c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
                time.sleep(0.1)
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in c.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(p.poll() is not None for p in c.procs)
        for pid in pids:  # gone, not zombies of someone else
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        c.stop()


@pytest.mark.timeout(IDLE_S + 240)
def test_an_idle_cluster_stays_up_and_a_placement_applied_to_it_completes(path):
    info = moe_info(path)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(6,))
    want = [reference_generate(model, p, 16) for p in prompts]
    with LocalCluster(path, routers=1, workers=2, num_redundant_experts=2, pg_timeout_s=10) as c:
        t0 = time.monotonic()
        steps = c.status().step
        while time.monotonic() - t0 < IDLE_S:  # idle for much longer than the pg timeout
            time.sleep(min(10, IDLE_S))
            now = c.status().step
            assert now > steps  # heartbeats keep flowing
            steps = now
        target = random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + 2, 9)
        c.apply_placement(target, wait=True, timeout_s=60)
        np.testing.assert_array_equal(c.placement().phy2log, target)
        assert_workers_hold(c, target, expert_digests(path))
        assert c.generate(prompts, max_tokens=16, ignore_eos=True) == want


def _gone(c, pids, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in c.procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is not None for p in c.procs)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(120)
def test_losing_the_leader_is_fatal_and_clean(path):
    c = LocalCluster(path, routers=2, workers=2).start()
    try:
        assert c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
        pids = [p.pid for p in c.procs]
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(ClusterError, match=r"rank 0 \(router\) exited with signal SIGKILL"):
            for _ in range(300):
                c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
                time.sleep(0.1)
        _gone(c, pids)
    finally:
        c.stop()


@pytest.mark.timeout(240)
def test_a_rank_lost_past_the_restart_limit_stops_the_cluster_naming_the_limit(path):
    c = LocalCluster(path, routers=1, workers=2, max_restarts=1).start()
    try:
        assert c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
        os.kill(c.procs[2].pid, signal.SIGKILL)  # replaced: restart 1 of 1
        deadline = time.monotonic() + 120
        while c.status().generation < 1:
            assert time.monotonic() < deadline, "the lost worker was not replaced"
            time.sleep(0.1)
        assert c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
        pids = [p.pid for p in c.procs]
        os.kill(pids[2], signal.SIGKILL)  # the second loss within a minute: not replaced
        with pytest.raises(ClusterError, match=r"lost 2 times within 60 s: the restart limit \(max_restarts = 1\)"):
            for _ in range(300):
                c.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)
                time.sleep(0.1)
        _gone(c, pids)
    finally:
        c.stop()
