"""Vectorised placement primitives on batches of independent sub-problems (numpy only).

Dimension letters: B rows (independent sub-problems: a MoE layer, or a (layer, node) pair in
the hierarchical case), e logical experts of a row (ids local to the row), p slots of a row,
w workers of a row, s = p / w slots per worker, Q worker pairs handled per iteration,
T iterations of the local search.

A row's slot ``k`` lives on its worker ``k // s``. Every function works on all rows at once with
numpy; the only Python loops run over slots-per-worker rounds, replicas or search iterations,
never over rows.

Cost model (the yardstick's and the data plane's): a logical expert's load splits evenly over
its replicas, a worker's load is the sum over its slots, a row's balancedness is mean worker
load / max worker load.
"""
from __future__ import annotations

import numpy as np

__all__ = ["replica_counts", "counts_of", "expand_counts", "slot_load", "worker_load_rows",
           "pack_greedy", "pack_ldm", "pack", "refine", "Search", "select_prefix", "match"]


def counts_of(assign: np.ndarray, num_logical: int) -> np.ndarray:
    """Replica count of every expert: ``assign [B, p]`` -> ``cnt [B, e]`` int64."""
    rows, p = assign.shape
    flat = (assign + (np.arange(rows) * num_logical)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * num_logical).reshape(rows, num_logical)


def replica_counts(load: np.ndarray, num_slots: int, num_workers: int | None = None) -> np.ndarray:
    """Replica counts minimising the largest load per replica (D'Hondt): ``[B, e]`` -> ``[B, e]``.

    Every expert gets one replica; each further slot goes to the expert with the largest load
    per replica at that moment (the lower id on ties), which is optimal for min-max per replica.

    With ``num_workers`` w, counts are made packable: an expert with more than w but fewer than
    2w replicas puts two of them on some worker; where two of its replicas weigh more than a
    worker's mean load that worker is overloaded whatever the packing, so such an expert is
    cut back to w replicas (one per worker) and the slots freed go, by the same rule, to the
    experts below w replicas.
    """
    rows, e = load.shape
    cnt = np.ones(rows * e, dtype=np.int64)
    lf = np.ascontiguousarray(load, dtype=np.float64).ravel()
    per = lf.copy()                                                   # load per replica
    per2 = per.reshape(rows, e)
    roff = np.arange(rows) * e
    for _ in range(num_slots - e):
        k = per2.argmax(axis=1) + roff
        cnt[k] += 1
        per[k] = lf[k] / cnt[k]
    if num_workers is None or num_workers < 2:
        return cnt.reshape(rows, e)
    w = num_workers
    c2 = cnt.reshape(rows, e)
    mean = load.sum(1) / w                                            # [B] mean worker load
    cut = (c2 > w) & (c2 < 2 * w) & (2 * load / c2 > mean[:, None])
    if not cut.any():
        return c2
    freed = np.where(cut, c2 - w, 0).sum(1)                           # [B]
    c2[cut] = w
    per2[:] = np.where(cut | (c2 >= w), -np.inf, load / c2)
    for _ in range(int(freed.max())):
        k = per2.argmax(axis=1) + roff
        give = freed > 0
        k = k[give]
        cnt[k] += 1
        per[k] = np.where(cnt[k] >= w, -np.inf, lf[k] / cnt[k])
        freed -= give
    return c2


def expand_counts(cnt: np.ndarray) -> np.ndarray:
    """The replicas as a list: ``cnt [B, e]`` (each row summing to p) -> expert ids ``[B, p]``, ascending."""
    rows, e = cnt.shape
    p = int(cnt[0].sum()) if rows else 0
    return np.repeat(np.tile(np.arange(e), rows), cnt.ravel()).reshape(rows, p)


