"""``moeserve up --model DIR ...``: a whole local cluster until SIGTERM.

Starts the ranks (``LocalCluster``: routers, workers, the leader with the admin API), the
serving front end and the balancer as child processes; ready when all three answer SERVING to
grpc.health.v1, then prints their addresses. On SIGTERM or SIGINT: the front end drains first
(health NOT_SERVING, in-flight requests finish within ``--grace-period``), then the balancer
stops, then the ranks; every child exits (no orphans). The balancer keeps no state, so when it
dies it is started again (serving goes on meanwhile); when a rank or the front end dies,
everything is torn down and the exit code is 1.

``--metrics-port M``: every process serves Prometheus metrics: the router leader (rank 0) on
M, the balancer on M+1, the front end on M+2, then every other rank in rank order (M+3, ...);
M = 0 gives each a free port. The list is printed once ready, and the leader reports it in
GetStatus.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from moeserve.cli import UsageError
from moeserve.cli import flags as F


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="run a whole local cluster: ranks, front end, balancer",
                              description="Run routers, workers, the serving front end and the balancer on this "
                                          "machine until SIGTERM.")
    F.add_model_flags(p)
    g = p.add_argument_group("ports")
    g.add_argument("--port", type=F.port, default=8000, help="serving front end (default 8000; 0 = any free)")
    g.add_argument("--admin-port", type=F.port, default=8001, help="admin API of the leader (default 8001)")
    g.add_argument("--balancer-port", type=F.port, default=8002, help="balancer (default 8002)")
    F.add_token_flag(p)
    F.add_balancer_flags(p)
    F.add_server_flags(p)
    F.add_metrics_flags(p, per_expert=True)
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S", help="seconds to become ready")
    p.add_argument("--log-dir", metavar="DIR", help="keep every process's log here")
    p.set_defaults(func=run)


def wait_serving(address: str, timeout_s: float, ca_file: str | None = None, alive=lambda: True) -> None:
    """Block until grpc.health.v1 at ``address`` answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    creds = grpc.ssl_channel_credentials(open(ca_file, "rb").read()) if ca_file else None
    with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if not alive():
                raise RuntimeError(f"the process serving {address} exited")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} was not SERVING within {timeout_s:.0f} s")
            time.sleep(0.1)


def metrics_layout(base: int | None, world_size: int) -> dict[str, int] | None:
    """Metrics port of every process of ``up`` (None: no metrics): rank0 = M, balancer = M+1,
    frontend = M+2, rank r = M+2+r for r >= 1; M = 0 gives each a free port."""
    if base is None:
        return None
    from moeserve.cluster.launcher import free_port
    names = ["rank0", "balancer", "frontend"] + [f"rank{r}" for r in range(1, world_size)]
    if base == 0:
        ports: list[int] = []
        while len(ports) < len(names):
            p = free_port()
            if p not in ports:
                ports.append(p)
        return dict(zip(names, ports))
    if base + len(names) - 1 > 65535:
        raise UsageError(f"--metrics-port {base}: the {len(names)} processes need ports up to {base + len(names) - 1}")
    return {n: base + i for i, n in enumerate(names)}


