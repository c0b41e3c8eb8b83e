"""The step loop every rank runs, and what a rank holds (docs/dataplane.md, "One step, on every rank").

On every rank one step-driver thread (the main thread) owns every torch.distributed call, in
one fixed order: the leader's header broadcast on the gloo control group -> this rank's
migration work (staging, commits, weight moves) -> the forward pass (every MoE layer's
exchange) -> the end-of-step gather of results to the leader.

This module only drives: it knows a rank's roles by the interfaces of
``moeserve.dataplane.roles`` (a router runner and its maps, a worker store, the leader's
engine), never which classes implement them, so the data plane imports neither the router, the
worker, the engine nor any gRPC code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeserve.dataplane.exchange import Exchange, Topology, idle_walk
from moeserve.dataplane.header_wire import HeaderWire
from moeserve.dataplane.protocol import RankResult, StepHeader
from moeserve.dataplane.roles import LeaderRole, RouterMapsRole, RouterRole, RunMoves, WorkerRole
from moeserve.ops import profiling

log = logging.getLogger(__name__)

SLOW_STEP_S = 0.5  # a rank's part of one step that takes longer is logged (with what it did)


@dataclass
class RankState:
    """What one rank holds: its roles' objects (None for a role it does not have; the
    interfaces are ``moeserve.dataplane.roles``).

    runner:    router role (``RouterRole``): runs its sequences' share of each step.
    maps:      router role (``RouterMapsRole``): the placement in force.
    store:     worker role (``WorkerRole``): the expert slots and the compute the exchange calls.
    run_moves: worker role: runs one step's weight moves (``moeserve.expert_worker.migration``).
    leader:    rank 0 (``LeaderRole``): the header of every step, the results of every rank.
    recover:   called with the exception when a step's torch.distributed call fails; True when
               the groups were re-formed (a lost rank was replaced or left out) and the loop goes
               on, False when the failure is fatal. None: every failure is fatal.
    regroup:   called after a step whose header says ``regroup``: the world re-forms (a rank joins).
    poll:      the leader, before each header: True when a rank waits to join the world.
    router:    this rank's router index in the configuration (the header's work is indexed by
               it; None: not a router; -1: as ``topo`` says, for a world that never re-forms).
    rank is this rank in the configuration; ``topo`` is the world's now (ranks of the world).
    """

    rank: int
    topo: Topology
    exchange: Exchange
    control_group: dist.ProcessGroup
    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    runner: RouterRole | None = None
    maps: RouterMapsRole | None = None
    store: WorkerRole | None = None
    run_moves: RunMoves | None = None
    leader: LeaderRole | None = None
    recover: Callable[[BaseException], bool] | None = None
    regroup: Callable[[], None] | None = None
    poll: Callable[[], bool] | None = None
    router: int | None = -1
    top_k: int = 1
    last_enqueue_s: float = 0.0  # the last step's runner.run (host enqueue) and deliver (wait for tokens)
    last_deliver_s: float = 0.0
    header_wire: HeaderWire | None = None  # on control_group (made by the step loop)


def step_pairs(header: StepHeader, top_k: int) -> int:
    """The (token, k) pairs of a forward step over every router (the new tokens of its work)."""
    return top_k * sum(len(w.decodes) + sum(sw.num_new for sw in w.seqs) for w in header.work)


def run_step(st: RankState, header: StepHeader) -> RankResult:
    """This rank's part of one step, after the header (docs/dataplane.md, steps 2-5).

    A router first starts reading the load of the steps before (when the header asks: always
    before a commit, which changes the maps the counts are read with), then enqueues the
    step's work, then waits for the tokens of the oldest undelivered step (with asynchronous
    steps, the step before this one: the device is still running this one)."""
    res = RankResult(st.rank, started_at=time.perf_counter())
    if header.read_load and st.runner is not None:
        st.runner.snapshot_load()
    mig = header.migration
    if mig is not None:
        if st.store is not None and mig.begin_staging_slots:
            res.staging_error = st.store.begin_staging(mig.begin_staging_slots)
        for c in mig.commits:  # rows of a placement the leader validated: trusted
            if st.maps is not None:
                st.maps.set_layer(c.moe_layer, c.phy2log, c.breakeven or 0)
            if st.store is not None:
                st.store.commit(c.moe_layer, list(c.staged), c.phy2log)
        if st.store is not None:
            if mig.rollback:
                st.store.end_staging()
            if mig.moves:
                assert st.run_moves is not None  # a worker has both
                st.run_moves(mig.moves)
            if mig.end:
                st.store.end_staging()
    if header.report and st.store is not None:
        res.slot_digest = st.store.digest()
    if header.report and st.maps is not None:
        res.router_maps = (st.maps.phy2log.copy(), st.maps.breakeven.cpu().numpy().copy())
    if st.runner is not None and (header.grammars or header.drop_grammars):
        st.runner.update_grammars(header.grammars, header.drop_grammars)
    router = st.topo.router_index(st.rank) if st.router == -1 else st.router  # None: a worker-only rank
    if st.store is not None:
        # the expert kernels by rows per slot (every rank sees every router's work)
        st.store.set_step_pairs(
            header.warmup[0] * st.top_k * st.topo.num_routers
            if header.warmup is not None
            else step_pairs(header, st.top_k)
            if header.forward
            else 0
        )
    if header.warmup is not None:  # a decode graph warm-up at start: every rank's exchange
        if st.runner is not None:
            st.runner.warmup(*header.warmup, header.step)
        else:
            idle_walk(st.exchange, st.num_layers, st.hidden_size, st.dtype, st.store)
    elif header.forward:
        if st.runner is not None and router is not None:
            t0 = time.perf_counter()
            st.runner.run(header.work[router], header.step)
            st.last_enqueue_s = time.perf_counter() - t0
        else:
            idle_walk(st.exchange, st.num_layers, st.hidden_size, st.dtype, st.store)
    elif header.work and st.runner is not None and router is not None:
        st.runner.release(header.work[router].release)
    t0 = time.perf_counter()
    res.enqueue_s = t0 - res.started_at
    if st.runner is not None:
        res.tokens_step, res.tokens, res.logits, res.prompt_logprobs = st.runner.deliver(header.step)
        res.tokens_at = time.perf_counter()
        st.last_deliver_s = res.tokens_wait_s = res.tokens_at - t0
        res.grammars = st.runner.grammar_reports()
        load = st.runner.take_load_snapshot()
        if load is not None:
            with profiling.span("load_read"):
                res.logical_load, res.worker_load, res.load_steps, res.histogram, res.slot_busy = load
    return res


def step_loop(st: RankState) -> None:
    """The step driver: header, this rank's work, gather; until a stop header. A step whose
    collectives fail because a peer was lost is handed to ``st.recover``; once the groups are
    re-formed the leader issues that step's work again (docs/dataplane.md, "When a peer dies")."""
    prof = profiling.StepProfiler.from_env(st.rank)
    try:
        while True:
            try:
                header = _one_step(st, prof)
            except Exception as e:
                if st.recover is None or not st.recover(e):
                    raise
                continue
            if header.stop:
                return
            if header.regroup and st.regroup is not None:
                st.regroup()
    finally:
        if prof is not None:
            prof.finish()


