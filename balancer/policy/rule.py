"""The step-time model under the data plane's replica rule with break-even counts b, and b
chosen per (layer, expert) by it (numpy only).

Dimension letters: L MoE layers, E logical experts, B rows (a layer, or a (layer, node) pair),
e logical experts of a row, p slots of a row, W workers, S phases, K histogram bins, C
candidate counts, X the most replicas of an expert.

The rule (docs/dataplane.md, "Replica choice"; ``exchange.choose_slots``): an expert with c
replicas and n pairs in a step sends them, when 0 < n <= b, all to ONE replica, index
(step + e) mod c (replica j = the j-th slot holding e, ascending); when n > b, evenly over
replicas 0 .. u - 1, u = min(c, ceil(n / b)); with b = 0 over all c. So which worker reads an
expert's weights depends on the step number. :func:`rule_times` takes every worker's expected
busy slots and pairs at each step number s ("phase") of the rule's period (the lcm of the
layer's replica counts, at most RULE_PHASES), the layer's time at s as its slowest worker's
(:meth:`~moeserve.balancer.policy.cost.StepModel.time`), and the layer's time as the mean over
the phases. :func:`~moeserve.balancer.policy.cost.worker_times` is the same model without b
(every replica read whenever its Poisson share is non-zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeserve.balancer.policy.cost import StepModel, _bin_counts
from moeserve.placement import logical_counts

__all__ = [
    "RULE_PHASES",
    "NEVER_SPREAD",
    "poisson_cdf",
    "replica_rank",
    "rule_phases",
    "RuleShares",
    "rule_shares",
    "rule_slot_shares",
    "rule_times",
    "b_candidates",
    "plan_breakeven",
]


RULE_PHASES = 12  # the most step numbers a layer is averaged over (lcm(1..4) = 12)
NEVER_SPREAD = 1 << 40  # a b no step's count passes: one replica read a step, whatever the count


def _erf(x: np.ndarray) -> np.ndarray:
    """erf, Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7): numpy has none."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = (((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592
    y = 1.0 - poly * t * np.exp(-a * a)
    return s * y


_EXACT_BELOW = 16  # poisson_cdf sums the terms below this count, and approximates above


def poisson_cdf(m, lam) -> np.ndarray:
    """P(N <= m) for N ~ Poisson(lam) (arrays broadcast; m an integer count, < 0 gives 0, inf 1).

    Exact for m < 16; above, through P(N <= m) = P(chi2 with 2(m + 1) degrees of freedom > 2 lam)
    and the Wilson-Hilferty cube root (within about 1e-3 of the exact value there)."""
    m, lam = np.broadcast_arrays(np.asarray(m, dtype=np.float64), np.asarray(lam, dtype=np.float64))
    out = np.ones(m.shape)
    small = (m < _EXACT_BELOW) & (lam > 0)
    if small.any():  # the sum of the first terms
        ms, ls = m[small], lam[small]
        term = np.exp(-ls)
        acc = np.zeros_like(term)
        for i in range(int(max(ms.max(), -1)) + 1):
            acc += np.where(ms >= i, term, 0.0)
            term = term * ls / (i + 1)
        out[small] = acc
    big = (m >= _EXACT_BELOW) & np.isfinite(m) & (lam > 0)
    if big.any():
        k = 2.0 * (m[big] + 1.0)
        v = 2.0 / (9.0 * k)
        z = (np.cbrt(2.0 * lam[big] / k) - (1.0 - v)) / np.sqrt(v)
        out[big] = 0.5 * (1.0 - _erf(z / np.sqrt(2.0)))
    return np.where(m < 0, 0.0, np.clip(out, 0.0, 1.0))


