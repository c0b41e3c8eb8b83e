"""The project's placement policy: migration-aware, budgeted, vectorised across layers (numpy only).

Dimension letters: L MoE layers, E logical experts, P slots per layer, W workers, G expert
groups, N nodes, B rows of the engine (a layer, or a (layer, node) pair in the hierarchical case).

``place(load, num_slots, num_workers, num_groups, num_nodes, current) -> phy2log`` is the
yardstick's interface (``../shared/eval/policy_yardstick.py``); :func:`make_policy` builds one
with other settings; :func:`rebalance_experts` is the DeepSeek-compatible drop-in
(:mod:`moeserve.balancer.reference`); :func:`evaluate` says what a proposed placement buys.

How a call decides (see :mod:`moeserve.balancer.engine` for the primitives):

- **No placement in force** (``current=None``) or **no move budget**: a fresh plan. Replica
  counts minimise the largest load per replica (as the reference), except that an expert is
  not given between w + 1 and 2w - 1 replicas when two of them would overload a worker;
  replicas are packed onto workers by largest differencing (3 to 16 workers) or greedily,
  heaviest first, then a local search swaps slots between the heaviest and lightest workers.
  With a placement in force the fresh plan is then *relabelled* to it: workers are matched to
  the current workers they share most experts with and experts that already sit in a slot
  stay there, so a plan that merely permutes where experts sit moves nothing.
- **A placement in force and a move budget** (default 10 % of all slots per call): the local
  search starts from the placement in force, so every slot stays unless a move lowers its
  layer's peak by more than the window's sampling noise; each move (a swap: 2 slots; where an
  expert's replica outweighs most of a worker's mean load, a re-replication: 1 slot) is
  recorded with the balancedness it reaches, and the budget is spent across layers where it
  buys the most balancedness per slot moved (a price per slot over every layer's moves).
- **Hierarchical** (``num_groups > 1``, ``num_nodes > 1``, ``num_groups % num_nodes == 0``,
  group-limited routing): expert groups are packed onto nodes (``G / N`` per node, balanced by
  group load, a group staying on its node while a placement is in force), and each node is a
  sub-problem of its own; every replica of a group stays on the group's node. With
  ``cross_node_replicas=True`` hot experts' *redundant* replicas may go to other nodes (their
  first replica stays home); that trades cross-node traffic for balance and is not valid under
  strict group-limited routing (the yardstick rejects it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeserve.balancer import engine
from moeserve.balancer.reference import rebalance_experts
from moeserve.placement import balancedness as _balancedness

__all__ = ["place", "make_policy", "PolicyConfig", "rebalance_experts", "evaluate", "PlanReport",
           "cross_node_share"]


@dataclass(frozen=True)
class PolicyConfig:
    """Settings of a policy built by :func:`make_policy`.

    move_budget: fraction of all slots (``L * P``) one call may change while a placement is in
      force, in [0, 1]; None = unlimited (a fresh plan relabelled to the placement in force).
    cross_node_replicas: hierarchical case only; let hot experts' redundant replicas leave their
      group's node (their first replica stays). Off by default. Such plans are made afresh
      every call and relabelled to the placement in force; the move budget does not apply.
    max_iter: iterations of the local search per call.
    """

    move_budget: float | None = 0.10
    cross_node_replicas: bool = False
    max_iter: int = 24

    def __post_init__(self):
        if self.move_budget is not None and not (0.0 <= self.move_budget <= 1.0):
            raise ValueError(f"move_budget must be a fraction in [0, 1] or None (unlimited), got {self.move_budget!r}")
        if not isinstance(self.max_iter, int) or self.max_iter < 0:
            raise ValueError(f"max_iter must be a non-negative integer, got {self.max_iter!r}")


def make_policy(move_budget: float | None = 0.10, *, cross_node_replicas: bool = False, max_iter: int = 24):
    """A policy with the yardstick's signature and these settings (see :class:`PolicyConfig`).

    The function returned has a ``config`` attribute.
    """
    cfg = PolicyConfig(move_budget, cross_node_replicas, max_iter)

    def policy(load, num_slots, num_workers, num_groups=1, num_nodes=1, current=None):
        return _plan(load, num_slots, num_workers, num_groups, num_nodes, current, cfg)

    policy.config = cfg
    policy.__doc__ = place.__doc__
    return policy


def place(load, num_slots, num_workers, num_groups=1, num_nodes=1, current=None):
    """Plan a placement for ``load`` starting from ``current``, with the default move budget (10 %).

    load: float [L, E], tokens per logical expert in the window (non-negative, finite).
    num_slots: P, a multiple of ``num_workers`` and at least E; num_workers: W.
    num_groups, num_nodes: group-limited routing (hierarchical when both exceed 1 and
      ``num_groups % num_nodes == 0``; E must then split into the groups and W into the nodes).
    current: int [L, P], the placement in force, or None on the first call.
    Returns phy2log: int64 [L, P]; slot p belongs to worker ``p // (P / W)``.

    In the hierarchical case a placement in force that puts an expert away from its group's
    node (e.g. one planned without groups) is repaired first, whatever the budget: the router
    could not use it. Everything else stays within the budget.
    """
    return _plan(load, num_slots, num_workers, num_groups, num_nodes, current, _DEFAULT)


_DEFAULT = PolicyConfig()


# ---- arguments -------------------------------------------------------------------------------

def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _check(load, num_slots, num_workers, num_groups, num_nodes, current):
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] == 0:
        raise ValueError(f"load must be 2-D [layers, logical experts] with at least one expert, got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    p = _positive_int("num_slots", num_slots)
    w = _positive_int("num_workers", num_workers)
    g = _positive_int("num_groups", num_groups)
    n = _positive_int("num_nodes", num_nodes)
    layers, e = load.shape
    if p < e:
        raise ValueError(f"num_slots ({p}) must be at least the number of logical experts ({e})")
    if p % w:
        raise ValueError(f"num_slots ({p}) must be a multiple of num_workers ({w})")
    hier = g > 1 and n > 1 and g % n == 0
    if hier:
        if e % g:
            raise ValueError(f"hierarchical placement: the {e} logical experts do not split into num_groups={g} equal groups")
        if w % n:
            raise ValueError(f"hierarchical placement: num_workers ({w}) must be a multiple of num_nodes ({n})")
    if current is not None:
        current = np.asarray(current)
        if current.shape != (layers, p):
            raise ValueError(f"current has shape {current.shape}, expected {(layers, p)}")
        if not np.issubdtype(current.dtype, np.integer):
            raise ValueError(f"current must hold integer logical expert ids, got dtype {current.dtype}")
        current = current.astype(np.int64)
        if (current < 0).any() or (current >= e).any():
            raise ValueError(f"current holds logical expert ids outside 0..{e - 1}")
        missing = engine.counts_of(current, e) == 0
        if missing.any():
            l, x = map(int, np.argwhere(missing)[0])
            raise ValueError(f"current is not a valid placement: layer {l}: logical expert {x} has no replica")
    return load, p, w, g, n, hier, current


# ---- the plan --------------------------------------------------------------------------------

def _plan(load, num_slots, num_workers, num_groups, num_nodes, current, cfg: PolicyConfig) -> np.ndarray:
    load, p, w, g, n, hier, current = _check(load, num_slots, num_workers, num_groups, num_nodes, current)
    layers = load.shape[0]
    budget = None if (current is None or cfg.move_budget is None) else int(cfg.move_budget * layers * p)
    if hier and cfg.cross_node_replicas:
        return _plan_cross_node(load, p, w, g, n, current, cfg)
    if hier:
        return _plan_hierarchical(load, p, w, g, n, current, budget, cfg)
    if budget is None:
        fresh = _fresh(load, p, w, cfg)
        return fresh if current is None else engine.match(current, fresh, w, load.shape[1])
    return _budgeted(load, current, w, budget, cfg, layer_of_row=None)


def _fresh(load: np.ndarray, p: int, w: int, cfg: PolicyConfig, skip_below=None, ldm=True) -> np.ndarray:
    """A plan from scratch for rows ``load [B, e]`` on p slots and w workers: [B, p]."""
    cnt = engine.replica_counts(load, p, w)
    assign = engine.pack(load, cnt, w) if ldm else engine.pack_greedy(load, cnt, w)
    return engine.refine(load, assign, w, max_iter=cfg.max_iter, pairs=max(1, w // 4), retarget=False,
                         tol=_noise_tol(load, w, _FRESH_TOL), skip_below=skip_below).final


def _layer_floor(row_load: np.ndarray, n: int, wn: int) -> np.ndarray:
    """[L*N] for node rows: the least peak their layer can reach (its hottest node's mean worker
    load); a node whose peak is at or below it never sets the layer's balancedness."""
    mean = row_load.sum(1).reshape(-1, n) / wn
    return np.repeat(mean.max(1), n)


