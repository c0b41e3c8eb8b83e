"""The cost-aware policy's plans for the data plane's replica rule: the rule's step-time
model (balancer/policy/rule.py), break-even counts b chosen per (layer, expert), and placements
whose one replica read per step splits evenly over the workers."""

import sys
from pathlib import Path

import numpy as np
import pytest

from moeserve.balancer.policy import make_policy, place
from moeserve.balancer.policy.cost import StepModel, breakeven
from moeserve.balancer.policy.rule import (
    NEVER_SPREAD,
    plan_breakeven,
    poisson_cdf,
    rule_phases,
    rule_shares,
    rule_slot_shares,
    rule_times,
)
from moeserve.placement import logical_counts

ROOT = Path(__file__).resolve().parent.parent
MODEL = StepModel("H200", "scout", 5120, 8192, 2, 4.0e12, 6.0e14, 5e-6, 2e-5)  # b0 = 161
B0 = MODEL.breakeven_count


def simulate(model, counts, phy2log, b, w):
    """The rule applied by hand to fixed per-step counts ``counts [E]`` of one layer: the mean over
    the rule's period of the slowest worker's time (docs/dataplane.md, "Replica choice")."""
    e, p = counts.size, phy2log.size
    logcnt = np.bincount(phy2log, minlength=e)
    slots = [np.flatnonzero(phy2log == x) for x in range(e)]  # replica j = j-th slot
    period = int(np.lcm.reduce(logcnt))
    times = []
    for step in range(period):
        pairs = np.zeros(p)
        for x, n in enumerate(counts):
            c = logcnt[x]
            if n == 0:
                continue
            if 0 < b[x] and n <= b[x]:
                pairs[slots[x][(step + x) % c]] += n
            else:
                u = min(c, int(np.ceil(n / b[x]))) if b[x] > 0 else c
                pairs[slots[x][:u]] += n / u
        per_worker = pairs.reshape(w, -1)
        times.append(model.time((per_worker > 0).sum(1), per_worker.sum(1)).max())
    return float(np.mean(times))


def test_the_rule_model_matches_the_rule_applied_by_hand_on_fixed_counts():
    rng = np.random.default_rng(0)
    e, p, w = 8, 12, 2
    for _ in range(20):
        phy2log = rng.permutation(np.concatenate([np.arange(e), rng.choice(e, p - e)]))
        while (np.bincount(phy2log, minlength=e) == 0).any():
            phy2log = rng.permutation(np.concatenate([np.arange(e), rng.choice(e, p - e)]))
        bins = rng.integers(1, 10, size=e)  # one histogram bin per expert: a fixed count
        hist = np.zeros((1, e, 10))
        hist[0, np.arange(e), bins] = 5.0
        counts = np.where(bins == 1, 1.0, np.sqrt(2.0 ** (bins - 1) * (2.0**bins - 1)))  # the bins' middles
        b = rng.choice([1, 4, 16, 64, 600], size=e)
        got = rule_times(MODEL, 5 * counts[None], phy2log[None], w, b[None], 5, histogram=hist)[0]
        assert got == pytest.approx(simulate(MODEL, counts, phy2log, b, w), rel=1e-9)


def test_the_rule_model_with_window_sums_matches_sampled_poisson_counts():
    rng = np.random.default_rng(1)
    w, steps = 2, 4
    phy2log = np.array([0, 1, 2, 3, 4, 5, 0, 1, 6, 7, 2, 0])
    load = np.array([900.0, 500, 300, 60, 40, 20, 8, 2]) * steps
    b = np.array([200, 100, 40, 161, 161, 161, 161, 161])
    sampled = []
    for _ in range(400):
        counts = rng.poisson(load / steps)
        sampled.append(simulate(MODEL, counts, phy2log, b, w))
    predicted = rule_times(MODEL, load[None], phy2log[None], w, b[None], steps)[0]
    assert predicted == pytest.approx(np.mean(sampled), rel=0.02)


