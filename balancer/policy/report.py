"""What a proposed placement buys over the placement in force: balancedness before and after,
slots and bytes moved (numpy only), so the balancer can skip a rebalance that does not pay.

Dimension letters: L MoE layers, E logical experts, P slots per layer, W workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeserve.placement import balancedness as _balancedness

__all__ = ["PlanReport", "evaluate"]


@dataclass(frozen=True)
class PlanReport:
    """Predicted effect of replacing ``current`` by ``proposed`` under ``load``.

    balancedness_before/after: [L] per layer; mean_before/after: the model's (mean over layers
    with tokens); slots_moved: slots whose logical expert changes; slots_moved_across_workers:
    those whose new expert is not already on their worker (its weights cross the wire);
    bytes_moved: slots_moved_across_workers * expert_bytes.
    """

    balancedness_before: np.ndarray
    balancedness_after: np.ndarray
    mean_before: float
    mean_after: float
    slots_moved: int
    slots_moved_across_workers: int
    bytes_moved: int

    @property
    def gain(self) -> float:
        return self.mean_after - self.mean_before


def evaluate(load, current, proposed, num_workers: int, expert_bytes: int) -> PlanReport:
    """What ``proposed [L, P]`` buys over ``current [L, P]`` under ``load [L, E]``, so the
    balancer can skip a rebalance that does not pay. Vectorised; no move list is built."""
    load = np.asarray(load, dtype=np.float64)
    cur, new = np.asarray(current, dtype=np.int64), np.asarray(proposed, dtype=np.int64)
    if cur.shape != new.shape or cur.shape[0] != load.shape[0]:
        raise ValueError(f"shapes disagree: load {load.shape}, current {cur.shape}, proposed {new.shape}")
    layers, p = cur.shape
    e = load.shape[1]
    before = _balancedness(load, cur, num_workers)
    after = _balancedness(load, new, num_workers)
    busy = load.sum(1) > 0
    changed = cur != new
    # is the new expert already held (in the old placement) by the slot's worker?
    worker = np.arange(p) // (p // num_workers)
    held = np.zeros((layers, num_workers, e), dtype=bool)
    held[np.arange(layers)[:, None], worker, cur] = True
    local = held[np.arange(layers)[:, None], worker, new]
    across = int((changed & ~local).sum())
    return PlanReport(
        before,
        after,
        float(before[busy].mean()) if busy.any() else 1.0,
        float(after[busy].mean()) if busy.any() else 1.0,
        int(changed.sum()),
        across,
        across * int(expert_bytes),
    )
