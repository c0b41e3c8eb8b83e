"""deploy/: the compose cluster validates with the Compose v2 binary (and a broken file fails),
every service command is a real ``moeserve`` subcommand with real flags, Prometheus scrapes
every service, Grafana's provisioning and dashboards fit together; the offline variant's
moeserve services are the base file's. tests/test_compose_live.py starts the cluster for real."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from ops_util import DASHBOARDS, DEPLOY, REPO, compose_binary, promtool

pytestmark = pytest.mark.timeout(120)

ENV = {"MOESERVE_ADMIN_TOKEN": "test-token", "MOESERVE_CONTROL_KEY": "00112233445566778899aabbccddeeff"}
BASE = DEPLOY / "docker-compose.yml"
GPU = DEPLOY / "docker-compose.gpu.yml"
OFFLINE = DEPLOY / "docker-compose.offline.yml"
DATASOURCE_UID = "moeserve-prometheus"


def compose(*files: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``docker compose -f ... config --format json`` with the Compose v2 binary."""
    args = [compose_binary()]
    for f in files:
        args += ["-f", str(f)]
    e = {k: v for k, v in os.environ.items() if not k.startswith("MOESERVE_")}
    e.update(ENV if env is None else env)
    return subprocess.run(
        args + ["config", "--format", "json"], capture_output=True, text=True, env=e, timeout=60, cwd=DEPLOY
    )


def config(*files: Path) -> dict:
    p = compose(*files)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture(scope="module", params=["cpu", "gpu", "offline"])
def project(request) -> dict:
    return {"cpu": lambda: config(BASE), "gpu": lambda: config(BASE, GPU), "offline": lambda: config(OFFLINE)}[
        request.param
    ]()


def moeserve_services(project: dict) -> dict:
    return {n: s for n, s in project["services"].items() if str(s.get("image", "")).startswith("moeserve:")}


@pytest.mark.slow
def test_the_compose_file_and_its_gpu_and_offline_variants_validate_with_compose_v2(project):
    assert {"router", "worker-1", "worker-2", "frontend", "balancer", "prometheus"} <= set(project["services"])


@pytest.mark.slow
def test_the_offline_variant_has_the_base_files_moeserve_services_a_local_prometheus_and_no_grafana():
    base, offline = config(BASE), config(OFFLINE)
    assert "grafana" in base["services"] and "grafana" not in offline["services"]
    for name, s in moeserve_services(base).items():
        o = dict(offline["services"][name])
        if "build" in o:
            assert o["build"].pop("args") == {"BASE_IMAGE": "localhost/moeserve-base:bookworm"}
        assert o == s, f"{name} differs between docker-compose.yml and docker-compose.offline.yml"
    prom = offline["services"]["prometheus"]
    assert prom["build"]["args"]["BASE_IMAGE"] == "localhost/moeserve-base:bookworm"
    assert Path(prom["build"]["context"]) == DEPLOY / "prometheus"
    assert {v["target"] for v in prom["volumes"]} == {v["target"] for v in base["services"]["prometheus"]["volumes"]}
    assert offline["volumes"].keys() == {"state", "prometheus"}


@pytest.mark.slow
def test_the_compose_file_takes_secrets_from_the_environment_and_keeps_state_on_a_named_volume():
    svc = config(BASE)["services"]
    assert svc["frontend"]["environment"].get("MOESERVE_API_KEY") is None  # passed through when set
    p = compose(BASE, env={**ENV, "MOESERVE_API_KEY": "k"})
    assert json.loads(p.stdout)["services"]["frontend"]["environment"]["MOESERVE_API_KEY"] == "k"
    assert svc["worker-1"]["restart"] == svc["worker-2"]["restart"] == "on-failure"
    front = svc["frontend"]["command"]
    assert front[front.index("--http-port") + 1] == "8000" and front[front.index("--port") + 1] == "8003"
    assert {(p["target"], p["published"]) for p in svc["frontend"]["ports"]} == {(8000, "8000"), (8003, "8003")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "breakage,message",
    [
        (lambda d: d["services"]["router"].update(bogus_key=1), "bogus_key"),
        (lambda d: d["services"]["frontend"]["depends_on"].update(nowhere={"condition": "service_healthy"}), "nowhere"),
        (lambda d: d["services"]["worker-1"].update(shm_size=[1, 2]), "shm_size"),
    ],
)
def test_a_broken_compose_file_fails_validation(tmp_path, breakage, message):
    d = yaml.safe_load(BASE.read_text())
    breakage(d)
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(d))
    p = compose(bad)
    assert p.returncode != 0 and message in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("missing", sorted(ENV))
