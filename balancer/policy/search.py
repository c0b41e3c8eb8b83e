"""Local search that lowers the heaviest workers' loads by moving slots, and the choice of how
far along it each row goes within a budget of slots moved (numpy only).

Dimension letters: B rows (independent sub-problems: a MoE layer, or a (layer, node) pair in
the hierarchical case), n the rows still searched (n <= B), e logical experts of a row (ids
local to the row), p slots of a row, w workers of a row, s = p / w slots per worker, Q worker
pairs relieved per iteration, K heavy slots a swap considers, T steps of a row's search,
G prices tried at once by :func:`select_prefix`.

A row's slot ``k`` lives on worker ``k // s``; a logical expert's load splits evenly over its
replicas, a worker's load is the sum over its slots, a row's peak is its largest worker load
and its balancedness mean worker load / peak. Every function works on all rows at once; the
only Python loop runs over iterations, never over rows.

Moves:
- **swap**: a slot of the heavy worker and a slot of the light worker exchange their logical
  experts (2 slots change; replica counts stay).
- **re-replication**: the heavy worker's heaviest logical expert gets one more replica, in a slot
  of the light worker whose expert has a replica to spare (1 slot changes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from moeserve.balancer.policy.packing import slot_load, worker_load_rows
from moeserve.placement import logical_counts

__all__ = ["SearchSettings", "refine", "Search", "Moves", "select_prefix", "follow_counts"]

# a replica carrying more than this share of a worker's mean load cannot be balanced by swaps
# alone: its expert needs another replica
REPLICATE_ABOVE = 0.9


@dataclass(frozen=True)
class SearchSettings:
    """How long and how wide :func:`refine` searches.

    max_iter: iterations at most.
    pairs: Q, worker pairs (q-th heaviest with q-th lightest) relieved per iteration (at most w // 2).
    heavy_slots: K, the heavy worker's heaviest slots a swap considers.
    replicate: also try re-replications, in rows where some replica carries more than
      ``REPLICATE_ABOVE`` of a worker's mean load (elsewhere swaps alone keep the replica
      counts, and are cheaper).
    stop_cost: stop once the slots changed over all rows reach it (a caller with a budget needs
      no more candidates); None: no limit.
    """

    max_iter: int = 24
    pairs: int = 4
    heavy_slots: int = 9
    replicate: bool = False
    stop_cost: float | None = None


@dataclass(slots=True)
class Moves:
    """The moves of one iteration for the rows then searched, ``[n, Q]`` each (pair q of row i).
    Not frozen: one is made per iteration, and a frozen dataclass costs ~1 % of a call.

    rows [n]: their row ids; heavy_slot / light_slot: the slot on the heavy / light worker;
    heavy_expert / light_expert: the logical experts those slots held before the move; made:
    the move was made; replication: a re-replication (the light slot takes the heavy slot's
    expert) rather than a swap; peak: the row's peak worker load after this move; cost: slots
    changed. Pairs move as a prefix: pair q only if pairs 0..q-1 do.
    """

    rows: np.ndarray
    heavy_slot: np.ndarray
    light_slot: np.ndarray
    heavy_expert: np.ndarray
    light_expert: np.ndarray
    made: np.ndarray
    replication: np.ndarray
    peak: np.ndarray
    cost: np.ndarray


class Search:
    """The moves a :func:`refine` run made, so that a prefix of them can be chosen per row.

    Step t of a row is its t-th move in (iteration, pair) order; a row outside an iteration's
    ``Moves.rows`` makes no move in it.
    """

    def __init__(self, start: np.ndarray, peak0: np.ndarray, mean: np.ndarray, pairs: int):
        self.start = start  # [B, p] the placement searched from
        self.peak0 = peak0  # [B] its peak worker load
        self.peak_now = peak0.copy()  # [B] the peak after the moves so far
        self.mean = mean  # [B] mean worker load
        self.pairs = pairs  # Q
        self.moves: list[Moves] = []
        self.final = start  # [B, p] the placement after every move

    def record(self, moves: Moves) -> None:
        """Keep one iteration's moves, setting ``moves.peak`` of the steps past a row's last
        move to the row's peak."""
        # pairs move as a prefix, so the peak after the last move made is the iteration's
        # (exact) peak, and a row that made no move keeps the peak it had
        made_count = moves.made.sum(1)
        last_peak = moves.peak[np.arange(moves.rows.size), np.maximum(made_count - 1, 0)][:, None]
        peak = np.where(moves.made, moves.peak, last_peak)
        peak[made_count == 0] = self.peak_now[moves.rows][made_count == 0, None]
        self.peak_now[moves.rows] = peak[:, -1]
        moves.peak = peak
        self.moves.append(moves)

    def curves(self) -> tuple[np.ndarray, np.ndarray]:
        """``peak [T+1, B]`` and cumulative ``cost [T+1, B]`` after each of T steps (step 0: none)."""
        rows, q = self.start.shape[0], self.pairs
        running = self.peak0.copy()
        peaks, costs = [running[None]], [np.zeros((1, rows), np.int64)]
        for moves in self.moves:
            peak = np.repeat(running[:, None], q, 1)
            peak[moves.rows] = moves.peak
            cost = np.zeros((rows, q), np.int64)
            cost[moves.rows] = moves.cost
            running = peak[:, -1].copy()
            peaks.append(peak.T)
            costs.append(cost.T)
        return np.concatenate(peaks), np.cumsum(np.concatenate(costs), 0)

    def replay(self, steps: np.ndarray) -> np.ndarray:
        """The placement ``[B, p]`` after the first ``steps[b]`` steps of each row (``steps [B]``)."""
        out = self.start.copy()
        flat = out.ravel()
        p = out.shape[1]
        q = self.pairs
        for t, moves in enumerate(self.moves):
            take = moves.made & ((t * q + np.arange(q)) < steps[moves.rows][:, None])
            base = (moves.rows * p)[:, None]
            swap, replication = take & ~moves.replication, take & moves.replication
            flat[(base + moves.heavy_slot)[swap]] = moves.light_expert[swap]
            flat[(base + moves.light_slot)[swap]] = moves.heavy_expert[swap]
            flat[(base + moves.light_slot)[replication]] = moves.heavy_expert[replication]
        return out


