"""Replicas used only when they pay: the break-even rule of the replica
choice, on the torch path (choose_slots: the collective exchange and the reference) and in the
direct exchange's route kernel (run by Triton's interpreter); the break-even count from the
step model; the balancer's trigger and pay test on predicted step time; and a live migration on
a gloo cluster with b set, which changes no token."""

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from triton_util import needs_triton  # noqa: E402

from moeserve.balancer.controller import LoopConfig, StepGain, pays, planned_step_s, step_efficiency, step_gain, trigger
from moeserve.balancer.policy.cost import StepModel, breakeven
from moeserve.config import BREAKEVEN_ENV
from moeserve.dataplane.exchange import choose_slots, replicas_used
from moeserve.router.dispatcher import RouterMaps


def maps_for(phy2log, num_logical, max_replicas, breakeven=None):
    return RouterMaps(np.asarray([phy2log]), num_logical, max_replicas, breakeven=breakeven)


def ids_for(own: int, t: int = 6) -> torch.Tensor:
    """ids [max(own, t), 2] over 6 experts in which expert 0 is the first choice of exactly the
    first ``own`` tokens (consecutive: the rule's token order covers its replicas evenly)."""
    rows = []
    for i in range(max(own, t)):
        first = 0 if i < own else 1 + i % 5
        rows.append([first, 1 + (i + 1) % 5 if first else 1 + i % 5])
    return torch.tensor(rows, dtype=torch.long)


def kernel_slots(ids, maps, layer, offset, router, num_routers, p, capacity=1024):
    from moeserve import kernels

    k = ids.shape[1]
    args = kernels.pair_args(None, ids.contiguous(), None, ids.numel(), offset)
    sl, _ = kernels.route(
        args,
        maps.log2phy[layer],
        maps.logcnt[layer],
        p,
        maps.single[layer],
        k,
        capacity,
        maps.route_breakeven(layer, always=True),
        router,
        num_routers,
    )
    return sl[: ids.numel()].long()


# ---- the rule ---------------------------------------------------------------------------------

PHY2LOG = [0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 0, 3]  # E = 6: expert 0 has 4 replicas, 1 and 2 two, 3 two


@pytest.mark.parametrize("b", [0, 1, 3, 4, 7])
@pytest.mark.parametrize("num_routers,router,step", [(1, 0, 0), (2, 1, 5), (3, 2, 11)])
def test_a_replica_gets_pairs_exactly_when_the_estimated_count_passes_b(b, num_routers, router, step):
    m = maps_for(PHY2LOG, 6, 4, breakeven=b)
    replicas = m.log2phy[0, 0, :4].tolist()
    for own in range(0, 13):  # this router's pairs of expert 0
        ids = ids_for(own)
        slots = choose_slots(ids, m.log2phy[0], m.logcnt[0], router + step, m.breakeven[0], router, num_routers)
        mine = slots[ids.reshape(-1) == 0]
        est = own * num_routers
        used = sorted(set(mine.tolist()))
        if own == 0:
            assert used == []
        elif b == 0:  # no threshold: every replica, as before
            assert len(used) == min(4, own)
        elif est <= b:  # one copy: the step's, the same on every router
            assert used == [replicas[step % 4]]
        else:  # min(logcnt, ceil(est / b)) copies, the first ones
            want = min(4, -(-est // b))
            assert len(used) == min(want, own) and set(used) <= set(replicas[:want])
            per = torch.bincount(mine, minlength=12)[replicas[:want]]
            assert int(per.max() - per.min()) <= 1  # an even split, give or take one
        # every pair still lands on a slot of its own expert
        assert torch.equal(torch.tensor(PHY2LOG)[slots], ids.reshape(-1))


def test_below_b_every_router_picks_the_same_replica_and_it_rotates_with_the_step():
    m = maps_for(PHY2LOG, 6, 4, breakeven=8)
    for step in range(9):
        chosen = set()
        for router in range(3):  # different counts, all with est <= 8
            own = [1, 2, 2][router]
            ids = ids_for(own)[torch.randperm(6, generator=torch.Generator().manual_seed(step * 3 + router))]
            slots = choose_slots(ids, m.log2phy[0], m.logcnt[0], router + step, m.breakeven[0], router, 3)
            chosen |= set(slots[ids.reshape(-1) == 0].tolist())
        assert chosen == {int(m.log2phy[0, 0, step % 4])}


def test_b_zero_is_the_rule_without_a_threshold():
    g = torch.Generator().manual_seed(1)
    m = maps_for(PHY2LOG, 6, 4)
    for t in (0, 1, 5, 40):
        ids = (
            torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(t)])
            if t
            else torch.zeros(0, 3, dtype=torch.long)
        )
        plain = choose_slots(ids, m.log2phy[0], m.logcnt[0], 4)
        assert torch.equal(choose_slots(ids, m.log2phy[0], m.logcnt[0], 4, m.breakeven[0], 1, 2), plain)
        assert torch.equal(m.slots_of(0, ids, 4, 1, 2), plain)