def test_poisson_cdf_is_exact_for_small_counts_and_close_above():
    from math import exp, lgamma, log

    for lam in (0.3, 2.0, 9.0, 40.0, 300.0):
        for m in (0, 1, 5, 15, 16, 40, 280, 320):
            exact = sum(exp(-lam + k * log(lam) - lgamma(k + 1)) for k in range(m + 1))
            assert poisson_cdf(m, lam) == pytest.approx(exact, abs=1e-9 if m < 16 else 2e-3)
    assert poisson_cdf(-1, 3.0) == 0.0 and poisson_cdf(np.inf, 3.0) == 1.0 and poisson_cdf(0, 0.0) == 1.0


def test_the_rule_repeats_over_the_lcm_of_a_layers_replica_counts():
    assert rule_phases(np.array([[1, 1, 2, 2], [1, 3, 2, 1], [1, 1, 1, 1]])).tolist() == [2, 6, 1]


def decode_layer(per_step, steps=8, layers=4, experts=16, seed=0):
    """Window sums of a uniform decode-sized layer: ``per_step`` pairs a step over ``experts``."""
    rng = np.random.default_rng(seed)
    share = np.full(experts, 1 / experts)
    return np.stack([rng.multinomial(per_step * steps, share) for _ in range(layers)]).astype(float)


@pytest.mark.parametrize("per_step", [32, 128, 512])
def test_at_decode_sizes_the_cost_aware_plan_is_as_fast_as_the_better_of_eplb_off_and_token_balanced(per_step):
    # Scout-like: 16 experts, 4 redundant slots, 2 workers; every step's count is below b0, so
    # each expert is read on one replica a step. The placement in force doubles four even
    # experts: in a step they are all read on the same worker (10 reads against 6).
    load = decode_layer(per_step)
    layers, e = load.shape
    current = np.tile([0, 2, 4, 6, 1, 3, 5, 7, 8, 9] + [0, 2, 4, 6, 10, 11, 12, 13, 14, 15], (layers, 1))
    plan = make_policy(step_model=MODEL)(load, 20, 2, 1, 1, current, steps=8)
    assert (plan != current).sum() <= int(0.1 * plan.size)
    assert (logical_counts(plan, e) > 0).all()
    zero = np.zeros((layers, e), np.int64)
    off = rule_times(MODEL, load, np.tile(np.arange(e), (layers, 1)), 2, zero, 8)
    token = rule_times(MODEL, load, place(load, 20, 2), 2, zero, 8)
    cost = rule_times(MODEL, load, plan, 2, plan_breakeven(MODEL, load, plan, 2, 8), 8)
    assert (cost <= 1.02 * np.minimum(off, token)).all()


def test_at_decode_sizes_every_steps_reads_split_evenly_over_the_workers():
    load = decode_layer(128)
    layers, e = load.shape
    current = np.tile([0, 2, 4, 6, 1, 3, 5, 7, 8, 9] + [0, 2, 4, 6, 10, 11, 12, 13, 14, 15], (layers, 1))
    plan = make_policy(step_model=MODEL)(load, 20, 2, 1, 1, current, steps=8)
    b = plan_breakeven(MODEL, load, plan, 2, 8)
    busy, _ = rule_slot_shares(rule_shares(load, logical_counts(plan, e), b, 8), plan, None, 2)
    reads = busy.reshape(layers, 2, 2, 10).sum(3)  # [L, step parity, worker]
    assert np.abs(reads[..., 0] - reads[..., 1]).max() < 0.1
    before, _ = rule_slot_shares(rule_shares(load, logical_counts(current, e), b, 8), current, None, 2)
    assert np.abs(np.diff(before.reshape(layers, 2, 2, 10).sum(3), axis=2)).min() > 3.5  # 10 against 6 reads


def hot_layer(hot, others, layers=2, experts=16, steps=8):
    load = np.full((layers, experts), float(others * steps))
    load[:, 0] = hot * steps
    return load


