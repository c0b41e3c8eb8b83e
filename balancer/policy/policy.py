"""The project's placement policy: migration-aware, budgeted, vectorised across layers (numpy only).

Dimension letters: L MoE layers, E logical experts, P slots per layer, W workers, G expert
groups, N nodes, B rows of the search (a layer, or a (layer, node) pair in the hierarchical case).

``place(load, num_slots, num_workers, num_groups, num_nodes, current) -> phy2log`` is the
interface every policy shares (the balancer and ``benchmarks/policy.py`` call it so);
:func:`make_policy` builds one with other settings; :func:`rebalance_experts` is the
DeepSeek-compatible drop-in (:mod:`moeserve.balancer.policy.reference`); :func:`~moeserve.balancer.policy.report.evaluate` says
what a proposed placement buys.

How a call decides (the primitives: :mod:`~moeserve.balancer.policy.packing` for fresh plans,
:mod:`~moeserve.balancer.policy.search` for the local search, :mod:`~moeserve.balancer.policy.relabel`):

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

from dataclasses import dataclass, replace

import numpy as np

from moeserve.balancer.policy.cost import StepModel
from moeserve.balancer.policy.packing import (
    expand_counts,
    pack,
    pack_greedy,
    replica_counts,
    slot_load,
    worker_load_rows,
)
from moeserve.balancer.policy.reads import read_search
from moeserve.balancer.policy.relabel import greedy_match, relabel
from moeserve.balancer.policy.rule import NEVER_SPREAD, b_candidates, plan_breakeven, rule_times
from moeserve.balancer.policy.search import SearchSettings, follow_counts, refine, select_prefix
from moeserve.placement import logical_counts

__all__ = ["place", "make_policy", "PolicyConfig", "cross_node_share", "NOISE_K"]


@dataclass(frozen=True)
class PolicyConfig:
    """Settings of a policy built by :func:`make_policy`.

    move_budget: fraction of all slots (``L * P``) one call may change while a placement is in
      force, in [0, 1]; None = unlimited (a fresh plan relabelled to the placement in force).
    cross_node_replicas: hierarchical case only; let hot experts' redundant replicas leave their
      group's node (their first replica stays). Off by default. Such plans are made afresh
      every call and relabelled to the placement in force; the move budget does not apply.
    max_iter: iterations of the local search per call.
    follow_counts: with a move budget, also let each layer walk its replica counts toward a
      fresh plan's (then search on from there) where that buys more balancedness per slot
      moved; off: replica counts change only where one replica outweighs most of a worker
      (the policy as it was before replica counts followed the traffic).
    step_model: a :class:`~moeserve.balancer.policy.cost.StepModel`: with it, a call given the
      window's ``steps`` (or a per-step ``histogram``) and a move budget picks, per layer, among
      the plans the token-balanced search offers and those of a search on the data plane's
      replica rule (:mod:`~moeserve.balancer.policy.reads`: which experts fill the redundant
      slots so that each step's one replica read splits evenly over the workers) the one with
      the least predicted layer time (weights read by busy slots against matmul time, under the
      rule with the break-even counts :func:`~moeserve.balancer.policy.rule.plan_breakeven`
      gives that plan, see :mod:`~moeserve.balancer.policy.rule`), spending the budget where it
      saves the most time per slot moved, and never a plan predicted slower than the placement
      in force. The caller installs the plan with ``plan_breakeven(step_model, load, plan,
      num_workers, steps, histogram)``, the b it was priced with. Without ``steps``, or without
      a placement in force, it plans for token balance as without a model.
    """

    move_budget: float | None = 0.10
    cross_node_replicas: bool = False
    max_iter: int = 24
    follow_counts: bool = True
    step_model: StepModel | None = None

    def __post_init__(self):
        if self.move_budget is not None and not (0.0 <= self.move_budget <= 1.0):
            raise ValueError(f"move_budget must be a fraction in [0, 1] or None (unlimited), got {self.move_budget!r}")
        if not isinstance(self.max_iter, int) or self.max_iter < 0:
            raise ValueError(f"max_iter must be a non-negative integer, got {self.max_iter!r}")
        if self.step_model is not None and not isinstance(self.step_model, StepModel):
            raise ValueError(f"step_model must be a StepModel (see cost.load_table) or None, got {self.step_model!r}")


def make_policy(
    move_budget: float | None = 0.10,
    *,
    cross_node_replicas: bool = False,
    max_iter: int = 24,
    follow_counts: bool = True,
    step_model: StepModel | None = None,
):
    """A policy with the yardstick's signature and these settings (see :class:`PolicyConfig`).

    The function returned has a ``config`` attribute, and takes two optional keywords beyond the
    yardstick's: ``steps``, the forward steps the window's ``load`` was summed over, and
    ``histogram [L, E, K]``, steps per power-of-two bin of each expert's per-step count (see
    :mod:`~moeserve.balancer.policy.cost`); with ``step_model`` set they make it cost-aware.
    """
    cfg = PolicyConfig(move_budget, cross_node_replicas, max_iter, follow_counts, step_model)

    def policy(load, num_slots, num_workers, num_groups=1, num_nodes=1, current=None, *, steps=None, histogram=None):
        return _plan(load, num_slots, num_workers, num_groups, num_nodes, current, cfg, steps, histogram)

    policy.config = cfg  # type: ignore[attr-defined]  # a function attribute, which mypy cannot declare
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


@dataclass(frozen=True)
class _Shape:
    """The sizes of one call: L layers, E logical experts, P slots, W workers, G groups, N nodes."""

    layers: int
    experts: int
    slots: int
    workers: int
    groups: int
    nodes: int

    @property
    def hierarchical(self) -> bool:
        return self.groups > 1 and self.nodes > 1 and self.groups % self.nodes == 0

    @property
    def group_size(self) -> int:
        return self.experts // self.groups

    @property
    def groups_per_node(self) -> int:
        return self.groups // self.nodes

    @property
    def experts_per_node(self) -> int:
        return self.experts // self.nodes

    @property
    def slots_per_node(self) -> int:
        return self.slots // self.nodes

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.nodes


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _check(load, num_slots, num_workers, num_groups, num_nodes, current):
    """Validate the arguments; returns ``load [L, E]`` float64, the :class:`_Shape` and
    ``current [L, P]`` int64 (or None)."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] == 0:
        raise ValueError(f"load must be 2-D [layers, logical experts] with at least one expert, got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    layers, experts = load.shape
    shape = _Shape(
        layers,
        experts,
        _positive_int("num_slots", num_slots),
        _positive_int("num_workers", num_workers),
        _positive_int("num_groups", num_groups),
        _positive_int("num_nodes", num_nodes),
    )
    layers, e, p, w, g, n = shape.layers, shape.experts, shape.slots, shape.workers, shape.groups, shape.nodes
    if p < e:
        raise ValueError(f"num_slots ({p}) must be at least the number of logical experts ({e})")
    if p % w:
        raise ValueError(f"num_slots ({p}) must be a multiple of num_workers ({w})")
    if shape.hierarchical:
        if e % g:
            raise ValueError(
                f"hierarchical placement: the {e} logical experts do not split into num_groups={g} equal groups"
            )
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
        missing = logical_counts(current, e) == 0
        if missing.any():
            layer, expert = map(int, np.argwhere(missing)[0])
            raise ValueError(f"current is not a valid placement: layer {layer}: logical expert {expert} has no replica")
    return load, shape, current


# ---- the plan --------------------------------------------------------------------------------


def _plan(
    load, num_slots, num_workers, num_groups, num_nodes, current, cfg: PolicyConfig, steps=None, histogram=None
) -> np.ndarray:
    """:func:`place` with the settings ``cfg``: phy2log [L, P]."""
    load, shape, current = _check(load, num_slots, num_workers, num_groups, num_nodes, current)
    budget = None if (current is None or cfg.move_budget is None) else int(cfg.move_budget * shape.layers * shape.slots)
    cost = _cost_context(cfg, steps, histogram, load)
    if shape.hierarchical and cfg.cross_node_replicas:
        return _plan_cross_node(load, shape, current, cfg)
    if shape.hierarchical:
        return _plan_hierarchical(load, shape, current, budget, cfg, cost)
    if budget is None:
        fresh = _fresh(load, shape.slots, shape.workers, cfg)
        return fresh if current is None else relabel(current, fresh, shape.workers, shape.experts)
    return _budgeted(load, current, shape.workers, budget, cfg, layer_of_row=None, cost=cost)


@dataclass(frozen=True)
class _Cost:
    """What the cost-aware choice needs: the model, the window's steps, the histogram
    ``[B, e, K]`` of the rows planned (or None) and the ids ``[B, e]`` the data plane's replica
    rule staggers by (None: a row's ids are the layer's, 0 .. E - 1)."""

    model: StepModel
    steps: int
    histogram: np.ndarray | None
    expert_ids: np.ndarray | None = None

    def rows(self, local2global: np.ndarray, rows: int) -> _Cost:
        """The same for node rows (``local2global [L, N, E/N]``)."""
        layers = local2global.shape[0]
        ids = local2global.reshape(rows, -1)
        if self.histogram is None:
            return _Cost(self.model, self.steps, None, ids)
        k = self.histogram.shape[2]
        hist = np.take_along_axis(self.histogram, local2global.reshape(layers, -1)[:, :, None], 1)
        return _Cost(self.model, self.steps, hist.reshape(rows, -1, k), ids)

    def times(self, load: np.ndarray, phy2log: np.ndarray, w: int, candidates: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of every row ``[B]`` of ``phy2log [B, p]`` (``load [B, e]``) under the
        data plane's replica rule with the break-even counts
        :func:`~moeserve.balancer.policy.rule.plan_breakeven` gives that placement (those a caller
        installs with it; ``candidates``: the counts it tries, by default from this load)."""
        ids, hist = self.expert_ids, self.histogram
        b = plan_breakeven(self.model, load, phy2log, w, self.steps, hist, ids, candidates=candidates)
        return rule_times(self.model, load, phy2log, w, b, self.steps, hist, ids)

    def subset(self, rows: np.ndarray) -> _Cost:
        """The same for the rows ``rows`` only."""
        return _Cost(
            self.model,
            self.steps,
            None if self.histogram is None else self.histogram[rows],
            None if self.expert_ids is None else self.expert_ids[rows],
        )


def _cost_context(cfg: PolicyConfig, steps, histogram, load) -> _Cost | None:
    """The cost-aware settings of a call, or None (token balance): a model and the steps."""
    if cfg.step_model is None or steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer (forward steps summed in load), got {steps!r}")
    if histogram is not None:
        histogram = np.asarray(histogram, dtype=np.float64)
        if histogram.ndim != 3 or histogram.shape[:2] != load.shape or histogram.shape[2] < 1:
            raise ValueError(
                f"histogram must be [layers, experts, bins] with [layers, experts] = {load.shape}, "
                f"got shape {histogram.shape}"
            )
        if not np.isfinite(histogram).all() or (histogram < 0).any():
            raise ValueError("histogram must be finite and non-negative")
    return _Cost(cfg.step_model, int(steps), histogram)


def _fresh(load: np.ndarray, p: int, w: int, cfg: PolicyConfig, skip_below=None, ldm=True) -> np.ndarray:
    """A plan from scratch for rows ``load [B, e]`` on p slots and w workers: phy2log [B, p]."""
    logcnt = replica_counts(load, p, w)
    phy2log = pack(load, logcnt, w) if ldm else pack_greedy(load, logcnt, w)
    settings = SearchSettings(max_iter=cfg.max_iter, pairs=max(1, w // 4))
    return refine(load, phy2log, w, settings, tol=_noise_tol(load, w, _FRESH_TOL), skip_below=skip_below).final


def _layer_floor(row_load: np.ndarray, n: int, workers_per_node: int) -> np.ndarray:
    """[L*N] for node rows: the least peak their layer can reach (its hottest node's mean worker
    load); a node whose peak is at or below it never sets the layer's balancedness."""
    mean = row_load.sum(1).reshape(-1, n) / workers_per_node
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


def _budgeted(load, current, w, budget, cfg, layer_of_row, layer_mean=None, skip_below=None, cost=None) -> np.ndarray:
    """Local search from ``current [B, p]`` within ``budget`` slots over all rows: phy2log [B, p].

    layer_of_row [B] (hierarchical rows) groups rows into layers: a row then counts only as
    far as it sets its layer's peak (``layer_mean [B]``: the mean worker load of its layer).

    With ``cfg.follow_counts`` every row has a second way to go: its replica counts walk toward
    those of a fresh plan for this window (:func:`~moeserve.balancer.policy.search.follow_counts`),
    then the local search goes on from there. Each row takes the prefix of either way that the
    budget buys the most balancedness per slot moved with (doing nothing is always an option).

    With ``cost`` (a :class:`_Cost`) the rows then choose among a few plans of those paths
    (the token-balanced choices at a quarter, half and all of the budget, and each path's end)
    and every step of the searches on the replica rule (:func:`_read_paths`) the one that saves
    the most predicted layer time per slot moved, within the budget; a row whose plans all
    predict no saving keeps the placement in force.
    """
    rows, p = current.shape
    settings = SearchSettings(
        max_iter=cfg.max_iter, pairs=_pairs_for(budget / rows), replicate=True, stop_cost=1.2 * budget
    )
    tol = _noise_tol(load, w, 1e-9)
    search = refine(load, current, w, settings, tol=tol, skip_below=skip_below)
    paths = [_Path(search, *search.curves())]
    if cfg.follow_counts and budget > 0:
        paths += _follow_paths(load, current, w, budget, settings, tol, skip_below)
    value = _value(np.concatenate([path.peak for path in paths]), search.mean, layer_of_row, layer_mean)
    cost_ = np.concatenate([path.cost for path in paths])
    if cost is None:
        return _replay(paths, select_prefix(value, cost_, budget))
    options = [current] + [_replay(paths, select_prefix(value, cost_, f * budget)) for f in (0.25, 0.5, 1.0)]
    end = 0
    for path in paths:
        end += path.peak.shape[0]
        options.append(_replay(paths, np.full(rows, end - 1)))
    if budget > 0:
        options += _read_paths(load, current, w, budget, cost)
    return _cheapest(load, current, options, w, budget, cost)


def _read_paths(load, current, w: int, budget: int, cost: _Cost) -> list[np.ndarray]:
    """Plans for the data plane's replica rule (:func:`~moeserve.balancer.policy.reads.read_search`),
    every step of two searches from the placement in force: one pricing each expert with the
    break-even count planned for that placement, one with a b no count passes (every expert
    read on one replica a step, the decode case). Two, because the b that fits a placement
    depends on it: a layer whose doubled experts all spread at the b of the placement in force
    would not see that balancing the one-replica reads pays once b stops them spreading.
    ``[B, p]`` each, step 0 left out."""
    rows, p = current.shape
    e = load.shape[1]
    length = int(min(p - e, max(4, np.ceil(2.0 * budget / rows))))  # moves per row, as follow_counts
    planned = plan_breakeven(cost.model, load, current, w, cost.steps, cost.histogram, cost.expert_ids)
    out = []
    for b in (planned, np.full_like(planned, NEVER_SPREAD)):
        out += read_search(cost.model, load, current, w, b, cost.steps, cost.histogram, cost.expert_ids, length)[1:]
    return out


def _cheapest(load, current, options: list[np.ndarray], w: int, budget: int, cost: _Cost) -> np.ndarray:
    """Per row, the option (``options[0]`` the placement in force) saving the most predicted layer
    time per slot moved, within ``budget`` slots over all rows. Each option is priced under the
    data plane's replica rule with the break-even counts planned for it (:meth:`_Cost.times`)."""
    stack = np.stack(options)  # [K, B, p]
    k, rows, p = stack.shape
    moved = (stack != current[None]).sum(2)  # [K, B]
    # b is planned row by row (from one list of candidate counts), so a row an option leaves
    # as it is keeps the time of the placement in force: only the rows it changes are priced
    cand = b_candidates(cost.model, load, cost.steps, cost.histogram)
    times = np.repeat(cost.times(load, current, w, cand)[None], k, 0)  # [K, B]
    for i in range(1, k):
        ch = np.flatnonzero(moved[i])
        if ch.size:
            times[i, ch] = cost.subset(ch).times(load[ch], stack[i, ch], w, cand)
    # a plan predicted no faster than the placement in force counts as worse than it: never taken
    value = np.where(times < times[:1], -times, -times[:1] - 1.0)
    value[0] = -times[0]
    pick = select_prefix(value, moved, budget)
    return stack[pick, np.arange(rows)]


class _Path:
    """One way a row may go: its :class:`~moeserve.balancer.policy.search.Search` (which may
    start where another path ends), the row's peak and cumulative cost (from the placement in
    force) after each step, ``[T, B]`` each (the first path also has step 0: no move)."""

    def __init__(self, search, peak, cost):
        self.search, self.peak, self.cost = search, peak, cost


_THEN_ITER = 12  # the search after the counts moved: a shorter one (its moves come on top)


def _follow_paths(load, current, w, budget, settings, tol, skip_below) -> list[_Path]:
    """Replica counts toward a fresh plan's (``replica_counts``), then the local search from
    there: the two paths after the plain local search (their step 0 left out, it repeats it)."""
    rows, p = current.shape
    e = load.shape[1]
    target = replica_counts(load, p, w)
    searched = None
    if skip_below is not None:
        searched = worker_load_rows(slot_load(load, current, logical_counts(current, e)), w).max(1) > np.maximum(
            skip_below, 0
        )
    steps = int(min(p - e, max(4, np.ceil(2.0 * budget / rows))))
    follow = follow_counts(load, current, w, target, steps, rows=searched)
    f_peak, f_cost = follow.curves()
    moved = f_cost[-1] > 0
    if not moved.any():
        return []
    out = [_Path(follow, f_peak[1:], f_cost[1:])]
    skip = np.where(moved, -np.inf if skip_below is None else skip_below, np.inf)  # only the rows that moved
    then = refine(
        load, follow.final, w, replace(settings, max_iter=min(settings.max_iter, _THEN_ITER)), tol=tol, skip_below=skip
    )
    t_peak, t_cost = then.curves()
    out.append(_Path(then, t_peak[1:], t_cost[1:] + f_cost[-1]))
    return out


def _value(peak, mean, layer_of_row, layer_mean) -> np.ndarray:
    """Balancedness of every row after every step, ``[T+1, B]`` (hierarchical rows: their layer's,
    as far as they set it)."""
    if layer_of_row is None:
        return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    # a node below its layer's hottest node buys nothing by going lower still
    floor = np.zeros(int(layer_of_row.max()) + 1)
    np.maximum.at(floor, layer_of_row, peak.min(0))  # the least peak each row reaches
    top = np.maximum(peak, floor[layer_of_row])
    return np.where(top > 0, layer_mean / np.where(top > 0, top, 1.0), 1.0)


def _replay(paths: list[_Path], choice: np.ndarray) -> np.ndarray:
    """The placement after step ``choice[b]`` of the paths laid end to end: ``[B, p]``. The first
    path covers steps 0 .. T of its search, every later one steps 1 .. T of its own."""
    first = paths[0]
    end = first.peak.shape[0]
    out = first.search.replay(np.where(choice < end, choice, 0))
    for path in paths[1:]:
        mine = (choice >= end) & (choice < end + path.peak.shape[0])
        if mine.any():
            out[mine] = path.search.replay(np.where(mine, choice - end + 1, 0))[mine]
        end += path.peak.shape[0]
    return out


# ---- hierarchical ----------------------------------------------------------------------------


def _replicas_per_node(phy2log: np.ndarray, shape: _Shape) -> np.ndarray:
    """``phy2log [L, P]`` -> replicas of each expert group on each node: ``[L, G, N]``."""
    g, n = shape.groups, shape.nodes
    slot_node = np.arange(shape.slots) // shape.slots_per_node
    key = ((np.arange(shape.layers)[:, None] * g + phy2log // shape.group_size) * n + slot_node).ravel()
    return np.bincount(key, minlength=shape.layers * g * n).reshape(shape.layers, g, n)


def _node_of_group(load, current, shape: _Shape, keep: bool) -> np.ndarray:
    """Node of every expert group: [L, G], ``G / N`` groups per node.

    Groups are packed onto nodes by load (greedy, then swaps between the heaviest and lightest
    node). With a placement in force, ``keep`` keeps its grouping where it is a valid one
    (each group homed on the node with most of its replicas, G / N groups per node); elsewhere
    the packed nodes are renamed to match the placement in force as far as they can.
    """
    layers, g, n = shape.layers, shape.groups, shape.nodes
    group_load = load.reshape(layers, g, shape.group_size).sum(2)  # [L, G]
    packed = pack_greedy(group_load, np.ones((layers, g), dtype=np.int64), n)
    packed = refine(group_load, packed, n).final  # [L, G] slot -> group
    node = np.empty((layers, g), dtype=np.int64)
    np.put_along_axis(node, packed, np.broadcast_to(np.arange(g) // shape.groups_per_node, (layers, g)), axis=1)
    if current is None:
        return node
    votes = _replicas_per_node(current, shape)  # [L, G, N]
    home = votes.argmax(2)  # [L, G]
    groups_on_node = logical_counts(home, n)  # [L, N]
    valid = (groups_on_node == shape.groups_per_node).all(1) if keep else np.zeros(layers, dtype=bool)
    if valid.all():
        return home
    # score[l, a, b]: replicas of packed node a's groups already on node b
    score = np.zeros((layers, n, n))
    np.add.at(score, (np.arange(layers)[:, None], node), votes)
    rename = greedy_match(score)  # [L, N] packed -> current
    return np.where(valid[:, None], home, np.take_along_axis(rename, node, 1))


def _node_rows(node_of_group, shape: _Shape):
    """Split every layer into N node rows: local experts of row (l, node) are its groups' experts.

    Returns local2global [L, N, E/N] and global2local [L, E] (local id inside its node).
    """
    layers, e, g, n = shape.layers, shape.experts, shape.groups, shape.nodes
    size, per_node = shape.group_size, shape.groups_per_node
    order = np.argsort(node_of_group * g + np.arange(g), axis=1, kind="stable")  # groups by node
    local2global = order.reshape(layers, n, per_node)[..., None] * size + np.arange(size)
    local2global = local2global.reshape(layers, n, per_node * size)
    global2local = np.empty((layers, e), dtype=np.int64)
    np.put_along_axis(
        global2local,
        local2global.reshape(layers, e),
        np.broadcast_to(np.tile(np.arange(per_node * size), n), (layers, e)),
        axis=1,
    )
    return local2global, global2local


def _plan_hierarchical(load, shape: _Shape, current, budget, cfg, cost=None) -> np.ndarray:
    """Groups pinned to nodes, each node a sub-problem (rows of local ids): phy2log [L, P]."""
    layers, n = shape.layers, shape.nodes
    local_experts, local_workers = shape.experts_per_node, shape.workers_per_node
    node_of_group = _node_of_group(load, current, shape, keep=budget is not None)
    local2global, global2local = _node_rows(node_of_group, shape)
    row_load = np.take_along_axis(load, local2global.reshape(layers, -1), 1).reshape(layers * n, local_experts)
    floor = _layer_floor(row_load, n, local_workers) * (1 + 1e-9)
    if budget is None:
        out = _fresh(row_load, shape.slots_per_node, local_workers, cfg, skip_below=floor, ldm=False)  # [L*N, P/N]
        if current is not None:
            current_rows, _ = _current_rows(current, node_of_group, global2local, shape, row_load)
            out = relabel(current_rows, out, local_workers, local_experts)
    else:
        current_rows, repaired = _current_rows(current, node_of_group, global2local, shape, row_load)
        layer_mean = np.repeat(load.sum(1) / shape.workers, n)
        out = _budgeted(
            row_load,
            current_rows,
            local_workers,
            max(budget - repaired, 0),
            cfg,
            layer_of_row=np.repeat(np.arange(layers), n),
            layer_mean=layer_mean,
            skip_below=floor,
            cost=None if cost is None else cost.rows(local2global, layers * n),
        )
    phy2log = np.take_along_axis(local2global.reshape(layers * n, local_experts), out, 1)
    return phy2log.reshape(layers, shape.slots)


def _current_rows(current, node_of_group, global2local, shape: _Shape, row_load):
    """The placement in force as node rows of local ids [L*N, P/N], slots that hold another
    node's expert reassigned (missing experts first, then the heaviest per replica); also
    returns how many slots that repair changed."""
    layers, n = shape.layers, shape.nodes
    slots_per_node, local_experts = shape.slots_per_node, shape.experts_per_node
    home = np.take_along_axis(node_of_group, current // shape.group_size, 1)  # [L, P]
    slot_node = np.arange(shape.slots) // slots_per_node
    local = np.take_along_axis(global2local, current, 1)
    local = np.where(home == slot_node, local, -1).reshape(layers * n, slots_per_node)
    valid = local >= 0
    flat = local + (np.arange(layers * n) * local_experts)[:, None]
    held = np.bincount(flat[valid], minlength=layers * n * local_experts)
    bad_rows = np.flatnonzero(~valid.all(1) | (held.reshape(layers * n, local_experts) == 0).any(1))
    repaired = 0
    for r in bad_rows:  # rare: a grouping change
        repaired += _repair_row(local[r], row_load[r])
    return local, repaired


def _repair_row(row: np.ndarray, row_load: np.ndarray) -> int:
    """Fill the free slots (-1) of one node row ``[P/N]`` in place: first every expert without a
    replica (taking a spare replica of the lightest per replica when no slot is free), then the
    heaviest per replica. Returns the slots changed."""
    logcnt = np.bincount(row[row >= 0], minlength=row_load.size)
    free = list(np.flatnonzero(row < 0))
    changed = 0
    for expert in np.flatnonzero(logcnt == 0):
        if not free:  # take a spare replica
            spare = np.flatnonzero((row >= 0) & (logcnt[np.maximum(row, 0)] >= 2))
            k = spare[np.argmin(row_load[row[spare]] / logcnt[row[spare]])]
            logcnt[row[k]] -= 1
            free.append(k)
        k = free.pop(0)
        row[k] = expert
        logcnt[expert] += 1
        changed += 1
    for k in free:
        heaviest = int(np.argmax(row_load / np.maximum(logcnt, 1)))
        row[k] = heaviest
        logcnt[heaviest] += 1
        changed += 1
    return changed


# ---- hierarchical, redundant replicas may leave their node -------------------------------------


def _plan_cross_node(load, shape: _Shape, current, cfg) -> np.ndarray:
    """Every expert keeps one replica on its group's node; the other replicas go to whichever
    node is lightest (the home node on ties), then each node is packed on its own. The plan is
    made afresh and relabelled node by node to the placement in force (no move budget)."""
    layers, e, p, n = shape.layers, shape.experts, shape.slots, shape.nodes
    node_of_group = _node_of_group(load, current, shape, keep=True)
    home = np.repeat(node_of_group, shape.group_size, axis=1)  # [L, E]
    logcnt = replica_counts(load, p)  # [L, E] over all nodes
    per_replica = load / logcnt
    node_logcnt = _spread_replicas(per_replica, logcnt, home, shape)  # [L, N, E]
    # pack each node: rows (l, node) over all E experts, the load of e there = per_replica[e] * copies
    rows_load = (per_replica[:, None, :] * node_logcnt).reshape(layers * n, e)
    rows_logcnt = node_logcnt.reshape(layers * n, e)
    phy2log = pack_greedy(rows_load, rows_logcnt, shape.workers_per_node)  # slot load = per_replica[e]
    phy2log = refine(rows_load, phy2log, shape.workers_per_node, SearchSettings(max_iter=cfg.max_iter)).final
    if current is not None:
        phy2log = relabel(current.reshape(layers * n, shape.slots_per_node), phy2log, shape.workers_per_node, e)
    return phy2log.reshape(layers, p)


def _spread_replicas(per_replica, logcnt, home, shape: _Shape) -> np.ndarray:
    """Replicas of every expert on every node, ``[L, N, E]``: the first at home (``home [L, E]``),
    the redundant ones, heaviest first, on the lightest node with room (home on ties within a hair).

    per_replica [L, E]: an expert's load per replica; logcnt [L, E]: its replicas over all nodes.
    """
    layers, e, n = shape.layers, shape.experts, shape.nodes
    r = np.arange(layers)
    node_logcnt = np.zeros((layers, n, e), dtype=np.int64)
    node_logcnt[r[:, None], home, np.arange(e)] = 1
    node_load = np.zeros((layers, n))
    np.add.at(node_load, (np.repeat(r, e), home.ravel()), per_replica.ravel())
    free = np.full((layers, n), shape.slots_per_node - shape.experts_per_node)
    extra = expand_counts(logcnt - 1) if shape.slots > e else np.zeros((layers, 0), dtype=np.int64)
    order = np.argsort(-np.take_along_axis(per_replica, extra, 1), axis=1, kind="stable")
    extra = np.take_along_axis(extra, order, 1)  # heaviest first
    for k in range(extra.shape[1]):
        expert = extra[:, k]
        replica_load = per_replica[r, expert]
        score = np.where(free > 0, node_load, np.inf)
        score[r, home[r, expert]] -= 1e-9 * np.maximum(replica_load, 1e-300)
        dst = score.argmin(1)
        node_logcnt[r, dst, expert] += 1
        node_load[r, dst] += replica_load
        free[r, dst] -= 1
    return node_logcnt


def cross_node_share(load, phy2log, num_groups: int, num_nodes: int) -> float:
    """Share of routed tokens served on a node other than their expert group's node.

    load [L, E], phy2log [L, P]. A group's node is the one holding most of its replicas; an
    expert's tokens split evenly over its replicas (the data plane's replica choice).
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, e = load.shape
    shape = _Shape(layers, e, phy2log.shape[1], 1, num_groups, num_nodes)
    home = _replicas_per_node(phy2log, shape).argmax(2)  # [L, G]
    logcnt = logical_counts(phy2log, e)
    per_slot = np.take_along_axis(load / np.maximum(logcnt, 1), phy2log, 1)  # [L, P]
    slot_node = np.arange(shape.slots) // shape.slots_per_node
    away = slot_node != np.take_along_axis(home, phy2log // shape.group_size, 1)
    total = load.sum()
    return float(per_slot[away].sum() / total) if total > 0 else 0.0