class _Rows:
    """The rows still searched and their state; arrays are C-contiguous so that their flat views
    (``.ravel()``) write through.

    rows [n]: row ids in the batch; phy2log [n, p]; slot_load [n, p]; worker_load [n, w];
    logcnt [n, e]; load [n * e] (flat); min_gain [n, 1]: least drop of a pair's peak worth a
    move; may_replicate [n]. expert_base, slot_base, worker_base [n, 1]: flat offset of each
    row's experts, slots and workers; pair_ids [n * Q].
    """

    __slots__ = (
        "rows",
        "phy2log",
        "slot_load",
        "worker_load",
        "logcnt",
        "load",
        "min_gain",
        "may_replicate",
        "pairs",
        "expert_base",
        "slot_base",
        "worker_base",
        "pair_ids",
    )

    def __init__(self, rows, phy2log, slot_load_, worker_load, logcnt, load, min_gain, may_replicate, pairs):
        self.rows, self.phy2log, self.slot_load, self.worker_load = rows, phy2log, slot_load_, worker_load
        self.logcnt, self.load, self.min_gain, self.may_replicate = logcnt, load, min_gain, may_replicate
        self.pairs = pairs
        self._index()

    def _index(self) -> None:
        n = self.rows.size
        e, p, w = self.logcnt.shape[1], self.phy2log.shape[1], self.worker_load.shape[1]
        self.expert_base, self.slot_base, self.worker_base = ((np.arange(n) * m)[:, None] for m in (e, p, w))
        self.pair_ids = np.arange(n * self.pairs)

    def save(self, phy2log: np.ndarray) -> None:
        """Write the rows' placement into the batch's ``phy2log [B, p]`` (a no-op if they work on it)."""
        if self.phy2log is not phy2log and self.rows.size:
            phy2log[self.rows] = self.phy2log

    def keep(self, alive: np.ndarray) -> None:
        """Drop the rows that stopped moving (``alive [n]``), once their placement is saved."""
        keep = np.flatnonzero(alive)
        e = self.logcnt.shape[1]
        self.rows = self.rows[keep]
        self.phy2log, self.slot_load = self.phy2log[keep], self.slot_load[keep]
        self.worker_load, self.logcnt = self.worker_load[keep], self.logcnt[keep]
        self.load = self.load.reshape(-1, e)[keep].ravel()
        self.min_gain, self.may_replicate = self.min_gain[keep], self.may_replicate[keep]
        self._index()