def test_the_compose_file_refuses_to_start_without_the_token_or_the_key(missing):
    p = compose(BASE, env={k: v for k, v in ENV.items() if k != missing})
    assert p.returncode != 0 and missing in p.stderr


@pytest.mark.slow
def test_ranks_talk_on_an_internal_network_only_and_services_wait_for_a_healthy_leader(project):
    assert project["networks"]["ranks"].get("internal") is True
    svc = project["services"]
    world = int(svc["router"]["environment"]["WORLD_SIZE"])
    ranks = {}
    for name, s in moeserve_services(project).items():
        if s["command"][1] in ("router", "worker"):
            env = s["environment"]
            assert env["WORLD_SIZE"] == str(world) and env["MASTER_ADDR"] == "router"
            ranks[int(env["RANK"])] = name
            assert s.get("ipc") == "host" or s.get("shm_size"), f"{name}: torch needs shared memory"
            # Every rank, the leader too, is on the internal network only and publishes nothing:
            # MASTER_ADDR names one address, on which the leader binds the store and by which
            # each rank's gloo picks its interface (no interface name is set).
            assert set(s["networks"]) == {"ranks"}, f"{name} must be on the internal network only"
            assert not s.get("ports"), f"{name} publishes a port"
            assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env
    assert sorted(ranks) == list(range(world)) and ranks[0] == "router"
    for name in ("frontend", "balancer"):
        assert svc[name]["depends_on"]["router"]["condition"] == "service_healthy"
    for name, s in moeserve_services(project).items():
        assert s.get("healthcheck", {}).get("test"), f"{name} has no health check"
    # The balancer reaches the admin API on the internal network and publishes its own port on
    # the host's loopback only.
    assert set(svc["balancer"]["networks"]) == {"ranks", "edge"}
    assert all(p.get("host_ip") == "127.0.0.1" for p in svc["balancer"]["ports"])


@pytest.mark.slow
def test_every_variant_keeps_the_state_dir_of_every_rank_on_the_named_volume(project):
    svc = project["services"]
    for name in ("router", "worker-1", "worker-2"):
        cmd = svc[name]["command"]
        assert "--state-dir" in cmd, f"{name} forgets its placement on restart: {cmd}"
        state = cmd[cmd.index("--state-dir") + 1]
        (vol,) = [v for v in svc[name]["volumes"] if v["target"] == state]
        assert vol["type"] == "volume" and vol["source"] == "state"
        assert vol.get("read_only", False) is (name != "router")  # the leader writes, workers read at start


@pytest.mark.slow
def test_every_rank_of_every_variant_holds_the_clusters_secret(project):
    """The ranks' store admits only holders of the secret: a worker without it could not join."""
    for name in ("router", "worker-1", "worker-2", "frontend"):
        env = project["services"][name]["environment"]
        assert env.get("MOESERVE_CONTROL_KEY") == ENV["MOESERVE_CONTROL_KEY"], name


@pytest.mark.slow
def test_the_gpu_variant_reserves_one_gpu_per_rank_and_uses_nccl():
    svc = config(BASE, GPU)["services"]
    gpus = []
    for name in ("router", "worker-1", "worker-2"):
        s = svc[name]
        cmd = s["command"]
        assert cmd[cmd.index("--backend") + 1] == "nccl"
        assert s["ipc"] == "host"
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
        gpus += dev["device_ids"]
    assert len(set(gpus)) == 3


def test_the_dockerfile_copies_what_the_package_needs_and_takes_a_cuda_base_as_a_build_argument():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    # Offline: the wheels of scripts/image-wheels, bind-mounted (never in a layer), with --no-index.
    assert text.count("--mount=type=bind,source=deploy,target=/tmp/deploy") == 3
    assert text.count("--no-index --find-links /tmp/deploy/wheels") == 3
    assert not re.search(r"^VOLUME", text, re.M)  # an anonymous volume per service would outlive `down -v`
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for part in src.split():
            assert (REPO / part).exists(), f"COPY {part}: not in the repository"
    pyproject = (REPO / "pyproject.toml").read_text()
    for folder in ("router", "expert_worker", "balancer", "moeserve"):
        assert f'"{folder}"' in pyproject and f"COPY {folder} " in text


