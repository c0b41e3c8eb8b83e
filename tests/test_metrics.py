"""Metrics of every process (moeserve/ops/metrics.py, moeserve/services/metrics.py for gRPC servers):
names, series present from the start, what the leader, routers, front end, balancer and gRPC
servers record, that docs/metrics.md lists them all, and promtool's verdict."""

import asyncio
import pathlib
import re
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ops_util import check_metrics, samples, scrape

from moeserve.cluster.rank import initial_placement
from moeserve.config import ClusterConfig, EplbConfig
from moeserve.dataplane.protocol import RankResult, StepHeader
from moeserve.ops import metrics as M
from moeserve.placement import MigrationProgress, MigrationState
from moeserve.router.engine.api import EngineStatus, LoadReport
from moeserve.router.engine.leader import Engine, ModelShape
from moeserve.services import metrics as GM

LAYERS, EXPERTS, WORKERS, REDUNDANT = 2, 8, 2, 2
EXPERT_BYTES = 1000

pytestmark = pytest.mark.timeout(120)


def engine(layers=LAYERS, experts=EXPERTS) -> Engine:
    cfg = ClusterConfig(
        model_dir="/nowhere",
        routers=1,
        workers=WORKERS,
        heartbeat_s=0.001,
        eplb=EplbConfig(enable_eplb=True, num_redundant_experts=REDUNDANT),
    )
    shape = ModelShape(layers, experts, 1, 512, (2,), EXPERT_BYTES)
    return Engine(cfg, shape, initial_placement(cfg, layers, experts))


def forward(eng: Engine, logical: np.ndarray, wload: np.ndarray) -> None:
    """One forward step as the gather hands it to the leader."""
    eng.next_header()
    results = [RankResult(0, logical_load=logical, worker_load=wload)] + [RankResult(r) for r in (1, 2)]
    eng.on_results(StepHeader(eng.step, forward=True), results)


def leader_registry(eng: Engine, per_expert: str = "auto"):
    pm = M.ProcessMetrics("router", 0)
    eng.metrics = M.LeaderMetrics(pm.registry, eng, per_expert)
    return pm


def test_a_process_serves_its_metrics_on_a_free_port_when_given_port_0():
    pm = M.ProcessMetrics("worker", 3)
    try:
        port = pm.serve(0, "127.0.0.1")
        assert port > 0 and pm.port == port
        text = scrape(port)
        assert samples(text, "moeserve_process_info") == {(("rank", "3"), ("role", "worker")): 1.0}
        assert "process_cpu_seconds_total" in text
        assert "_created" not in text  # no creation-time series
    finally:
        pm.close()


@pytest.mark.parametrize(
    "choice,layers,experts,on",
    [
        ("auto", 16, 256, True),  # 4096 series: still on
        ("auto", 17, 256, False),  # 4352: off
        ("on", 61, 256, True),  # forced on (DeepSeek-V3 size)
        ("off", 2, 8, False),  # forced off
    ],
)
def test_per_expert_series_are_on_while_layers_x_experts_is_at_most_4096_unless_forced(choice, layers, experts, on):
    assert M.per_expert_enabled(choice, layers, experts) is on


def test_an_unknown_per_expert_choice_is_refused():
    with pytest.raises(ValueError, match="auto"):
        M.per_expert_enabled("maybe", 2, 8)


def test_every_leader_series_a_dashboard_queries_exists_before_the_first_step():
    eng = engine()
    text = M.scrape_text(leader_registry(eng).registry)
    tokens = samples(text, "moeserve_expert_tokens_total")
    assert len(tokens) == LAYERS * EXPERTS and set(tokens.values()) == {0.0}
    assert len(samples(text, "moeserve_expert_replicas")) == LAYERS * EXPERTS
    assert len(samples(text, "moeserve_worker_tokens_total")) == LAYERS * WORKERS
    assert set(samples(text, "moeserve_layer_balancedness").values()) == {1.0}  # no tokens: 1.0
    assert samples(text, "moeserve_migrations_total")[(("result", "failed"),)] == 0.0
    for kind in M.STEP_KINDS:
        assert samples(text, "moeserve_steps_total")[(("kind", kind),)] == 0.0
        assert samples(text, "moeserve_step_duration_seconds_count")[(("kind", kind),)] == 0.0
    for name in (
        "moeserve_placement_version",
        "moeserve_migration_in_progress",
        "moeserve_slots_moved_total",
        "moeserve_bytes_moved_total",
        "moeserve_requests_waiting",
        "moeserve_requests_running",
    ):
        assert len(samples(text, name)) == 1, name