@dataclass(slots=True)
class _Pairs:
    """This iteration's worker pairs, the q-th heaviest worker with the q-th lightest: ``[n, Q]``.

    heavy / light: flat worker ids (into ``worker_load.ravel()``); heavy_load / light_load;
    next_load [n]: the heaviest worker outside the pairs (0 if every worker is paired);
    heavy_slot_load, light_slot_load, light_experts: ``[n, Q, s]``; heavy_first / light_first:
    the first slot of each worker in its row.
    """

    heavy: np.ndarray
    light: np.ndarray
    heavy_load: np.ndarray
    light_load: np.ndarray
    next_load: np.ndarray
    heavy_slot_load: np.ndarray
    light_slot_load: np.ndarray
    light_experts: np.ndarray
    heavy_first: np.ndarray
    light_first: np.ndarray


@dataclass(slots=True)
class _Candidates:
    """The best move of every pair, ``[n, Q]``: the pair's larger load after it (``new_peak``),
    the heavy and light slots it changes, and whether it is a re-replication (None: swaps only)."""

    new_peak: np.ndarray
    heavy_slot: np.ndarray
    light_slot: np.ndarray
    replication: np.ndarray | None = None


def _pair_workers(rows: _Rows, q: int) -> _Pairs:
    """Sort each row's workers by load and pair the q-th heaviest with the q-th lightest."""
    worker_load, worker_base = rows.worker_load, rows.worker_base
    n, w = worker_load.shape
    s = rows.phy2log.shape[1] // w
    flat_worker_load = worker_load.ravel()
    order = np.argsort(worker_load, axis=1)
    heavy = order[:, : -q - 1 : -1] + worker_base  # [n, Q] heaviest first
    light = order[:, :q] + worker_base  # [n, Q] lightest first
    next_load = flat_worker_load[order[:, -q - 1] + worker_base[:, 0]] if w > 2 * q else np.zeros(n)
    by_worker_load, by_worker_expert = rows.slot_load.reshape(n * w, s), rows.phy2log.reshape(n * w, s)
    return _Pairs(
        heavy,
        light,
        flat_worker_load[heavy],
        flat_worker_load[light],
        next_load,
        by_worker_load[heavy],
        by_worker_load[light],
        by_worker_expert[light],
        (heavy - worker_base) * s,
        (light - worker_base) * s,
    )


def _best_swaps(rows: _Rows, pairs: _Pairs, heavy_slots: int) -> _Candidates:
    """Per pair, the swap of one of the heavy worker's K heaviest slots with a light worker's slot
    that lowers the pair's larger load the most."""
    heavy_slot_load = pairs.heavy_slot_load
    n, q, s = heavy_slot_load.shape
    k = min(heavy_slots, s)
    ids = rows.pair_ids
    if k < s:
        top_k = np.argpartition(heavy_slot_load, s - k, axis=2)[:, :, s - k :]  # [n, Q, K]
        heavy_k = heavy_slot_load.reshape(-1, s)[ids[:, None], top_k.reshape(-1, k)].reshape(n, q, k)
    else:
        heavy_k = heavy_slot_load
    # swapping heavy slot i with light slot j, d = x_i - x_j, leaves the pair's larger load at
    # max(heavy - d, light + d) = centre + |d - half| (half = (heavy - light) / 2): the best swap
    # has d nearest to half, and it lowers the pair's peak only if |d - half| < half
    half = (pairs.heavy_load - pairs.light_load) * 0.5
    gap = (heavy_k - half[:, :, None])[:, :, :, None] - pairs.light_slot_load[:, :, None, :]  # [n, Q, K, s]
    gap = np.abs(gap, out=gap).reshape(-1, k * s)  # in place: the largest array of a call
    best = gap.argmin(1)  # [n*Q]
    new_peak = (pairs.heavy_load - half) + gap[ids, best].reshape(n, q)
    heavy_pick, light_pick = best // s, best % s
    if k < s:
        heavy_pick = top_k.reshape(-1, k)[ids, heavy_pick]
    return _Candidates(
        new_peak, pairs.heavy_first + heavy_pick.reshape(n, q), pairs.light_first + light_pick.reshape(n, q)
    )


