"""A live cluster (``moeserve up --metrics-port M``) scraped every second by a real Prometheus:
the metrics port layout, GetStatus reporting it, promtool on a scrape of every service, what
the metrics say after traffic and one rebalance, and every PromQL expression of every
dashboard panel returning data."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
import yaml
from control_util import Up, free_ports
from ops_util import DASHBOARDS, check_metrics, prometheus, samples, scrape

from moeserve.ops.ports import free_block

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUESTS, MAX_TOKENS = 16, 12
# Grafana's variables, as an instant query at "now" sees them.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "1h", "$layer": "0", "$model_name": ".+"}


class Prometheus:
    """The Debian ``prometheus`` binary scraping ``targets`` every second."""

    def __init__(self, targets: dict[str, int], tmp):
        (self.port,) = free_ports(1)
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "moeserve",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{port}"], "labels": {"service": name}}
                        for name, port in targets.items()
                    ],
                }
            ],
        }
        path = tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                prometheus(),
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.targets = targets

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            out = json.loads(r.read())
        assert out["status"] == "success", out
        return out["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def wait_all_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                up = self.query("up")
                if len(up) == len(self.targets) and all(r["value"][1] == "1" for r in up):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"Prometheus targets not all up: {self.api('targets')}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def run(demo_checkpoint, tmp_path_factory):
    """The cluster and Prometheus, after traffic, one rebalance and more traffic."""
    base = free_block(5)
    up = Up(
        demo_checkpoint,
        "--routers",
        "1",
        "--workers",
        "2",
        "--enable-eplb",
        "--num-redundant-experts",
        "2",
        "--eplb-step-interval",
        "100000000",
        "--eplb-move-budget",
        "0.2",
        "--metrics-port",
        str(base),
    )
    prom = None
    try:
        serving, admin, balancer = up.clients()
        ports = admin.status().metrics_ports
        prom = Prometheus(ports, tmp_path_factory.mktemp("prometheus"))
        prom.wait_all_up()
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 500, int(rng.integers(4, 16))).tolist() for _ in range(REQUESTS)]

        def traffic():
            threads = [
                threading.Thread(
                    target=serving.generate,
                    kwargs=dict(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120),
                )
                for p in prompts
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)

        traffic()
        rebalance = balancer.rebalance(wait=True)
        traffic()
        time.sleep(3)  # a few more scrapes
        yield dict(up=up, base=base, ports=ports, prom=prom, rebalance=rebalance, admin=admin, dump=admin.dump_load())
    finally:
        if prom is not None:
            prom.stop()
        up.stop()


def test_up_gives_the_leader_m_the_balancer_m1_the_front_end_m2_then_the_other_ranks_and_prints_them(run):
    m = run["base"]
    assert run["ports"] == {"rank0": m, "balancer": m + 1, "frontend": m + 2, "rank1": m + 3, "rank2": m + 4}
    out = run["up"].output()
    for name, port in run["ports"].items():
        assert f"http://127.0.0.1:{port}/metrics" in out, (name, out)
    assert "rank 0 (router, leader)" in out and "front end" in out


def test_every_service_scrape_passes_promtool(run):
    for name, port in run["ports"].items():
        text = scrape(port)
        assert "moeserve_process_info" in text, name
        check_metrics(text)


def test_the_metrics_tell_what_happened(run):
    p = run["ports"]
    leader, front, bal = scrape(p["rank0"]), scrape(p["frontend"]), scrape(p["balancer"])
    total = np.asarray(run["dump"].total_load)  # [L, E]
    tokens = samples(leader, "moeserve_expert_tokens_total")
    assert sum(tokens.values()) == total.sum()
    assert tokens[(("expert", "2"), ("layer", "0"))] == total[0, 2]
    assert sum(samples(leader, "moeserve_worker_tokens_total").values()) == total.sum()
    rb = run["rebalance"]
    assert rb.applied
    assert samples(leader, "moeserve_slots_moved_total") == {(): float(rb.slots_moved)}
    assert samples(leader, "moeserve_bytes_moved_total") == {(): float(rb.bytes_moved)}
    assert samples(leader, "moeserve_migrations_total")[(("result", "done"),)] == 1
    assert samples(leader, "moeserve_placement_version") == {(): float(run["admin"].placement().version)}
    assert samples(bal, "moeserve_rebalances_total") == {
        (("result", "done"),): 1.0,
        (("result", "skipped"),): 0.0,
        (("result", "failed"),): 0.0,
        (("result", "dry_run"),): 0.0,
    }
    assert samples(bal, "moeserve_rebalance_duration_seconds_count") == {(): 1.0}
    assert samples(front, "moeserve_time_to_first_token_seconds_count") == {(): 2.0 * REQUESTS}
    assert samples(front, "moeserve_generation_tokens_total") == {(): 2.0 * REQUESTS * MAX_TOKENS}
    assert samples(front, "moeserve_requests_total")[(("finish_reason", "length"),)] == 2 * REQUESTS
    generate = samples(front, "moeserve_grpc_server_handled_total")[
        (("grpc_code", "OK"), ("grpc_method", "Generate"), ("grpc_service", "moeserve.v1.Serving"))
    ]
    assert generate == 2 * REQUESTS
    rebalance = samples(bal, "moeserve_grpc_server_handled_total")[
        (("grpc_code", "OK"), ("grpc_method", "Rebalance"), ("grpc_service", "moeserve.v1.Balancer"))
    ]
    assert rebalance == 1
    assert samples(scrape(p["rank1"]), "moeserve_process_info") == {(("rank", "1"), ("role", "worker")): 1.0}
    assert samples(leader, "moeserve_dispatch_duration_seconds_count")[()] > 0
    assert samples(leader, "moeserve_steps_total")[(("kind", "forward"),)] > 0


def panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for t in panel.get("targets", []):
                out.append((path.stem, panel["title"], t["expr"]))
    return out


def substitute(expr: str) -> str:
    for k in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(k, VARIABLES[k])
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def test_every_expression_of_every_dashboard_panel_returns_data(run):
    queries = panel_queries()
    assert len(queries) > 40
    empty = []
    for board, title, expr in queries:
        result = run["prom"].query(substitute(expr))
        values = [float(r["value"][1]) for r in result]
        if not values or not any(math.isfinite(v) for v in values):
            empty.append(f"{board} / {title}: {expr} -> {result}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def moeserve(*args: str) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "moeserve", *args], capture_output=True, text=True, timeout=120)


def test_moeserve_health_probes_grpc_services_and_metrics_endpoints(run):
    up = run["up"]
    for address in (up.serving, up.admin, up.balancer):
        p = moeserve("health", "--address", address)
        assert p.returncode == 0 and "healthy" in p.stdout, p.stdout + p.stderr
    p = moeserve("health", "--metrics-url", f"http://127.0.0.1:{run['ports']['rank1']}/metrics")
    assert p.returncode == 0, p.stderr
    (closed,) = free_ports(1)
    p = moeserve("health", "--address", f"127.0.0.1:{closed}", "--timeout", "1")
    assert p.returncode == 1 and "UNAVAILABLE" in p.stderr
    p = moeserve("health", "--metrics-url", f"http://127.0.0.1:{closed}/metrics", "--timeout", "1")
    assert p.returncode == 1 and "unhealthy" in p.stderr


def test_moeserve_load_plots_the_live_window_and_dumps_it_with_the_placement(run, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    from control_util import TOKEN

    dump, png = tmp_path / "load.json", tmp_path / "live.png"
    p = moeserve("load", "--address", run["up"].admin, "--admin-token", TOKEN, "--dump", str(dump), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    d = json.loads(dump.read_text())
    assert d["format"] == "moeserve.load/1"
    np.testing.assert_array_equal(d["placement"]["phy2log"], run["admin"].placement().phy2log)
    side = tmp_path / "side.png"
    p = moeserve("load", "--plot", str(side), str(dump), str(dump))  # offline: no server needed
    assert p.returncode == 0, p.stderr
    assert side.read_bytes()[:4] == b"\x89PNG"