def test_per_expert_series_can_be_turned_off():
    text = M.scrape_text(leader_registry(engine(), "off").registry)
    assert not samples(text, "moeserve_expert_tokens_total")
    assert not samples(text, "moeserve_expert_replicas")
    assert len(samples(text, "moeserve_worker_tokens_total")) == LAYERS * WORKERS


def test_the_leader_exports_the_load_it_aggregated_and_counts_steps_by_kind():
    eng = engine()
    pm = leader_registry(eng)
    logical = np.arange(LAYERS * EXPERTS).reshape(LAYERS, EXPERTS)  # [L, E]
    wload = np.array([[10, 30], [20, 20]])  # [L, W]
    forward(eng, logical, wload)
    forward(eng, logical, wload)
    eng.on_results(eng.next_header(), [RankResult(r) for r in range(3)])  # idle: a heartbeat
    text = M.scrape_text(pm.registry)
    tokens = samples(text, "moeserve_expert_tokens_total")
    assert tokens[(("expert", "3"), ("layer", "1"))] == 2 * logical[1, 3]
    workers = samples(text, "moeserve_worker_tokens_total")
    assert workers[(("layer", "0"), ("worker", "1"))] == 60
    bal = samples(text, "moeserve_layer_balancedness")
    assert bal[(("layer", "0"),)] == pytest.approx(20 / 30) and bal[(("layer", "1"),)] == 1.0
    steps = samples(text, "moeserve_steps_total")
    assert steps[(("kind", "forward"),)] == 2 and steps[(("kind", "heartbeat"),)] == 1
    assert samples(text, "moeserve_step_duration_seconds_count")[(("kind", "forward"),)] == 2
    replicas = samples(text, "moeserve_expert_replicas")
    assert replicas[(("expert", "0"), ("layer", "0"))] == 2 and replicas[(("expert", "7"), ("layer", "0"))] == 1


def test_a_migration_counts_slots_and_bytes_moved_and_its_result():
    eng = engine()
    pm = leader_registry(eng)
    target = eng.placement().phy2log.copy()
    target[0, [2, 7]] = target[0, [7, 2]]  # two experts change workers in layer 0
    target[1, 8] = 5  # a hot expert's replica instead of expert 0's
    mig = eng.apply_placement(target)
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_migration_in_progress") == {(): 1.0}
    for _ in range(50):
        mig = eng.migration(mig.migration_id)
        if mig.ended:
            break
        eng.on_results(eng.next_header(), [RankResult(r) for r in range(3)])
    assert mig.state == "done"
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_slots_moved_total") == {(): 3.0}
    assert samples(text, "moeserve_bytes_moved_total") == {(): 3.0 * EXPERT_BYTES}
    assert samples(text, "moeserve_migrations_total")[(("result", "done"),)] == 1
    assert samples(text, "moeserve_migration_in_progress") == {(): 0.0}
    assert samples(text, "moeserve_placement_version") == {(): float(eng.placement().version)}
    assert samples(text, "moeserve_steps_total")[(("kind", "migration"),)] >= 2
    assert samples(text, "moeserve_expert_replicas")[(("expert", "5"), ("layer", "1"))] == 2


class _PublicEngine:
    """Only the engine's public API: the leader's metrics must need nothing else (no migrator,
    no scheduler)."""

    def __init__(self, status: EngineStatus):
        self._leader = engine()
        self.shape = self._leader.shape
        self._status = status

    def placement(self):
        return self._leader.placement()

    def total_load(self):
        return self._leader.total_load()

    def total_worker_load(self):
        return self._leader.total_worker_load()

    def expert_load(self, window_steps=None) -> LoadReport:
        return self._leader.expert_load(window_steps)

    def status(self) -> EngineStatus:
        return self._status


