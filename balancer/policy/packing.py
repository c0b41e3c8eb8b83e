"""Fresh plans for batches of rows: how many replicas each logical expert gets, and which worker
holds them (numpy only).

Dimension letters: B rows (independent sub-problems: a MoE layer, or a (layer, node) pair in
the hierarchical case), e logical experts of a row (ids local to the row), p slots of a row,
w workers of a row, s = p / w slots per worker.

A row's slot ``k`` lives on worker ``k // s``. A logical expert's load splits evenly over its
replicas; a worker's load is the sum over its slots. Every function works on all rows at once;
the only Python loops run over replicas or rounds, never over rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["replica_counts", "expand_counts", "slot_load", "worker_load_rows", "pack_greedy", "pack_ldm", "pack"]


def replica_counts(load: np.ndarray, num_slots: int, num_workers: int | None = None) -> np.ndarray:
    """Replica counts minimising the largest load per replica (D'Hondt): ``load [B, e]`` -> ``logcnt [B, e]``.

    Every logical expert gets one replica; each further slot goes to the expert with the largest
    load per replica at that moment (the lower id on ties), which is optimal for min-max per
    replica.

    With ``num_workers`` w, counts are made packable: an expert with more than w but fewer than
    2w replicas puts two of them on some worker; where two of its replicas weigh more than a
    worker's mean load that worker is overloaded whatever the packing, so such an expert is
    cut back to w replicas (one per worker) and the slots freed go, by the same rule, to the
    experts below w replicas.
    """
    rows, e = load.shape
    flat_cnt = np.ones(rows * e, dtype=np.int64)
    flat_load = np.ascontiguousarray(load, dtype=np.float64).ravel()
    per_replica = flat_load.copy()
    per_replica_rows = per_replica.reshape(rows, e)  # [B, e], a view
    row_base = np.arange(rows) * e
    for _ in range(num_slots - e):
        k = per_replica_rows.argmax(axis=1) + row_base
        flat_cnt[k] += 1
        per_replica[k] = flat_load[k] / flat_cnt[k]
    if num_workers is None or num_workers < 2:
        return flat_cnt.reshape(rows, e)
    w = num_workers
    logcnt = flat_cnt.reshape(rows, e)  # [B, e], a view
    mean = load.sum(1) / w  # [B] mean worker load
    cut = (logcnt > w) & (logcnt < 2 * w) & (2 * load / logcnt > mean[:, None])
    if not cut.any():
        return logcnt
    freed = np.where(cut, logcnt - w, 0).sum(1)  # [B]
    logcnt[cut] = w
    # experts at w replicas or more take no freed slot: -inf keeps them out of the argmax
    per_replica_rows[:] = np.where(cut | (logcnt >= w), -np.inf, load / logcnt)
    for _ in range(int(freed.max())):
        k = per_replica_rows.argmax(axis=1) + row_base
        give = freed > 0
        k = k[give]
        flat_cnt[k] += 1
        per_replica[k] = np.where(flat_cnt[k] >= w, -np.inf, flat_load[k] / flat_cnt[k])
        freed -= give
    return logcnt


def expand_counts(logcnt: np.ndarray) -> np.ndarray:
    """The replicas as a list: ``logcnt [B, e]`` (each row summing to p) -> expert ids ``[B, p]``, ascending."""
    rows, e = logcnt.shape
    p = int(logcnt[0].sum()) if rows else 0
    return np.repeat(np.tile(np.arange(e), rows), logcnt.ravel()).reshape(rows, p)


def slot_load(load: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """Load of every slot, its expert's load over its replica count: ``load [B, e]``,
    ``phy2log [B, p]``, ``logcnt [B, e]`` -> ``[B, p]`` float64."""
    rows, e = load.shape
    flat = phy2log + (np.arange(rows) * e)[:, None]  # 1-D gathers: faster than [r, phy2log]
    return load.ravel()[flat] / logcnt.ravel()[flat]


def worker_load_rows(slot_load_: np.ndarray, num_workers: int) -> np.ndarray:
    """Slot loads ``[B, p]`` -> worker loads ``[B, w]``."""
    rows, p = slot_load_.shape
    return slot_load_.reshape(rows, num_workers, p // num_workers).sum(axis=2)


def _replicas_heaviest_first(load: np.ndarray, logcnt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every replica of ``logcnt [B, e]``, heaviest first: expert ids ``[B, p]`` and their loads ``[B, p]``."""
    replicas = expand_counts(logcnt)  # [B, p]
    replica_load = slot_load(np.ascontiguousarray(load, dtype=np.float64), replicas, logcnt)
    order = np.argsort(-replica_load, axis=1)
    return np.take_along_axis(replicas, order, 1), np.take_along_axis(replica_load, order, 1)


def pack_greedy(load: np.ndarray, logcnt: np.ndarray, num_workers: int) -> np.ndarray:
    """Pack the replicas ``logcnt [B, e]`` of experts with ``load [B, e]`` onto w workers of s slots.

    Round-based greedy: replicas are taken heaviest first, w at a time; in each round the
    heaviest goes to the currently lightest worker, the next to the next lightest, and so on, so
    every worker gets exactly one slot per round. Returns ``phy2log [B, p]`` (slot -> expert).
    """
    rows = load.shape[0]
    replicas, replica_load = _replicas_heaviest_first(load, logcnt)
    p = replicas.shape[1]
    w = num_workers
    s = p // w
    phy2log = np.empty(rows * p, dtype=np.int64)
    worker_load = np.zeros(rows * w)
    worker_load_2d = worker_load.reshape(rows, w)  # [B, w], a view
    worker_base = (np.arange(rows) * w)[:, None]
    for k in range(s):
        lightest_first = np.argsort(worker_load_2d, axis=1) + worker_base  # [B, w] flat worker ids
        phy2log[lightest_first * s + k] = replicas[:, k * w : (k + 1) * w]
        worker_load[lightest_first] += replica_load[:, k * w : (k + 1) * w]
    return phy2log.reshape(rows, p)


def pack_ldm(load: np.ndarray, logcnt: np.ndarray, num_workers: int) -> np.ndarray:
    """Balanced largest differencing (Karmarkar-Karp for equal-size workers): ``phy2log [B, p]``.

    The replicas, heaviest first, are cut into s rounds of w; each round is a partial packing
    (one replica per worker). The two partial packings whose loads differ most are merged,
    heaviest worker of one with the lightest of the other, until one is left: every worker
    ends with exactly s replicas. s - 1 merges, each vectorised over the rows.
    """
    rows = load.shape[0]
    replicas, replica_load = _replicas_heaviest_first(load, logcnt)
    p = replicas.shape[1]
    w = num_workers
    s = p // w
    sums = replica_load.reshape(rows * s, w)  # [(B, s), w] descending
    # place[b, r, j]: where the j-th replica of round r sits in its partial packing (desc order)
    place = np.broadcast_to(np.arange(w), (rows, s, w)).copy()
    packing_of_round = np.broadcast_to(np.arange(s), (rows, s)).copy()
    spread = (sums[:, 0] - sums[:, -1]).reshape(rows, s)  # [B, s]
    r = np.arange(rows)
    round_base = r * s
    worker_base = (r * w)[:, None, None]
    for _ in range(s - 1):
        widest = spread.argmax(1)
        spread[r, widest] = -np.inf
        second = spread.argmax(1)
        merged = sums[round_base + widest] + sums[round_base + second][:, ::-1]  # [B, w]
        order = np.argsort(-merged, axis=1)
        rank = np.argsort(order, axis=1)  # old place -> new
        sums[round_base + widest] = np.take_along_axis(merged, order, 1)
        spread[r, widest] = merged.max(1) - merged.min(1)
        spread[r, second] = -np.inf
        in_second = (packing_of_round == second[:, None])[:, :, None]  # [B, s, 1]
        place = np.where(in_second, (w - 1) - place, place)
        packing_of_round = np.where(in_second[:, :, 0], widest[:, None], packing_of_round)
        in_merged = (packing_of_round == widest[:, None])[:, :, None]
        place = np.where(in_merged, rank.ravel()[place + worker_base], place)
    return np.take_along_axis(replicas, np.argsort(place.reshape(rows, p), axis=1, kind="stable"), 1)


def pack(load: np.ndarray, logcnt: np.ndarray, num_workers: int) -> np.ndarray:
    """Pack replicas onto workers: ``load [B, e]``, ``logcnt [B, e]`` -> ``phy2log [B, p]``.

    Largest differencing for 3 to 16 workers with at most 32 slots each (there it balances
    better than the greedy, and cheaply), the round-based greedy otherwise (with many workers
    the two balance alike and the greedy is faster).
    """
    p = int(logcnt[0].sum()) if logcnt.size else 0
    if num_workers == 1:  # one worker holds everything
        return expand_counts(logcnt)
    if 2 < num_workers <= 16 and p // num_workers <= 32:
        return pack_ldm(load, logcnt, num_workers)
    return pack_greedy(load, logcnt, num_workers)
