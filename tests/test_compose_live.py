"""The compose cluster of deploy/, started for real under podman + podman-compose (rootful, runc;
the runtime and ulimits from deploy/containers.conf through CONTAINERS_CONF), without any image
registry: a Debian bookworm base from debootstrap, imported with ``podman import``; the moeserve
image built from it with the wheels of scripts/image-wheels and no network; Prometheus built on
the same base from Debian's package (deploy/docker-compose.offline.yml).

From the host, on the published ports: greedy tokens through the SDK (gRPC) and through HTTP
/v1/completions equal the single-process reference on the image's own checkpoint; a rebalance
moves experts live; the compose Prometheus has scraped moeserve_expert_tokens_total and every
dashboard query returns data; a worker container killed (SIGKILL of its process) in the middle
of streams is restarted by the engine and rejoins, every stream completing with the reference
tokens; ``down -v`` leaves no container, volume or network of the project.

Caches (a cold machine needs ~4-5 minutes, a warm one ~1.5): the base image is tagged by a hash
of the debootstrap command, the images carry a label with a hash of what they are built from
(Dockerfile, pyproject, wheels, sources); either is rebuilt only when its hash changed. Under
CI=true missing tooling fails the test instead of skipping it; ``-m "not compose"`` deselects it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from ops_util import DASHBOARDS, DEPLOY, REPO

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(900)]

PROJECT = "moeserve"
COMPOSE_FILE = DEPLOY / "docker-compose.offline.yml"
SUITE, MIRROR = "bookworm", os.environ.get("MOESERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBOOTSTRAP = ["--variant=minbase", "--include=python3,python3-venv", SUITE]
BASE_REPO = "localhost/moeserve-base"
IMAGE, PROM_IMAGE = "moeserve:ci", "moeserve-prometheus:offline"
ADMIN_TOKEN, CONTROL_KEY, API_KEY = "compose-admin-token", "00112233445566778899aabbccddeeff", "compose-api-key"
MAX_TOKENS = 16
# Grafana's variables as the dashboards' panels use them ($model_name: the vLLM dashboard's, any)
VARIABLES = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "1h", "$layer": "0", "$model_name": ".*"}
PHASES: dict[str, float] = {}
SUMMARY: list[str] = []  # phase times, image size, ...: conftest prints them at the end of the run


def report(line: str) -> None:
    """Print a line of the test's summary now (with -s) and in the run's final summary."""
    SUMMARY.append(line)
    print(line, flush=True)


def tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed ({hint}; .ci/run installs it as root)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI=true requires it")
    pytest.skip(message)


def env() -> dict:
    e = dict(os.environ)
    e.setdefault("CONTAINERS_CONF", str(DEPLOY / "containers.conf"))
    return e


def sh(*args, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=kw.pop("env", env()), **kw
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p


class Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        PHASES[self.name] = time.monotonic() - self.t0
        report(f"phase {self.name:<28} {PHASES[self.name]:7.1f} s")


def digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def tree_digest(paths) -> str:
    h = hashlib.sha256()
    for root in paths:
        files = (
            [root]
            if root.is_file()
            else sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        )
        for f in files:
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def image_label(podman: str, image: str) -> str | None:
    p = sh(podman, "image", "inspect", "--format", '{{index .Labels "moeserve.hash"}}', image, check=False)
    return p.stdout.strip() if p.returncode == 0 else None


def base_image(podman: str, tmp: Path) -> str:
    """The Debian base (Python 3.11, venv): debootstrap'ed once per hash of its command."""
    tag = f"{BASE_REPO}:{SUITE}-{digest(DEBOOTSTRAP, MIRROR)}"
    if sh(podman, "image", "exists", tag, check=False).returncode == 0:
        return tag
    debootstrap = tool("debootstrap", "apt-get install -y debootstrap")
    root = tmp / "rootfs"
    sh(debootstrap, *DEBOOTSTRAP, root, MIRROR, timeout=600)
    # Only what the image needs: no package cache, lists, docs or locales.
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"):
        shutil.rmtree(root / junk, ignore_errors=True)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    p = subprocess.run(
        [podman, "import", "-", tag], stdin=tar.stdout, capture_output=True, text=True, env=env(), timeout=300
    )
    tar.stdout.close()
    assert tar.wait() == 0 and p.returncode == 0, p.stderr
    shutil.rmtree(root, ignore_errors=True)
    sh(podman, "tag", tag, f"{BASE_REPO}:{SUITE}")
    return tag