def run(args: argparse.Namespace) -> int:
    from moeserve.cluster.launcher import LocalCluster, _die_with_parent, free_port

    kw = F.cluster_kwargs(args)
    opts = F.server_options(args, 0)                    # validates the server flags
    token = F.token(args) or secrets.token_urlsafe(18)
    ports = {k: getattr(args, k) or free_port() for k in ("port", "admin_port", "balancer_port")}
    if len(set(ports.values())) < 3:
        raise UsageError(f"--port, --admin-port and --balancer-port must differ, got {sorted(ports.values())}")
    loop = F.loop_config(args, None, kw.get("step_interval"))   # validates the balancer flags
    host = args.host
    world = kw["routers"] if kw["colocated"] else kw["routers"] + kw["workers"]
    metrics = metrics_layout(args.metrics_port, world)
    mkw = {}
    if metrics is not None:
        mkw = dict(metrics_ports=[metrics[f"rank{r}"] for r in range(world)], per_expert_metrics=args.per_expert_metrics,
                   metrics_peers={k: metrics[k] for k in ("balancer", "frontend")})
    try:
        cluster = LocalCluster(args.model, admin_port=ports["admin_port"], admin_host=host, admin_token=token,
                               admin_tls_cert=args.tls_cert or "", admin_tls_key=args.tls_key or "",
                               max_message_bytes=opts.max_message_bytes, grace_s=opts.grace_s,
                               startup_timeout_s=args.startup_timeout, log_dir=args.log_dir, **mkw, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children: list[subprocess.Popen] = []
    cluster.start()
    try:
        env = dict(os.environ, MOESERVE_PARENT_PID=str(os.getpid()), MOESERVE_ADMIN_TOKEN=token,
                   **{F.CONTROL_KEY_ENV: cluster.authkey.hex()})
        common = ["--host", host, "--max-message-bytes", str(opts.max_message_bytes),
                  "--grace-period", str(opts.grace_s)]
        if args.tls_cert:
            common += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
        chost, cport = cluster.control_address
        front = [sys.executable, "-m", "moeserve", "frontend", "--port", str(ports["port"]),
                 "--control-address", f"{chost}:{cport}", "--model", args.model, *common]
        bal = [sys.executable, "-m", "moeserve", "balancer", "--balancer-port", str(ports["balancer_port"]),
               "--admin-address", f"{host}:{ports['admin_port']}", "--eplb-step-interval", str(loop.step_interval),
               "--eplb-min-balancedness", str(loop.min_balancedness), "--eplb-min-gain", str(loop.min_gain),
               "--eplb-move-cost", str(loop.move_cost), "--eplb-move-budget", str(loop.move_budget),
               "--balancer-poll-interval", str(args.balancer_poll_interval), *common]
        if args.tls_cert:
            bal += ["--ca-file", args.tls_cert]
        if metrics is not None:
            front += ["--metrics-port", str(metrics["frontend"])]
            bal += ["--metrics-port", str(metrics["balancer"])]
        logs = args.log_dir or cluster.run_dir

        def spawn(name, cmd):
            with open(os.path.join(logs, f"{name}.log"), "ab") as out:
                return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

        children.extend([spawn("frontend", front), spawn("balancer", bal)])
        addrs = {"serving": f"{host}:{ports['port']}", "admin": f"{host}:{ports['admin_port']}",
                 "balancer": f"{host}:{ports['balancer_port']}"}
        ca = args.tls_cert if args.tls_cert else None
        for name, addr in addrs.items():
            wait_serving(addr, args.startup_timeout, ca, alive=lambda: cluster.alive and all(c.poll() is None for c in children))
        print(f"serving  {addrs['serving']}\nadmin    {addrs['admin']}\nbalancer {addrs['balancer']}", flush=True)
        if metrics is not None:
            print(metrics_list(metrics, host, cluster.config), flush=True)
        if not F.token(args):
            print(f"admin token {token}", flush=True)
        print("ready", flush=True)
        code = 0
        while not stop.wait(0.2):
            if children[1].poll() is not None and cluster.alive and not stop.is_set():
                print(f"moeserve up: the balancer exited ({children[1].returncode}); starting it again",
                      file=sys.stderr, flush=True)
                children[1] = spawn("balancer", bal)
            dead = [c for c in children[:1] if c.poll() is not None]
            if dead or not cluster.alive:
                print(f"moeserve up: a process exited ({cluster.error or [c.args[3] for c in dead]}); stopping",
                      file=sys.stderr, flush=True)
                code = 1
                break
        return code
    except (RuntimeError, TimeoutError) as e:
        print(f"moeserve up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        _shutdown(children, cluster, opts.grace_s)


def metrics_list(metrics: dict[str, int], host: str, cfg) -> str:
    """One line per process: its role and its metrics URL (``cfg``: the ClusterConfig)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    lines = []
    for name, port in metrics.items():
        if name.startswith("rank"):
            role = cfg.role(int(name[4:]))
            label = f"worker {role.worker_index}" if role.name == "worker" else role.name
            what = f"rank {role.rank} ({label}{', leader' if role.rank == 0 else ''})"
        else:
            what = "front end" if name == "frontend" else name
        lines.append(f"metrics  {what:<28} http://{shown}:{port}/metrics")
    return "\n".join(lines)


def _shutdown(children, cluster, grace_s: float) -> None:
    """The front end drains first (its requests need the ranks), then the balancer, then the ranks."""
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
            try:
                c.wait(grace_s + 10)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    cluster.stop()