# Sampling noise. Loads are token counts, so a worker's load in one window is off from its
# expectation by about sqrt(load): a move whose predicted gain is smaller than a fraction of
# that is chasing noise, buys nothing on the next window and costs weights on the wire (and a
# fresh plan polished that far fits the window's noise, which the next window punishes). The
# search therefore ignores moves that lower a pair's peak by less than NOISE_K / sqrt(mean
# worker load) of the mean (loads given in other units than tokens only make this tighter or
# looser; a plan stays valid either way). A fresh plan's polish also stops below 0.2 %.
NOISE_K = 0.5
_FRESH_TOL = 0.002


def _noise_tol(load: np.ndarray, w: int, floor: float) -> np.ndarray:
    """Per-row least relative gain worth a move: ``[B]``."""
    mean = load.sum(1) / w
    return np.maximum(floor, NOISE_K / np.sqrt(np.maximum(mean, 1e-300)))


def _pairs_for(budget_per_row: float) -> int:
    # with a small budget per row the search moves one pair at a time (every slot counts);
    # with more to spend it relieves several heavy workers per iteration
    return int(np.clip(round(budget_per_row / 8), 1, 4))


def _budgeted(load, current, w, budget, cfg, layer_of_row, layer_mean=None, skip_below=None) -> np.ndarray:
    """Local search from ``current [B, p]`` within ``budget`` slots over all rows: [B, p].

    layer_of_row [B] (hierarchical rows) groups rows into layers: a row then counts only as
    far as it sets its layer's peak (``layer_mean [B]``: the mean worker load of its layer).
    """
    rows = load.shape[0]
    layers = rows if layer_of_row is None else int(layer_of_row.max()) + 1
    search = engine.refine(load, current, w, max_iter=cfg.max_iter, pairs=_pairs_for(budget / rows), retarget="auto",
                           tol=_noise_tol(load, w, 1e-9), skip_below=skip_below,
                           stop_cost=1.2 * budget)
    peak, cost = search.curves()                                            # [K+1, B]
    if layer_of_row is None:
        value = np.where(peak > 0, search.mean / np.where(peak > 0, peak, 1.0), 1.0)
    else:
        # a node below its layer's hottest node buys nothing by going lower still
        floor = np.zeros(layers)
        np.maximum.at(floor, layer_of_row, peak[-1])
        top = np.maximum(peak, floor[layer_of_row])
        value = np.where(top > 0, layer_mean / np.where(top > 0, top, 1.0), 1.0)
    steps = engine.select_prefix(value, cost, budget)
    return search.replay(steps)


