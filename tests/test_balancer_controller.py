"""When the balancer's loop rebalances, and when a plan pays for its moves."""

import pytest

from moeserve.balancer.controller import LoopConfig, pays, trigger

CFG = LoopConfig(step_interval=100, min_balancedness=0.8, min_gain=0.01, move_cost=0.5)


def test_no_load_no_trigger():
    assert trigger(CFG, steps=0, steps_since_change=10_000, steps_since_plan=None, predicted_balancedness=0.1) is None


def test_the_interval_counts_from_the_last_placement_change_and_the_last_plan():
    assert trigger(CFG, 50, steps_since_change=100, steps_since_plan=None, predicted_balancedness=1.0) == "interval"
    assert trigger(CFG, 50, steps_since_change=99, steps_since_plan=None, predicted_balancedness=1.0) is None
    assert trigger(CFG, 50, steps_since_change=500, steps_since_plan=20, predicted_balancedness=1.0) is None


def test_balancedness_under_the_threshold_triggers_early():
    assert trigger(CFG, 50, steps_since_change=10, steps_since_plan=None, predicted_balancedness=0.5) == "threshold"
    assert trigger(CFG, 50, steps_since_change=10, steps_since_plan=None, predicted_balancedness=0.9) is None
    off = LoopConfig(step_interval=100, min_balancedness=0.0)
    assert trigger(off, 50, steps_since_change=10, steps_since_plan=None, predicted_balancedness=0.1) is None


def test_a_plan_pays_when_its_gain_covers_the_share_of_slots_it_moves():
    assert pays(CFG, gain=0.06, slots_moved=10, slots_across=10, total_slots=100, requested=False)[0]  # needs 0.05
    ok, why = pays(CFG, gain=0.04, slots_moved=10, slots_across=10, total_slots=100, requested=False)
    assert not ok and "does not pay" in why and "0.0500" in why
    assert not pays(CFG, gain=0.005, slots_moved=1, slots_across=0, total_slots=100, requested=False)[0]  # < min_gain


def test_a_request_applies_any_plan_that_moves_something_and_does_not_hurt():
    assert pays(CFG, gain=0.001, slots_moved=2, slots_across=2, total_slots=10, requested=True)[0]
    assert not pays(CFG, gain=0.0, slots_moved=0, slots_across=0, total_slots=10, requested=True)[0]
    assert not pays(CFG, gain=-0.1, slots_moved=2, slots_across=2, total_slots=10, requested=True)[0]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(step_interval=0), "step_interval"),
        (dict(min_balancedness=1.5), "min_balancedness"),
        (dict(window_steps=-1), "window_steps"),
        (dict(move_budget=0.0), "move_budget"),
    ],
)
def test_bad_settings_say_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        LoopConfig(**kw)