def test_replicas_used_per_expert():
    logcnt = torch.tensor([4, 4, 4, 1, 3, 2])
    b = torch.tensor([5, 5, 0, 5, 2, 5])
    est = torch.tensor([5, 6, 100, 50, 5, 0])
    used, alone = replicas_used(est, logcnt, b, step=7)
    assert used.tolist() == [1, 2, 4, 1, 3, 1]
    assert alone.tolist() == [3, -1, -1, -1, -1, 0]  # at or below b: (step + e) mod logcnt


def test_below_b_experts_doubled_on_the_same_workers_take_turns():
    """Experts 0-3, each with a replica on worker 0 (slots 0-3) and one on worker 1 (slots
    4-7), all below b: in every step two of them read worker 0's copy and two worker 1's."""
    log2phy = torch.tensor([[e, 4 + e] for e in range(4)])
    logcnt = torch.full((4,), 2)
    ids = torch.arange(4).view(4, 1)  # one pair per expert
    for step in range(4):
        slots = choose_slots(ids, log2phy, logcnt, step, torch.full((4,), 10), 0, 1)
        workers = (slots >= 4).long()
        assert workers.sum().item() == 2, (step, slots.tolist())


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_the_interpreted_route_kernel_equals_the_torch_rule(seed):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    e = int(rng.integers(3, 9))
    replicas = bool(seed % 3)  # a third of the cases: no replica at all
    p = e + (int(rng.integers(1, 6)) if replicas else 0)
    phy2log = np.concatenate([rng.permutation(e), rng.integers(0, e, p - e)])
    k = int(rng.integers(1, min(e, 4) + 1))
    # per-expert thresholds around the counts: 0 (off), small, large
    b = rng.choice([0, 1, 2, 3, 5, 8, 40, 1000], size=e)
    m = maps_for(phy2log, e, p - e + 1, breakeven=b)
    for t in (0, 1, 7, 90, 200):  # several blocks of 256 pairs at the largest
        ids = (
            torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            if t
            else torch.zeros(0, k, dtype=torch.long)
        )
        for num_routers in (1, 2, 3):
            for router in range(num_routers):
                offset = router + int(rng.integers(0, 50))
                want = choose_slots(ids, m.log2phy[0], m.logcnt[0], offset, m.breakeven[0], router, num_routers)
                assert torch.equal(kernel_slots(ids, m, 0, offset, router, num_routers, p), want)
                assert torch.equal(m.slots_of(0, ids, offset, router, num_routers), want)


@needs_triton
def test_the_kernel_counts_only_the_n_valid_pairs_and_applies_the_threshold():
    from moeserve import kernels

    m = maps_for(PHY2LOG, 6, 4, breakeven=4)
    # 300 tokens, but N says 3 pairs: expert 0's count is 3 (est 6 > 4 with 2 routers: 2 replicas)
    ids = torch.zeros(300, 1, dtype=torch.long)
    args = kernels.pair_args(None, ids, None, 3, 1)
    sl, hist = kernels.route(args, m.log2phy[0], m.logcnt[0], 12, False, 1, 600, m.breakeven[0], 1, 2)
    assert sl[:3].tolist() == [m.log2phy[0, 0, (t + 1) % 2].item() for t in range(3)]
    assert int(hist[0].sum()) == 3
    args = kernels.pair_args(None, ids, None, 2, 1)  # est 4 <= 4: the step's replica (1 - 1) mod 4
    sl, _ = kernels.route(args, m.log2phy[0], m.logcnt[0], 12, False, 1, 600, m.breakeven[0], 1, 2)
    assert sl[:2].tolist() == [m.log2phy[0, 0, 0].item()] * 2
    # no breakeven row: the rule without a threshold (one launch)
    sl, _ = kernels.route(args, m.log2phy[0], m.logcnt[0], 12, False, 1, 600)
    assert sl[:2].tolist() == [m.log2phy[0, 0, (t + 1) % 4].item() for t in range(2)]


# ---- the maps ---------------------------------------------------------------------------------


