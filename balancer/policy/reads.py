"""A local search on the predicted layer time under the data plane's replica rule (numpy only).

Dimension letters: B rows (a MoE layer, or a (layer, node) pair), n the rows still searched, e
logical experts of a row, p slots of a row, w workers of a row, K the slots a move may take, S
phases (step numbers over which the rule repeats), X the most replicas of an expert plus one.

Under the replica rule with break-even counts b (:mod:`~moeserve.balancer.policy.rule`), an
expert whose step count is at most b is read on ONE replica, index (step + e) mod c, replica 0
the copy in the lowest slot. At decode sizes that is every expert, and a layer's time is set by
the worker that reads the most weights in a step: which experts fill the redundant slots, and
where their copies sit, decide whether each step's reads split evenly over the workers (with
two workers and an expert's copies on both, expert e is read on worker (step + e) mod 2: the
doubled experts should be half even, half odd, and the single ones half on each worker). The
token-balanced search (:mod:`.search`) does not see that; this search moves slots to lower
:func:`~moeserve.balancer.policy.rule.rule_times` directly.

Its one move is a re-replication: a slot holding a replica of an expert with more than one
takes another expert (1 slot changes). Every such move of every row is priced each iteration
(the two experts' contributions to each worker at each phase recomputed) and each row makes its
best one while that lowers the row's predicted time.
"""

from __future__ import annotations

import numpy as np

from moeserve.balancer.policy.cost import StepModel
from moeserve.balancer.policy.rule import RULE_PHASES, replica_rank, rule_shares
from moeserve.placement import logical_counts

__all__ = ["read_search", "MAX_WORK"]

# a step of the search prices n * K * e * S * w numbers (every move of every row at every phase
# on every worker); it stops before a step that would price more (a DeepSeek-V3 sized call,
# 58 layers of 256 experts on 32 workers, would price about 4e8 a step; the 27 layers of
# ERNIE-4.5-21B on 2 workers about 2e6): the policy then keeps its other plans
MAX_WORK = 4e6


def _phases(max_count: int) -> int:
    """S: the lcm of 1 .. max_count + 1 (every count a move can make), at most SEARCH_PHASES."""
    out = 1
    for c in range(2, max_count + 2):
        out = int(np.lcm(out, c))
        if out >= SEARCH_PHASES:
            return SEARCH_PHASES
    return out


# the search's own price averages at most this many step numbers (the lcm of counts up to 4);
# where counts go higher it is an estimate, and the policy prices its result with
# rule.rule_times (up to RULE_PHASES)
SEARCH_PHASES = min(12, RULE_PHASES)


def _contrib(shares_c, e_idx, slots, count, gid, slot_worker, w: int, phases: int, x: int):
    """Busy and pairs ``[N, S, w]`` that N experts add to each worker at each phase (with
    ``w`` workers: a slot id may map to a worker of its own, as the new slot of a move does).

    shares_c: (alone_busy [B, e], alone_pairs [B, e], rep_busy [B, e, X], rep_pairs [B, e, X])
    at the counts the experts have here; e_idx: (row [N], expert [N]); slots [N, X] their slots
    in replica order (-1 beyond ``count [N]``); gid [N] the ids the rule staggers by;
    slot_worker [p'] the worker of every slot id."""
    a_busy, a_pairs, r_busy, r_pairs = shares_c
    row, ex = e_idx
    j = np.arange(x)
    s = np.arange(phases)
    valid = j[None, :] < count[:, None]  # [N, X]
    alone = (s[None, :, None] + gid[:, None, None]) % np.maximum(count, 1)[:, None, None] == j[None, None, :]
    alone &= valid[:, None, :]  # [N, S, X]
    busy = r_busy[row, ex][:, None, :] * valid[:, None, :] + a_busy[row, ex][:, None, None] * alone
    pairs = r_pairs[row, ex][:, None, :] * valid[:, None, :] + a_pairs[row, ex][:, None, None] * alone
    onehot = ((slot_worker[np.maximum(slots, 0)][..., None] == np.arange(w)) & valid[..., None]).astype(np.float64)
    return np.matmul(busy, onehot), np.matmul(pairs, onehot)