def _prefer_replications(rows: _Rows, pairs: _Pairs, swaps: _Candidates) -> _Candidates:
    """Per pair, a re-replication instead of the swap where it relieves the heavy worker more
    than half as much as the swap does (per slot changed it then does better).

    The heavy worker's heaviest slot (expert b, c_b replicas of load x_b) gets one more replica in
    a spare slot j of the light worker: the heavy worker drops by x_b / (c_b + 1), the light one
    changes by x_b * c_b / (c_b + 1) - x_j. The light slot taken is the lightest spare one that
    keeps the light worker below the heavy (the least load pushed onto the other holders of its
    expert), else the heaviest spare one.
    """
    n, q, s = pairs.heavy_slot_load.shape
    ids = rows.pair_ids
    flat_phy2log, flat_logcnt = rows.phy2log.ravel(), rows.logcnt.ravel()
    heaviest = pairs.heavy_slot_load.argmax(2)  # [n, Q]
    heaviest_load = pairs.heavy_slot_load.reshape(-1, s)[ids, heaviest.ravel()].reshape(n, q)
    expert = flat_phy2log[rows.slot_base + pairs.heavy_first + heaviest]
    light_flat_expert = pairs.light_experts + rows.expert_base[:, :, None]
    spare = (flat_logcnt[light_flat_expert] > 1) & (pairs.light_experts != expert[:, :, None])  # [n, Q, s]
    over = pairs.light_slot_load - (pairs.light_load + heaviest_load - pairs.heavy_load)[:, :, None]
    rank = np.where(spare, np.where(over >= 0, over, 1e300 - over), np.inf)
    light_pick = rank.argmin(2)
    light_pick_load = pairs.light_slot_load.reshape(-1, s)[ids, light_pick.ravel()].reshape(n, q)
    relief = heaviest_load / (flat_logcnt[expert + rows.expert_base] + 1)
    new_peak = np.maximum(pairs.heavy_load - relief, pairs.light_load + heaviest_load - relief - light_pick_load)
    better = (
        ((pairs.heavy_load - new_peak) > (pairs.heavy_load - swaps.new_peak) * 0.5)
        & (rank.min(2) < np.inf)
        & rows.may_replicate[:, None]
    )
    return _Candidates(
        np.where(better, new_peak, swaps.new_peak),
        np.where(better, pairs.heavy_first + heaviest, swaps.heavy_slot),
        np.where(better, pairs.light_first + light_pick, swaps.light_slot),
        better,
    )


def _accepted(rows: _Rows, pairs: _Pairs, best: _Candidates) -> np.ndarray:
    """Which pairs move, ``[n, Q]``: a prefix of the pairs, each lowering its heavy worker by more
    than ``min_gain`` and below the level pair 0 reaches (once a pair's heavy worker cannot come
    down, the row's peak cannot drop below it this iteration, and lighter pairs would move in vain)."""
    gain = pairs.heavy_load - best.new_peak
    return np.logical_and.accumulate(
        (gain > rows.min_gain) & (pairs.heavy_load > best.new_peak[:, :1] + rows.min_gain), axis=1
    )


