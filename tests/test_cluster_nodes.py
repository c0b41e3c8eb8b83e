"""Two hosts on one machine: two network namespaces joined by a veth pair (made and removed
here), one ``moeserve up --nnodes 2`` in each, gloo over the veth addresses. Node 0 runs the
leader and worker 0 with the front end, the balancer and the admin API; node 1 runs workers 1
and 2. Every address bound is a veth address or a namespace's own loopback, so no traffic
leaves the namespaces. Greedy tokens equal the single-process model's (fp32), also after a
placement change that swaps experts between the nodes and after a worker of node 1 was killed
and replaced by node 1's launcher; node 0 stopping ends node 1 cleanly, node 0 lost ends it
with an error naming node 0, and a node that never starts is named at the start-up timeout.
A model with expert groups (DeepSeek-V3, 4 groups) on 2 hosts of 2 co-located ranks keeps every
group's replicas on one host, at start and through a rebalance the balancer plans, and serves
the single-process tokens before and after.

Needs root (``ip netns``). Under CI=true a machine that cannot make the namespaces fails the
test; elsewhere it is skipped with the reason."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from cluster_util import moe_info, prompts_for, reference_generate, reference_model, tiny_checkpoint

pytestmark = pytest.mark.slow  # every test here starts processes

MAX_TOKENS = 64
STREAMS = 6
ROUTERS, WORKERS, REDUNDANT = 1, 3, 1  # 4 ranks, 2 per node: node 0 = ranks 0, 1; node 1 = ranks 2, 3
MASTER_PORT = 29500
PORTS = dict(port=18000, admin=18001, balancer=18002)
TOKEN = "namespace-test-token"


def _ip(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:  # no ip command, or a hung one
        return subprocess.CompletedProcess(["ip", *args], 127, "", str(e))


class Namespaces:
    """Two network namespaces, a veth pair between them and an address on each end."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.names = (f"msnodeA{tag}", f"msnodeB{tag}")
        self.links = (f"msa{tag}", f"msb{tag}")
        net = 16 + os.getpid() % 200
        self.addrs = (f"10.231.{net}.1", f"10.231.{net}.2")

    def make(self) -> str | None:
        """None once made, else why not."""
        a, b = self.names
        steps = [
            ("netns", "add", a),
            ("netns", "add", b),
            ("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]),
            ("link", "set", self.links[0], "netns", a),
            ("link", "set", self.links[1], "netns", b),
        ]
        for ns, link, addr in zip(self.names, self.links, self.addrs):
            steps += [
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", link),
                ("-n", ns, "link", "set", link, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            r = _ip(*step)
            if r.returncode:
                return f"ip {' '.join(step)}: {r.stderr.strip()}"
        return None

    def kill_all(self) -> None:
        """End what runs in the namespaces (every process there was started by this module's
        tests), and wait until nothing does: a test that failed with its nodes up must not leave
        their ports and store to the next (they bind fixed ports)."""
        deadline = time.monotonic() + 30
        while True:
            pids = [p for ns in self.names for p in _ip("netns", "pids", ns).stdout.split()]
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            time.sleep(0.2)

    def remove(self) -> None:
        """End what runs in the namespaces, then delete them, which deletes the veth pair."""
        self.kill_all()
        for ns in self.names:
            _ip("netns", "del", ns)


@pytest.fixture(scope="module")
def namespaces():
    ns = Namespaces()
    why = "ip netns needs root" if os.geteuid() != 0 else ns.make()
    if why:
        ns.remove()
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot make the two network namespaces: {why}")
        pytest.skip(f"cannot make the two network namespaces: {why}")
    yield ns
    ns.remove()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("nodes"), "llama4")
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=tuple(3 + i % 5 for i in range(STREAMS)), seed=5)
    return dict(
        path=str(path),
        prompts=prompts,
        want=[reference_generate(model, p, MAX_TOKENS) for p in prompts],
        info=moe_info(path),
    )


def _env(secret: str) -> dict:
    env = dict(os.environ, MOESERVE_CONTROL_KEY=secret, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MOESERVE_ADMIN_TOKEN", None)
    return env


def _up(ns: Namespaces, node: int, setup, secret: str, log_dir, *extra: str) -> subprocess.Popen:
    """``moeserve up --nnodes 2 --node-rank <node>`` in namespace <node>, bound to its veth address."""
    cmd = [
        *("ip", "netns", "exec", ns.names[node], sys.executable, "-m", "moeserve", "up"),
        *("--model", setup["path"], "--routers", str(ROUTERS), "--workers", str(WORKERS)),
        *("--enable-eplb", "--num-redundant-experts", str(REDUNDANT), "--max-model-len", "128"),
        *("--nnodes", "2", "--node-rank", str(node), "--master-addr", ns.addrs[0]),
        *("--master-port", str(MASTER_PORT), "--host", ns.addrs[node], "--log-dir", str(log_dir / f"node{node}")),
        *("--port", str(PORTS["port"]), "--admin-port", str(PORTS["admin"]), "--balancer-port", str(PORTS["balancer"])),
        *("--admin-token", TOKEN),
        *extra,
    ]
    out = open(log_dir / f"up{node}.out", "w")
    return subprocess.Popen(cmd, env=_env(secret), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_line(path, text: str, proc: subprocess.Popen, timeout_s: float = 400.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode} before {text!r}:\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:.0f} s:\n{path.read_text()}"
        time.sleep(0.2)


CLIENT = """
import json, sys, threading
from moeserve.client import Client
host, what, arg, ports, token, max_tokens = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
serving = Client(f"{host}:{ports['port']}")
admin = Client(f"{host}:{ports['admin']}", token=token)
if what == "generate":
    out, said = [[] for _ in arg], threading.Lock()
    def one(i):
        for chunk in serving.generate_stream(prompt_token_ids=arg[i], max_tokens=max_tokens, ignore_eos=True):
            out[i] += chunk.token_ids
            if said.acquire(blocking=False):  # once, when the first tokens came
                print("streaming", file=sys.stderr, flush=True)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(arg))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps(out))
elif what == "apply":
    admin.apply_placement(arg, wait=True, timeout=300)
    p = admin.placement()
    print(json.dumps(dict(phy2log=p.phy2log.tolist(), version=p.version, workers_per_node=p.workers_per_node)))
elif what == "placement":
    p = admin.placement()
    print(json.dumps(dict(phy2log=p.phy2log.tolist(), version=p.version, workers_per_node=p.workers_per_node)))
elif what == "rebalance":
    r = Client(f"{host}:{ports['balancer']}", token=token).rebalance(wait=True, timeout=300)
    p = admin.placement()
    groups = admin.status().model.num_expert_groups
    print(json.dumps(dict(applied=r.applied, note=r.note, phy2log=p.phy2log.tolist(), groups=groups)))
"""


def _client(ns: Namespaces, what: str, arg, secret: str, background: bool = False):
    """Run a client of node 0's services inside namespace A (the test's own namespace has no
    route to it): the JSON it prints, or with ``background`` the process."""
    cmd = ["ip", "netns", "exec", ns.names[0], sys.executable, "-c", CLIENT, ns.addrs[0], what]
    cmd += [json.dumps(v) for v in (arg, PORTS, TOKEN, MAX_TOKENS)]
    if background:
        return subprocess.Popen(cmd, env=_env(secret), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, env=_env(secret), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _rank_pid(ns: Namespaces, node: int, rank: int) -> int:
    """The pid of ``rank``'s process in namespace ``node`` (from its environment)."""
    for pid in _ip("netns", "pids", ns.names[node]).stdout.split():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"moeserve.cluster.rank" in cmd and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} in {ns.names[node]}")


@pytest.fixture(scope="module")
def two_nodes(namespaces, setup, tmp_path_factory):
    logs = tmp_path_factory.mktemp("node-logs")
    secret = secrets.token_hex(16)
    t0 = time.monotonic()
    nodes = [_up(namespaces, k, setup, secret, logs, "--metrics-port", "0") for k in (0, 1)]
    for k, p in enumerate(nodes):
        _wait_line(logs / f"up{k}.out", "ready", p)
    print(f"\ntwo nodes ready in {time.monotonic() - t0:.1f} s")
    yield dict(ns=namespaces, nodes=nodes, logs=logs, secret=secret)
    for p in nodes:
        if p.poll() is None:
            p.kill()
            p.wait()
    namespaces.kill_all()  # the front ends, balancer and ranks of a node killed above


def _signal_state(pid: int) -> str:
    """The signal masks of a process (``/proc/<pid>/status``): pending, blocked, caught."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return ", ".join(
                line.strip() for line in f if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
            )
    except OSError as e:
        return f"unreadable ({e})"


@pytest.mark.timeout(600)
def test_two_nodes_serve_the_single_process_tokens(two_nodes, setup):
    out = two_nodes["logs"]
    assert "node 0 of 2: ranks 0, 1" in (out / "up0.out").read_text()
    node1 = (out / "up1.out").read_text()
    assert "node 1 of 2: ranks 2, 3 (worker 1, worker 2)" in node1
    assert "metrics  rank 3" in node1 and two_nodes["ns"].addrs[1] in node1  # node 1's ranks serve on its address
    got = _client(two_nodes["ns"], "generate", setup["prompts"], two_nodes["secret"])
    assert got == setup["want"]
    placement = _client(two_nodes["ns"], "placement", None, two_nodes["secret"])
    assert placement["workers_per_node"] == 1  # node 0 holds one worker, node 1 two: a placement node is one worker


@pytest.mark.timeout(600)
def test_a_placement_change_moves_experts_between_the_nodes_and_tokens_do_not_change(two_nodes, setup):
    before = _client(two_nodes["ns"], "placement", None, two_nodes["secret"])
    s = (setup["info"].num_logical_experts + REDUNDANT) // WORKERS  # slots per worker
    # worker 0 (node 0) and worker 1 (node 1) swap what they hold, in every MoE layer
    target = [row[s : 2 * s] + row[:s] + row[2 * s :] for row in before["phy2log"]]
    assert target != before["phy2log"]
    after = _client(two_nodes["ns"], "apply", target, two_nodes["secret"])
    assert after["phy2log"] == target and after["version"] > before["version"]
    assert _client(two_nodes["ns"], "generate", setup["prompts"], two_nodes["secret"]) == setup["want"]


@pytest.mark.timeout(600)
def test_a_worker_of_node_1_killed_is_replaced_by_node_1_and_tokens_do_not_change(two_nodes, setup):
    ns, logs = two_nodes["ns"], two_nodes["logs"]
    streams = _client(ns, "generate", setup["prompts"], two_nodes["secret"], background=True)
    assert streams.stderr.readline().strip() == "streaming"  # tokens flow
    t0 = time.monotonic()
    os.kill(_rank_pid(ns, 1, 2), signal.SIGKILL)
    out, err = streams.communicate(timeout=400)
    assert streams.returncode == 0, err
    assert json.loads(out) == setup["want"]
    print(f"\nkilled rank 2 on node 1: the streams finished {time.monotonic() - t0:.1f} s after the kill")
    _wait_line(
        logs / "up1.out", "rank 2 (worker) exited with signal SIGKILL: starting its replacement", two_nodes["nodes"][1]
    )
    assert "replacement" in (logs / "node1" / "rank2.log").read_text()
    assert _client(ns, "generate", setup["prompts"][:2], two_nodes["secret"]) == setup["want"][:2]
    assert all(p.poll() is None for p in two_nodes["nodes"])


@pytest.mark.timeout(600)
def test_node_0_stopping_ends_node_1_with_exit_code_0(two_nodes):
    node0, node1 = two_nodes["nodes"]
    node0.send_signal(signal.SIGTERM)  # ip netns exec runs moeserve up in its own process
    try:
        assert node0.wait(120) == 0
    except subprocess.TimeoutExpired:
        out = (two_nodes["logs"] / "up0.out").read_text()
        pytest.fail(f"node 0 did not stop within 120 s of SIGTERM ({_signal_state(node0.pid)}):\n{out}")
    assert node1.wait(120) == 0
    assert "node 0 stopped the cluster" in (two_nodes["logs"] / "up1.out").read_text()


@pytest.mark.timeout(600)
def test_node_0_lost_ends_node_1_with_an_error_naming_node_0(namespaces, setup, tmp_path):
    namespaces.kill_all()  # nothing of an earlier test's nodes holds the fixed ports
    secret = secrets.token_hex(16)
    nodes = [_up(namespaces, 0, setup, secret, tmp_path), _up(namespaces, 1, setup, secret, tmp_path)]
    try:
        for k, p in enumerate(nodes):
            _wait_line(tmp_path / f"up{k}.out", "ready", p)
        nodes[0].kill()  # its ranks die with it (they watch their parent)
        nodes[0].wait()
        assert nodes[1].wait(120) == 1
        assert "node 0 (rank 0, the leader) is gone" in (tmp_path / "up1.out").read_text()
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(300)
def test_a_node_that_never_starts_is_named_at_the_start_up_timeout(namespaces, setup, tmp_path):
    namespaces.kill_all()  # nothing of an earlier test's nodes holds the fixed ports
    node0 = _up(namespaces, 0, setup, secrets.token_hex(16), tmp_path, "--startup-timeout", "20")
    try:
        assert node0.wait(120) == 1
        text = (tmp_path / "up0.out").read_text()
        assert "ranks 2, 3 (node 1) never reached node 0's store" in text, text
    finally:
        if node0.poll() is None:
            node0.kill()
            node0.wait()


def group_hosts(phy2log, group_size: int, slots_per_host: int) -> list[dict[int, set[int]]]:
    """Per MoE layer, the hosts that hold a replica of each expert group."""
    out = []
    for row in phy2log:
        hosts: dict[int, set[int]] = {}
        for slot, expert in enumerate(row):
            hosts.setdefault(int(expert) // group_size, set()).add(slot // slots_per_host)
        out.append(hosts)
    return out


@pytest.mark.timeout(900)
def test_expert_groups_stay_on_one_host_through_a_rebalance_and_tokens_do_not_change(namespaces, tmp_path):
    """DeepSeek-V3's group-limited routing: 16 experts in 4 groups, 4 co-located ranks (each a
    router and a worker), 2 per host, 4 redundant slots (20: 10 per host). The placement's node
    is a host (workers_per_node 2, from the layout); the balancer learns the groups from the
    admin API and plans hierarchically, so no group spans the veth link."""
    namespaces.kill_all()  # nothing of an earlier test's nodes holds the fixed ports
    path = tiny_checkpoint(tmp_path / "model", "deepseek_v3", hot_experts=2)
    info = moe_info(path)
    assert info.num_expert_groups == 4
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(5, 11, 3, 9), seed=3)
    want = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    grouped = dict(path=str(path))
    extra = ("--colocated", "--routers", "4", "--workers", "4", "--num-redundant-experts", "4")
    extra += ("--eplb-step-interval", "1000000", "--migration-bytes-per-step", str(info.expert_bytes))
    secret = secrets.token_hex(16)
    nodes = [_up(namespaces, k, grouped, secret, tmp_path, *extra) for k in (0, 1)]
    try:
        for k, p in enumerate(nodes):
            _wait_line(tmp_path / f"up{k}.out", "ready", p)
        group, per_host = info.num_logical_experts // 4, (info.num_logical_experts + 4) // 2
        start = _client(namespaces, "placement", None, secret)
        assert start["workers_per_node"] == 2
        assert all(len(h) == 1 for layer in group_hosts(start["phy2log"], group, per_host) for h in layer.values())
        assert _client(namespaces, "generate", prompts, secret) == want  # the load window holds the hot experts
        r = _client(namespaces, "rebalance", None, secret)
        assert r["applied"] and r["groups"] == 4, r["note"]
        assert r["phy2log"] != start["phy2log"]
        layers = group_hosts(r["phy2log"], group, per_host)
        assert all(len(h) == 1 for layer in layers for h in layer.values()), layers  # each group on one host
        assert all(sorted(layer) == [0, 1, 2, 3] for layer in layers)
        assert _client(namespaces, "generate", prompts, secret) == want
    finally:
        if nodes[0].poll() is None:
            nodes[0].send_signal(signal.SIGTERM)  # node 0 stopping ends node 1 too
        for p in nodes:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