def test_a_hot_experts_second_copy_is_not_read_where_the_workers_are_bound_by_reads():
    # 300 pairs a step is above b0 (161), but both workers spend more time reading weights than
    # multiplying: a second read of the hot expert would only slow its worker down
    load = hot_layer(300, 20)
    plan = place(load, 20, 2)
    assert logical_counts(plan, 16)[:, 0].min() >= 2
    b = plan_breakeven(MODEL, load, plan, 2, 8)
    assert (b[:, 0] > 300 + 6 * np.sqrt(300)).all()  # no step's count passes it
    t = rule_times(MODEL, load, plan, 2, b, 8)
    assert (t < rule_times(MODEL, load, plan, 2, breakeven(MODEL, 2, 16), 8)).all()


def test_a_hot_expert_spreads_over_its_copies_where_the_matmul_dominates():
    load = hot_layer(6000, 500)
    plan = place(load, 20, 2)
    b = plan_breakeven(MODEL, load, plan, 2, 8)
    assert (b[:, 0] < 6000).all()
    t = rule_times(MODEL, load, plan, 2, b, 8)
    assert (t < rule_times(MODEL, load, plan, 2, np.full((2, 16), NEVER_SPREAD), 8)).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_step", [16, 256, 4096])
def test_planned_b_is_never_predicted_slower_than_one_b_for_every_expert(seed, per_step):
    rng = np.random.default_rng(seed)
    load = np.stack([rng.permutation(per_step * 8 / np.arange(1, 17) ** 1.2) for _ in range(4)]).round()
    plan = place(load, 24, 2)
    b = plan_breakeven(MODEL, load, plan, 2, 8)
    assert b.dtype == np.int64 and b.shape == load.shape and (b >= 1).all()
    assert (b[logical_counts(plan, 16) == 1] == B0).all()  # b changes nothing there
    t = rule_times(MODEL, load, plan, 2, b, 8)
    for one in (B0, 2 * B0, NEVER_SPREAD):
        assert (t <= rule_times(MODEL, load, plan, 2, np.full_like(b, one), 8) * (1 + 1e-9)).all()
    assert (plan_breakeven(MODEL, load, plan, 2, 8) == b).all()  # the same for the caller


def test_node_rows_and_a_histogram_give_valid_plans_within_the_budget():
    rng = np.random.default_rng(0)
    layers, e, p, g, n, w = 4, 32, 48, 4, 2, 4
    load = np.stack([rng.permutation(2000 / np.arange(1, e + 1)) for _ in range(layers)]).round()
    cur = place(load, p, w, g, n)
    hist = rng.integers(0, 5, size=(layers, e, 8)).astype(float)
    pol = make_policy(step_model=MODEL)
    for kw in (dict(steps=8), dict(steps=8, histogram=hist)):
        plan = pol(load, p, w, g, n, cur, **kw)
        assert (logical_counts(plan, e) > 0).all() and (plan != cur).sum() <= int(0.1 * plan.size)
        group_node = (plan // (e // g)) * n + np.arange(p) // (p // n)  # groups stay on one node
        for l in range(layers):
            assert len(set(group_node[l].tolist())) == g
        assert plan_breakeven(MODEL, load, plan, w, **kw).shape == (layers, e)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["scout", "ernie21b"])
def test_the_layer_benchmarks_cost_rows_are_predicted_within_2_percent_of_the_better_of_off_and_token(shape):
    # the 1.02 check on the step model's predictions (benchmarks/eplb_layer.py --predict-only)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import eplb_layer as B

    res = B.main(["--predict-only", "--models", shape, "--sizes", "128,512,2048"])
    t = {(r["tokens"], r["zipf"], r["policy"]): r["pred_ms"] for r in res}
    for tokens in (128, 512, 2048):
        for z in B.ZIPF:
            assert t[(tokens, z, "cost")] <= B.TOLERANCE * min(t[(tokens, z, "off")], t[(tokens, z, "token")])