def test_the_leader_reads_migration_moves_and_queue_from_the_engine_status():
    progress = MigrationProgress(
        "m-1",
        MigrationState.MOVING,
        "",
        7,
        moves_total=8,
        moves_done=2,
        bytes_total=8000,
        bytes_done=2000,
        layers_total=2,
        layers_committed=0,
    )
    status = EngineStatus(
        step=10,
        forward_steps=9,
        uptime_s=1.0,
        placement_version=6,
        layer_versions=(6, 6),
        migration=progress,
        error=None,
        waiting=3,
        running=5,
        moved_slots=11,
        moved_bytes=11000,
        migrations_ended={"done": 2, "aborted": 1},
    )
    pm = M.ProcessMetrics("router", 0)
    M.LeaderMetrics(pm.registry, _PublicEngine(status))
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_migration_in_progress") == {(): 1.0}
    assert samples(text, "moeserve_migration_progress_ratio") == {(): 0.25}
    assert samples(text, "moeserve_migrations_total") == {
        (("result", "done"),): 2.0,
        (("result", "aborted"),): 1.0,
        (("result", "failed"),): 0.0,
    }
    assert samples(text, "moeserve_slots_moved_total") == {(): 11.0}
    assert samples(text, "moeserve_bytes_moved_total") == {(): 11000.0}
    assert samples(text, "moeserve_requests_waiting") == {(): 3.0}
    assert samples(text, "moeserve_requests_running") == {(): 5.0}

    idle = EngineStatus(
        step=10,
        forward_steps=9,
        uptime_s=1.0,
        placement_version=6,
        layer_versions=(6, 6),
        migration=None,
        error=None,
        waiting=0,
        running=0,
    )
    pm = M.ProcessMetrics("router", 0)
    M.LeaderMetrics(pm.registry, _PublicEngine(idle))
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_migration_in_progress") == {(): 0.0}
    assert samples(text, "moeserve_migration_progress_ratio") == {(): 0.0}
    assert set(samples(text, "moeserve_migrations_total").values()) == {0.0}


def test_the_leader_says_how_the_world_re_formed_lost_and_replaced_ranks_and_readmitted_requests():
    status = EngineStatus(
        step=10,
        forward_steps=9,
        uptime_s=1.0,
        placement_version=6,
        layer_versions=(6, 6),
        migration=None,
        error=None,
        waiting=0,
        running=4,
        readmitted=7,
        generation=3,
        members=(0, 2, 3),
        ranks_in_world={"router": 1, "worker": 2},
        ranks_lost={"router": 1, "worker": 1},
        ranks_replaced={"router": 0, "worker": 1},
    )
    pm = M.ProcessMetrics("router", 0)
    M.LeaderMetrics(pm.registry, _PublicEngine(status))
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_cluster_generation") == {(): 3.0}
    assert samples(text, "moeserve_ranks") == {(("role", "router"),): 1.0, (("role", "worker"),): 2.0}
    assert samples(text, "moeserve_ranks_lost_total") == {(("role", "router"),): 1.0, (("role", "worker"),): 1.0}
    assert samples(text, "moeserve_rank_replacements_total") == {
        (("role", "router"),): 0.0,
        (("role", "worker"),): 1.0,
    }
    assert samples(text, "moeserve_requests_readmitted_total") == {(): 7.0}


def test_router_timing_hooks_wrap_dispatch_and_combine_and_return_their_results():
    pm = M.ProcessMetrics("router", 1)
    rm = M.RouterMetrics(pm.registry)

    class Experts:
        def dispatch(self, layer, hidden, routing):
            return ("handle", layer)

        def combine(self, handle):
            return handle[1] * 10

    ex = Experts()
    rm.instrument(ex)
    assert ex.combine(ex.dispatch(3, None, None)) == 30
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_dispatch_duration_seconds_count") == {(): 1.0}
    assert samples(text, "moeserve_combine_duration_seconds_count") == {(): 1.0}


def test_the_front_end_records_latencies_tokens_and_finish_reasons():
    pm = M.ProcessMetrics("frontend")
    fm = M.FrontendMetrics(pm.registry)
    text = M.scrape_text(pm.registry)
    assert set(samples(text, "moeserve_requests_total")) == {(("finish_reason", r),) for r in M.FINISH_REASONS}
    rec = fm.request(prompt_tokens=5)
    assert samples(M.scrape_text(pm.registry), "moeserve_requests_in_flight") == {(): 1.0}
    rec.engine_times(0.25, 0.5)  # the leader's clock, from the first token's event
    for _ in range(4):
        rec.token()
    rec.finish("length")
    rec.finish("length")  # once only
    fm.request(prompt_tokens=3).finish("cancelled")  # no token: no latency observed
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_prompt_tokens_total") == {(): 8.0}
    assert samples(text, "moeserve_generation_tokens_total") == {(): 4.0}
    assert samples(text, "moeserve_requests_total")[(("finish_reason", "length"),)] == 1
    assert samples(text, "moeserve_requests_total")[(("finish_reason", "cancelled"),)] == 1
    assert samples(text, "moeserve_time_to_first_token_seconds_count") == {(): 1.0}
    assert samples(text, "moeserve_time_per_output_token_seconds_count") == {(): 1.0}
    assert samples(text, "moeserve_e2e_request_latency_seconds_count") == {(): 1.0}
    assert samples(text, "moeserve_requests_in_flight") == {(): 0.0}
    assert samples(text, "moeserve_request_queue_time_seconds_sum") == {(): 0.25}
    assert samples(text, "moeserve_request_prefill_time_seconds_sum") == {(): 0.5}