@pytest.mark.slow
def test_prometheus_config_is_valid_and_scrapes_every_moeserve_service():
    p = subprocess.run(
        [promtool(), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, s in moeserve_services(config(BASE)).items():
        cmd = s["command"]
        port = cmd[cmd.index("--metrics-port") + 1]
        assert f"{name}:{port}" in targets, f"Prometheus does not scrape {name}"


@pytest.mark.slow
def test_grafana_provisions_the_datasource_every_dashboard_names_and_loads_the_dashboards_folder():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/moeserve.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    mounts = config(BASE)["services"]["grafana"]["volumes"]
    assert any(m["target"] == path and Path(m["source"]) == DASHBOARDS for m in mounts)


def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def test_the_four_dashboards_exist_and_every_panel_queries_the_provisioned_datasource():
    boards = dashboards()
    assert set(boards) == {"overview", "experts", "rebalancing", "vllm"}
    uids = [b["uid"] for b in boards.values()]
    assert len(set(uids)) == 4
    for name, board in boards.items():
        panels = [p for p in board["panels"] if p["type"] != "row"]
        assert panels, name
        for p in panels:
            assert p["datasource"]["uid"] == DATASOURCE_UID, (name, p["title"])
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), (name, p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == DATASOURCE_UID
                names = ("vllm:",) if name == "vllm" else ("moeserve_", "process_")
                assert any(n in t["expr"] for n in names), (name, p["title"], t["expr"])


def test_the_vllm_dashboard_queries_vllms_names_for_the_model_picked():
    board = dashboards()["vllm"]
    (var,) = board["templating"]["list"]
    assert var["name"] == "model_name" and "vllm:" in var["query"]["query"]
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs and all('model_name=~"$model_name"' in e and "moeserve_" not in e for e in exprs)
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert any(f"vllm:{name}_bucket" in e for e in exprs), name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total"):
        assert any(f"vllm:{name}" in e for e in exprs), name


def test_the_experts_dashboard_has_a_layer_variable_a_heatmap_and_replica_counts():
    board = dashboards()["experts"]
    (var,) = [v for v in board["templating"]["list"] if v["name"] == "layer"]
    assert "moeserve_expert_tokens_total" in var["query"]["query"]
    kinds = {p["type"] for p in board["panels"]}
    assert "heatmap" in kinds
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    assert 'layer="$layer"' in exprs and "moeserve_expert_replicas" in exprs


def command_of(test: list[str]) -> list[str]:
    """The argv of a compose health check test (CMD form, or CMD-SHELL split like a shell)."""
    if test[0] == "CMD":
        return test[1:]
    assert test[0] == "CMD-SHELL", test
    return shlex.split(test[1])


def parse(argv: list[str], environment: dict, monkeypatch):
    """Parse a ``moeserve ...`` argv with moeserve's own CLI parser, in the service's environment
    (the rank flags default to RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from moeserve.cli import build_parser

    assert argv[0] == "moeserve", argv
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (environment or {}).items():
        monkeypatch.setenv(k, str(v))
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"moeserve's parser refused {' '.join(argv)} (exit {e.code})") from None


@pytest.mark.slow
def test_every_service_command_and_health_check_is_a_real_moeserve_subcommand_with_real_flags(project, monkeypatch):
    seen = set()
    for name, s in moeserve_services(project).items():
        args = parse(s["command"], s.get("environment"), monkeypatch)
        assert args.command == s["command"][1] and callable(args.func), name
        seen.add(args.command)
        if args.command in ("router", "worker"):
            assert args.rank == int(s["environment"]["RANK"]) and args.world_size == 3, name
            assert args.metrics_port == 9100, name
        health = parse(command_of(s["healthcheck"]["test"]), s.get("environment"), monkeypatch)
        assert health.command == "health", name
    assert seen == {"router", "worker", "frontend", "balancer"}


def test_the_command_check_has_teeth(monkeypatch):
    with pytest.raises(AssertionError, match="refused"):
        parse(["moeserve", "worker", "--model", "/m", "--no-such-flag"], {"RANK": "1", "WORLD_SIZE": "3"}, monkeypatch)
    with pytest.raises(AssertionError, match="refused"):
        parse(["moeserve", "worker", "--model", "/m"], {}, monkeypatch)  # no rank anywhere
    with pytest.raises(AssertionError, match="refused"):
        parse(["moeserve", "serve-everything"], {}, monkeypatch)