def test_router_maps_keep_b_beside_logcnt_and_a_commit_sets_it(monkeypatch):
    monkeypatch.delenv(BREAKEVEN_ENV, raising=False)
    m = RouterMaps(np.asarray([PHY2LOG, PHY2LOG]), 6, 4)
    assert m.breakeven.shape == (2, 6) and m.breakeven.dtype == torch.long
    assert not any(m.thresholded) and m.route_breakeven(0) is None
    assert m.route_breakeven(0, always=True).data_ptr() == m.breakeven[0].data_ptr()
    # one allocation: what keeps logcnt alive keeps b alive at a fixed address
    assert m.breakeven.untyped_storage().data_ptr() == m.logcnt.untyped_storage().data_ptr()
    ptr = m.breakeven.data_ptr()
    m.set_layer(1, PHY2LOG, np.arange(6) * 2.7)  # floats are floored: integer counts
    assert m.breakeven[1].tolist() == [0, 2, 5, 8, 10, 13] and m.thresholded == [False, True]
    m.set_layer(1, PHY2LOG)  # without b: 0
    assert m.breakeven[1].tolist() == [0] * 6 and m.thresholded == [False, False]
    m.set_breakeven(np.full((2, 6), 3))
    assert m.breakeven.tolist() == [[3] * 6] * 2 and all(m.thresholded)
    assert m.breakeven.data_ptr() == ptr  # rewritten in place (graphs read it)
    with pytest.raises(ValueError, match="breakeven must be"):
        m.set_breakeven(np.ones(5))
    with pytest.raises(ValueError, match=">= 0"):
        m.set_breakeven(-1)


def test_the_environment_knob_is_only_the_start_placement_s_default(monkeypatch, tmp_path):
    """MOESERVE_EPLB_BREAKEVEN sets b of a start placement that carries none; RouterMaps and
    commits never read it (b travels with the placement)."""
    from moeserve.cluster.rank import initial_placement
    from moeserve.config import ClusterConfig, EplbConfig

    monkeypatch.setenv(BREAKEVEN_ENV, "5")
    m = RouterMaps(np.asarray([PHY2LOG]), 6, 4)
    assert m.breakeven[0].tolist() == [0] * 6
    cfg = ClusterConfig(str(tmp_path), workers=2, eplb=EplbConfig(enable_eplb=True, num_redundant_experts=2))
    p = initial_placement(cfg, 3, 6)
    assert p.breakeven.shape == (3, 6) and (p.breakeven == 5).all()
    given = np.arange(18).reshape(3, 6)
    cfg = ClusterConfig(
        str(tmp_path),
        workers=2,
        eplb=EplbConfig(enable_eplb=True, num_redundant_experts=2),
        breakeven=tuple(tuple(int(x) for x in r) for r in given),
    )
    np.testing.assert_array_equal(initial_placement(cfg, 3, 6).breakeven, given)  # a placement's own b wins
    assert ClusterConfig.from_json(cfg.to_json()) == cfg
    monkeypatch.setenv(BREAKEVEN_ENV, "many")
    with pytest.raises(ValueError, match=BREAKEVEN_ENV):
        initial_placement(dataclasses.replace(cfg, breakeven=None), 3, 6)


# ---- b from the step model ----------------------------------------------------------------------

MODEL = StepModel(
    "test-gpu",
    "test",
    hidden_size=512,
    intermediate_size=1024,
    dtype_bytes=2,
    hbm_bytes_per_s=4e12,
    matmul_flops_per_s=7e14,
    slot_overhead_s=4e-6,
    layer_overhead_s=2e-5,
)