def _limit_replications(
    rows: _Rows, pairs: _Pairs, best: _Candidates, made: np.ndarray, light_expert: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At most one re-replication per row and iteration, and none that lifts another holder of the
    expert giving up a replica above the level its pair reaches: such a row makes no move now and
    swaps only from its next iteration, so a row's peak never rises.

    Returns ``made [n, Q]``, ``replication [n, Q]`` (made re-replications) and ``blocked [n]``.
    """
    blocked = np.zeros(made.shape[0], dtype=bool)
    replication = made & best.replication if best.replication is not None else np.zeros_like(made)
    if not replication.any():
        return made, replication, blocked
    w = rows.worker_load.shape[1]
    s = rows.phy2log.shape[1] // w
    first = replication & (np.cumsum(replication, 1) == 1)
    made = np.logical_and.accumulate(made & ~(replication & ~first), axis=1)
    replication = first & made
    row, pair = np.nonzero(replication)
    giver = light_expert[row, pair]
    holds = rows.phy2log[row] == giver[:, None]  # [m, p]
    holds[np.arange(row.size), best.light_slot[row, pair]] = False  # the slot that changes
    giver_cnt = rows.logcnt.ravel()[rows.expert_base[row, 0] + giver]
    rise = pairs.light_slot_load[row, pair, best.light_slot[row, pair] % s] / (giver_cnt - 1)  # per other replica
    # worker_load still holds the heavy worker's load before the move, so peak_after is at
    # least that load, which the pair was accepted for exceeding by more than min_gain: this
    # test blocks every re-replication (up to rounding)
    peak_after = (rows.worker_load[row] + holds.reshape(-1, w, s).sum(2) * rise[:, None]).max(1)
    bad = peak_after > best.new_peak[row, pair] + rows.min_gain[row, 0]
    if bad.any():
        blocked[row[bad]] = True
        made[row[bad]] = False
        replication[row[bad]] = False
    return made, replication, blocked


def _peak_after_each_move(pairs: _Pairs, best: _Candidates, made: np.ndarray) -> np.ndarray:
    """The row's peak after each of this iteration's moves, ``[n, Q]`` (exact for swaps): the
    largest of the moved pairs' new loads and the heaviest worker not yet relieved."""
    not_yet_relieved = np.concatenate([pairs.heavy_load[:, 1:], pairs.next_load[:, None]], 1)
    moved_peak = np.where(made, np.maximum(best.new_peak, pairs.light_load), -np.inf)
    return np.maximum(np.maximum.accumulate(moved_peak, 1), not_yet_relieved)


def _apply_swaps(
    rows: _Rows, pairs: _Pairs, best: _Candidates, swap: np.ndarray, heavy_expert: np.ndarray, light_expert: np.ndarray
) -> None:
    """Exchange the two slots' experts and loads; the pair's workers shift by their difference."""
    flat_phy2log, flat_load, flat_worker_load = rows.phy2log.ravel(), rows.slot_load.ravel(), rows.worker_load.ravel()
    heavy_slot, light_slot = (rows.slot_base + best.heavy_slot)[swap], (rows.slot_base + best.light_slot)[swap]
    shift = flat_load[heavy_slot] - flat_load[light_slot]
    flat_phy2log[heavy_slot], flat_phy2log[light_slot] = light_expert[swap], heavy_expert[swap]
    flat_load[heavy_slot], flat_load[light_slot] = flat_load[light_slot], flat_load[heavy_slot] + 0.0
    flat_worker_load[pairs.heavy[swap]] -= shift
    flat_worker_load[pairs.light[swap]] += shift


def _apply_replications(
    rows: _Rows, best: _Candidates, replication: np.ndarray, heavy_expert: np.ndarray, light_expert: np.ndarray
) -> None:
    """The light slot takes the heavy slot's expert; two replica counts change, so the rows'
    slot and worker loads are recomputed."""
    w = rows.worker_load.shape[1]
    s = rows.phy2log.shape[1] // w
    flat_logcnt = rows.logcnt.ravel()
    changed = np.flatnonzero(replication.any(1))
    row, pair = np.nonzero(replication)
    rows.phy2log.ravel()[rows.slot_base[row, 0] + best.light_slot[row, pair]] = heavy_expert[row, pair]
    np.add.at(flat_logcnt, rows.expert_base[row, 0] + heavy_expert[row, pair], 1)
    np.add.at(flat_logcnt, rows.expert_base[row, 0] + light_expert[row, pair], -1)
    flat_expert = rows.phy2log[changed] + rows.expert_base[changed]
    rows.slot_load[changed] = rows.load[flat_expert] / flat_logcnt[flat_expert]
    rows.worker_load[changed] = rows.slot_load[changed].reshape(-1, w, s).sum(2)


def _iterate(rows: _Rows, settings: SearchSettings) -> tuple[Moves, np.ndarray] | None:
    """One iteration on every row still searched: pick each pair's best move, make the accepted
    ones. Returns the moves and ``alive [n]`` (rows that moved or were blocked), or None when
    no row can move."""
    pairs = _pair_workers(rows, rows.pairs)
    best = _best_swaps(rows, pairs, settings.heavy_slots)
    if settings.replicate and rows.may_replicate.any():
        best = _prefer_replications(rows, pairs, best)
    made = _accepted(rows, pairs, best)
    if not made.any():
        return None
    flat_phy2log = rows.phy2log.ravel()
    heavy_expert = flat_phy2log[rows.slot_base + best.heavy_slot]  # [n, Q] before the move
    light_expert = flat_phy2log[rows.slot_base + best.light_slot]
    made, replication, blocked = _limit_replications(rows, pairs, best, made, light_expert)
    peak = _peak_after_each_move(pairs, best, made)
    _apply_swaps(rows, pairs, best, made & ~replication, heavy_expert, light_expert)
    if replication.any():
        _apply_replications(rows, best, replication, heavy_expert, light_expert)
    rows.may_replicate &= ~blocked
    made_count = made.sum(1)
    last = (np.arange(rows.rows.size), np.maximum(made_count - 1, 0))
    peak[last] = np.where(made_count > 0, rows.worker_load.max(1), peak[last])
    cost = np.where(made, np.where(replication, 1, 2), 0)
    moves = Moves(
        rows.rows, best.heavy_slot, best.light_slot, heavy_expert, light_expert, made, replication, peak, cost
    )
    return moves, (made_count > 0) | blocked


def refine(
    load: np.ndarray,
    phy2log: np.ndarray,
    num_workers: int,
    settings: SearchSettings = SearchSettings(),
    *,
    tol: float | np.ndarray = 1e-9,
    skip_below: np.ndarray | None = None,
) -> Search:
    """Local search that lowers the heavy workers' loads, all rows at once; returns a :class:`Search`.

    load [B, e] float; phy2log [B, p] int, the placement to start from (not modified);
    num_workers w (p % w == 0); settings: see :class:`SearchSettings`.
    tol: float or [B], the least drop of a pair's peak, as a share of the row's mean worker load,
      that a move must bring. skip_below [B]: rows whose peak is already at or under it are not
      searched (e.g. a node that cannot set its layer's peak).

    Each iteration pairs the q-th heaviest worker of a row with its q-th lightest (q < Q) and
    picks, per pair, the better per slot changed of a swap and (``settings.replicate``) a
    re-replication; the pairs move as a prefix (pair q only if pairs 0..q-1 move and its heavy
    worker would otherwise stay above the level pair 0 reaches): a move that cannot lower the
    row's peak is not made, and a row's peak never rises. Rows that stop moving leave the
    working set. The search stops when no row moves, after ``settings.max_iter`` iterations,
    or once the slots changed over all rows reach ``settings.stop_cost``.
    """
    batch, p = phy2log.shape
    e = load.shape[1]
    w = num_workers
    s = p // w
    q = min(settings.pairs, w // 2)
    start = phy2log.astype(np.int64, copy=True)
    load = np.ascontiguousarray(load, dtype=np.float64)
    logcnt = logical_counts(start, e)
    slot_loads = slot_load(load, start, logcnt)  # [B, p]
    worker_load = worker_load_rows(slot_loads, w)  # [B, w]
    search = Search(start.copy(), worker_load.max(1), worker_load.mean(1), q)
    search.final = start
    busy = search.peak0 > 0 if skip_below is None else search.peak0 > np.maximum(skip_below, 0)
    idx = np.flatnonzero(busy)
    if q == 0 or s == 0 or idx.size == 0 or settings.max_iter == 0:
        return search
    min_gain = (tol * search.mean)[idx][:, None]
    if settings.replicate:
        may_replicate = slot_loads[idx].max(1) > REPLICATE_ABOVE * search.mean[idx]
    else:
        may_replicate = np.zeros(idx.size, dtype=bool)
    if idx.size < batch:  # idle rows stay out
        rows = _Rows(
            idx,
            start[idx],
            slot_loads[idx],
            worker_load[idx],
            logcnt[idx],
            load[idx].ravel(),
            min_gain,
            may_replicate,
            q,
        )
    else:  # work in place: copies cost ~5 %
        rows = _Rows(idx, start, slot_loads, worker_load, logcnt, load.ravel(), min_gain, may_replicate, q)
    spent = 0
    for _ in range(settings.max_iter):
        step = _iterate(rows, settings)
        if step is None:
            break
        moves, alive = step
        search.record(moves)
        spent += int(moves.cost.sum())
        if settings.stop_cost is not None and spent >= settings.stop_cost:
            break
        if alive.sum() <= rows.rows.size // 2:  # shrink the working set
            rows.save(start)
            rows.keep(alive)
            if rows.rows.size == 0:
                break
    rows.save(start)
    return search


def select_prefix(value: np.ndarray, cost: np.ndarray, budget: float | None, grid: int = 16) -> np.ndarray:
    """Pick, for every row, how far along its search to go: ``steps [B]``.

    value [T+1, B]: what the row is worth after t steps (higher is better);
    cost [T+1, B]: slots changed by then. Maximises the summed value with the summed cost
    within ``budget`` (None: unlimited) by a price per slot: every row takes the step
    maximising ``value - price * cost``, which lies on the row's upper convex hull, and the
    price is the lowest that keeps the total within budget. That is "spend the budget where it
    buys the most per slot moved". The price is searched on a grid of ``grid`` prices, three
    times (each grid between the two best prices of the last), all prices of a grid at once.
    """
    cols = np.arange(value.shape[1])
    best = np.argmax(value, 0)
    if budget is None or cost[best, cols].sum() <= budget:
        return best
    gain = np.ascontiguousarray((value - value[:1]).T)  # [B, T+1]
    row_cost = np.ascontiguousarray(cost.T)  # [B, T+1]
    low, high = 0.0, float((gain / np.maximum(row_cost, 1)).max()) * 1.0001 + 1e-300  # at high nothing moves
    for _ in range(3):
        price = np.linspace(low, high, grid)  # [G]
        steps = np.argmax(gain[None] - price[:, None, None] * row_cost[None], 2)  # [G, B]
        spend = np.take_along_axis(row_cost, steps.T, 1).sum(0)  # [G], falls with the price
        k = int(np.argmax(spend <= budget))  # first price within budget
        low, high = (price[k - 1] if k > 0 else low), price[k]
    return np.argmax(gain - high * row_cost, 1)


def follow_counts(
    load: np.ndarray,
    phy2log: np.ndarray,
    num_workers: int,
    target: np.ndarray,
    max_steps: int,
    rows: np.ndarray | None = None,
) -> Search:
    """Move replica counts toward ``target [B, e]``, one slot per row and step: a :class:`Search`.

    The local search keeps replica counts unless one replica outweighs most of a worker, so
    counts planned for old traffic stay when traffic drifts; this walks them toward the counts
    a fresh plan would give (``target``, each row summing to p). Each step, in every row whose
    counts differ from its target (and that is in ``rows``, a boolean [B], if given), the
    expert with a replica short of its target that has the heaviest load per replica takes
    one slot of an expert with a replica over its target: of those slots, the one whose change
    lowers the sum of squared worker loads the most (to first order in the replicas that
    change load elsewhere, exactly on the slot's own worker). Recorded as re-replications with
    one pair per iteration, so :meth:`Search.curves` and :meth:`Search.replay` apply; a row's
    peak may rise on a step (the caller's choice of a prefix weighs that).
    """
    batch, p = phy2log.shape
    e = load.shape[1]
    w = num_workers
    s = p // w
    start = phy2log.astype(np.int64, copy=True)
    load = np.ascontiguousarray(load, dtype=np.float64)
    logcnt = logical_counts(start, e)
    loads = slot_load(load, start, logcnt)
    worker_load = worker_load_rows(loads, w)
    search = Search(start.copy(), worker_load.max(1), worker_load.mean(1), 1)
    active = (logcnt != target).any(1)
    if rows is not None:
        active &= rows
    idx = np.flatnonzero(active)
    if idx.size == 0 or s == 0 or max_steps <= 0:
        search.final = start
        return search
    cur, cnt, tgt, lo = start[idx], logcnt[idx], np.asarray(target, dtype=np.int64)[idx], load[idx]
    n = idx.size
    r = np.arange(n)
    e_base = (r * e)[:, None]
    wl = worker_load[idx]
    # the slots that may give: those of experts over their target (a set that only shrinks), [n, C]
    cnt_flat, lo_flat, tgt_flat = cnt.reshape(-1), lo.reshape(-1), tgt.reshape(-1)  # views
    over = (cnt > tgt).reshape(-1)[cur + e_base]
    cand = np.argsort(~over, axis=1, kind="stable")[:, : max(int(over.sum(1).max()), 1)]
    cand_ok = np.take_along_axis(over, cand, 1)
    cand_worker = cand // s
    w_base = (r * w)[:, None]
    slot_worker = np.arange(p) // s
    for _ in range(max_steps):
        deficit = cnt < tgt
        live = cast(np.ndarray, deficit.any(1))  # [n] (typed as bool or array: the stubs miss the axis)
        if not live.any():
            break
        per_replica = lo / cnt
        b = np.where(deficit, per_replica, -np.inf).argmax(1)  # [n] the expert gaining
        cb, lb = cnt[r, b], lo[r, b]
        d = wl - wl.mean(1, keepdims=True)  # [n, w]
        flat_cur = cur + e_base
        g = np.bincount(flat_cur.reshape(-1), weights=d[:, slot_worker].reshape(-1), minlength=n * e)
        a = np.take_along_axis(cur, cand, 1)  # [n, C] the expert losing
        flat_a = a + e_base
        ca, la = cnt_flat[flat_a], lo_flat[flat_a]
        ok = cand_ok & (ca > tgt_flat[flat_a]) & live[:, None]
        d_here = d.reshape(-1)[cand_worker + w_base]
        own = (lb / (cb + 1))[:, None] - la / ca  # change on the slot's worker
        delta_a = la / np.maximum(ca - 1, 1) - la / ca  # each other replica of a
        delta_b = lb / (cb + 1) - lb / cb  # each replica of b
        score = d_here * own + 0.5 * own * own + delta_a * (g[flat_a] - d_here) + (delta_b * g[r * e + b])[:, None]
        score[~ok] = np.inf
        pick = score.argmin(1)
        made = ok[r, pick]
        k = cand[r, pick]
        old = cur[r, k]
        rows_made = r[made]
        cur[rows_made, k[made]] = b[made]
        cnt[rows_made, b[made]] += 1
        cnt[rows_made, old[made]] -= 1
        flat_cur = (cur + e_base).reshape(-1)
        wl = (lo_flat[flat_cur] / cnt_flat[flat_cur]).reshape(n, w, s).sum(2)
        search.record(
            Moves(
                idx,
                k[:, None],
                k[:, None],
                b[:, None],
                old[:, None],
                made[:, None],
                np.ones((n, 1), dtype=bool),
                wl.max(1)[:, None],
                made[:, None].astype(np.int64),
            )
        )
    start[idx] = cur
    search.final = start
    return search