def _share_table(load, b, steps, hist, cmax: int):
    """Every expert's :class:`~moeserve.balancer.policy.rule.RuleShares` at every count 1 .. cmax:
    (alone_busy, alone_pairs [C, B, e], rep_busy, rep_pairs [C, B, e, C]), C = cmax."""
    rows, e = load.shape
    big = (cmax, rows, e)
    counts = np.broadcast_to(np.arange(1, cmax + 1)[:, None, None], big).reshape(-1, e)
    h = None if hist is None else np.broadcast_to(hist[None], (cmax,) + hist.shape).reshape(cmax * rows, e, -1)
    sh = rule_shares(
        np.broadcast_to(load[None], big).reshape(-1, e),
        counts,
        np.broadcast_to(b[None], big).reshape(-1, e),
        steps,
        h,
        width=cmax,
    )
    return (
        sh.alone_busy.reshape(big),
        sh.alone_pairs.reshape(big),
        sh.rep_busy.reshape(big + (cmax,)),
        sh.rep_pairs.reshape(big + (cmax,)),
    )


def read_search(
    model: StepModel,
    load,
    current,
    num_workers: int,
    breakeven,
    steps: int | None = None,
    histogram=None,
    expert_ids=None,
    max_steps: int = 8,
) -> list[np.ndarray]:
    """Re-replications that lower each row's predicted time under the replica rule, one per row
    and step: the placements after 0, 1, ... T steps, a list of ``[B, p]`` (a row that stops
    keeps its last placement). Nothing beyond step 0 when a step would price more than
    ``MAX_WORK`` numbers.

    load [B, e] over ``steps`` steps (or histogram [B, e, K]); current [B, p]; breakeven [B, e]:
    the b each expert is priced with throughout (an expert that gains a replica keeps its own);
    expert_ids [B, e] (or None: 0 .. e - 1): the ids the rule staggers by.
    """
    load = np.asarray(load, dtype=np.float64)
    cur = np.asarray(current, dtype=np.int64).copy()
    rows, p = cur.shape
    e = load.shape[1]
    w = num_workers
    b = np.broadcast_to(np.asarray(breakeven, dtype=np.float64), (rows, e))
    gid_all = np.broadcast_to(np.arange(e), (rows, e)) if expert_ids is None else np.asarray(expert_ids, dtype=np.int64)
    hist = None if histogram is None else np.asarray(histogram, dtype=np.float64)
    out = [cur.copy()]
    slot_worker = np.arange(p) // (p // w)
    live = np.arange(rows)  # rows still searched
    table = None
    for _ in range(max_steps if p > e else 0):
        n = live.size
        now_p2l = cur[live]
        logcnt = logical_counts(now_p2l, e)  # [n, e]
        x = int(logcnt.max()) + 1  # list width after a gain
        phases = _phases(int(logcnt.max()))
        ca = np.take_along_axis(logcnt, now_p2l, 1)  # [n, p]
        give = ca >= 2  # slots that may change
        kmax = int(give.sum(1).max())
        if n * kmax * e * phases * w > MAX_WORK:
            break
        ks = np.argsort(~give, axis=1, kind="stable")[:, :kmax]  # [n, K] candidate slots
        k_ok = np.take_along_axis(give, ks, 1)
        r = np.arange(n)
        rank = replica_rank(now_p2l, e)
        slots_of = np.full((n, e, x), -1, dtype=np.int64)  # [n, e, X] replica order
        slots_of[np.repeat(r, p), now_p2l.ravel(), rank.ravel()] = np.tile(np.arange(p), n)
        if table is None:  # every expert's shares at every count it can reach
            table = _share_table(load, b, steps, hist, int(logcnt.max()) + max_steps + 1)
        cmax = table[0].shape[0]

        def shares_at(counts):  # counts [n, e] -> the shares of the live rows' experts
            ci = np.clip(counts, 1, cmax) - 1
            at = (ci, live[:, None], np.arange(e)[None, :])
            return table[0][at], table[1][at], table[2][at][..., :x], table[3][at][..., :x]

        gid_n = gid_all[live]
        # every expert's part now: [n, e, S, w]
        old_b, old_p = _contrib(
            shares_at(logcnt),
            (np.repeat(r, e), np.tile(np.arange(e), n)),
            slots_of.reshape(-1, x),
            logcnt.ravel(),
            gid_n.ravel(),
            slot_worker,
            w,
            phases,
            x,
        )
        old_b, old_p = old_b.reshape(n, e, phases, w), old_p.reshape(n, e, phases, w)
        tot_b, tot_p = old_b.sum(1), old_p.sum(1)  # [n, S, w]
        t_now = model.time(tot_b, tot_p).max(2).mean(1)  # [n]
        # the expert a = cur[k] gives up slot k (keeping its other replicas, in order): [n, K, S, w]
        a = np.take_along_axis(now_p2l, ks, 1)  # [n, K]
        ka = np.take_along_axis(rank, ks, 1)
        cak = np.take_along_axis(ca, ks, 1)
        j = np.arange(x)
        lst = slots_of[r[:, None], a]  # [n, K, X]
        new_lst = np.take_along_axis(lst, np.minimum(j[None, None, :] + (j[None, None, :] >= ka[..., None]), x - 1), 2)
        new_lst = np.where(j[None, None, :] < (cak - 1)[..., None], new_lst, -1)
        ab, ap = _contrib(
            shares_at(logcnt - 1),
            (np.repeat(r, kmax), a.ravel()),
            new_lst.reshape(-1, x),
            np.maximum(cak - 1, 0).ravel(),
            np.take_along_axis(gid_n, a, 1).ravel(),
            slot_worker,
            w,
            phases,
            x,
        )
        d_a_b = ab.reshape(n, kmax, phases, w) - old_b[r[:, None], a]
        d_a_p = ap.reshape(n, kmax, phases, w) - old_p[r[:, None], a]
        # expert y gains a slot on worker v at position pos of its list: [n, e, X, w, S, w]
        pos = np.arange(x)
        src = np.where(j[None, :] < pos[:, None], j[None, :], j[None, :] - 1)  # [pos, X] into the old list
        ins = np.take_along_axis(slots_of[:, :, None, :], np.maximum(src, 0)[None, None], 3)  # [n, e, pos, X]
        ins = np.where((j[None, :] == pos[:, None])[None, None], p, ins)  # slot id p: the new slot
        cy = logcnt + 1
        ins = np.where(j[None, None, None, :] < cy[..., None, None], ins, -1)
        # the new slot counted on an extra worker w, then put on each worker v: [n, e, pos, v, S, w]
        idx = (np.repeat(r, e * x), np.tile(np.repeat(np.arange(e), x), n))
        yb, yp = _contrib(
            shares_at(cy),
            idx,
            ins.reshape(-1, x),
            np.repeat(cy.ravel(), x),
            np.repeat(gid_n.ravel(), x),
            np.append(slot_worker, w),
            w + 1,
            phases,
            x,
        )
        yb, yp = yb.reshape(n, e, x, 1, phases, w + 1), yp.reshape(n, e, x, 1, phases, w + 1)
        on_v = np.eye(w)[None, None, None, :, None, :]  # [.., v, 1, w]
        y_b = yb[..., :w] + yb[..., w:] * on_v - old_b[:, :, None, None]
        y_p = yp[..., :w] + yp[..., w:] * on_v - old_p[:, :, None, None]
        # candidate (k, y): slot k goes to y, at the position of y's list that k's slot id takes
        kpos = ((slots_of[:, None, :, :] >= 0) & (slots_of[:, None, :, :] < ks[:, :, None, None])).sum(3)  # [n, K, e]
        rr, yy = r[:, None, None], np.arange(e)[None, None, :]
        kv = slot_worker[ks][:, :, None]
        busy = tot_b[:, None, None] + d_a_b[:, :, None] + y_b[rr, yy, kpos, kv]  # [n, K, e, S, w]
        pairs = tot_p[:, None, None] + d_a_p[:, :, None] + y_p[rr, yy, kpos, kv]
        t = model.time(busy, pairs).max(4).mean(3)  # [n, K, e]
        t[~(k_ok[:, :, None] & (a[:, :, None] != yy))] = np.inf
        flat = t.reshape(n, -1).argmin(1)
        made = t.reshape(n, -1)[r, flat] < t_now * (1 - 1e-6)
        if not made.any():
            break
        kk, y = np.divmod(flat, e)
        cur[live[made], ks[r, kk][made]] = y[made]
        live = live[made]
        out.append(cur.copy())
    return out
