"""The leader's engine (router rank 0): requests, placement and load, and the step headers.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

Two kinds of callers meet here. The step-driver thread calls ``next_header`` at the start of
every step and ``on_results`` at its end; it is the only thread that touches
torch.distributed. Every other thread (the local channel, the gRPC admin handlers) calls the
methods of :class:`~moeserve.router.engine.api.EngineAPI`, which only validate, record and
enqueue work for the next header: they never wait for a step except where they say so
(``wait_migration``, ``slot_digests``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, cast

import numpy as np

from moeserve.config import ClusterConfig
from moeserve.dataplane.protocol import RankResult, StepHeader
from moeserve.placement import MigrationProgress, Placement, balancedness, worker_balancedness
from moeserve.router.engine.api import (
    EngineAPI,
    EngineStatus,
    EplbDisabled,
    GenerateRequest,
    InvalidRequest,
    LoadReport,
    ModelShape,
    NotFound,
    Unavailable,
    step_delivery,
    validate_request,
)
from moeserve.router.engine.grammars import GrammarTable
from moeserve.router.engine.migration import Migrator
from moeserve.router.engine.pacing import StepPacer, learn_lead_setting
from moeserve.router.engine.scheduler import Scheduler, Sequence
from moeserve.sampling import MAX_SEED, request_seed

if TYPE_CHECKING:  # the metrics are made on ranks that export them (prometheus_client)
    from moeserve.ops.metrics import LeaderMetrics

log = logging.getLogger("moeserve.leader")

GRAMMAR_POLL_S = 0.005  # the gap between steps while grammars compile on the routers and nothing else runs


class Engine(EngineAPI):
    """The leader's state: scheduler, migrator, load window."""

    def __init__(self, cfg: ClusterConfig, shape: ModelShape, placement: Placement):
        self.cfg = cfg
        self.shape = shape
        # Sliding-window layers read the cache as full ones do: every layer's keys of a block live
        # under the one block table, so a cached block holds them all (a windowed layer reads the
        # last window of them; keeping only those would save memory, not change a token).
        self.scheduler = Scheduler(
            cfg.routers,
            cfg.limits,
            shape.eos_token_ids,
            cfg.cache.block_size,
            prefix_caching=cfg.cache.enable_prefix_caching,
            routing=cfg.routing_policy,
        )
        self.grammars = GrammarTable(cfg.routers)
        self.scheduler.grammar_ready = self.grammars.ready
        placement, self._saver = _saved_state(cfg, placement)  # --state-dir: versions back, saves on
        self._saved_key = _placement_key(placement)
        self.migrator = Migrator(placement, shape.expert_bytes, cfg.migration_bytes_per_step)
        self._load_lock = threading.Lock()
        # the load as routers read it: chunks (logical [L, E], worker [L, W], forward steps), the
        # oldest dropped while the rest still covers window_size steps
        self._window: deque[tuple[int, tuple]] = deque()
        self._window_steps = 0
        # Running sums over the window: admin calls read them in O(1) instead of summing up to
        # window_size arrays while holding the lock (and the GIL) the step driver needs.
        # (logical [L, E], worker [L, W], histogram [L, E, K], slot busy [L, P]) summed over the
        # window; a read without per-step statistics adds 0 to the last two
        self._window_sum: list = [0, 0, 0, 0]
        self._total_logical = np.zeros((shape.num_moe_layers, shape.num_logical_experts), dtype=np.int64)
        self._total_worker = np.zeros((shape.num_moe_layers, placement.num_workers), dtype=np.int64)
        self.step = 0
        self.forward_steps = 0
        self.started = time.time()
        self._stop = threading.Event()
        self._wake = self.scheduler.work_available
        self.error: str | None = None
        self._report_lock = threading.Lock()
        self._report_wanted = False
        self._report_done = threading.Event()
        self._report: list[np.ndarray] | None = None
        self._router_maps: list[tuple[np.ndarray, np.ndarray]] = []
        self._seen_version = int(placement.version)
        self._placement_step = 0  # forward_steps when the placement last changed
        self.metrics: LeaderMetrics | None = None  # when this rank exports metrics
        self.metrics_ports: dict[str, int] = {}  # name ("rank0", "balancer", ...) -> metrics port
        self._header_t = time.perf_counter()
        self._last_step_t = time.monotonic()  # when the last step completed (health: a stall)
        self._in_flight: StepHeader | None = None  # the header whose results have not come back
        self._replay: StepHeader | None = None  # to issue again after a lost peer was replaced
        self._regroup = False  # a rank joins: the next header asks every rank to re-form
        self.generation = 0
        self.members: tuple[int, ...] = tuple(range(cfg.world_size))
        self.ranks_lost = {"router": 0, "worker": 0}  # by role, since start
        self.ranks_replaced = {"router": 0, "worker": 0}
        # forward steps whose sampled tokens have not come back (asynchronous steps): step -> work
        self._awaiting: dict[int, tuple] = {}
        self._unread_steps = 0  # forward steps issued since the last load read
        self._load_cond = threading.Condition(self._load_lock)
        self._load_asked = 0  # tickets: fresh load reads asked / issued / served
        self._load_issued = 0
        self._load_served = 0
        self._driver: int | None = None  # the step driver's thread id
        self._warmup: deque[tuple[int, int]] = deque()  # decode graph warm-up steps still to issue
        # late scheduling: the next schedule just before the GPUs finish the running step
        late = cfg.async_scheduling and cfg.late_scheduling
        self.pacer = StepPacer(cfg.late_scheduling_margin_ms / 1e3, learn_lead=learn_lead_setting()) if late else None
        self._sched_t = time.perf_counter()  # when the latest header's schedule began
        self._seed_lock = threading.Lock()
        self._seeds = random.Random(cfg.seed) if getattr(cfg, "seed", None) is not None else None

    # -- requests (any thread) ----------------------------------------------------------------

    def submit(self, req: GenerateRequest, sink=None) -> Sequence:
        """Validate ``req`` (the one check between a front door and the step) and admit it."""
        if self._stop.is_set() or self.error:
            raise Unavailable(self.error or "the cluster is shutting down")
        lim = self.cfg.limits
        validate_request(req, self.shape.vocab_size, lim.max_model_len, self.scheduler.max_kv_tokens)
        sp = req.sampling
        if sp.seed is None:  # fixed now: a recomputed (preempted) request samples the same
            sp = dataclasses.replace(sp, seed=self._seed(sp))
        if sp.min_tokens > 0:  # the ids min_tokens keeps the routers from sampling
            stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.shape.eos_token_ids))
            sp = dataclasses.replace(sp, stop_ids=tuple(sorted(stops)))
        if sp is not req.sampling:
            req = dataclasses.replace(req, sampling=sp)
        if req.grammar is None:
            return self.scheduler.submit(req, sink)
        gid, why = self.grammars.acquire(req.grammar)  # announced to the routers in the next header
        if why is not None:
            raise InvalidRequest(why)
        try:
            seq = self.scheduler.submit(req, sink, grammar=gid)
        except BaseException:
            self.grammars.abandon(gid)
            raise
        why = self.grammars.attach(gid, seq)
        if why is not None:  # it failed on a router in the meantime
            self.scheduler.fail_grammar(gid, why)
        return seq

    def _seed(self, sp) -> int:
        """A seed for a request that gave none: random, or with ``--seed`` the next of the
        cluster's seeded stream (vLLM's global seed: the same requests in the same order get the
        same tokens on every run)."""
        if self._seeds is None:
            return request_seed(sp)
        with self._seed_lock:
            return self._seeds.randrange(MAX_SEED + 1)

    def set_kv_capacity(self, blocks_per_router: list[int]) -> None:
        """The KV blocks each router allocated (reported once at start, before any request)."""
        self.scheduler.set_capacity(blocks_per_router)

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.cancel(seq)

    # -- placement and load (any thread) -------------------------------------------------------

    def placement(self) -> Placement:
        return self.migrator.placement()

    def plan_placement(self, target, expected_version: int | None = None) -> MigrationProgress:
        """Validate and diff ``target`` (phy2log [L, P] or a Placement) without applying."""
        self._check_eplb()
        return self.migrator.plan(target, expected_version).progress()

    def apply_placement(self, target, expected_version: int | None = None) -> MigrationProgress:
        """Start migrating to ``target`` (phy2log [L, P] or a Placement); returns at once."""
        self._check_eplb()
        mig = self.migrator.plan(target, expected_version)
        mig = self.migrator.start(mig, expected_version)
        self._wake.set()
        return mig.progress()

    def abort_migration(self) -> bool:
        ok = self.migrator.abort("aborted by request")
        self._wake.set()
        return ok

    def migration(self, migration_id: str) -> MigrationProgress:
        return self._migration(migration_id).progress()

    def wait_migration(self, migration_id: str, timeout_s: float) -> MigrationProgress:
        mig = self._migration(migration_id)
        mig.done.wait(max(0.0, float(timeout_s)))
        return mig.progress()

    def _migration(self, migration_id: str):
        mig = self.migrator.get(migration_id)
        if mig is None:
            raise NotFound(f"no migration with id {migration_id!r}")
        return mig

    def expert_load(self, window_steps: int | None = None) -> LoadReport:
        """The load over the window, or over its last ``window_steps`` steps (whole reads:
        routers send the load every ``load_read_steps`` forward steps; this call first asks
        them for the steps not read yet)."""
        self._fresh_load()
        placement = self.placement()
        with self._load_lock:
            if not window_steps or window_steps >= self._window_steps:
                n, sums = self._window_steps, list(self._window_sum)
            else:
                n, sums = 0, [0, 0, 0, 0]
                for k, parts in reversed(self._window):
                    n, sums = n + k, [a + b for a, b in zip(sums, parts)]
                    if n >= window_steps:
                        break
            load, wload, hist, busy = (x.copy() if isinstance(x, np.ndarray) else None for x in sums)
            if not n or load is None:
                load = np.zeros((self.shape.num_moe_layers, self.shape.num_logical_experts), dtype=np.int64)
                wload = np.zeros((self.shape.num_moe_layers, placement.num_workers), dtype=np.int64)
            assert wload is not None  # read with the logical load
            since = self.forward_steps - self._placement_step
        return LoadReport(
            load=load,
            worker_load=wload,
            steps=n,
            total_steps=self.forward_steps,
            balancedness_measured=worker_balancedness(wload)["per_layer"],
            balancedness_predicted=balancedness(load, placement.phy2log, placement.num_workers),
            placement_version=int(placement.version),
            steps_since_placement_change=since,
            histogram=hist,
            slot_busy_steps=busy,
        )

    def total_load(self) -> np.ndarray:
        """int64 [L, E]: pairs routed to each logical expert since start."""
        self._fresh_load()
        with self._load_lock:
            return self._total_logical.copy()

    def total_worker_load(self) -> np.ndarray:
        """int64 [L, W]: pairs sent to each worker since start."""
        self._fresh_load()
        with self._load_lock:
            return self._total_worker.copy()

    def _fresh_load(self, timeout_s: float = 2.0) -> None:
        """Have the routers send the load they hold (at the next step boundary) and wait for it;
        returns at once on the step driver's thread, when nothing is unread (every forward step
        issued is counted in ``_unread_steps`` until a read header is issued, and a read is in
        flight until its results are in), and when the step loop is not running (stopped,
        failed, or stalled for a second)."""
        if (
            threading.get_ident() == self._driver
            or self._driver is None
            or self._stop.is_set()
            or self.error
            or time.monotonic() - self._last_step_t > 1.0
        ):
            return
        with self._load_lock:
            if not self._unread_steps and self._load_issued == self._load_served:
                return  # every forward step issued so far has been read (a scrape's second call)
            self._load_asked += 1
            ticket = self._load_asked
        self._wake.set()
        with self._load_cond:
            self._load_cond.wait_for(lambda: self._load_served >= ticket or self.error is not None, timeout_s)

    def status(self) -> EngineStatus:
        p = self.placement()
        assert p.layer_versions is not None  # Placement fills it
        counts = self.scheduler.counts()
        slots, nbytes, ended = self.migrator.moved_totals()
        return EngineStatus(
            step=self.step,
            forward_steps=self.forward_steps,
            uptime_s=time.time() - self.started,
            placement_version=int(p.version),
            layer_versions=tuple(int(v) for v in p.layer_versions),
            migration=self.migrator.active_progress(),
            error=self.error,
            waiting=counts["waiting"],
            running=counts["running"],
            kv_blocks_total=counts["kv_blocks_total"],
            kv_blocks_used=counts["kv_blocks_used"],
            kv_blocks_cached=counts["kv_blocks_cached"],
            preemptions=counts["preemptions"],
            readmitted=counts["readmitted"],
            generation=self.generation,
            members=self.members,
            ranks_in_world={
                "router": sum(self.cfg.role(r).router_index >= 0 for r in self.members),
                "worker": sum(self.cfg.role(r).worker_index >= 0 for r in self.members),
            },
            ranks_lost=dict(self.ranks_lost),
            ranks_replaced=dict(self.ranks_replaced),
            prefix_cache_queries=counts["prefix_cache_queries"],
            prefix_cache_hits=counts["prefix_cache_hits"],
            metrics_ports=dict(self.metrics_ports),
            moved_slots=slots,
            moved_bytes=nbytes,
            migrations_ended=ended,
            last_step_age_s=time.monotonic() - self._last_step_t,
            late_schedules=self.pacer.delays if self.pacer is not None else 0,
            late_schedule_delay_s=self.pacer.delayed_s if self.pacer is not None else 0.0,
            late_schedule_bubbles=self.pacer.bubbles if self.pacer is not None else 0,
            late_schedule_ahead_s=self.pacer.ahead_s if self.pacer is not None else 0.0,
            late_schedule_slack_s=self.pacer.slack_s if self.pacer is not None else 0.0,
        )

    def slot_digests(self, timeout_s: float = 60.0) -> list[np.ndarray]:
        """Per worker, float64 [L, S, 2] digests (sum, sum of squares) of what each slot
        really holds, taken at a step boundary."""
        with self._report_lock:
            self._report_done.clear()
            self._report_wanted = True
        self._wake.set()
        if not self._report_done.wait(timeout_s):
            raise Unavailable(f"no worker report within {timeout_s} s")
        assert self._report is not None  # set with _report_done
        return self._report

    def router_maps(self, timeout_s: float = 60.0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per router, the maps it routes with, taken at a step boundary: (phy2log int64 [L, P],
        breakeven int64 [L, E]) (to check that a placement and its break-even counts reached
        every router)."""
        self.slot_digests(timeout_s)
        return self._router_maps

    def warm_up(self, keys) -> None:
        """Issue a warm-up step for each (bucket, longest sequence) of ``keys`` twice, before any
        other work: a decode graph key's first use compiles, its second captures (``DecodeGraphs``)."""
        for key in keys:
            self._warmup.extend([tuple(key)] * 2)
        log.info("capturing decode graphs at start: %d warm-up steps", len(self._warmup))

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _check_eplb(self) -> None:
        if not self.cfg.eplb.enable_eplb:
            raise EplbDisabled(
                "EPLB is disabled on this cluster (start it with enable_eplb): the placement cannot change"
            )

    # -- step driver ------------------------------------------------------------------------

    def pace(self) -> None:
        """Before the step driver's next schedule: while the GPUs run a step and the next one
        need not be enqueued yet, wait (``StepPacer``), so that requests arriving meanwhile join
        it. Never before a replay, a regroup, a warm-up step or a stop, nor while every router
        runs ``max_num_seqs`` sequences (an arrival could not join the next step)."""
        p = self.pacer
        if p is None or self._replay is not None or self._regroup or self._warmup or self._stop.is_set():
            return
        d = p.delay(time.perf_counter())
        if d > 0 and self.scheduler.has_room():
            p.note_delay(d)
            self._stop.wait(d)

    def next_header(self) -> StepHeader:
        """The header of the next step; when there is nothing to do, waits up to heartbeat_s
        for work and then returns a heartbeat. After a lost peer was replaced, the step that
        failed comes first, again."""
        self._driver = threading.get_ident()
        self._sched_t = time.perf_counter()
        if self._replay is not None:
            self._in_flight, self._replay = self._replay, None
            self._header_t = time.perf_counter()
            return self._in_flight
        if self._regroup:  # a flush of the tokens in flight, then every rank re-forms
            self._regroup = False
            self._header_t = time.perf_counter()
            self._unread_steps, self._load_issued = 0, self._load_asked
            self._in_flight = StepHeader(self.step, regroup=True, read_load=True)
            return self._in_flight
        if self.step == 0:  # the loop starts: its age counts from here
            self._last_step_t = time.monotonic()
        if self._warmup and not self._stop.is_set():
            self._header_t = time.perf_counter()
            self._in_flight = StepHeader(self.step, warmup=self._warmup.popleft())
            return self._in_flight
        # while grammars compile on the routers, steps keep coming to bring their reports back
        deadline = time.monotonic() + (GRAMMAR_POLL_S if self.grammars.compiling else self.cfg.heartbeat_s)
        while True:
            if self._stop.is_set():
                return StepHeader(self.step, stop=True)
            self._sched_t = time.perf_counter()
            grammars, drops = self.grammars.header()
            work = self.scheduler.schedule()
            ops = self.migrator.header_ops()
            report = self._report_wanted
            # tokens still on their way back, or load asked for: a step now, with or without work
            if (
                work is not None
                or ops is not None
                or report
                or self._awaiting
                or self._load_asked > self._load_issued
                or grammars
                or drops
            ):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wake.wait(remaining)
            self._wake.clear()
        forward = work is not None and any(w.runs for w in work)
        with self._load_lock:
            asked = self._load_asked
        # the routers' load of the steps before this one: every load_read_steps forward steps,
        # when asked, before a commit (which changes the maps they read it with), and when idle
        read = (
            asked > self._load_issued
            or bool(self._unread_steps)
            and (
                self._unread_steps >= self.cfg.load_read_steps or (ops is not None and bool(ops.commits)) or not forward
            )
        )
        if read:
            self._unread_steps = 0
            self._load_issued = asked
        self._unread_steps += forward
        self._header_t = time.perf_counter()
        self._in_flight = StepHeader(
            self.step,
            forward=forward,
            work=work or (),
            migration=ops,
            report=report,
            read_load=read,
            grammars=grammars,
            drop_grammars=drops,
        )
        return self._in_flight

    def request_regroup(self) -> None:
        """A rank joins the running cluster: the next header is a regroup (docs/dataplane.md,
        "When a rank joins a running cluster")."""
        self._regroup = True
        self._wake.set()

    def on_regroup(self, lost: set[int], failed: bool) -> Placement:
        """The world re-forms without the ranks ``lost`` (config ranks), after a failed step
        (``failed``) or for a rank that joins. The running migration is aborted (its
        uncommitted layers roll back; a replacement loads the placement in force); a lost
        router's sequences go back to the waiting queue to be recomputed on the routers left;
        after a failed step its work is issued again with the same step number (the lost
        routers' part emptied), so the same tokens take the same slots and get the same
        samples. Returns the placement in force, which every rank installs before the next step."""
        self.migrator.abort("the cluster re-formed during the migration: the placement in force stands")
        h = self._in_flight if failed else None
        replay = dataclasses.replace(h, migration=None) if h is not None and h.work else None
        for rank in sorted(lost):
            role = self.cfg.role(rank)
            self.ranks_lost["router" if role.router_index >= 0 else "worker"] += 1
            if role.router_index >= 0:
                moved = self.scheduler.router_lost(role.router_index, replay.work if replay is not None else None)
                if replay is not None and moved is not None:
                    replay = dataclasses.replace(replay, work=moved)
        self._replay = replay
        self._in_flight = None
        if self.pacer is not None:
            self.pacer.reset()  # another world: other ranks, other times
        return self.placement()

    def on_members(self, generation: int, members, joined: dict[int, tuple[int, int]]) -> None:
        """The world of ``generation`` formed with ``members``; ``joined``: config rank ->
        (metrics port, KV blocks) of each rank new in it (a replacement router opens for
        sequences with its blocks)."""
        self.generation, self.members = int(generation), tuple(members)
        for rank, (port, blocks) in joined.items():
            role = self.cfg.role(rank)
            self.ranks_replaced["router" if role.router_index >= 0 else "worker"] += 1
            if port >= 0:
                self.metrics_ports[f"rank{rank}"] = int(port)
            if role.router_index >= 0:
                self.scheduler.router_joined(role.router_index, blocks)
                self.grammars.router_joined(rank)  # compiled again there before it is used

    def on_results(self, header: StepHeader, results: list[RankResult]) -> None:
        """Consume the end-of-step gather (one RankResult per rank)."""
        self._in_flight = None
        self.step += 1
        self._last_step_t = time.monotonic()
        if self.pacer is not None:
            mine = next((r for r in results if r.rank == 0), None)  # the leader's own rank
            if mine is not None and mine.started_at:
                # schedule + broadcast here, then the slowest rank's enqueue
                lead = mine.started_at - self._sched_t + max(r.enqueue_s for r in results)
                self.pacer.on_step(header.forward, lead, mine.tokens_at, mine.tokens_wait_s)
        if self.metrics is not None:
            kind = "forward" if header.forward else "migration" if header.migration is not None else "heartbeat"
            self.metrics.on_step(kind, time.perf_counter() - self._header_t)
        if header.report:
            by_rank = {r.rank: r for r in results}  # results come in the order of the members
            with self._report_lock:
                # every worker answers a report with its digest
                self._report = cast("list[np.ndarray]", [by_rank[r].slot_digest for r in self.cfg.worker_ranks])
                self._router_maps = [r.router_maps for r in results if r.router_maps is not None]
                self._report_wanted = False
                self._report_done.set()
        for gid, why in self.grammars.on_results(results):
            self.scheduler.fail_grammar(gid, why)
        if header.migration is not None and header.migration.begin_staging_slots:
            errors = [r.staging_error for r in results if r.staging_error]
            self.migrator.on_staging(header.migration.migration_id, errors)
        placement = self.migrator.placement()
        version = int(placement.version)
        if version != self._seen_version:
            with self._load_lock:
                self._seen_version, self._placement_step = version, self.forward_steps
        if self._saver is not None:  # --state-dir: every commit, finish or abort is saved
            key = _placement_key(placement)
            if key != self._saved_key:
                self._saved_key = key
                self._saver.save(placement)
        loads = [r for r in results if r.logical_load is not None]
        steps = max((r.load_steps for r in loads), default=0)
        if steps:
            stats = [
                sum(getattr(r, f) for r in loads) if all(getattr(r, f) is not None for r in loads) else 0
                for f in ("histogram", "slot_busy")
            ]
            self._add_load(
                _router_sum([r.logical_load for r in loads]),
                _router_sum([r.worker_load for r in loads]),
                steps,
                *stats,
            )
        if header.read_load:
            with self._load_cond:
                self._load_served = max(self._load_served, self._load_issued)
                self._load_cond.notify_all()
        if header.forward:
            self.forward_steps += 1
            self._awaiting[header.step] = header.work
            eplb = self.cfg.eplb
            if eplb.log_balancedness and self.forward_steps % eplb.step_interval == 0:
                rep = self.expert_load()
                log.info(
                    "step %d: balancedness measured %.4f predicted %.4f (mean over %d MoE layers)",
                    self.forward_steps,
                    float(rep.balancedness_measured.mean()),
                    float(rep.balancedness_predicted.mean()),
                    len(rep.balancedness_measured),
                )
        # the tokens each router sampled in an earlier step (asynchronous steps) or in this one
        delivered: dict[int, tuple[dict, dict, dict]] = {}
        for r in results:
            if r.tokens_step >= 0:
                tokens, logits, plp = delivered.setdefault(r.tokens_step, ({}, {}, {}))
                tokens.update(r.tokens)
                logits.update(r.logits)
                plp.update(r.prompt_logprobs)
        with step_delivery():  # the steps' events leave together (a session's one frame)
            for step in sorted(delivered):
                work = self._awaiting.pop(step, None)
                if work is not None:
                    self.scheduler.on_results(work, *delivered[step])

    def _add_load(self, logical: np.ndarray, wload: np.ndarray, steps: int, histogram=0, slot_busy=0) -> None:
        """A read of the routers' load: ``steps`` forward steps' pairs per logical expert
        [L, E] and per worker [L, W], and their per-step statistics summed over routers
        (histogram [L, E, K], slot busy [L, P]; 0 when the routers sent none)."""
        parts = (logical, wload, histogram, slot_busy)
        with self._load_lock:
            self._window.append((steps, parts))
            self._window_sum = [a + b for a, b in zip(self._window_sum, parts)]
            self._window_steps += steps
            while len(self._window) > 1 and self._window_steps - self._window[0][0] >= self.cfg.eplb.window_size:
                k, old = self._window.popleft()
                self._window_sum = [a - b for a, b in zip(self._window_sum, old)]
                self._window_steps -= k
            self._total_logical += logical
            self._total_worker += wload

    def fail(self, message: str) -> None:
        """The step loop died: fail every request and migration waiting on it."""
        self.error = message
        self.scheduler.fail_all(message)
        self.migrator.abort(message)


def _router_sum(arrays: list[np.ndarray | None]) -> np.ndarray:
    """The sum of the routers' arrays of one load read (a new array: 0 + each); a router that
    read its load sent its logical and its worker load."""
    total = sum(cast("list[np.ndarray]", arrays))
    assert isinstance(total, np.ndarray)  # not 0: at least one router read
    return total


def _placement_key(p: Placement) -> tuple:
    assert p.layer_versions is not None  # Placement fills it
    return int(p.version), tuple(int(v) for v in p.layer_versions)


def _saved_state(cfg: ClusterConfig, placement: Placement):
    """With ``cfg.state_dir``: the placement the ranks start from, with the versions saved in the
    folder when it is the saved placement (the CLI handed it to the ranks), so that versions keep
    increasing across restarts; and the saver that keeps the folder up to date. A mixed state
    (the leader stopped in the middle of a migration) gets a fresh version, as an abort does."""
    if not getattr(cfg, "state_dir", ""):
        return placement, None
    from moeserve import state

    try:
        saved = state.read_placement(cfg.state_dir)
    except state.StateError as e:
        log.warning("%s", e)
        saved = None
    if (
        saved is not None
        and saved.phy2log.shape == placement.phy2log.shape
        and np.array_equal(saved.phy2log, placement.phy2log)
    ):
        lv = np.asarray(saved.layer_versions, dtype=np.int64)
        version = int(saved.version) if not len(lv) or lv.max() <= saved.version else int(lv.max()) + 1
        placement = placement.evolve(version=version, layer_versions=lv)
        log.info("placement version %d restored from %s", version, cfg.state_dir)
    saver = state.PlacementSaver(cfg.state_dir)
    saver.save(placement)
    return placement, saver


__all__ = ["Engine"]