def build(podman: str, image: str, key: str, *args) -> bool:
    """Build ``image`` unless it carries label moeserve.hash=key; True when it was built. The
    image it replaces is removed (its layers stay cached for the next build)."""
    if image_label(podman, image) == key:
        return False
    old = sh(podman, "image", "inspect", "--format", "{{.Id}}", image, check=False).stdout.strip()
    sh(podman, "build", "--label", f"moeserve.hash={key}", "-t", image, *args, timeout=900)
    new = sh(podman, "image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
    if old and old != new:
        sh(podman, "rmi", old, check=False)
    return True


def project_objects(podman: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        "containers": sh(podman, "ps", "-a", "--filter", label, "--format", "{{.Names}}").stdout.split(),
        "volumes": sh(podman, "volume", "ls", "--filter", label, "--format", "{{.Name}}").stdout.split(),
        "networks": [
            n
            for n in sh(podman, "network", "ls", "--format", "{{.Name}}").stdout.split()
            if n.startswith(f"{PROJECT}_")
        ],
    }


def free_port() -> int:
    from moeserve.ops.ports import free_port as pick

    return pick()


class Cluster:
    def __init__(self, podman: str, compose: str, ports: dict[str, int]):
        self.podman, self.compose, self.ports = podman, compose, ports
        self.env = env()
        self.env.update(
            MOESERVE_ADMIN_TOKEN=ADMIN_TOKEN,
            MOESERVE_CONTROL_KEY=CONTROL_KEY,
            MOESERVE_API_KEY=API_KEY,
            MOESERVE_IMAGE_TAG=IMAGE.split(":")[1],
            MOESERVE_HTTP_PORT=str(ports["http"]),
            MOESERVE_GRPC_PORT=str(ports["grpc"]),
            MOESERVE_BALANCER_PORT=str(ports["balancer"]),
            PROMETHEUS_PORT=str(ports["prometheus"]),
        )
        self.down_done = False

    def run(self, *args, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return sh(self.compose, "-p", PROJECT, "-f", COMPOSE_FILE, *args, timeout=timeout, check=check, env=self.env)

    def container(self, service: str) -> str:
        out = sh(
            self.podman,
            "ps",
            "-a",
            "--filter",
            f"label=com.docker.compose.project={PROJECT}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            "--format",
            "{{.Names}}",
        ).stdout.split()
        assert len(out) == 1, (service, out)
        return out[0]

    def inspect(self, service: str, fmt: str) -> str:
        return sh(self.podman, "inspect", "--format", fmt, self.container(service)).stdout.strip()

    def admin(self, code: str) -> dict:
        """Run ``code`` (it sets ``out``) with an SDK admin client inside the leader's container:
        the admin API is on the internal network only, like every other port of a rank."""
        script = (
            "import json\nfrom moeserve.client import Client\nadmin = Client('127.0.0.1:8001')\n"
            f"{code}\nprint(json.dumps(out))"
        )
        p = sh(self.podman, "exec", self.container("router"), "python", "-c", script, timeout=120)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        out = []
        for name in project_objects(self.podman)["containers"]:
            p = sh(self.podman, "logs", "--tail", "30", name, check=False)
            out.append(f"--- {name}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        return "\n".join(out)

    def down(self) -> dict[str, list[str]]:
        """``down -v``; what the project left behind (podman-compose 1.0.3 leaves its networks:
        they are removed here and reported)."""
        self.down_done = True
        self.run("down", "-v", "-t", "5", timeout=300, check=False)
        left = project_objects(self.podman)
        for net in left["networks"]:
            sh(self.podman, "network", "rm", "-f", net, check=False)
        return left


def wait_for(what: str, fn, timeout_s: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            out = fn()
            if out:
                return out
        except Exception as e:  # not up yet
            last = e
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s ({last!r})")


def healthy(address: str) -> bool:
    p = subprocess.run(
        [sys.executable, "-m", "moeserve", "health", "--address", address, "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return p.returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    t_start = time.monotonic()
    podman = tool("podman", "apt-get install -y podman runc")
    compose = tool("podman-compose", "apt-get install -y podman-compose")
    tool("runc", "apt-get install -y runc")
    tmp = tmp_path_factory.mktemp("compose")
    leftovers = project_objects(podman)
    if any(leftovers.values()):  # an earlier run killed before its teardown
        Cluster(podman, compose, {k: 0 for k in ("http", "grpc", "balancer", "prometheus")}).down()
    with Phase("wheels"):
        if not list((DEPLOY / "wheels").glob("torch-2.13.0*.whl")):
            sh(REPO / "scripts/image-wheels", timeout=600)
    with Phase("base image (debootstrap)"):
        base = base_image(podman, tmp)
    with Phase("images"):
        wheels = sorted(p.name for p in (DEPLOY / "wheels").glob("*.whl"))
        base_id = sh(podman, "image", "inspect", "--format", "{{.Id}}", base).stdout.strip()
        key = digest(
            base_id,
            wheels,
            tree_digest(
                [
                    DEPLOY / "Dockerfile",
                    REPO / "pyproject.toml",
                    REPO / "README.md",
                    REPO / "moeserve",
                    REPO / "router",
                    REPO / "expert_worker",
                    REPO / "balancer",
                    REPO / "proto",
                ]
            ),
        )
        # --network=none: the build must need no network at all.
        built = build(
            podman, IMAGE, key, "--network=none", "-f", DEPLOY / "Dockerfile", "--build-arg", f"BASE_IMAGE={base}", REPO
        )
        prom_key = digest(base_id, tree_digest([DEPLOY / "prometheus"]))
        build(
            podman,
            PROM_IMAGE,
            prom_key,
            "-f",
            DEPLOY / "prometheus/Dockerfile",
            "--build-arg",
            f"BASE_IMAGE={base}",
            DEPLOY / "prometheus",
        )
        size = int(sh(podman, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
        report(f"image {IMAGE}: {size / 1e9:.2f} GB ({'built' if built else 'cached'})")
    with Phase("reference"):
        # The image's own checkpoint, copied out, and the single-process model's greedy tokens.
        name = f"moeserve-ckpt-{os.getpid()}"
        sh(podman, "create", "--name", name, IMAGE)
        try:
            sh(podman, "cp", f"{name}:/models/demo", tmp / "demo")
        finally:
            sh(podman, "rm", "-f", name, check=False)
        from cluster_util import reference_generate, reference_model

        model = reference_model(tmp / "demo")
        prompts = [[1, 2, 3], [5, 17, 42, 99, 7], [300, 200, 100, 50], list(range(10, 30))]
        reference = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
        long_prompts = [[11 + i, 22 + 3 * i, 33, 44 + i] for i in range(8)]
        long_reference = [reference_generate(model, p, 48) for p in long_prompts]
    ports = {k: free_port() for k in ("http", "grpc", "balancer", "prometheus")}
    c = Cluster(podman, compose, ports)
    try:
        with Phase("up"):
            c.run("up", "-d", timeout=300)
        with Phase("healthy"):
            try:
                wait_for("the front end's health", lambda: healthy(f"127.0.0.1:{ports['grpc']}"), 180)
                wait_for("the balancer's health", lambda: healthy(f"127.0.0.1:{ports['balancer']}"), 60)
                wait_for(
                    "Prometheus ready",
                    lambda: (
                        urllib.request.urlopen(f"http://127.0.0.1:{ports['prometheus']}/-/ready", timeout=3).status
                        == 200
                    ),
                    60,
                )
            except AssertionError:
                print(c.logs())
                raise
        # The balancer's periodic loop paused before any traffic (kept in the state folder): every
        # placement change below is the test's own.
        from moeserve.client import Client

        assert Client(f"127.0.0.1:{ports['balancer']}", token=ADMIN_TOKEN, timeout=60).pause().paused
        c.prompts, c.reference = prompts, reference
        c.long_prompts, c.long_reference = long_prompts, long_reference
        c.t_start = t_start
        yield c
    finally:
        if not c.down_done:
            c.down()
        report("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in PHASES.items()))


def serving(c: Cluster):
    from moeserve.client import Client

    return Client(f"127.0.0.1:{c.ports['grpc']}", token=API_KEY, timeout=120)


def http(c: Cluster, path: str, body: dict | None = None, key: str | None = API_KEY):
    req = urllib.request.Request(
        f"http://127.0.0.1:{c.ports['http']}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_greedy_tokens_through_the_sdk_and_http_equal_the_single_process_reference(cluster):
    c = cluster
    with Phase("requests"):
        client = serving(c)
        got = [client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in c.prompts]
        assert got == c.reference
        for p, want in zip(c.prompts, c.reference):
            out = http(
                c,
                "/v1/completions",
                {"model": "/models/demo", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            )
            assert out["usage"]["completion_tokens"] == MAX_TOKENS
            assert out["choices"][0]["text"] == _detok(c, want)  # the reference ids, detokenized
        with pytest.raises(urllib.error.HTTPError) as e:  # the API key from the environment holds
            http(c, "/v1/completions", {"model": "/models/demo", "prompt": [1, 2], "max_tokens": 2}, key=None)
        assert e.value.code == 401


def _detok(c: Cluster, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    if not hasattr(c, "tokenizer"):
        name = f"moeserve-tok-{os.getpid()}"
        sh(c.podman, "create", "--name", name, IMAGE)
        try:
            dest = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}.json"
            sh(c.podman, "cp", f"{name}:/models/demo/tokenizer.json", dest)
        finally:
            sh(c.podman, "rm", "-f", name, check=False)
        c.tokenizer = Tokenizer.from_file(str(dest))
        dest.unlink()
    return c.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_rebalance_moves_experts_live_and_the_tokens_stay_the_reference(cluster):
    from moeserve.client import Client

    c = cluster
    with Phase("rebalance"):
        client = serving(c)
        bal = Client(f"127.0.0.1:{c.ports['balancer']}", token=ADMIN_TOKEN, timeout=120)
        for _ in range(3):  # load for the window
            threads = [
                threading.Thread(
                    target=client.generate, kwargs=dict(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                )
                for p in c.long_prompts
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        before = c.admin("p = admin.placement(); out = [p.version, p.phy2log.tolist()]")
        result = bal.rebalance(wait=True)
        assert result.applied and result.slots_moved > 0, result
        assert result.balancedness_after.mean > result.balancedness_before.mean
        after = c.admin(
            "p = admin.placement(); s = admin.status(); "
            "out = [p.version, p.phy2log.tolist(), s.migration.state.name if s.migration else None]"
        )
        assert after[0] > before[0] and after[1] != before[1], (before, after)
        assert after[1] == result.phy2log.tolist()
        got = [client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in c.prompts]
        assert got == c.reference
        c.rebalance = result


def prom_query(c: Cluster, expr: str) -> list:
    url = f"http://127.0.0.1:{c.ports['prometheus']}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        out = json.loads(r.read())
    assert out["status"] == "success", out
    return out["data"]["result"]


def panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel.get("targets", []):
                out.append((path.stem, panel["title"], t["expr"]))
    return out


def substitute(expr: str) -> str:
    for k in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(k, VARIABLES[k])
    assert "$" not in expr, expr
    return expr


def test_the_compose_prometheus_scraped_the_expert_load_and_every_dashboard_query_returns_data(cluster):
    c = cluster
    with Phase("prometheus"):
        up = wait_for(
            "every target up",
            lambda: (lambda r: len(r) == 5 and all(x["value"][1] == "1" for x in r) and r)(
                prom_query(c, 'up{job="moeserve"}')
            ),
            60,
        )
        assert {r["metric"]["service"] for r in up} == {"router", "worker-1", "worker-2", "frontend", "balancer"}
        # a scrape may land before the leader exported the requests' load: wait for a count, not a series
        tokens = wait_for(
            "moeserve_expert_tokens_total > 0",
            lambda: (lambda r: r and float(r[0]["value"][1]) > 0 and r)(
                prom_query(c, "sum(moeserve_expert_tokens_total)")
            ),
            60,
        )
        assert float(tokens[0]["value"][1]) > 0
        queries = panel_queries()
        assert len(queries) > 40

        def empty() -> list[str]:
            out = []
            for board, title, expr in queries:
                values = [float(r["value"][1]) for r in prom_query(c, substitute(expr))]
                if not values or not any(math.isfinite(v) for v in values):
                    out.append(f"{board} / {title}: {expr}")
            return out

        def traffic() -> None:  # requests inside the panels' rate() windows (1 m), HTTP and gRPC
            http(c, "/v1/completions", {"model": "/models/demo", "prompt": c.prompts[0], "max_tokens": 4})
            with serving(c) as client:
                client.generate(prompt_token_ids=c.prompts[1], max_tokens=4, ignore_eos=True)

        # rate() over the dashboards' windows needs two scrapes (5 s apart) after the traffic, and
        # the traffic within the window: on a loaded machine the earlier tests' may be older.
        traffic()
        deadline, missing = time.monotonic() + 60, None
        while True:
            missing = empty()
            if not missing or time.monotonic() > deadline:
                break
            traffic()
            time.sleep(2)
        assert not missing, "panels without data:\n" + "\n".join(missing)
        # the panels may all have data from a scrape taken before the rebalance's migration ended: wait for a
        # scrape (every 5 s) that counts its slots; the balancer may have moved some before, hence >=.
        assert c.rebalance.slots_moved > 0
        moved = wait_for(
            "moeserve_slots_moved_total counts the rebalance",
            lambda: (lambda r: r and float(r[0]["value"][1]) >= c.rebalance.slots_moved and r)(
                prom_query(c, "moeserve_slots_moved_total")
            ),
            30,
        )
        assert float(moved[0]["value"][1]) >= c.rebalance.slots_moved


def test_a_killed_worker_container_is_restarted_and_rejoins_without_losing_a_stream(cluster):
    c = cluster
    with Phase("kill a worker"):
        client = serving(c)
        placement = c.admin("out = admin.placement().phy2log.tolist()")
        init = int(c.inspect("worker-1", "{{.State.Pid}}"))  # the container's init (init: true)
        (pid,) = [int(x) for x in Path(f"/proc/{init}/task/{init}/children").read_text().split()]
        assert "moeserve" in Path(f"/proc/{pid}/cmdline").read_text()
        started = c.inspect("worker-1", "{{.State.StartedAt}}")
        results: dict[int, list[int]] = {}
        first = threading.Event()
        errors = []

        def stream(i: int, prompt: list[int]) -> None:
            ids = []
            try:
                for chunk in client.generate_stream(prompt_token_ids=prompt, max_tokens=48, ignore_eos=True):
                    ids += chunk.token_ids
                    first.set()
                results[i] = ids
            except Exception as e:  # reported below
                errors.append(f"stream {i}: {e!r}")

        threads = [threading.Thread(target=stream, args=(i, p)) for i, p in enumerate(c.long_prompts)]
        for t in threads:
            t.start()
        assert first.wait(60), "no stream started"
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # the worker's process dies (as an OOM kill would); its init follows
        for t in threads:
            t.join(180)
        t_done = time.monotonic()
        assert not errors, errors
        assert [results[i] for i in range(len(c.long_prompts))] == c.long_reference
        # The engine restarted the container (restart: on-failure) and the new process rejoined.
        wait_for(
            "worker-1 restarted",
            lambda: (
                c.inspect("worker-1", "{{.State.StartedAt}}") != started
                and c.inspect("worker-1", "{{.State.Running}}") == "true"
            ),
            60,
        )
        assert int(c.inspect("worker-1", "{{.State.Pid}}")) != init
        logs = sh(c.podman, "logs", c.container("worker-1")).stderr
        assert "(worker) joins the running cluster" in logs, logs[-2000:]
        wait_for("the front end serving again", lambda: healthy(f"127.0.0.1:{c.ports['grpc']}"), 60)
        got = [client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in c.prompts]
        assert got == c.reference
        status = c.admin("s = admin.status(); p = admin.placement(); out = [s.error, p.version, p.phy2log.tolist()]")
        assert status[0] == ""
        assert status[2] == placement  # the placement in force stands
        report(f"streams finished {t_done - t_kill:.1f} s after the kill")


def test_down_v_leaves_no_container_volume_or_network_behind(cluster):
    c = cluster
    with Phase("down -v"):
        assert project_objects(c.podman)["volumes"], "the project's named volumes should exist before down"
        left = c.down()
        assert not left["containers"] and not left["volumes"], left
        if left["networks"]:
            print(
                f"podman-compose left the networks {left['networks']} (1.0.3 removes none on down): removed", flush=True
            )
        assert not any(project_objects(c.podman).values()), project_objects(c.podman)
    total = time.monotonic() - c.t_start
    report(f"compose test: {total:.0f} s in all")
