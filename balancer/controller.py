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
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopConfig:
    """The balancer's knobs. window_steps: forward steps of load to plan on (0: the leader's
    whole window); step_interval: steps between periodic rebalances; min_balancedness: the
    threshold (0 = off); min_gain, move_cost: when a plan pays; move_budget: the policy's share
    of slots it may move per plan (None: unlimited); step_model: a
    :class:`moeserve.balancer.policy.cost.StepModel` (None, the default: plan for token balance)
    with which the policy picks plans by the predicted time of each layer's slowest worker."""

    window_steps: int = 0
    step_interval: int = 3000
    min_balancedness: float = 0.0
    min_gain: float = 0.01
    move_cost: float = 0.5
    move_budget: float | None = 0.10
    step_model: object | None = None        # a policy.cost.StepModel: plan for predicted step time

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


def trigger(cfg: LoopConfig, steps: int, steps_since_change: int, steps_since_plan: int | None,
            predicted_balancedness: float) -> str | None:
    """The loop's trigger now, or None. ``steps``: forward steps in the load window (no load,
    no plan); ``steps_since_plan``: since this process last planned (None: never)."""
    if steps == 0:
        return None
    quiet = steps_since_plan is None or steps_since_plan >= cfg.step_interval
    if steps_since_change >= cfg.step_interval and quiet:
        return "interval"
    if cfg.min_balancedness > 0 and predicted_balancedness < cfg.min_balancedness and \
            (steps_since_plan is None or steps_since_plan >= min(cfg.step_interval, steps)):
        return "threshold"
    return None


def pays(cfg: LoopConfig, gain: float, slots_moved: int, slots_across: int, total_slots: int,
         requested: bool) -> tuple[bool, str]:
    """Whether to apply a plan, and why not when it is not applied."""
    if slots_moved == 0:
        return False, "the plan equals the placement in force: nothing to move"
    if requested:
        if gain < 0:
            return False, f"the plan would lower balancedness by {-gain:.4f}"
        return True, ""
    need = max(cfg.min_gain, cfg.move_cost * slots_across / max(total_slots, 1))
    if gain < need:
        return False, (f"predicted gain {gain:.4f} does not pay for moving {slots_across} of {total_slots} slots "
                       f"(needs {need:.4f})")
    return True, ""