def test_breakeven_is_where_a_copy_s_read_equals_the_matmul_of_its_pairs():
    read = MODEL.expert_bytes / MODEL.hbm_bytes_per_s + MODEL.slot_overhead_s
    per_pair = MODEL.flops_per_pair / MODEL.matmul_flops_per_s
    b = MODEL.breakeven_count
    assert b == int(read // per_pair) and b * per_pair <= read < (b + 1) * per_pair
    # faster memory -> a smaller b; a faster matmul -> a larger b
    from dataclasses import replace

    assert replace(MODEL, hbm_bytes_per_s=8e12).breakeven_count < b
    assert replace(MODEL, matmul_flops_per_s=1.4e15).breakeven_count > b
    assert replace(MODEL, slot_overhead_s=0.0, hbm_bytes_per_s=1e30).breakeven_count == 1  # at least 1
    table = breakeven(MODEL, 3, 5)
    assert table.shape == (3, 5) and table.dtype == np.int64 and (table == b).all()
    assert (breakeven(None, 3, 5) == 0).all()


# ---- the controller on predicted step time ----------------------------------------------------


def test_without_a_step_model_the_controller_keeps_the_balancedness_tests():
    cfg = LoopConfig(step_interval=100, min_balancedness=0.8, min_gain=0.01, move_cost=0.5)
    # step-time figures are ignored without a model
    assert trigger(cfg, 50, 10, None, predicted_balancedness=0.9, step_efficiency=0.1) is None
    assert trigger(cfg, 50, 10, None, predicted_balancedness=0.5, step_efficiency=0.99) == "threshold"
    assert pays(cfg, 0.06, 10, 10, 100, False, step_gain=-0.5)[0]
    assert not pays(cfg, 0.04, 10, 10, 100, False, step_gain=0.9)[0]
    assert step_gain(cfg, np.ones((1, 2)), [[0, 1]], [[1, 0]], 2, 10) is None
    assert step_efficiency(cfg, np.ones((1, 2)), [[0, 1]], 2, 10) is None


def test_with_a_step_model_the_trigger_and_the_pay_test_use_predicted_step_time():
    cfg = LoopConfig(step_interval=100, min_balancedness=0.8, min_gain=0.01, move_cost=0.5, step_model=MODEL)
    assert trigger(cfg, 50, 10, None, predicted_balancedness=0.5, step_efficiency=0.9) is None
    assert trigger(cfg, 50, 10, None, predicted_balancedness=0.99, step_efficiency=0.5) == "threshold"
    assert trigger(cfg, 50, 100, None, predicted_balancedness=0.99, step_efficiency=0.99) == "interval"
    # a plan that lowers balancedness but speeds the step up pays, and the reverse does not
    assert pays(cfg, -0.2, 10, 10, 100, False, step_gain=0.06) == (True, "")
    ok, why = pays(cfg, 0.3, 10, 10, 100, False, step_gain=0.04)
    assert not ok and "step-time gain 4.00%" in why and "needs 5.00%" in why
    ok, why = pays(cfg, 0.3, 2, 2, 100, True, step_gain=-0.01)
    assert not ok and "slow the predicted step down" in why
    assert pays(cfg, -0.3, 2, 2, 100, True, step_gain=0.0)[0]
    # no step-time figure given: the balancedness test, as before
    assert pays(cfg, 0.06, 10, 10, 100, False)[0]


def test_step_gain_and_efficiency_come_from_the_model():
    cfg = LoopConfig(step_model=MODEL)
    # 2 workers x 3 slots, 4 experts; expert 0 is hot. Before: its two copies share worker 0.
    load = np.array([[4000.0, 100.0, 100.0, 100.0]])
    before = np.array([[0, 0, 1, 2, 3, 1]])
    after = np.array([[0, 1, 2, 0, 3, 1]])
    sg = step_gain(cfg, load, before, after, 2, steps=10)
    assert isinstance(sg, StepGain)
    assert sg.before_s == pytest.approx(planned_step_s(MODEL, load, before, 2, 10))  # priced as the policy does
    assert sg.after_s < sg.before_s and 0 < sg.gain < 1
    assert step_gain(cfg, load, before, after, 2, steps=0) is None
    e_before = step_efficiency(cfg, load, before, 2, 10)
    e_after = step_efficiency(cfg, load, after, 2, 10)
    assert 0 < e_before < e_after <= 1


# ---- a live migration on a gloo cluster with b set ----------------------------------------------

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def breakeven_cluster(tmp_path_factory):
    from cluster_util import moe_info, prompts_for, reference_generate, reference_model, tiny_checkpoint

    from moeserve.cluster import LocalCluster

    path = tiny_checkpoint(tmp_path_factory.mktemp("llama4-b"), "llama4", num_hidden_layers=4)
    info = moe_info(path)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 7, 2, 11, 6, 3))
    tokens = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    # b = 3 with 2 routers: a router's count of 1 (estimate 2) takes the step's one copy, 2 or more
    # (estimate 4+) spreads over ceil(estimate / 3) copies: prefill and decode meet both sides.
    with LocalCluster(
        path,
        routers=2,
        workers=2,
        num_redundant_experts=4,
        migration_bytes_per_step=info.expert_bytes,
        env={BREAKEVEN_ENV: "3"},
    ) as c:
        yield dict(cluster=c, info=info, prompts=prompts, tokens=tokens)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp32_tokens_are_unchanged_through_a_live_migration_with_b_set(breakeven_cluster):
    from cluster_util import random_placement

    c, info = breakeven_cluster["cluster"], breakeven_cluster["info"]
    e = info.num_logical_experts
    assert (
        c.generate(breakeven_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True) == breakeven_cluster["tokens"]
    )
    # a placement where hot and cold experts have several copies, applied under traffic
    target = random_placement(info.num_moe_layers, e, e + 4, seed=7)
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            out=c.generate(breakeven_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True)
        )
    )
    t.start()
    time.sleep(0.2)
    steps_before = c.status().forward_steps
    mid = c.apply_placement(target, wait=True)
    t.join(120)
    assert c.migration(mid).state == "done"
    assert c.status().forward_steps > steps_before
    np.testing.assert_array_equal(c.placement().phy2log, target)
    assert result["out"] == breakeven_cluster["tokens"]
    assert (
        c.generate(breakeven_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True) == breakeven_cluster["tokens"]
    )