def slot_load(load: np.ndarray, assign: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """Load of every slot: its expert's load over its replica count. -> ``[B, p]`` float64."""
    r = np.arange(assign.shape[0])[:, None]
    return load[r, assign] / cnt[r, assign]


def worker_load_rows(x: np.ndarray, num_workers: int) -> np.ndarray:
    """Slot loads ``[B, p]`` -> worker loads ``[B, w]``."""
    rows, p = x.shape
    return x.reshape(rows, num_workers, p // num_workers).sum(axis=2)


def pack_greedy(load: np.ndarray, cnt: np.ndarray, num_workers: int) -> np.ndarray:
    """Pack the replicas ``cnt [B, e]`` of experts with ``load [B, e]`` onto w workers of s slots.

    Round-based greedy: replicas are taken heaviest first, w at a time; in each round the
    heaviest goes to the currently lightest worker, the next to the next lightest, and so on, so
    every worker gets exactly one slot per round. Returns ``assign [B, p]`` (slot -> expert).
    """
    rows, e = load.shape
    items = expand_counts(cnt)                                    # [B, p]
    p = items.shape[1]
    w = num_workers
    s = p // w
    fi = items + (np.arange(rows) * e)[:, None]
    item_load = np.ascontiguousarray(load, dtype=np.float64).ravel()[fi] / cnt.ravel()[fi]
    order = np.argsort(-item_load, axis=1)
    items = np.take_along_axis(items, order, 1)
    item_load = np.take_along_axis(item_load, order, 1)
    assign = np.empty(rows * p, dtype=np.int64)
    wl = np.zeros(rows * w)
    wl2 = wl.reshape(rows, w)
    woff = (np.arange(rows) * w)[:, None]
    for k in range(s):
        light = np.argsort(wl2, axis=1) + woff                    # [B, w] lightest first
        assign[light * s + k] = items[:, k * w:(k + 1) * w]
        wl[light] += item_load[:, k * w:(k + 1) * w]
    return assign.reshape(rows, p)


def pack_ldm(load: np.ndarray, cnt: np.ndarray, num_workers: int) -> np.ndarray:
    """Balanced largest differencing (Karmarkar-Karp for equal-size workers): ``[B, p]`` assign.

    The replicas, heaviest first, are cut into s rounds of w; each round is a partial packing
    (one replica per worker). The two partial packings whose loads differ most are merged,
    heaviest worker of one with the lightest of the other, until one is left: every worker
    ends with exactly s replicas. s - 1 merges, each vectorised over the rows.
    """
    rows, e = load.shape
    items = expand_counts(cnt)
    p = items.shape[1]
    w = num_workers
    s = p // w
    fi = items + (np.arange(rows) * e)[:, None]
    item_load = np.ascontiguousarray(load, dtype=np.float64).ravel()[fi] / cnt.ravel()[fi]
    order = np.argsort(-item_load, axis=1)
    items = np.take_along_axis(items, order, 1)
    sums = np.take_along_axis(item_load, order, 1).reshape(rows * s, w)      # [(B, s), w] desc
    # place[b, r, j]: where the j-th replica of round r sits in its partial packing (desc order)
    place = np.broadcast_to(np.arange(w), (rows, s, w)).copy()
    part = np.broadcast_to(np.arange(s), (rows, s)).copy()                  # round -> packing
    spread = (sums[:, 0] - sums[:, -1]).reshape(rows, s)
    r1 = np.arange(rows)
    soff = r1 * s
    woff = (r1 * w)[:, None, None]
    for _ in range(s - 1):
        k1 = spread.argmax(1)
        spread[r1, k1] = -np.inf
        k2 = spread.argmax(1)
        merged = sums[soff + k1] + sums[soff + k2][:, ::-1]                  # [B, w]
        o = np.argsort(-merged, axis=1)
        rank = np.argsort(o, axis=1)                                        # old place -> new
        sums[soff + k1] = np.take_along_axis(merged, o, 1)
        spread[r1, k1] = merged.max(1) - merged.min(1)
        spread[r1, k2] = -np.inf
        in2 = (part == k2[:, None])[:, :, None]                             # [B, s, 1]
        place = np.where(in2, (w - 1) - place, place)
        part = np.where(in2[:, :, 0], k1[:, None], part)
        inpk = (part == k1[:, None])[:, :, None]
        place = np.where(inpk, rank.ravel()[place + woff], place)
    return np.take_along_axis(items, np.argsort(place.reshape(rows, p), axis=1, kind="stable"), 1)


def pack(load: np.ndarray, cnt: np.ndarray, num_workers: int) -> np.ndarray:
    """Pack replicas onto workers: largest differencing for 3 to 16 workers with at most 32 slots
    each (there it balances better than the greedy, and cheaply), the round-based greedy
    otherwise (with many workers the two balance alike and the greedy is faster)."""
    p = int(cnt[0].sum()) if cnt.size else 0
    if num_workers == 1:                                              # one worker holds everything
        return expand_counts(cnt)
    if 2 < num_workers <= 16 and p // num_workers <= 32:
        return pack_ldm(load, cnt, num_workers)
    return pack_greedy(load, cnt, num_workers)


def refine(load: np.ndarray, assign: np.ndarray, num_workers: int, *, max_iter: int = 24,
           pairs: int = 4, heavy_slots: int = 9, retarget: bool | str = True,
           stop_cost: float | None = None, floor: np.ndarray | None = None,
           tol: float | np.ndarray = 1e-9, skip_below: np.ndarray | None = None) -> "Search":
    """Local search that lowers the heavy workers' loads, all rows at once; returns a :class:`Search`.

    Each iteration sorts a row's workers by load and pairs the q-th heaviest with the q-th
    lightest (q < Q). In every pair it picks the better (per slot changed) of:
      - swap: exchange one of the heavy worker's ``heavy_slots`` heaviest slots with a slot of
        the light worker so that the pair's larger load drops the most (2 slots change);
      - retarget: the heavy worker's heaviest slot (expert b) gets one more replica, in a slot
        of the light worker whose expert has a replica to spare (more than ``floor``, at least
        1); b's load then splits over one more replica (1 slot changes).
    Pair q moves only if pairs 0..q-1 move and its heavy worker would otherwise stay above the
    level that pair 0 reaches: a move that cannot lower the row's peak is not made. A row makes at
    most one retarget per iteration, and none that would lift another holder of the expert
    giving up a replica above the level its pair reaches (such a row makes swaps only in its
    next iteration), so a row's peak never rises. Rows that stop moving leave the working set. The
    search stops when no row moves, after ``max_iter`` iterations, or once the slots changed
    over all rows reach ``stop_cost`` (a budget-aware caller needs no more candidates).

    ``tol`` (scalar or per row [B]): least drop of a pair's peak, as a share of the row's mean
    worker load, that a move must bring. ``skip_below [B]``: rows whose peak is already at or
    under it are not searched (e.g. a node that cannot set its layer's peak).
    ``retarget="auto"`` retargets only in rows where some replica carries more than 0.9 of a
    worker's mean load: there swaps cannot balance and the expert needs another replica;
    elsewhere the search swaps only, which keeps the replica counts and is cheaper.

    load [B, e] float, assign [B, p] int (not modified), num_workers w (p % w == 0).
    """
    rows, p = assign.shape
    e = load.shape[1]
    w = num_workers
    s = p // w
    q = min(pairs, w // 2)
    k = min(heavy_slots, s)
    full_a = assign.astype(np.int64, copy=True)
    load = np.ascontiguousarray(load, dtype=np.float64)
    cnt = counts_of(full_a, e)
    x = load.ravel()[full_a + (np.arange(rows) * e)[:, None]] / cnt.ravel()[full_a + (np.arange(rows) * e)[:, None]]
    wl = x.reshape(rows, w, s).sum(2)                                         # [B, w]
    search = Search(full_a.copy(), wl.max(1), wl.mean(1), q)
    search.final = full_a
    busy = search.peak0 > 0 if skip_below is None else search.peak0 > np.maximum(skip_below, 0)
    idx = np.flatnonzero(busy)                                                # working rows
    if q == 0 or s == 0 or idx.size == 0 or max_iter == 0:
        return search
    floor_all = np.ones((rows, e), dtype=np.int64) if floor is None else np.maximum(floor, 1)
    eps_all = tol * search.mean

    def take(ix):
        n = ix.size
        return (full_a[ix], x[ix], wl[ix], cnt[ix], load[ix].ravel(), floor_all[ix].ravel(),
                eps_all[ix][:, None], (np.arange(n) * e)[:, None], (np.arange(n) * p)[:, None],
                (np.arange(n) * w)[:, None], np.arange(n * q))

    if idx.size < rows:                                                      # idle rows stay out
        a, x, wl, cnt, lf, ff, eps, roff, poff, woff, bq = take(idx)
    else:
        a, lf, ff, eps = full_a, load.ravel(), floor_all.ravel(), eps_all[:, None]
        roff, poff, woff = ((np.arange(rows) * m)[:, None] for m in (e, p, w))
        bq = np.arange(rows * q)
    n = idx.size
    if retarget == "auto":
        allow = x.max(1) > 0.9 * search.mean[idx]                            # x: working rows
        retarget = bool(allow.any())
    else:
        allow = np.full(n, bool(retarget))
    spent = 0
    for _ in range(max_iter):
        af, cf, xf, wlf = a.ravel(), cnt.ravel(), x.ravel(), wl.ravel()
        order = np.argsort(wl, axis=1)
        hv = order[:, :-q - 1:-1] + woff                                      # [n, Q] heaviest first
        lt = order[:, :q] + woff                                              # [n, Q] lightest first
        wh, wm = wlf[hv], wlf[lt]
        rest = wlf[order[:, -q - 1] + woff[:, 0]] if w > 2 * q else np.zeros(n)
        x3, a3 = x.reshape(n * w, s), a.reshape(n * w, s)
        xh, xm, am = x3[hv], x3[lt], a3[lt]                                   # [n, Q, s]
        hs = (hv - woff) * s                                                  # first slot of heavy
        if k < s:
            kk = np.argpartition(xh, s - k, axis=2)[:, :, s - k:]             # [n, Q, K]
            xk = xh.reshape(-1, s)[bq[:, None], kk.reshape(-1, k)].reshape(n, q, k)
        else:
            xk = xh
        # swap heavy slot i with light slot j, d = x_i - x_j: the pair's larger load becomes
        # max(wh - d, wm + d) = centre + |d - half| (half = (wh - wm) / 2): the best swap has
        # d nearest to half, and it lowers the pair's peak only if |d - half| < half
        half = (wh - wm) * 0.5
        dev = np.abs((xk - half[:, :, None])[:, :, :, None] - xm[:, :, None, :]).reshape(-1, k * s)
        best = dev.argmin(1)                                                  # [n*Q]
        new_hi = (wh - half) + dev[bq, best].reshape(n, q)
        bi, bj = best // s, best % s
        if k < s:
            bi = kk.reshape(-1, k)[bq, bi]
        si, sj = hs + bi.reshape(n, q), (lt - woff) * s + bj.reshape(n, q)   # [n, Q] slots
        use_r = None
        if retarget and allow.any():
            # retarget: the heavy worker's heaviest slot (expert b with c_b replicas, load x_b
            # each) gets one more replica in a spare slot j of the light worker: heavy drops by
            # x_b / (c_b + 1), light changes by x_b * c_b / (c_b + 1) - x_j. Take the lightest
            # spare slot that keeps light below heavy (least load pushed onto the other holders
            # of its expert), else the heaviest spare slot.
            top = xh.argmax(2)                                                # [n, Q]
            xb = xh.reshape(-1, s)[bq, top.ravel()].reshape(n, q)
            eb = af[poff + hs + top]
            ia = am + roff[:, :, None]
            spare = (cf[ia] > ff[ia]) & (am != eb[:, :, None])                # [n, Q, s]
            over = xm - (wm + xb - wh)[:, :, None]                            # >= 0: light stays below
            key = np.where(spare, np.where(over >= 0, over, 1e300 - over), np.inf)
            jr = key.argmin(2)
            xj = xm.reshape(-1, s)[bq, jr.ravel()].reshape(n, q)
            relief = xb / (cf[eb + roff] + 1)
            hi_r = np.maximum(wh - relief, wm + xb - relief - xj)
            use_r = ((wh - hi_r) > (wh - new_hi) * 0.5) & (key.min(2) < np.inf) & allow[:, None]
            new_hi = np.where(use_r, hi_r, new_hi)
            si = np.where(use_r, hs + top, si)
            sj = np.where(use_r, (lt - woff) * s + jr, sj)
        # moves form a prefix of the pairs: once a pair's heavy worker cannot come down, the
        # row's peak cannot drop below it this iteration, and lighter pairs would move in vain
        ok = np.logical_and.accumulate((wh - new_hi > eps) & (wh > new_hi[:, :1] + eps), axis=1)
        if not ok.any():
            break
        ei, ej = af[poff + si], af[poff + sj]                                 # experts before
        rt = ok & use_r if use_r is not None else np.zeros_like(ok)
        blocked = np.zeros(n, dtype=bool)
        if rt.any():
            # one retarget per row and iteration, and only if the expert that gives up a
            # replica does not push one of its other holders above the level the pair reaches
            first = rt & (np.cumsum(rt, 1) == 1)
            ok = np.logical_and.accumulate(ok & ~(rt & ~first), axis=1)
            rt = first & ok
            r_, q_ = np.nonzero(rt)
            holds = a[r_] == ej[r_, q_][:, None]                              # [m, p]
            holds[np.arange(r_.size), sj[r_, q_]] = False                     # the slot that changes
            c_a = cf[roff[r_, 0] + ej[r_, q_]]
            rise = xm[r_, q_, (sj[r_, q_] % s)] / (c_a - 1)                   # per other replica
            top_after = (wl[r_] + holds.reshape(-1, w, s).sum(2) * rise[:, None]).max(1)
            bad = top_after > new_hi[r_, q_] + eps[r_, 0]
            if bad.any():
                blocked[r_[bad]] = True
                ok[r_[bad]] = False
                rt[r_[bad]] = False
        sw = ok & ~rt
        # the row's peak after the first moves of this iteration (exact for swaps): the largest
        # of the moved pairs' new loads and the heaviest worker not yet relieved
        nxt = np.concatenate([wh[:, 1:], rest[:, None]], 1)
        moved_hi = np.where(ok, np.maximum(new_hi, wm), -np.inf)
        step_peak = np.maximum(np.maximum.accumulate(moved_hi, 1), nxt)
        # swaps exchange two slot loads and shift d between the pair
        gs, gi = (poff + si)[sw], (poff + sj)[sw]
        d = xf[gs] - xf[gi]
        af[gs], af[gi] = ej[sw], ei[sw]
        xf[gs], xf[gi] = xf[gi], xf[gs] + 0.0
        wlf[hv[sw]] -= d
        wlf[lt[sw]] += d
        if rt.any():
            # a retarget changes two experts' replica counts: recompute its rows
            rr = np.flatnonzero(rt.any(1))
            r_, q_ = np.nonzero(rt)
            af[poff[r_, 0] + sj[r_, q_]] = ei[r_, q_]
            np.add.at(cf, roff[r_, 0] + ei[r_, q_], 1)
            np.add.at(cf, roff[r_, 0] + ej[r_, q_], -1)
            ar = a[rr] + roff[rr]
            x[rr] = lf[ar] / cf[ar]
            wl[rr] = x[rr].reshape(-1, w, s).sum(2)
        peak = wl.max(1)
        allow &= ~blocked
        nmov = ok.sum(1)
        last = np.maximum(nmov - 1, 0)
        alive = (nmov > 0) | blocked
        ar_n = np.arange(n)
        step_peak[ar_n, last] = np.where(nmov > 0, peak, step_peak[ar_n, last])
        cost = np.where(ok, np.where(rt, 1, 2), 0)
        search.record(idx, si, sj, ei, ej, ok, rt, step_peak, cost)
        spent += int(cost.sum())
        if stop_cost is not None and spent >= stop_cost:
            break
        if alive.sum() <= n // 2:                                             # shrink the working set
            if a is not full_a:
                full_a[idx] = a
            keep = np.flatnonzero(alive)
            idx = idx[keep]
            a, x, wl, cnt = a[keep], x[keep], wl[keep], cnt[keep]
            lf, ff = lf.reshape(n, e)[keep].ravel(), ff.reshape(n, e)[keep].ravel()
            eps, allow = eps[keep], allow[keep]
            n = idx.size
            if n == 0:
                break
            roff, poff, woff = (np.arange(n) * e)[:, None], (np.arange(n) * p)[:, None], (np.arange(n) * w)[:, None]
            bq = np.arange(n * q)
    if a is not full_a and n:
        full_a[idx] = a
    search.final = full_a
    return search


class Search:
    """The moves a :func:`refine` run made, so that a prefix of them can be chosen per row.

    Moves are kept per iteration for the rows then searched (``idx``), as ``[n, Q]`` arrays:
    slot on the heavy worker ``si``, slot on the light worker ``sj``, their experts ``ei``/``ej``
    before the move, ``ok`` made, ``rt`` retarget rather than swap, the row's peak worker load
    after each move and its cost in slots. Step k of a row is its k-th move in (iteration, pair)
    order; rows outside ``idx`` make no move in that iteration.
    """

    def __init__(self, start: np.ndarray, peak0: np.ndarray, mean: np.ndarray, pairs: int):
        self.start = start            # [B, p] the assignment searched from
        self.peak0 = peak0            # [B] its largest worker load
        self.peak_now = peak0.copy()  # [B] the largest worker load after the moves so far
        self.mean = mean              # [B] mean worker load
        self.pairs = pairs
        self.moves: list[tuple[np.ndarray, ...]] = []
        self.final = start

    def record(self, idx, si, sj, ei, ej, ok, rt, step_peak, cost) -> None:
        # pairs move as a prefix (pair q only after pair 0...), so steps past the last move of
        # the iteration carry its (exact) peak, and a row without moves keeps its peak
        nmov = ok.sum(1)
        sp = np.where(ok, step_peak, step_peak[np.arange(idx.size), np.maximum(nmov - 1, 0)][:, None])
        sp[nmov == 0] = self.peak_now[idx][nmov == 0, None]
        self.peak_now[idx] = sp[:, -1]
        self.moves.append((idx, si, sj, ei, ej, ok, rt, sp, cost))

    def curves(self) -> tuple[np.ndarray, np.ndarray]:
        """``peak [K+1, B]`` and cumulative ``cost [K+1, B]`` after each of K steps (step 0: none)."""
        rows, q = self.start.shape[0], self.pairs
        run = self.peak0.copy()
        peaks, costs = [run[None]], [np.zeros((1, rows), np.int64)]
        for idx, *_, sp, cost in self.moves:
            full = np.repeat(run[:, None], q, 1)
            full[idx] = sp
            c = np.zeros((rows, q), np.int64)
            c[idx] = cost
            run = full[:, -1].copy()
            peaks.append(full.T)
            costs.append(c.T)
        return np.concatenate(peaks), np.cumsum(np.concatenate(costs), 0)

    def replay(self, steps: np.ndarray) -> np.ndarray:
        """The assignment ``[B, p]`` after the first ``steps[b]`` steps of each row."""
        out = self.start.copy()
        of = out.ravel()
        p = out.shape[1]
        q = self.pairs
        for t, (idx, si, sj, ei, ej, ok, rt, _, _) in enumerate(self.moves):
            take = ok & ((t * q + np.arange(q)) < steps[idx][:, None])
            base = (idx * p)[:, None]
            sw, r = take & ~rt, take & rt
            of[(base + si)[sw]] = ej[sw]
            of[(base + sj)[sw]] = ei[sw]
            of[(base + sj)[r]] = ei[r]
        return out


def select_prefix(value: np.ndarray, cost: np.ndarray, budget: float | None, grid: int = 16) -> np.ndarray:
    """Pick, for every row, how far along its search to go: ``t [B]``.

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
    gain = np.ascontiguousarray((value - value[:1]).T)                        # [B, T+1]
    cst = np.ascontiguousarray(cost.T)
    lo, hi = 0.0, float((gain / np.maximum(cst, 1)).max()) * 1.0001 + 1e-300  # at hi nothing moves
    for _ in range(3):
        lam = np.linspace(lo, hi, grid)                                       # [G]
        t = np.argmax(gain[None] - lam[:, None, None] * cst[None], 2)          # [G, B]
        spend = np.take_along_axis(cst, t.T, 1).sum(0)                        # [G], falls with lam
        k = int(np.argmax(spend <= budget))                                   # first price within budget
        lo, hi = (lam[k - 1] if k > 0 else lo), lam[k]
    return np.argmax(gain - hi * cst, 1)


def match(current: np.ndarray, proposed: np.ndarray, num_workers: int, num_logical: int) -> np.ndarray:
    """Relabel the workers and slots of ``proposed`` so that it keeps as much of ``current`` as it can.

    current, proposed: [B, p]. Returns a placement with, in every row, the same multiset of
    experts per worker as ``proposed`` (so the same worker loads, up to which worker is which)
    but with workers and slots permuted: new workers are matched to current workers greedily by
    the number of experts they share, and inside a matched pair every expert that already sits
    in a slot of the current worker stays in that slot. A proposal that is a mere permutation of
    ``current`` comes back equal to ``current``.
    """
    rows, p = current.shape
    w = num_workers
    s = p // w
    e = num_logical
    roff = (np.arange(rows) * e)[:, None]
    # overlap[b, new worker, old worker]: slots of the new worker whose expert the old one has
    has = np.zeros((rows * e, w), dtype=bool)
    has[(current + roff).ravel(), np.tile(np.arange(p) // s, rows)] = True
    overlap = has[proposed + roff].reshape(rows, w, s, w).sum(2).astype(np.float64)  # [B, w, w]
    new_of_old = np.empty((rows, w), dtype=np.int64)
    r = np.arange(rows)
    for _ in range(w):
        k = overlap.reshape(rows, w * w).argmax(1)
        wn, wo = k // w, k % w
        new_of_old[r, wo] = wn
        overlap[r, wn, :] = -1.0
        overlap[r, :, wo] = -1.0
    new_s = proposed.reshape(rows, w, s)[r[:, None], new_of_old]            # [B, w(old), s]
    old_s = current.reshape(rows, w, s)
    out = np.full((rows, w, s), -1, dtype=np.int64)
    avail = np.ones((rows, w, s), dtype=bool)
    for k in range(s):                                                      # keep what sits already
        hit = avail & (new_s == old_s[:, :, k:k + 1])
        j = hit.argmax(2)
        got = hit.any(2)
        out[:, :, k] = np.where(got, old_s[:, :, k], -1)
        bb, ww = np.nonzero(got)
        avail[bb, ww, j[bb, ww]] = False
    empty = out < 0                                                         # fill the rest in order
    pos = np.argsort(~empty, axis=2, kind="stable")
    item = np.argsort(~avail, axis=2, kind="stable")
    n_empty = empty.sum(2)
    take = np.arange(s) < n_empty[:, :, None]
    bb, ww, jj = np.nonzero(take)
    out[bb, ww, pos[bb, ww, jj]] = new_s[bb, ww, item[bb, ww, jj]]
    return out.reshape(rows, p)