def test_the_front_end_splits_each_ttft_at_every_hop_and_the_parts_add_up_to_it():
    import time

    from moeserve.router.engine.api import HopTimes

    pm = M.ProcessMetrics("frontend")
    fm = M.FrontendMetrics(pm.registry)
    rec = fm.request(prompt_tokens=5)
    t = rec.start_wall
    # 1 ms in the front end, 2 ms to the leader, 1 ms of intake, queue 3 + prefill 5 ms, 1 ms to
    # the leader's write, 2 ms back, then the front end until the token
    hops = HopTimes(sent=t + 0.001, received=t + 0.003, arrived=t + 0.004, known=t + 0.012, written=t + 0.013)
    hops.read = t + 0.015
    time.sleep(0.02)
    assert rec.ttft_parts(hops, 0.003, 0.005) is None  # before the first token: nothing
    rec.token()
    parts = rec.ttft_parts(hops, 0.003, 0.005)
    assert list(parts) == list(M.TTFT_PARTS) and all(v >= 0 for v in parts.values())
    want = dict(frontend_before=0.001, submit_transport=0.002, leader_intake=0.001, queue=0.003, prefill=0.005)
    want.update(leader_event=0.001, event_transport=0.002)
    assert {k: parts[k] for k in want} == pytest.approx(want, abs=1e-6)  # epoch seconds: ~0.2 us apart
    ttft = rec.first - rec.start
    assert parts["frontend_after"] >= 0.005 and sum(parts.values()) == pytest.approx(ttft, abs=1e-3)
    # a hop nobody stamped (an engine in this process, an older channel): no parts, TTFT still
    other = fm.request(prompt_tokens=3)
    other.token()
    assert other.ttft_parts(HopTimes(known=time.time()), 0.0, 0.0) is None and other.ttft_parts(None, 0, 0) is None
    text = M.scrape_text(pm.registry)
    counts = samples(text, "moeserve_time_to_first_token_part_seconds_count")
    assert counts == {(("part", p),): 1.0 for p in M.TTFT_PARTS}
    sums = samples(text, "moeserve_time_to_first_token_part_seconds_sum")
    assert sum(sums.values()) <= samples(text, "moeserve_time_to_first_token_seconds_sum")[()]
    assert samples(text, "moeserve_time_to_first_token_seconds_count") == {(): 2.0}


def test_the_balancer_shows_every_result_from_the_start_and_times_real_rebalances():
    pm = M.ProcessMetrics("balancer")
    state = {"paused": True}
    bm = M.BalancerMetrics(pm.registry, paused=lambda: state["paused"])
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_rebalances_total") == {(("result", r),): 0.0 for r in M.REBALANCE_RESULTS}
    assert samples(text, "moeserve_balancer_paused") == {(): 1.0}
    bm.record("done", 2.0)
    bm.record("dry_run", 0.1)
    with pytest.raises(ValueError):
        bm.record("exploded", 1.0)
    text = M.scrape_text(pm.registry)
    assert samples(text, "moeserve_rebalances_total")[(("result", "done"),)] == 1
    assert samples(text, "moeserve_rebalance_duration_seconds_count") == {(): 1.0}  # dry runs are not timed


class _Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        if request.service == "missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such service")
        if request.service == "crash":
            raise RuntimeError("boom")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_grpc_calls_are_counted_by_method_and_code_and_unknown_methods_create_no_series():
    pm = M.ProcessMetrics("balancer")
    interceptor = GM.grpc_interceptor(pm, GM.HEALTH)

    async def run():
        server = grpc.aio.server(interceptors=[interceptor])
        health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                codes = []
                for svc in ("", "", "missing", "crash"):
                    try:
                        await stub.Check(health_pb2.HealthCheckRequest(service=svc))
                        codes.append("OK")
                    except grpc.RpcError as e:
                        codes.append(e.code().name)
                bogus = ch.unary_unary("/no.such.Service/Nothing")
                with pytest.raises(grpc.RpcError):
                    await bogus(b"")
                return codes
        finally:
            await server.stop(0)

    before = M.scrape_text(pm.registry)
    handled = samples(before, "moeserve_grpc_server_handled_total")
    assert handled[(("grpc_code", "OK"), ("grpc_method", "Watch"), ("grpc_service", GM.HEALTH))] == 0
    assert asyncio.run(run()) == ["OK", "OK", "NOT_FOUND", "UNKNOWN"]
    text = M.scrape_text(pm.registry)
    handled = samples(text, "moeserve_grpc_server_handled_total")
    key = lambda code: (("grpc_code", code), ("grpc_method", "Check"), ("grpc_service", GM.HEALTH))  # noqa: E731
    assert handled[key("OK")] == 2 and handled[key("NOT_FOUND")] == 1 and handled[key("UNKNOWN")] == 1
    assert (
        samples(text, "moeserve_grpc_server_handling_seconds_count")[
            (("grpc_method", "Check"), ("grpc_service", GM.HEALTH))
        ]
        == 4
    )
    assert not any("no.such" in str(k) for k in handled)