# ---- hierarchical ----------------------------------------------------------------------------

def _node_of_group(load, current, p, g, n, keep: bool) -> np.ndarray:
    """Node of every expert group: [L, G], ``G / N`` groups per node.

    Groups are packed onto nodes by load (greedy, then swaps between the heaviest and lightest
    node). With a placement in force, ``keep`` keeps its grouping where it is a valid one
    (each group homed on the node with most of its replicas, G / N groups per node); elsewhere
    the packed nodes are renamed to match the placement in force as far as they can.
    """
    layers, e = load.shape
    gs, gpn = e // g, g // n
    group_load = load.reshape(layers, g, gs).sum(2)                         # [L, G]
    packed = engine.pack_greedy(group_load, np.ones((layers, g), dtype=np.int64), n)
    packed = engine.refine(group_load, packed, n, retarget=False).final     # [L, G] slot -> group
    node = np.empty((layers, g), dtype=np.int64)
    np.put_along_axis(node, packed, np.broadcast_to(np.arange(g) // gpn, (layers, g)), axis=1)
    if current is None:
        return node
    slot_node = np.arange(p) // (p // n)
    key = ((np.arange(layers)[:, None] * g + current // gs) * n + slot_node).ravel()
    votes = np.bincount(key, minlength=layers * g * n).reshape(layers, g, n)  # replicas per node
    home = votes.argmax(2)                                                  # [L, G]
    valid = (engine.counts_of(home, n) == gpn).all(1) if keep else np.zeros(layers, dtype=bool)
    if valid.all():
        return home
    # rename packed nodes: score[l, a, b] = replicas of a's groups already on node b
    score = np.zeros((layers, n, n))
    np.add.at(score, (np.arange(layers)[:, None], node), votes)
    rename = np.empty((layers, n), dtype=np.int64)
    r = np.arange(layers)
    for _ in range(n):
        k = score.reshape(layers, n * n).argmax(1)
        a, b = k // n, k % n
        rename[r, a] = b
        score[r, a, :] = -1.0
        score[r, :, b] = -1.0
    return np.where(valid[:, None], home, np.take_along_axis(rename, node, 1))


def _rows(load, node_of_group, g, n):
    """Split every layer into N node rows: local experts of row (l, node) are its groups' experts.

    Returns local2global [L, N, E/N] and global2local [L, E] (local id inside its node).
    """
    layers, e = load.shape
    gs, gpn = e // g, g // n
    order = np.argsort(node_of_group * g + np.arange(g), axis=1, kind="stable")  # groups by node
    local2global = (order.reshape(layers, n, gpn)[..., None] * gs + np.arange(gs)).reshape(layers, n, gpn * gs)
    global2local = np.empty((layers, e), dtype=np.int64)
    np.put_along_axis(global2local, local2global.reshape(layers, e),
                      np.broadcast_to(np.tile(np.arange(gpn * gs), n), (layers, e)), axis=1)
    return local2global, global2local


def _plan_hierarchical(load, p, w, g, n, current, budget, cfg) -> np.ndarray:
    layers, e = load.shape
    gs = e // g
    pn, wn, en = p // n, w // n, e // n
    node_of_group = _node_of_group(load, current, p, g, n, keep=budget is not None)
    l2g, g2l = _rows(load, node_of_group, g, n)
    row_load = np.take_along_axis(load, l2g.reshape(layers, e), 1).reshape(layers * n, en)
    floor = _layer_floor(row_load, n, wn) * (1 + 1e-9)
    if budget is None:
        out = _fresh(row_load, pn, wn, cfg, skip_below=floor, ldm=False)    # [L*N, P/N] local ids
        if current is not None:
            cur_rows, _ = _current_rows(current, node_of_group, g2l, gs, n, pn, en, row_load)
            out = engine.match(cur_rows, out, wn, en)
    else:
        cur_rows, repaired = _current_rows(current, node_of_group, g2l, gs, n, pn, en, row_load)
        layer_mean = np.repeat(load.sum(1) / w, n)
        out = _budgeted(row_load, cur_rows, wn, max(budget - repaired, 0), cfg,
                        layer_of_row=np.repeat(np.arange(layers), n), layer_mean=layer_mean, skip_below=floor)
    phy2log = np.take_along_axis(l2g.reshape(layers * n, en), out, 1)
    return phy2log.reshape(layers, p)


def _current_rows(current, node_of_group, g2l, gs, n, pn, en, row_load):
    """The placement in force as node rows of local ids [L*N, P/N], slots that hold another
    node's expert reassigned (missing experts first, then the heaviest per replica); also
    returns how many slots that repair changed."""
    layers, p = current.shape
    home = np.take_along_axis(node_of_group, current // gs, 1)              # [L, P]
    slot_node = np.arange(p) // pn
    local = np.take_along_axis(g2l, current, 1)
    local = np.where(home == slot_node, local, -1).reshape(layers * n, pn)
    valid = local >= 0
    held = np.bincount((local + (np.arange(layers * n) * en)[:, None])[valid], minlength=layers * n * en)
    bad_rows = np.flatnonzero(~valid.all(1) | (held.reshape(layers * n, en) == 0).any(1))
    repaired = 0
    for r in bad_rows:                                                      # rare: a grouping change
        row = local[r]
        cnt = np.bincount(row[row >= 0], minlength=en)
        free = list(np.flatnonzero(row < 0))
        for x in np.flatnonzero(cnt == 0):
            if not free:                                                    # take a spare replica
                spare = np.flatnonzero((row >= 0) & (cnt[np.maximum(row, 0)] >= 2))
                k = spare[np.argmin(row_load[r, row[spare]] / cnt[row[spare]])]
                cnt[row[k]] -= 1
                free.append(k)
            k = free.pop(0)
            row[k] = x
            cnt[x] += 1
            repaired += 1
        for k in free:
            x = int(np.argmax(row_load[r] / np.maximum(cnt, 1)))
            row[k] = x
            cnt[x] += 1
            repaired += 1
    return local, repaired


# ---- hierarchical, redundant replicas may leave their node -------------------------------------

def _plan_cross_node(load, p, w, g, n, current, cfg) -> np.ndarray:
    """Every expert keeps one replica on its group's node; the other replicas go to whichever
    node is lightest (the home node on ties), then each node is packed on its own. The plan is
    made afresh and relabelled node by node to the placement in force (no move budget)."""
    layers, e = load.shape
    gs = e // g
    pn, wn, en = p // n, w // n, e // n
    node_of_group = _node_of_group(load, current, p, g, n, keep=True)
    home = np.repeat(node_of_group, gs, axis=1)                             # [L, E]
    cnt = engine.replica_counts(load, p)                                    # [L, E] global counts
    per = load / cnt
    r = np.arange(layers)[:, None]
    # node_cnt[l, node, e]: replicas of e on that node; first replicas at home
    node_cnt = np.zeros((layers, n, e), dtype=np.int64)
    node_cnt[r, home, np.arange(e)] = 1
    node_load = np.zeros((layers, n))
    np.add.at(node_load, (np.repeat(np.arange(layers), e), home.ravel()), per.ravel())
    free = np.full((layers, n), pn - en)
    extra = engine.expand_counts(cnt - 1) if p > e else np.zeros((layers, 0), dtype=np.int64)
    order = np.argsort(-np.take_along_axis(per, extra, 1), axis=1, kind="stable")
    extra = np.take_along_axis(extra, order, 1)                             # heaviest first
    rr = np.arange(layers)
    for k in range(extra.shape[1]):
        x = extra[:, k]
        px = per[rr, x]
        # lightest node with room, ties (within a hair) to the expert's home node
        score = np.where(free > 0, node_load, np.inf)
        score[rr, home[rr, x]] -= 1e-9 * np.maximum(px, 1e-300)
        dst = score.argmin(1)
        node_cnt[rr, dst, x] += 1
        node_load[rr, dst] += px
        free[rr, dst] -= 1
    # pack each node: rows (l, node) over all E experts, the load of e there = per[e] * copies
    rows_load = (per[:, None, :] * node_cnt).reshape(layers * n, e)
    rows_cnt = node_cnt.reshape(layers * n, e)
    assign = engine.pack_greedy(rows_load, rows_cnt, wn)                   # slot load = per[e]
    assign = engine.refine(rows_load, assign, wn, max_iter=cfg.max_iter, retarget=False).final
    if current is not None:
        cur_rows = current.reshape(layers * n, pn)
        assign = engine.match(cur_rows, assign, wn, e)
    return assign.reshape(layers, p)


def cross_node_share(load, phy2log, num_groups: int, num_nodes: int) -> float:
    """Share of routed tokens served on a node other than their expert group's node.

    load [L, E], phy2log [L, P]. A group's node is the one holding most of its replicas; an
    expert's tokens split evenly over its replicas (the data plane's replica choice).
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, e = load.shape
    p = phy2log.shape[1]
    gs, pn = e // num_groups, p // num_nodes
    slot_node = np.arange(p) // pn
    key = ((np.arange(layers)[:, None] * num_groups + phy2log // gs) * num_nodes + slot_node).ravel()
    votes = np.bincount(key, minlength=layers * num_groups * num_nodes).reshape(layers, num_groups, num_nodes)
    home = votes.argmax(2)                                                  # [L, G]
    cnt = engine.counts_of(phy2log, e)
    per = np.take_along_axis(load / np.maximum(cnt, 1), phy2log, 1)         # [L, P]
    away = slot_node != np.take_along_axis(home, phy2log // gs, 1)
    total = load.sum()
    return float(per[away].sum() / total) if total > 0 else 0.0


# ---- what a plan buys ------------------------------------------------------------------------

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
    s = p // num_workers
    before = _balancedness(load, cur, num_workers)
    after = _balancedness(load, new, num_workers)
    busy = load.sum(1) > 0
    changed = cur != new
    # is the new expert already held (in the old placement) by the slot's worker?
    worker = np.arange(p) // s
    held = np.zeros((layers, num_workers, e), dtype=bool)
    held[np.arange(layers)[:, None], worker, cur] = True
    local = held[np.arange(layers)[:, None], worker, new]
    across = int((changed & ~local).sum())
    return PlanReport(before, after,
                      float(before[busy].mean()) if busy.any() else 1.0,
                      float(after[busy].mean()) if busy.any() else 1.0,
                      int(changed.sum()), across, across * int(expert_bytes))
