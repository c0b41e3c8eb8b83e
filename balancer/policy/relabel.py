"""Relabel a fresh plan to the placement in force, so that a plan that merely permutes where
logical experts sit moves nothing (numpy only).

Dimension letters: B rows (a MoE layer, or a (layer, node) pair in the hierarchical case),
e logical experts of a row, p slots of a row, w workers of a row, s = p / w slots per worker.
"""

from __future__ import annotations

import numpy as np

__all__ = ["greedy_match", "relabel"]


def greedy_match(score: np.ndarray) -> np.ndarray:
    """Match the m items of one side to the m of the other, greedily by the highest score.

    score: [B, m, m], non-negative (``score[b, i, j]``: what matching i to j keeps). Returns
    ``match [B, m]``, a permutation per row: i is matched to ``match[b, i]``. The highest score
    left among unmatched items is matched first; ties go to the lower (i, j) in row-major order.
    """
    rows, m = score.shape[:2]
    score = score.astype(np.float64, copy=True)
    match = np.empty((rows, m), dtype=np.int64)
    r = np.arange(rows)
    for _ in range(m):
        k = score.reshape(rows, m * m).argmax(1)
        i, j = k // m, k % m
        match[r, i] = j
        score[r, i, :] = -1.0  # matched: out of the argmax
        score[r, :, j] = -1.0
    return match


def relabel(current: np.ndarray, proposed: np.ndarray, num_workers: int, num_logical: int) -> np.ndarray:
    """Relabel the workers and slots of ``proposed`` so that it keeps as much of ``current`` as it can.

    current, proposed: phy2log [B, p], logical ids below ``num_logical`` e. Returns a placement
    [B, p] with, in every row, the same multiset of logical experts per worker as ``proposed``
    (so the same worker loads, up to which worker is which) but with workers and slots permuted:
    new workers are matched to current workers greedily by the number of experts they share,
    and inside a matched pair every expert that already sits in a slot of the current worker
    stays in that slot. A proposal that is a mere permutation of ``current`` comes back equal
    to ``current``.
    """
    rows, p = current.shape
    w = num_workers
    s = p // w
    e = num_logical
    expert_base = (np.arange(rows) * e)[:, None]
    # overlap[b, new worker, old worker]: slots of the new worker whose expert the old one holds
    held = np.zeros((rows * e, w), dtype=bool)
    held[(current + expert_base).ravel(), np.tile(np.arange(p) // s, rows)] = True
    overlap = held[proposed + expert_base].reshape(rows, w, s, w).sum(2)  # [B, w, w]
    new_of_old = np.argsort(greedy_match(overlap), axis=1)  # the inverse permutation
    new_slots = proposed.reshape(rows, w, s)[np.arange(rows)[:, None], new_of_old]  # [B, w(old), s]
    old_slots = current.reshape(rows, w, s)
    out = np.full((rows, w, s), -1, dtype=np.int64)
    unplaced = np.ones((rows, w, s), dtype=bool)  # new_slots not yet placed
    for k in range(s):  # keep what sits already
        hit = unplaced & (new_slots == old_slots[:, :, k : k + 1])
        first_hit = hit.argmax(2)
        found = hit.any(2)
        out[:, :, k] = np.where(found, old_slots[:, :, k], -1)
        b, v = np.nonzero(found)
        unplaced[b, v, first_hit[b, v]] = False
    empty = out < 0  # fill the rest in order
    empty_slot = np.argsort(~empty, axis=2, kind="stable")
    unplaced_item = np.argsort(~unplaced, axis=2, kind="stable")
    take = np.arange(s) < empty.sum(2)[:, :, None]
    b, v, j = np.nonzero(take)
    out[b, v, empty_slot[b, v, j]] = new_slots[b, v, unplaced_item[b, v, j]]
    return out.reshape(rows, p)