def test_the_grpc_metrics_of_a_process_are_made_once_and_shared_by_its_servers():
    pm = M.ProcessMetrics("frontend")
    GM.grpc_interceptor(pm, "moeserve.v1.Serving")
    GM.grpc_interceptor(pm, GM.HEALTH)  # a second server of the same process: no duplicate
    handled = samples(M.scrape_text(pm.registry), "moeserve_grpc_server_handled_total")
    services = {dict(k)["grpc_service"] for k in handled}
    assert services == {"moeserve.v1.Serving", GM.HEALTH}
    other = M.ProcessMetrics("balancer")  # another registry gets its own families
    GM.grpc_interceptor(other, "moeserve.v1.Balancer")
    services = {
        dict(k)["grpc_service"] for k in samples(M.scrape_text(other.registry), "moeserve_grpc_server_handled_total")
    }
    assert services == {"moeserve.v1.Balancer", GM.HEALTH}


def _every_group():
    """A registry with every group of metrics, after one forward step."""
    eng = engine()
    pm = leader_registry(eng)
    M.RouterMetrics(pm.registry)
    from moeserve.ops.vllm_metrics import VllmMetrics

    M.FrontendMetrics(pm.registry, VllmMetrics(pm.registry, "tiny"))
    M.BalancerMetrics(
        pm.registry, balancedness=lambda: 0.9, predicted_step_s=lambda: 0.01, step_efficiency=lambda: 0.8
    )  # the step-time series: with --eplb-step-model
    M.ReadinessMetrics(pm.registry)
    GM.grpc_interceptor(pm, GM.HEALTH)
    forward(eng, np.ones((LAYERS, EXPERTS), dtype=np.int64), np.ones((LAYERS, WORKERS), dtype=np.int64))
    return pm


def test_docs_metrics_md_lists_every_metric_with_its_type_and_labels_and_no_other():
    from prometheus_client.parser import text_string_to_metric_families

    exported = {}
    for fam in text_string_to_metric_families(M.scrape_text(_every_group().registry)):
        if fam.name.startswith(("moeserve_", "vllm:")):
            name = fam.name + ("_total" if fam.type == "counter" else "")
            exported[name] = (fam.type, sorted({k for smp in fam.samples for k in smp.labels} - {"le"}))
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    assert set(re.findall(r"moeserve_[a-z0-9_]+|vllm:[a-z0-9_]+", doc)) == set(exported)
    documented, header = {}, []
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0] == "metric":
            header = cells
        elif cells and cells[0].startswith(("`moeserve_", "`vllm:")):
            row = dict(zip(header, cells))
            documented[cells[0].strip("`")] = (row["type"], sorted(re.findall(r"`(\w+)`", row.get("labels", ""))))
    for name, labels in re.findall(r"`(moeserve_[a-z0-9_]+)\{([a-z_, ]+)\}`", doc):
        documented[name] = (exported[name][0], sorted(x.strip() for x in labels.split(",")))
    assert documented == exported


@pytest.mark.slow
def test_importing_the_metrics_module_imports_no_grpc_or_protobuf():
    code = (
        "import sys\nimport moeserve.ops.metrics\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'grpc_health') "
        "or m.startswith('google.protobuf'))\nassert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_promtool_finds_nothing_to_say_about_a_registry_with_every_group():
    check_metrics(M.scrape_text(_every_group().registry))


@pytest.mark.slow
def test_a_rank_with_metrics_on_imports_no_grpc_code():
    """The GPU machines have no protobuf: what a rank records must not need it (only the
    leader's admin API, a gRPC server anyway, uses the gRPC interceptor)."""
    code = (
        "import sys\nfrom moeserve.ops import metrics as M\nimport moeserve.cluster.rank\n"
        "pm = M.ProcessMetrics('router', 0)\nM.RouterMetrics(pm.registry)\nM.scrape_text(pm.registry)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('grpc', 'google.protobuf', 'moeserve.rpc', "
        "'moeserve.services', 'moeserve.client')))\nassert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