def _one_step(st: RankState, prof: profiling.StepProfiler | None = None) -> StepHeader:
    leader = st.leader
    if leader is not None and st.poll is not None and st.poll():
        leader.request_regroup()
    if leader is not None:
        with profiling.span("pacing"):
            leader.pace()
    t0 = time.perf_counter()
    with profiling.span("schedule"):
        box = [leader.next_header() if leader is not None else None]
    took = time.perf_counter() - t0
    if leader is not None and took > SLOW_STEP_S and box[0] is not None and (box[0].forward or box[0].migration):
        log.warning("slow schedule of step %d: %.2f s in the leader's next_header", box[0].step, took)
    with profiling.span("header_broadcast"):
        if st.header_wire is None or st.header_wire.group is not st.control_group:  # new groups after a lost peer
            st.header_wire = HeaderWire(st.control_group, alone=dist.get_world_size(st.control_group) == 1)
        header: StepHeader = st.header_wire.exchange(box[0])
    if header.stop:
        return header
    if prof is not None:
        prof.step(header.forward)
    t0 = time.perf_counter()
    graphs = st.runner.graphs if st.runner is not None else None
    before = (graphs.captures, len(graphs.seen)) if graphs is not None else (0, 0)
    res = run_step(st, header)
    took = time.perf_counter() - t0
    if took > SLOW_STEP_S:
        after = (graphs.captures, len(graphs.seen)) if graphs is not None else (0, 0)
        log.warning(
            "slow step %d on rank %d: %.2f s (enqueue %.2f s, waiting for tokens %.2f s; forward %s, %d "
            "pairs, %d decode graph captures, %d first eager runs of a graph key, migration %s, load "
            "read %s)",
            header.step,
            st.rank,
            took,
            st.last_enqueue_s,
            st.last_deliver_s,
            header.forward,
            step_pairs(header, st.top_k) if header.forward else 0,
            after[0] - before[0],
            after[1] - before[1],
            header.migration is not None,
            header.read_load,
        )
    st.last_enqueue_s = st.last_deliver_s = 0.0
    out: list[Any] | None = [None] * st.topo.world_size if leader is not None else None  # the gather fills it
    with profiling.span("result_gather"):
        if st.header_wire.alone and out is not None:  # one rank: its own result, nothing to gather
            out[0] = res
        else:
            dist.gather_object(res, out, dst=0, group=st.control_group)
        if leader is not None and out is not None:
            leader.on_results(header, out)
    return header
