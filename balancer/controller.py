"""When the balancer rebalances, and whether a plan is worth its moves (pure functions).

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

- **interval**: ``step_interval`` forward steps have passed since the placement last changed
  (the leader counts them, so a restarted balancer loses nothing) and since this process last
  planned;
- **threshold**: the predicted balancedness (the window's load on the placement in force) is
  under ``min_balancedness`` (0 turns this off);
- **request**: an operator's Rebalance call.

A plan from a trigger of the loop is applied only when it *pays*: its predicted gain in mean
balancedness is at least ``min_gain`` and at least ``move_cost`` times the share of all slots
whose weights cross workers (moving 10 % of the slots with move_cost 0.5 must buy 0.05). An
operator's request applies any plan that moves something and does not lower balancedness.

**With a step model** (``LoopConfig.step_model``, a ``policy.cost.StepModel``) the same tests
use predicted step time instead of token balance (docs/eplb.md): the threshold compares the
*step efficiency* (:func:`step_efficiency`: per layer the mean worker's predicted time over
the slowest worker's, summed over layers) with ``min_balancedness``, and a plan pays when its
*relative predicted step-time gain* (:func:`step_gain`: (before - after) / before of the
predicted MoE time of a step) clears the same bar; a request applies any plan that does not
slow the step down. Balancedness stays what the balancer reports. A caller that passes no
step-time figures (``step_efficiency`` / ``step_gain`` None) gets the balancedness tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moeserve.balancer.policy.cost import StepModel


@dataclass(frozen=True)
class LoopConfig:
    """The balancer's knobs. window_steps: forward steps of load to plan on (0: the leader's
    whole window); step_interval: steps between periodic rebalances; min_balancedness: the
    threshold (0 = off; with a step model, on the step efficiency); min_gain, move_cost: when a
    plan pays (with a step model, in relative predicted step time); move_budget: the policy's
    share of slots it may move per plan (None: unlimited); step_model: a
    :class:`moeserve.balancer.policy.cost.StepModel` (None, the default: plan for token balance)
    with which the policy picks plans by the predicted time of each layer's slowest worker, and
    the trigger and the pay test use predicted step time (the module's docstring)."""

    window_steps: int = 0
    step_interval: int = 3000
    min_balancedness: float = 0.0
    min_gain: float = 0.01
    move_cost: float = 0.5
    move_budget: float | None = 0.10
    step_model: StepModel | None = None  # plan for predicted step time

    def __post_init__(self):
        if self.window_steps < 0:
            raise ValueError(f"window_steps must be >= 0 (0 = the leader's whole window), got {self.window_steps}")
        if self.step_interval < 1:
            raise ValueError(f"step_interval must be >= 1, got {self.step_interval}")
        if not 0.0 <= self.min_balancedness <= 1.0:
            raise ValueError(f"min_balancedness must be in [0, 1] (0 = off), got {self.min_balancedness}")
        if self.min_gain < 0 or self.move_cost < 0:
            raise ValueError("min_gain and move_cost must be >= 0")
        if self.move_budget is not None and not 0.0 < self.move_budget <= 1.0:
            raise ValueError(f"move_budget must be in (0, 1] or None (unlimited), got {self.move_budget}")


def trigger(
    cfg: LoopConfig,
    steps: int,
    steps_since_change: int,
    steps_since_plan: int | None,
    predicted_balancedness: float,
    step_efficiency: float | None = None,
) -> str | None:
    """The loop's trigger now, or None. ``steps``: forward steps in the load window (no load,
    no plan); ``steps_since_plan``: since this process last planned (None: never).
    ``step_efficiency``: with a step model, :func:`step_efficiency` of the placement in force;
    the threshold then compares it (not ``predicted_balancedness``) with ``min_balancedness``."""
    if steps == 0:
        return None
    quiet = steps_since_plan is None or steps_since_plan >= cfg.step_interval
    if steps_since_change >= cfg.step_interval and quiet:
        return "interval"
    measure = predicted_balancedness
    if cfg.step_model is not None and step_efficiency is not None:
        measure = step_efficiency
    if (
        cfg.min_balancedness > 0
        and measure < cfg.min_balancedness
        and (steps_since_plan is None or steps_since_plan >= min(cfg.step_interval, steps))
    ):
        return "threshold"
    return None


def pays(
    cfg: LoopConfig,
    gain: float,
    slots_moved: int,
    slots_across: int,
    total_slots: int,
    requested: bool,
    step_gain: float | None = None,
) -> tuple[bool, str]:
    """Whether to apply a plan, and why not when it is not applied. ``gain``: its gain in mean
    balancedness; ``step_gain``: with a step model, its relative predicted step-time gain
    (:func:`step_gain`), which then decides in place of ``gain``."""
    if slots_moved == 0:
        return False, "the plan equals the placement in force: nothing to move"
    timed = cfg.step_model is not None and step_gain is not None
    value = step_gain if timed and step_gain is not None else gain  # (timed: step_gain is set)
    if requested:
        if value < 0:
            if timed:
                return False, f"the plan would slow the predicted step down by {-value:.2%}"
            return False, f"the plan would lower balancedness by {-value:.4f}"
        return True, ""
    need = max(cfg.min_gain, cfg.move_cost * slots_across / max(total_slots, 1))
    if value < need:
        what = f"predicted step-time gain {value:.2%}" if timed else f"predicted gain {value:.4f}"
        bar = f"{need:.2%}" if timed else f"{need:.4f}"
        return False, f"{what} does not pay for moving {slots_across} of {total_slots} slots (needs {bar})"
    return True, ""


@dataclass(frozen=True)
class StepGain:
    """Predicted MoE seconds of a step on the placement in force and on a plan (the step model's
    sum over layers of each layer's slowest worker)."""

    before_s: float
    after_s: float

    @property
    def gain(self) -> float:
        """The relative gain, (before - after) / before (0 when nothing runs)."""
        return (self.before_s - self.after_s) / self.before_s if self.before_s > 0 else 0.0


def step_gain(
    cfg: LoopConfig, load, current, proposed, num_workers: int, steps: int, histogram=None, breakeven=None
) -> StepGain | None:
    """What ``proposed [L, P]`` saves over ``current [L, P]`` in predicted step time under the
    window's ``load [L, E]`` over ``steps`` forward steps (``histogram [L, E, K]``, optional:
    per-step counts); None without a step model or without steps. ``breakeven [L, E]``: the
    counts already planned for ``proposed`` (the caller installs them), so they are not planned
    twice."""
    if cfg.step_model is None or steps < 1:
        return None
    load = np.asarray(load, dtype=np.float64)
    return StepGain(
        planned_step_s(cfg.step_model, load, current, num_workers, steps, histogram),
        planned_step_s(cfg.step_model, load, proposed, num_workers, steps, histogram, breakeven),
    )


def planned_step_s(model, load, phy2log, num_workers: int, steps: int, histogram=None, breakeven=None) -> float:
    """Predicted seconds of a step's MoE layers for placement ``phy2log [L, P]`` with the
    break-even counts the balancer would install with it (``policy.rule.plan_breakeven``, unless
    given as ``breakeven [L, E]``), under the data plane's replica rule (``policy.rule.rule_times``):
    how the policy prices a plan."""
    from moeserve.balancer.policy.rule import plan_breakeven, rule_times

    b = plan_breakeven(model, load, phy2log, num_workers, steps, histogram) if breakeven is None else breakeven
    return float(rule_times(model, load, phy2log, num_workers, b, steps, histogram).sum())


def step_efficiency(cfg: LoopConfig, load, phy2log, num_workers: int, steps: int, histogram=None) -> float | None:
    """The trigger's step-time measure of the placement in force (``policy.cost.step_efficiency``);
    None without a step model or without steps."""
    if cfg.step_model is None or steps < 1:
        return None
    from moeserve.balancer.policy.cost import step_efficiency as efficiency

    return efficiency(cfg.step_model, np.asarray(load, dtype=np.float64), phy2log, num_workers, steps, histogram)
