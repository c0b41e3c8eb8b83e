"""Prometheus metrics of every moeserve process: one registry and one ``/metrics`` endpoint per
process (:class:`ProcessMetrics`) and the groups of metrics each role records: the leader
(:class:`LeaderMetrics`, read from the engine's public API at scrape time), router ranks
(:class:`RouterMetrics`), the front end (:class:`FrontendMetrics`), the balancer
(:class:`BalancerMetrics`) and the readiness of every service (:class:`ReadinessMetrics`). The
gRPC servers' interceptor is in ``moeserve.services.metrics``: nothing here imports gRPC or
protobuf, so a rank records its metrics without them.

docs/metrics.md is the one list of the metrics, their types, labels and meaning.

Dimension letters: L MoE layers, E logical experts, W workers.
"""

from __future__ import annotations

import functools
import http.server
import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PER_EXPERT_LIMIT = 4096
PER_EXPERT_CHOICES = ("auto", "on", "off")
STEP_KINDS = ("forward", "migration", "heartbeat")
MIGRATION_RESULTS = ("done", "aborted", "failed")
RANK_ROLES = ("router", "worker")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
REBALANCE_RESULTS = ("done", "skipped", "failed", "dry_run")
# Where a request's TTFT goes, in order (RequestRecord.ttft_parts; docs/metrics.md): the front
# end, the submit's way to the leader, the leader's intake, queue and prefill, the first token's
# way to the leader's channel, its way back, the front end again.
TTFT_PARTS = (
    "frontend_before",
    "submit_transport",
    "leader_intake",
    "queue",
    "prefill",
    "leader_event",
    "event_transport",
    "frontend_after",
)

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
EXCHANGE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PART_BUCKETS = (1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
REBALANCE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def per_expert_enabled(choice: str, num_layers: int, num_logical: int) -> bool:
    """Whether per-expert series are exported: ``choice`` auto (L x E <= PER_EXPERT_LIMIT), on, off."""
    if choice not in PER_EXPERT_CHOICES:
        raise ValueError(f"per-expert metrics must be one of {PER_EXPERT_CHOICES}, got {choice!r}")
    if choice == "auto":
        return num_layers * num_logical <= PER_EXPERT_LIMIT
    return choice == "on"


TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # what /metrics serves


class ProcessMetrics:
    """The registry of one process and its HTTP endpoint.

    role: what the process is ("router", "worker", "router+worker", "frontend", "balancer");
    rank: its rank in the world (-1 for a process that is not a rank).
    """

    def __init__(self, role: str, rank: int = -1):
        from prometheus_client import disable_created_metrics
        from prometheus_client.gc_collector import GCCollector
        from prometheus_client.platform_collector import PlatformCollector
        from prometheus_client.process_collector import ProcessCollector

        disable_created_metrics()  # no ``*_created`` series: they double the count and no panel reads them
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        info = Gauge(
            "moeserve_process_info",
            "Always 1: what this process is (role) and its rank (-1: not a rank).",
            ("role", "rank"),
            registry=self.registry,
        )
        info.labels(role, str(rank)).set(1)
        self.role, self.rank = role, rank
        self.port: int | None = None
        self._server: http.server.ThreadingHTTPServer | None = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port.
        Always the text format 0.0.4, whatever the scraper accepts: prometheus-client 0.23's
        OpenMetrics writer spells the ``:`` of vLLM's names (``vllm:...``) as ``_`` in samples,
        which would hide them from dashboards built for vLLM."""
        registry = self.registry

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = scrape_text(registry).encode()
                self.send_response(200)
                self.send_header("Content-Type", TEXT_FORMAT)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # a scrape a second would flood the log
                pass

        server = http.server.ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# -- the leader -------------------------------------------------------------------------------


class LeaderMetrics:
    """The leader's metrics. ``engine``: the leader's ``Engine`` (read at scrape time);
    ``per_expert``: auto, on or off. ``Engine.on_results`` calls :meth:`on_step` once per step."""

    def __init__(self, registry: CollectorRegistry, engine, per_expert: str = "auto"):
        shape = engine.shape
        self.per_expert = per_expert_enabled(per_expert, shape.num_moe_layers, shape.num_logical_experts)
        self.steps = Counter(
            "moeserve_steps",
            "Steps run by the cluster, by kind: forward (tokens), migration (weight moves only), heartbeat (idle).",
            ("kind",),
            registry=registry,
        )
        self.step_seconds = Histogram(
            "moeserve_step_duration_seconds",
            "Wall time of one step on the leader, from the header broadcast to the end-of-step gather.",
            ("kind",),
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        # Label children looked up once: on_step is on the step driver.
        self._steps = {k: self.steps.labels(k) for k in STEP_KINDS}
        self._step_seconds = {k: self.step_seconds.labels(k) for k in STEP_KINDS}
        registry.register(_LeaderCollector(engine, self.per_expert))

    def on_step(self, kind: str, seconds: float) -> None:
        self._steps[kind].inc()
        self._step_seconds[kind].observe(seconds)


# Counters read straight off the leader's EngineStatus: (metric, help, EngineStatus field)
STATUS_COUNTERS = (
    (
        "moeserve_requests_readmitted",
        "Sequences of a lost router moved to another router, to be recomputed from the tokens known.",
        "readmitted",
    ),
    (
        "moeserve_prefix_cache_queries",
        "Prompt tokens of admitted requests that looked the prefix cache up.",
        "prefix_cache_queries",
    ),
    (
        "moeserve_prefix_cache_hits",
        "Prompt tokens of admitted requests read from the prefix cache instead of computed.",
        "prefix_cache_hits",
    ),
    (
        "moeserve_late_schedules",
        "Schedules the leader delayed to just before the running step's expected end (late scheduling).",
        "late_schedules",
    ),
    (
        "moeserve_late_schedule_delay_seconds",
        "Time the leader waited before those schedules, in total.",
        "late_schedule_delay_s",
    ),
    (
        "moeserve_late_schedule_bubbles",
        "Delayed schedules after which the GPU went idle before the step was enqueued (the pacer backs off).",
        "late_schedule_bubbles",
    ),
    (
        "moeserve_late_schedule_ahead_seconds",
        "How long before the running step's estimated end the delayed schedules started, in total "
        "(the host's longest lead, the margin and the pacer's correction).",
        "late_schedule_ahead_s",
    ),
    (
        "moeserve_late_schedule_slack_seconds",
        "How long the leader's rank waited for the running step's tokens after the delayed schedules, in total.",
        "late_schedule_slack_s",
    ),
)


class _LeaderCollector(Collector):
    """Series computed when Prometheus scrapes, from the engine's public API only:
    ``placement()``, ``total_load()``, ``total_worker_load()``, ``expert_load()``, ``status()``
    (each takes its own short lock; nothing here touches the migrator or the scheduler)."""

    def __init__(self, engine, per_expert: bool):
        self.engine = engine
        self.per_expert = per_expert

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        placement = e.placement()
        layers = [str(i) for i in range(placement.num_layers)]
        experts = [str(i) for i in range(placement.num_logical)]
        workers = [str(i) for i in range(placement.num_workers)]
        total_logical, total_worker = e.total_load(), e.total_worker_load()  # [L, E], [L, W]
        rep = e.expert_load()

        if self.per_expert:
            c = CounterMetricFamily(
                "moeserve_expert_tokens",
                "Pairs (token, k) routed to each logical expert since start (the load), per MoE layer.",
                labels=("layer", "expert"),
            )
            _add_matrix(c, total_logical, layers, experts)
            yield c
            g = GaugeMetricFamily(
                "moeserve_expert_replicas",
                "Replicas (physical slots) of each logical expert in the placement in force.",
                labels=("layer", "expert"),
            )
            _add_matrix(g, placement.logcnt(), layers, experts)
            yield g
        c = CounterMetricFamily(
            "moeserve_worker_tokens",
            "Pairs (token, k) sent to each expert worker since start, per MoE layer.",
            labels=("layer", "worker"),
        )
        _add_matrix(c, total_worker, layers, workers)
        yield c
        g = GaugeMetricFamily(
            "moeserve_layer_balancedness",
            "Measured balancedness of each MoE layer over the "
            "load window: mean worker load / max worker load (1 = perfect).",
            labels=("layer",),
        )
        for layer, v in zip(layers, rep.balancedness_measured):
            g.add_metric((layer,), float(v))
        yield g
        g = GaugeMetricFamily(
            "moeserve_layer_balancedness_predicted",
            "Balancedness the placement in force predicts for the window's load, split evenly over replicas.",
            labels=("layer",),
        )
        for layer, v in zip(layers, rep.balancedness_predicted):
            g.add_metric((layer,), float(v))
        yield g
        yield GaugeMetricFamily(
            "moeserve_placement_version", "Version of the placement in force.", value=float(placement.version)
        )
        status = e.status()
        mig = status.migration
        yield GaugeMetricFamily(
            "moeserve_migration_in_progress", "1 while a migration runs, else 0.", value=1.0 if mig is not None else 0.0
        )
        ratio = mig.moves_done / mig.moves_total if mig is not None and mig.moves_total else 0.0
        yield GaugeMetricFamily(
            "moeserve_migration_progress_ratio",
            "Moves scheduled / moves of the running migration (0 when none runs).",
            value=float(ratio),
        )
        c = CounterMetricFamily("moeserve_migrations", "Migrations that ended, by result.", labels=("result",))
        for result in MIGRATION_RESULTS:
            c.add_metric((result,), float(status.migrations_ended.get(result, 0)))
        yield c
        yield CounterMetricFamily(
            "moeserve_slots_moved",
            "Expert weights sent to another slot by migrations.",
            value=float(status.moved_slots),
        )
        yield CounterMetricFamily(
            "moeserve_bytes_moved", "Bytes of expert weights sent by migrations.", value=float(status.moved_bytes)
        )
        yield GaugeMetricFamily(
            "moeserve_requests_waiting", "Requests in the admission queue.", value=float(status.waiting)
        )
        yield GaugeMetricFamily(
            "moeserve_requests_running", "Sequences running on the routers.", value=float(status.running)
        )
        yield GaugeMetricFamily(
            "moeserve_kv_cache_usage_ratio",
            "KV blocks in use / KV blocks of all routers.",
            value=status.kv_blocks_used / status.kv_blocks_total if status.kv_blocks_total else 0.0,
        )
        yield GaugeMetricFamily(
            "moeserve_kv_cache_blocks", "KV blocks of all routers' paged caches.", value=float(status.kv_blocks_total)
        )
        yield CounterMetricFamily(
            "moeserve_preemptions",
            "Sequences preempted (freed, to be recomputed) because KV blocks ran out.",
            value=float(status.preemptions),
        )
        yield GaugeMetricFamily(
            "moeserve_cluster_generation",
            "Times the world re-formed since start (a rank lost, replaced or joining).",
            value=float(status.generation),
        )
        g = GaugeMetricFamily(
            "moeserve_ranks", "Ranks in the world now, by role (a co-located rank counts in both).", labels=("role",)
        )
        for role in RANK_ROLES:
            g.add_metric((role,), float(status.ranks_in_world.get(role, 0)))
        yield g
        for name, help_, counts in (
            (
                "moeserve_ranks_lost",
                "Ranks lost (their process died or fell out of the world), by role.",
                status.ranks_lost,
            ),
            (
                "moeserve_rank_replacements",
                "Replacements of lost ranks that joined the world, by role.",
                status.ranks_replaced,
            ),
        ):
            c = CounterMetricFamily(name, help_, labels=("role",))
            for role in RANK_ROLES:
                c.add_metric((role,), float(counts.get(role, 0)))
            yield c
        for name, help_, attr in STATUS_COUNTERS:
            yield CounterMetricFamily(name, help_, value=float(getattr(status, attr)))


def _add_matrix(family, values: np.ndarray, rows: list[str], cols: list[str]) -> None:
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            family.add_metric((r, c), float(values[i, j]))


# -- router ranks -----------------------------------------------------------------------------


class RouterMetrics:
    """Dispatch and combine durations of a router rank; :meth:`instrument` hooks them into the
    rank's experts backend."""

    def __init__(self, registry: CollectorRegistry):
        self.dispatch_seconds = Histogram(
            "moeserve_dispatch_duration_seconds",
            "Host-side time of a router's dispatch of one MoE layer "
            "(slot choice, counts, row gather, start of the exchange).",
            buckets=EXCHANGE_BUCKETS,
            registry=registry,
        )
        self.combine_seconds = Histogram(
            "moeserve_combine_duration_seconds",
            "Host-side time of a router's combine of one MoE layer (end of "
            "the exchange, waiting for the workers, weighted sum).",
            buckets=EXCHANGE_BUCKETS,
            registry=registry,
        )

    def instrument(self, experts) -> None:
        """Time ``experts.dispatch`` and ``experts.combine`` (instance attributes shadow the
        methods): two clock reads and one observation each, no device synchronisation."""
        experts.dispatch = _timed(experts.dispatch, self.dispatch_seconds.observe)
        experts.combine = _timed(experts.combine, self.combine_seconds.observe)


def _timed(fn, observe):
    clock = time.perf_counter

    def timed(*args):
        t0 = clock()
        out = fn(*args)
        observe(clock() - t0)
        return out

    # sets timed.__wrapped__ = fn only (no name or docstring copied)
    functools.update_wrapper(timed, fn, assigned=(), updated=())
    return timed


# -- the front end ----------------------------------------------------------------------------


class FrontendMetrics:
    """Request metrics of the serving front end; :meth:`request` starts one request's record.
    ``vllm``: a ``moeserve.ops.vllm_metrics.VllmMetrics`` that records the same requests under
    vLLM's names (None: none)."""

    def __init__(self, registry: CollectorRegistry, vllm=None):
        self.vllm = vllm
        self.ttft = Histogram(
            "moeserve_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "moeserve_time_per_output_token_seconds",
            "Mean time between a request's generated tokens after the first.",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "moeserve_e2e_request_latency_seconds",
            "From a request's arrival to its last token.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.queue = Histogram(
            "moeserve_request_queue_time_seconds",
            "The leader's clock: from the engine taking a request to its first admission to a router.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.prefill = Histogram(
            "moeserve_request_prefill_time_seconds",
            "The leader's clock: from a request's first admission to the leader learning its first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.ttft_part = Histogram(
            "moeserve_time_to_first_token_part_seconds",
            "A request's TTFT by part, in order: frontend_before (arrival to the submit's write), "
            "submit_transport (to the leader's channel reading it), leader_intake (to the engine taking it), "
            "queue, prefill (the leader's), leader_event (to the leader's channel writing the first token's "
            "event), event_transport (to the front end reading it), frontend_after (to the first token); "
            "wall clocks across processes, the parts sum to the TTFT.",
            ("part",),
            buckets=PART_BUCKETS,
            registry=registry,
        )
        # Label children looked up once: observed for every request.
        self._parts = [self.ttft_part.labels(p) for p in TTFT_PARTS]
        self.prompt_tokens = Counter("moeserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=registry)
        self.generation_tokens = Counter("moeserve_generation_tokens", "Generated tokens.", registry=registry)
        self.requests = Counter(
            "moeserve_requests", "Requests that ended, by finish reason.", ("finish_reason",), registry=registry
        )
        for r in FINISH_REASONS:
            self.requests.labels(r)
        self.in_flight = Gauge("moeserve_requests_in_flight", "Requests the front end is serving.", registry=registry)

    def request(self, prompt_tokens: int) -> RequestRecord:
        return RequestRecord(self, prompt_tokens)


class RequestRecord:
    """One request's timings: ``token(n)`` as tokens arrive, then ``finish(reason)`` once."""

    def __init__(self, m: FrontendMetrics, prompt_tokens: int):
        self.m = m
        self.start = time.monotonic()
        self.start_wall = time.time()  # the clock of the hops across processes (ttft_parts)
        self.first: float | None = None
        self.first_wall = 0.0
        self.last = self.start
        self.tokens = 0
        self.done = False
        self.prompt_tokens = prompt_tokens
        self.prefill_s: float | None = None
        m.prompt_tokens.inc(prompt_tokens)
        m.in_flight.inc()
        if m.vllm is not None:
            m.vllm.admitted(prompt_tokens)

    def engine_times(self, queued_s: float, prefill_s: float) -> None:
        """The leader's queue and prefill time of the request (its ``FirstToken``)."""
        self.prefill_s = prefill_s
        self.m.queue.observe(queued_s)
        self.m.prefill.observe(prefill_s)
        if self.m.vllm is not None:
            self.m.vllm.engine_times(queued_s, prefill_s)

    def ttft_parts(self, hops, queued_s: float, prefill_s: float) -> dict[str, float] | None:
        """Record where the TTFT went (``moeserve_time_to_first_token_part_seconds``), after
        :meth:`token` saw the first token; ``hops``: its ``api.HopTimes``. Returns the parts
        (seconds, each at least 0), or None (nothing recorded) when a hop was not stamped (an
        engine in this process, a channel without stamps)."""
        h = hops
        if self.first is None or h is None or not all((h.sent, h.received, h.arrived, h.known, h.written, h.read)):
            return None
        values = (
            h.sent - self.start_wall,
            h.received - h.sent,
            h.arrived - h.received,
            queued_s,
            prefill_s,
            h.written - h.known,
            h.read - h.written,
            self.first_wall - h.read,
        )
        parts = {}
        for name, child, v in zip(TTFT_PARTS, self.m._parts, values):
            v = max(0.0, v)  # the wall clock may step between two stamps
            child.observe(v)
            parts[name] = v
        return parts

    def token(self, n: int = 1) -> None:
        now = time.monotonic()
        first = gap = None
        if self.first is None and n > 0:
            self.first, self.first_wall = now, time.time()
            first = now - self.start
            self.m.ttft.observe(first)
        elif n > 0:
            gap = now - self.last
        self.last = now
        self.tokens += n
        self.m.generation_tokens.inc(n)
        if self.m.vllm is not None:
            self.m.vllm.token(gap, first, n)

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.m
        m.in_flight.dec()
        m.requests.labels(reason if reason in FINISH_REASONS else "error").inc()
        e2e = tpot = decode = None
        if self.first is not None:
            e2e, decode = self.last - self.start, self.last - self.first
            m.e2e.observe(e2e)
            if self.tokens > 1:
                tpot = decode / (self.tokens - 1)
                m.tpot.observe(tpot)
        if m.vllm is not None:
            m.vllm.finished(reason, self.prompt_tokens, self.tokens, e2e, tpot, decode, self.prefill_s)


# -- the balancer -----------------------------------------------------------------------------


class BalancerMetrics:
    """Rebalances by result and their duration. ``paused``, ``admin_reachable`` and (each
    optional, no series without it) ``balancedness``, ``predicted_step_s``, ``step_efficiency``:
    callables read at scrape time."""

    def __init__(
        self,
        registry: CollectorRegistry,
        paused=lambda: False,
        admin_reachable=lambda: True,
        balancedness=None,
        predicted_step_s=None,
        step_efficiency=None,
    ):
        self.rebalances = Counter(
            "moeserve_rebalances",
            "Rebalances by result: done (applied, migration "
            "finished), skipped (the plan did not pay), failed, dry_run.",
            ("result",),
            registry=registry,
        )
        for r in REBALANCE_RESULTS:
            self.rebalances.labels(r)
        self.duration = Histogram(
            "moeserve_rebalance_duration_seconds",
            "From the start of planning to the end of the migration (or to the decision not to apply).",
            buckets=REBALANCE_BUCKETS,
            registry=registry,
        )
        g = Gauge("moeserve_balancer_paused", "1 while the balancer's loop is paused.", registry=registry)
        g.set_function(lambda: float(bool(paused())))
        g = Gauge("moeserve_balancer_admin_reachable", "1 when the last admin call answered.", registry=registry)
        g.set_function(lambda: float(bool(admin_reachable())))
        if balancedness is not None:
            g = Gauge(
                "moeserve_balancer_balancedness",
                "Predicted balancedness (mean over MoE layers) of the "
                "placement in force on the load window, as the balancer last saw it.",
                registry=registry,
            )
            g.set_function(lambda: float(balancedness()))
        if predicted_step_s is not None:
            g = Gauge(
                "moeserve_balancer_predicted_step_seconds",
                "With a step model (--eplb-step-model): the "
                "predicted MoE seconds of a step (sum over MoE layers of the slowest worker's) of the "
                "placement in force on the load window, as the balancer last saw it.",
                registry=registry,
            )
            g.set_function(lambda: float(predicted_step_s()))
        if step_efficiency is not None:
            g = Gauge(
                "moeserve_balancer_step_efficiency",
                "With a step model: the mean worker's predicted MoE "
                "time over the slowest worker's, summed over layers, in (0, 1] (the step-time analogue of "
                "balancedness; the threshold trigger compares it).",
                registry=registry,
            )
            g.set_function(lambda: float(step_efficiency()))

    def record(self, result: str, seconds: float) -> None:
        if result not in REBALANCE_RESULTS:
            raise ValueError(f"rebalance result must be one of {REBALANCE_RESULTS}, got {result!r}")
        self.rebalances.labels(result).inc()
        if result != "dry_run":
            self.duration.observe(seconds)


# -- readiness (the front end, the admin service in the leader, the balancer) -----------------

READY_REASONS = ("step_stalled", "leader_unreachable", "cluster_failed")  # as moeserve.services.readiness


class ReadinessMetrics:
    """Whether this process's health says SERVING (the cluster can take a request) and, when
    not, why: one of :data:`READY_REASONS`. Not ready until the first look."""

    def __init__(self, registry: CollectorRegistry):
        self.ready = Gauge(
            "moeserve_ready",
            "1 while this process's health says SERVING (the cluster can take a "
            "request), else 0; moeserve_not_ready_reason says why.",
            registry=registry,
        )
        self.reason = Gauge(
            "moeserve_not_ready_reason",
            "1 for the reason this process is not ready: step_stalled "
            "(no step for the stall deadline), leader_unreachable, cluster_failed; 0 for the others.",
            ("reason",),
            registry=registry,
        )
        self._reasons = {r: self.reason.labels(r) for r in READY_REASONS}

    def set(self, reason: str | None) -> None:
        """None: ready; else the reason (one of READY_REASONS)."""
        if reason is not None and reason not in self._reasons:
            raise ValueError(f"not-ready reason must be one of {READY_REASONS}, got {reason!r}")
        self.ready.set(1.0 if reason is None else 0.0)
        for r, g in self._reasons.items():
            g.set(1.0 if r == reason else 0.0)


def scrape_text(registry: CollectorRegistry) -> str:
    """The registry in the text exposition format (what ``/metrics`` serves)."""
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()
