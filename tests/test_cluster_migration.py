"""Live migration: placements applied under traffic change no token, commit on every rank,
and leave the workers holding exactly the new placement's experts; abort, supersede and
staging failures roll back to a consistent state; recorded load equals routing decisions."""

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

from moeserve.cluster import ClusterError, LocalCluster
from moeserve.router.engine.migration import StaleVersion

pytestmark = pytest.mark.slow  # every test here starts processes

WORKERS = 2
REDUNDANT = 4
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("llama4"), "llama4", num_hidden_layers=6)
    info = moe_info(path)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 7, 2, 11, 6, 3))
    tokens = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    return dict(path=path, info=info, model=model, prompts=prompts, tokens=tokens, digests=expert_digests(path))


@pytest.fixture(scope="module")
def cluster(setup):
    # One expert per destination worker per step: a migration spans many steps.
    with LocalCluster(
        setup["path"],
        routers=2,
        workers=WORKERS,
        num_redundant_experts=REDUNDANT,
        migration_bytes_per_step=setup["info"].expert_bytes,
    ) as c:
        yield c


def placement(setup, seed):
    info = setup["info"]
    return random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + REDUNDANT, seed)


@pytest.mark.timeout(300)
def test_placement_applied_during_generation_changes_no_token_and_moves_the_weights(cluster, setup):
    target = placement(setup, 1)
    v0 = cluster.placement().version
    result = {}
    t = threading.Thread(
        target=lambda: result.update(out=cluster.generate(setup["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True))
    )
    t.start()
    time.sleep(0.3)  # let generation get going
    steps_before = cluster.status().forward_steps
    mid = cluster.apply_placement(target, wait=True)
    t.join(120)
    assert result["out"] == setup["tokens"]
    assert cluster.migration(mid).state == "done"
    # The migration overlapped with traffic: forward steps ran while it was in flight.
    assert cluster.status().forward_steps > steps_before
    p = cluster.placement()
    np.testing.assert_array_equal(p.phy2log, target)
    assert p.version > v0 and all(v == p.version for v in p.layer_versions)
    assert_workers_hold(cluster, target, setup["digests"])


@pytest.mark.timeout(300)
def test_recorded_load_equals_the_routing_decisions(cluster, setup):
    model = setup["model"]
    info = setup["info"]
    counted = np.zeros((info.num_moe_layers, info.num_logical_experts), dtype=np.int64)
    local = model.experts

    class Counting:
        def dispatch(self, layer, hidden, routing):
            np.add.at(counted[layer], routing.ids.reshape(-1).numpy(), 1)
            return local.dispatch(layer, hidden, routing)

        def combine(self, handle):
            return local.combine(handle)

    model.experts = Counting()
    try:
        for p in setup["prompts"][:3]:
            reference_generate(model, p, 8)
    finally:
        model.experts = local
    before = cluster.total_load()
    cluster.generate(setup["prompts"][:3], max_tokens=8, ignore_eos=True)
    load = cluster.total_load() - before
    # Every token of every step is routed to top_k experts in every MoE layer: the prompts'
    # tokens at prefill, then one token per decode step (the last sampled token is not fed).
    tokens = sum(len(p) + 8 - 1 for p in setup["prompts"][:3])
    assert (load.sum(axis=1) == tokens * info.top_k).all()
    np.testing.assert_array_equal(load, counted)


@pytest.mark.timeout(300)
def test_window_load_and_balancedness_are_reported(cluster, setup):
    cluster.generate(setup["prompts"][:2], max_tokens=4, ignore_eos=True)
    rep = cluster.expert_load()
    assert rep.load.shape == (setup["info"].num_moe_layers, setup["info"].num_logical_experts)
    assert rep.steps > 0 and rep.load.sum() > 0
    assert ((rep.balancedness_measured > 0) & (rep.balancedness_measured <= 1)).all()
    assert ((rep.balancedness_predicted > 0) & (rep.balancedness_predicted <= 1)).all()
    # the per-step statistics (docs/eplb.md): one bin per (router, step) and expert, a pair-bin
    # exactly where the window has load; a slot busy at most once per (router, step)
    info = setup["info"]
    from moeserve.router.dispatcher import LOAD_BINS

    assert rep.histogram.shape == (info.num_moe_layers, info.num_logical_experts, LOAD_BINS)
    assert (rep.histogram.sum(2) == rep.steps * 2).all()  # 2 routers
    np.testing.assert_array_equal(rep.histogram[:, :, 1:].sum(2) > 0, rep.load > 0)
    assert rep.slot_busy_steps.shape == (info.num_moe_layers, info.num_logical_experts + REDUNDANT)
    assert 0 < rep.slot_busy_steps.max() <= rep.steps * 2


@pytest.mark.timeout(300)
def test_a_superseding_plan_aborts_the_running_one_and_wins(cluster, setup):
    a, b = placement(setup, 2), placement(setup, 3)
    first = cluster.apply_placement(a, wait=False)
    second = cluster.apply_placement(b, wait=True)
    assert cluster.migration(first).state in ("aborted", "done")
    assert cluster.migration(second).state == "done"
    np.testing.assert_array_equal(cluster.placement().phy2log, b)
    assert_workers_hold(cluster, b, setup["digests"])
    assert cluster.generate(setup["prompts"][:2], max_tokens=MAX_TOKENS, ignore_eos=True) == setup["tokens"][:2]


@pytest.mark.timeout(300)
def test_abort_keeps_committed_layers_and_rolls_back_the_others(cluster, setup):
    before = cluster.placement()
    target = placement(setup, 4)
    mid = cluster.apply_placement(target, wait=False)
    while cluster.migration(mid).layers_committed < 1 and cluster.migration(mid).state == "moving":
        time.sleep(0.01)
    cluster.abort_migration()
    state = cluster.migration(mid)
    after = cluster.placement()
    assert after.version not in (before.version, state.target_version)  # a fresh version
    for layer in range(after.phy2log.shape[0]):  # each layer: old or new, whole
        row = after.phy2log[layer]
        assert (row == target[layer]).all() or (row == before.phy2log[layer]).all()
        assert after.layer_versions[layer] in (before.layer_versions[layer], state.target_version)
    assert_workers_hold(cluster, after.phy2log, setup["digests"])
    assert cluster.generate(setup["prompts"][:2], max_tokens=MAX_TOKENS, ignore_eos=True) == setup["tokens"][:2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda p: p[:, :-1], "shape"),
        (lambda p: np.where(p == 0, 1, p), "no replica"),
        (lambda p: np.where(p == 0, 99, p), "out of range"),
    ],
)
def test_an_invalid_placement_is_rejected_and_changes_nothing(cluster, setup, bad, match):
    before = cluster.placement()
    with pytest.raises(ValueError, match=match):
        cluster.apply_placement(bad(before.phy2log.copy()))
    after = cluster.placement()
    assert after.version == before.version
    np.testing.assert_array_equal(after.phy2log, before.phy2log)


@pytest.mark.timeout(120)
def test_a_stale_expected_version_is_refused(cluster, setup):
    before = cluster.placement()
    with pytest.raises(StaleVersion):
        cluster.apply_placement(placement(setup, 5), expected_version=before.version - 1)
    assert cluster.placement().version == before.version


@pytest.mark.timeout(300)
def test_staging_that_cannot_be_allocated_fails_the_migration_and_serving_goes_on(setup):
    with LocalCluster(
        setup["path"],
        routers=1,
        workers=WORKERS,
        num_redundant_experts=REDUNDANT,
        max_staging_bytes=setup["info"].expert_bytes,
    ) as c:
        before = c.placement()
        with pytest.raises(ClusterError, match="max_staging_bytes"):
            c.apply_placement(placement(setup, 6), wait=True)
        after = c.placement()
        np.testing.assert_array_equal(after.phy2log, before.phy2log)
        assert_workers_hold(c, before.phy2log, setup["digests"])
        assert c.generate(setup["prompts"][:2], max_tokens=MAX_TOKENS, ignore_eos=True) == setup["tokens"][:2]