def replica_rank(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """The replica index of every slot, ``[L, P]``: slot k is replica j of its expert when it is
    the j-th slot holding that expert (ascending), the order the data plane's rule counts on."""
    layers, p = phy2log.shape
    key = phy2log + (np.arange(layers) * num_experts)[:, None]
    order = np.argsort(key, axis=1, kind="stable")  # [L, P] slots by expert
    sorted_key = np.take_along_axis(key, order, 1)
    new = np.ones_like(sorted_key, dtype=bool)
    new[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    first = np.maximum.accumulate(np.where(new, np.arange(p)[None, :], 0), axis=1)  # where each run starts
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(p)[None, :] - first, 1)
    return rank


def rule_phases(logcnt: np.ndarray) -> np.ndarray:
    """Step numbers per row over which the rule repeats, ``[B]``: the lcm of the row's replica
    counts (``logcnt [B, e]``), RULE_PHASES where that is larger."""
    logcnt = np.asarray(logcnt, dtype=np.int64)
    out = np.ones(logcnt.shape[0], dtype=np.int64)
    for c in range(2, int(logcnt.max(initial=1)) + 1):
        has = (logcnt == c).any(1)
        out = np.where(has & (out <= RULE_PHASES), np.lcm(out, c), out)
    return np.minimum(out, RULE_PHASES)


@dataclass(frozen=True)
class RuleShares:
    """What an expert's count distribution gives its replicas under the rule, per (row, expert).

    alone_busy, alone_pairs [B, e]: P(0 < n <= b) and E[n; n <= b], the step's one replica's;
    rep_busy, rep_pairs [B, e, X]: P(replica j is among those the pairs spread over) and its
    expected pairs then (n > b; every replica with b = 0), X the most replicas of an expert.
    """

    alone_busy: np.ndarray
    alone_pairs: np.ndarray
    rep_busy: np.ndarray
    rep_pairs: np.ndarray


def rule_shares(
    load, logcnt, breakeven, steps: int | None = None, histogram=None, width: int | None = None
) -> RuleShares:
    """:class:`RuleShares` of every (row, expert) with ``logcnt [B, e]`` replicas and break-even
    count ``breakeven [B, e]`` (0: no threshold): per-step counts Poisson with mean
    ``load [B, e] / steps``, or the histogram's bins ``[B, e, K]`` (the bin's middle count).
    ``width``: X, at least the largest count (default: that count)."""
    logcnt = np.asarray(logcnt, dtype=np.int64)
    b = np.broadcast_to(np.asarray(breakeven, dtype=np.float64), logcnt.shape)
    x = int(width or max(int(logcnt.max(initial=1)), 1))
    c = np.maximum(logcnt, 1).astype(np.float64)
    j = np.arange(x, dtype=np.float64)  # [X]
    on = b > 0
    valid = j[None, None, :] < c[..., None]  # [B, e, X]
    if histogram is not None:
        hist = np.asarray(histogram, dtype=np.float64)
        total = hist.sum(2, keepdims=True)
        q = hist / np.where(total > 0, total, 1.0)  # [B, e, K]
        n = _bin_counts(hist.shape[2])[None, None, :]  # [1, 1, K]
        bb, cc = b[..., None], c[..., None]
        alone = on[..., None] & (n > 0) & (n <= bb)
        alone_busy, alone_pairs = (q * alone).sum(2), (q * alone * n).sum(2)
        # n > b: u = min(c, ceil(n / b)) replicas, n / u pairs each; b = 0: all c, n / c each,
        # a replica busy as the window model has it (c (1 - (1 - 1/c)^n) of the c replicas)
        u = np.where(on[..., None], np.clip(np.ceil(n / np.maximum(bb, 1e-300)), 1, cc), cc)  # [B, e, K]
        spread = (q * ((n > 0) & ~alone))[..., None, :]  # [B, e, 1, K]
        in_u = j[None, None, :, None] < u[..., None, :]  # [B, e, X, K]
        rep_pairs = (spread * in_u * (n / u)[..., None, :]).sum(3)
        busy_off = (q * -np.expm1(n * np.log1p(-1.0 / np.maximum(cc, 1 + 1e-12)))).sum(2)
        busy_off = np.where(c == 1, 1.0 - q[..., 0], busy_off)
        rep_busy = np.where(on[..., None], (spread * in_u).sum(3), busy_off[..., None])
        return RuleShares(alone_busy, alone_pairs, np.where(valid, rep_busy, 0.0), np.where(valid, rep_pairs, 0.0))
    if steps is None or steps < 1:
        raise ValueError(f"steps must be a positive integer (forward steps in the window), got {steps!r}")
    lam = np.asarray(load, dtype=np.float64) / steps  # [B, e]
    p0 = np.exp(-lam)
    fb = poisson_cdf(b, lam)
    alone_busy = np.where(on, fb - p0, 0.0)
    alone_pairs = np.where(on, lam * poisson_cdf(b - 1, lam), 0.0)
    # bands of n > b: u = k for n in ((k-1) b, k b] (k < c), u = c above (c - 1) b; band 1 is
    # (b, b] (empty) unless c = 1, where everything above b goes to replica 0
    k = np.arange(1, x + 1, dtype=np.float64)  # [X]
    lo = np.maximum(k - 1, 1)[None, None, :] * b[..., None]  # [B, e, X]
    hi = np.where(k[None, None, :] < c[..., None], k[None, None, :] * b[..., None], np.inf)
    band = valid & (k[None, None, :] <= c[..., None])
    lam3 = lam[..., None]
    mass = np.where(band, lam3 * (poisson_cdf(hi - 1, lam3) - poisson_cdf(lo - 1, lam3)), 0.0) / k  # E[n / u; band]
    # replica j gets a share in bands k > j: suffix sums over k
    rep_pairs_on = np.cumsum(mass[..., ::-1], axis=2)[..., ::-1]
    rep_busy_on = np.where(valid, 1.0 - poisson_cdf(np.maximum(j, 1)[None, None, :] * b[..., None], lam3), 0.0)
    share = lam3 / c[..., None]
    rep_busy = np.where(on[..., None], rep_busy_on, -np.expm1(-share))
    rep_pairs = np.where(on[..., None], rep_pairs_on, share)
    return RuleShares(alone_busy, alone_pairs, np.where(valid, rep_busy, 0.0), np.where(valid, rep_pairs, 0.0))


def rule_slot_shares(shares: RuleShares, phy2log, expert_ids=None, phases: int | None = None):
    """Expected busy probability and pairs of every slot at every phase: ``([B, S, p], [B, S, p])``.

    shares: :func:`rule_shares` of the rows' experts; phy2log [B, p]; expert_ids [B, e] (or
    None: 0 .. e - 1), the ids the rule staggers by (a node row's global ids); phases: S
    (default: the largest of :func:`rule_phases`)."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    rows, p = phy2log.shape
    e = shares.alone_busy.shape[1]
    logcnt = logical_counts(phy2log, e)
    if phases is None:
        phases = int(rule_phases(logcnt).max(initial=1))
    rank = replica_rank(phy2log, e)  # [B, p]
    c = np.take_along_axis(logcnt, phy2log, 1)  # [B, p]
    gid = phy2log if expert_ids is None else np.take_along_axis(np.asarray(expert_ids, dtype=np.int64), phy2log, 1)
    s = np.arange(phases)[None, :, None]
    alone = ((s + gid[:, None, :]) % c[:, None, :]) == rank[:, None, :]  # [B, S, p]
    flat = phy2log * shares.rep_busy.shape[2] + rank
    rep_busy = np.take_along_axis(shares.rep_busy.reshape(rows, -1), flat, 1)  # [B, p]
    rep_pairs = np.take_along_axis(shares.rep_pairs.reshape(rows, -1), flat, 1)
    a_busy = np.take_along_axis(shares.alone_busy, phy2log, 1)
    a_pairs = np.take_along_axis(shares.alone_pairs, phy2log, 1)
    busy = rep_busy[:, None, :] + alone * a_busy[:, None, :]
    pairs = rep_pairs[:, None, :] + alone * a_pairs[:, None, :]
    return busy, pairs


def rule_times(
    model: StepModel,
    load,
    phy2log,
    num_workers: int,
    breakeven,
    steps: int | None = None,
    histogram=None,
    expert_ids=None,
) -> np.ndarray:
    """Predicted seconds of every row (layer) under the replica rule with break-even counts
    ``breakeven [B, e]``: ``[B]``, the mean over the rule's phases (:func:`rule_phases`) of the
    slowest worker's time at that phase. load [B, e] over ``steps`` steps (or histogram
    [B, e, K]); phy2log [B, p]; expert_ids as in :func:`rule_slot_shares`."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    rows, p = phy2log.shape
    load = np.asarray(load, dtype=np.float64)
    logcnt = logical_counts(phy2log, load.shape[1])
    shares = rule_shares(load, logcnt, breakeven, steps, histogram)
    per_row = rule_phases(logcnt)
    busy, pairs = rule_slot_shares(shares, phy2log, expert_ids, int(per_row.max(initial=1)))
    w = num_workers
    t = model.time(busy.reshape(rows, -1, w, p // w).sum(3), pairs.reshape(rows, -1, w, p // w).sum(3)).max(2)  # [B, S]
    mask = np.arange(t.shape[1])[None, :] < per_row[:, None]
    return (t * mask).sum(1) / per_row


def b_candidates(model: StepModel, load, steps=None, histogram=None) -> np.ndarray:
    """The break-even counts :func:`plan_breakeven` tries, in order of preference: the model's
    b0, then b0 * 2, * 4, ... up to the first that no step's count passes (the window's largest
    plausible count), then b0 / 2 and b0 / 4. ``[C]`` int64."""
    b0 = model.breakeven_count
    if histogram is not None:
        hist = np.asarray(histogram)
        k = np.flatnonzero(hist.reshape(-1, hist.shape[2]).sum(0) > 0)
        top = 2.0 ** (int(k.max()) if k.size else 0)
    else:
        lam = float(np.max(load, initial=0.0)) / steps
        top = lam + 6.0 * np.sqrt(lam) + 6.0
    ups = [b0]
    while ups[-1] < top and len(ups) < 40:
        ups.append(ups[-1] * 2)
    downs = [v for v in (b0 // 2, b0 // 4) if v >= 1 and v not in ups]
    return np.array(ups + downs, dtype=np.int64)


def plan_breakeven(
    model: StepModel,
    load,
    phy2log,
    num_workers: int,
    steps: int | None = None,
    histogram=None,
    expert_ids=None,
    passes: int = 2,
    candidates=None,
) -> np.ndarray:
    """Break-even counts chosen per (layer, expert) by the predicted layer time: int64 ``[L, E]``.

    The b the data plane compares a step's count with decides how many replicas it reads. The
    best b of an expert depends on the rest of its workers' loads: at decode sizes, where every
    worker is bound by weight reads, a second copy of a hot expert adds a read to a worker that
    has no matmul time to save, and one copy per step (a b no count passes) is faster; where a
    worker is bound by its matmul, spreading above the model's b0 pays. So each expert with more
    than one replica takes, of the candidates (:func:`b_candidates`: b0, b0 * 2, ... up to a b
    no step's count passes in this window, b0 / 2, b0 / 4), the one with the least predicted
    time of its layer (:func:`rule_times`): first the best single candidate for all of a
    layer's experts, then each expert in turn, hottest first, the others' b as chosen so far,
    ``passes`` times over; a tie goes to the earlier candidate (b0 first). Experts with one
    replica keep b0 (b changes nothing for them).

    load [L, E] over ``steps`` steps (or histogram [L, E, K]); phy2log [L, P]; expert_ids as in
    :func:`rule_slot_shares`; candidates [C]: the counts tried (default :func:`b_candidates` of
    this load). Each layer's counts depend only on its own rows and the candidates, and the same
    arguments give the same counts: a caller that installs a plan recomputes its b with this
    function.
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, e = load.shape
    p = phy2log.shape[1]
    w = num_workers
    b0 = model.breakeven_count
    logcnt = logical_counts(phy2log, e)
    b = np.full((layers, e), b0, dtype=np.int64)
    multi = logcnt > 1
    if not multi.any():
        return b
    cand = b_candidates(model, load, steps, histogram) if candidates is None else np.asarray(candidates, np.int64)
    ncand = cand.size
    x = int(logcnt.max())
    per_row = rule_phases(logcnt)
    phases = int(per_row.max())
    mean = (np.arange(phases)[None, :] < per_row[:, None]) / per_row[:, None]  # [L, S] weights of the phase mean
    gid = np.broadcast_to(np.arange(e), (layers, e)) if expert_ids is None else np.asarray(expert_ids, dtype=np.int64)
    hist = None if histogram is None else np.asarray(histogram, dtype=np.float64)
    lrange = np.arange(layers)[:, None]
    # the experts with more than one replica, hottest first: [L, M], M the most in a layer
    m = int(multi.sum(1).max())
    order = np.argsort(-np.where(multi, load, -np.inf), axis=1, kind="stable")[:, :m]
    live = np.take_along_axis(multi, order, 1)  # [L, M] (False: padding)
    cnt = logcnt[lrange, order]
    # their shares under every candidate: [C, L, M] and [C, L, M, X]
    big = (ncand, layers, m)
    hist_m = (
        None
        if hist is None
        else np.broadcast_to(hist[lrange, order][None], big + hist.shape[2:]).reshape(ncand * layers, m, -1)
    )
    sh = rule_shares(
        np.broadcast_to(load[lrange, order][None], big).reshape(-1, m),
        np.broadcast_to(cnt[None], big).reshape(-1, m),
        np.broadcast_to(cand[:, None, None], big).reshape(-1, m),
        steps,
        hist_m,
        width=x,
    )
    a_busy, a_pairs = sh.alone_busy.reshape(big), sh.alone_pairs.reshape(big)
    r_busy, r_pairs = sh.rep_busy.reshape(big + (x,)), sh.rep_pairs.reshape(big + (x,))
    # where their replicas sit: onehot [L, M, X, W] (replica j of the r-th expert on worker w),
    # and the worker that reads the one replica at each phase: alone_w [L, M, S, W]
    rank = replica_rank(phy2log, e)
    slot_of = np.full((layers, e, x), -1, dtype=np.int64)
    slot_of[np.repeat(np.arange(layers), p), phy2log.ravel(), rank.ravel()] = np.tile(np.arange(p), layers)
    slots = slot_of[lrange, order]  # [L, M, X]
    onehot = (((slots // (p // w))[..., None] == np.arange(w)) & (slots >= 0)[..., None]).astype(np.float64)
    alone_j = (np.arange(phases)[None, None, :] + gid[lrange, order][..., None]) % cnt[..., None]  # [L, M, S]
    alone_w = np.take_along_axis(onehot, alone_j[..., None], 2)  # [L, M, S, W]
    spread_b = np.einsum("clmx,lmxw->clmw", r_busy, onehot)  # [C, L, M, W]
    spread_p = np.einsum("clmx,lmxw->clmw", r_pairs, onehot)

    def contribution(r):
        """Busy and pairs [L, C, S, W] the r-th expert of every layer adds to each worker under
        every candidate (zeros in a layer with fewer such experts)."""
        on = live[:, r, None, None, None]
        aw = alone_w[:, None, r]  # [L, 1, S, W]
        busy = spread_b[:, :, r].transpose(1, 0, 2)[:, :, None, :] + a_busy[:, :, r].T[:, :, None, None] * aw
        pairs = spread_p[:, :, r].transpose(1, 0, 2)[:, :, None, :] + a_pairs[:, :, r].T[:, :, None, None] * aw
        return busy * on, pairs * on

    # the experts with one replica: one copy read whenever the count is not 0, whatever b
    one = rule_shares(load, np.ones_like(logcnt), b, steps, hist, width=1)
    single = ~np.take_along_axis(multi, phy2log, 1)  # [L, P]
    part_b = np.take_along_axis(one.alone_busy + one.rep_busy[..., 0], phy2log, 1) * single
    part_p = np.take_along_axis(one.alone_pairs + one.rep_pairs[..., 0], phy2log, 1) * single
    base_b = part_b.reshape(layers, w, p // w).sum(2)[:, None, None, :]  # [L, 1, 1, W]
    base_p = part_p.reshape(layers, w, p // w).sum(2)[:, None, None, :]
    # start from the best single b for all of a layer's experts: one expert at a time cannot
    # leave a layer where every hot expert spreads (a read less on one worker at some phases
    # does not lower the slowest worker), all of them together can
    all_b = np.broadcast_to(base_b, (layers, ncand, phases, w)).copy()  # [L, C, S, W]
    all_p = np.broadcast_to(base_p, (layers, ncand, phases, w)).copy()
    for r in range(m):
        cb, cp = contribution(r)
        all_b += cb
        all_p += cp
    t = (model.time(all_b, all_p).max(3) * mean[:, None, :]).sum(2)  # [L, C]
    first = np.argmax(t <= t.min(1, keepdims=True) * (1 + 1e-9) + 1e-15, axis=1)  # the first within a hair of the best
    rows = np.arange(layers)
    tot_b, tot_p = all_b[rows, first], all_p[rows, first]  # [L, S, W]
    choice = np.repeat(first[:, None], m, 1)  # [L, M] index into cand
    for _ in range(passes):
        changed = False
        for r in range(m):
            cb, cp = contribution(r)
            mine = choice[:, r]
            rest_b, rest_p = tot_b - cb[rows, mine], tot_p - cp[rows, mine]
            t = (model.time(rest_b[:, None] + cb, rest_p[:, None] + cp).max(3) * mean[:, None, :]).sum(2)  # [L, C]
            pick = np.argmax(t <= t.min(1, keepdims=True) * (1 + 1e-9) + 1e-15, axis=1)
            pick = np.where(live[:, r], pick, mine)
            changed |= bool((pick != mine).any())
            choice[:, r] = pick
            tot_b, tot_p = rest_b + cb[rows, pick], rest_p + cp[rows, pick]
        if not changed:
            break
    b[lrange, order] = np.where(live, cand[choice], b0)
    return b
