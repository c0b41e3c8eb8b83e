"""``moeserve up --model DIR ...``: a whole local cluster until SIGTERM.

Starts the ranks (``LocalCluster``: routers, workers, the leader with the admin API), the
serving front end and the balancer as child processes; ready when all three answer SERVING to
grpc.health.v1, then prints their addresses. On SIGTERM or SIGINT: the front ends drain
(health NOT_SERVING, in-flight requests finish within ``--grace-period``) while the balancer
stops, then the ranks stop; every child exits (no orphans). The balancer keeps no state, so when it
dies it is started again (serving goes on meanwhile), and so is the front end (clients that
retry are served); a lost expert worker is replaced by the launcher (docs/dataplane.md, "When a
peer dies"); when a router or the leader dies, everything is torn down and the exit code is 1.
A port given on the command line that is in use is reported before anything loads (exit 1);
ports given as 0 are picked outside the kernel's ephemeral range (``moeserve.ops.ports``), so that
no rank's outgoing connection takes one before its server binds it.

``--http-port H``: the front end also serves the OpenAI-compatible HTTP API on H
(``moeserve.services.http``; ``moeserve serve`` is ``up`` with the HTTP API on ``--port``).
``--api-key`` (or $MOESERVE_API_KEY) guards the serving API, HTTP and gRPC alike.

``--metrics-port M``: every process serves Prometheus metrics: the router leader (rank 0) on
M, the balancer on M+1, the front end on M+2, then every other rank in rank order (M+3, ...),
then the other front ends; M = 0 gives each a free port.

``--api-server-count N``: N front-end processes share the serving and HTTP ports
(``moeserve frontend --reuse-port``), logs ``frontend.log``, ``frontend1.log``, ...; ready once
each says it listens; a lost one is started again. The list is printed once ready, and the leader reports it in
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

from moeserve.cli import UsageError, multinode
from moeserve.cli import flags as F
from moeserve.cli.launching import Replacements, start_cluster
from moeserve.ops.procs import child_env, module_command


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up",
        help="run a whole local cluster: ranks, front end, balancer",
        description="Run routers, workers, the serving front end and the balancer on this machine until SIGTERM.",
    )
    F.add_model_flags(p)
    F.add_state_flags(p)
    g = p.add_argument_group("ports")
    g.add_argument("--port", type=F.port, default=8000, help="serving front end (default 8000; 0 = any free)")
    g.add_argument("--admin-port", type=F.port, default=8001, help="admin API of the leader (default 8001)")
    g.add_argument("--balancer-port", type=F.port, default=8002, help="balancer (default 8002)")
    F.add_token_flag(p)
    F.add_http_flags(p, max_model_len=False)
    F.add_balancer_flags(p)
    F.add_server_flags(p)
    F.add_metrics_flags(p, per_expert=True)
    F.add_api_server_count_flag(p)
    multinode.add_node_flags(p)
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S", help="seconds to become ready")
    p.add_argument("--log-dir", metavar="DIR", help="keep every process's log here")
    p.set_defaults(func=run)


def poll_until(check, timeout_s: float, alive, exited: str, late: str) -> None:
    """Call ``check`` every 0.1 s until it returns True; RuntimeError(``exited``) when ``alive()``
    turns false first, TimeoutError(``late``) once ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if not alive():
            raise RuntimeError(exited)
        if time.monotonic() > deadline:
            raise TimeoutError(late)
        time.sleep(0.1)


def wait_serving(address: str, timeout_s: float, ca_file: str | None = None, alive=lambda: True) -> None:
    """Block until grpc.health.v1 at ``address`` answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = grpc.ssl_channel_credentials(open(ca_file, "rb").read()) if ca_file else None
    with grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def serving() -> bool:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return False
            return status == health_pb2.HealthCheckResponse.SERVING

        poll_until(
            serving,
            timeout_s,
            alive,
            f"the process serving {address} exited",
            f"{address} was not SERVING within {timeout_s:.0f} s",
        )


def metrics_layout(base: int | None, world_size: int, taken=(), frontends: int = 1) -> dict[str, int] | None:
    """Metrics port of every process of ``up`` (None: no metrics): rank0 = M, balancer = M+1,
    frontend = M+2, rank r = M+2+r for r >= 1, then the other front ends (``frontend<j>``, j >=
    1, with ``--api-server-count``); M = 0 gives each a free port, none of ``taken``."""
    if base is None:
        return None
    from moeserve.ops.ports import free_port

    names = ["rank0", "balancer", "frontend"] + [f"rank{r}" for r in range(1, world_size)]
    names += frontend_names(frontends)[1:]
    if base == 0:
        ports: list[int] = []
        while len(ports) < len(names):
            ports.append(free_port(exclude=[*ports, *taken]))
        return dict(zip(names, ports))
    if base + len(names) - 1 > 65535:
        raise UsageError(f"--metrics-port {base}: the {len(names)} processes need ports up to {base + len(names) - 1}")
    return {n: base + i for i, n in enumerate(names)}


def frontend_names(count: int) -> list[str]:
    """The front-end processes of ``up``: ``frontend``, then ``frontend1`` ... (their logs and
    metrics are named so)."""
    return ["frontend"] + [f"frontend{j}" for j in range(1, count)]


def wait_logged(path: str, offset: int, text: str, timeout_s: float, alive=lambda: True) -> None:
    """Block until ``text`` appears in the log at ``path`` after byte ``offset``."""

    def said() -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return text.encode() in f.read()
        except OSError:
            return False

    poll_until(
        said,
        timeout_s,
        alive,
        f"a process exited before {path} said {text!r}",
        f"{path} did not say {text!r} within {timeout_s:.0f} s",
    )


def run(args: argparse.Namespace) -> int:
    from moeserve.cluster.launcher import LocalCluster
    from moeserve.ops.ports import check_bindable, free_port
    from moeserve.ops.procs import describe_exit, set_death_signal
    from moeserve.router.engine.channel import ClusterError

    prog = f"moeserve {getattr(args, 'command', None) or 'up'}"
    node, key = multinode.layout(args)  # sets the layout's workers_per_node and exchange first
    kw = F.cluster_kwargs(args, leader=node is None or node.node_rank == 0)
    if node is not None and node.node_rank > 0:  # no front end, balancer or admin API here
        return multinode.run_node(args, kw, node, key, prog)
    opts = F.server_options(args, 0)  # validates the server flags
    frontends = args.api_server_count
    if not 1 <= frontends <= 64:
        raise UsageError(f"--api-server-count must be 1 .. 64 front-end processes, got {frontends}")
    F.door_limits(args)  # ... and the HTTP door's
    token = F.token(args) or secrets.token_urlsafe(18)
    http_port = getattr(args, "http_port", None)
    ports = {k: getattr(args, k) for k in ("port", "admin_port", "balancer_port")}
    if http_port is not None:
        ports["http_port"] = http_port
    for k, v in ports.items():  # 0: any free port, none of the given ones
        if not v:
            ports[k] = free_port(exclude=[p for p in ports.values() if p])
    if len(set(ports.values())) < len(ports):
        names = "--port, --admin-port, --balancer-port" + (" and the HTTP port" if http_port is not None else "")
        raise UsageError(f"{names} must differ, got {sorted(ports.values())}")
    loop = F.loop_config(
        args, None, kw.get("step_interval"), args.model, kw.get("dtype")
    )  # validates the balancer flags
    host = args.host
    world = kw["routers"] if kw["colocated"] else kw["routers"] + kw["workers"]
    here = node.ranks(world) if node is not None else range(world)
    metrics = metrics_layout(args.metrics_port, len(here), taken=list(ports.values()), frontends=frontends)
    fronts = frontend_names(frontends)
    # A port in use is reported now, not after the ranks have loaded the weights (minutes for
    # a real checkpoint). Ports this process picks lie outside the ephemeral range, so that no
    # rank's outgoing connection takes one meanwhile (moeserve.ops.ports).
    serve = getattr(args, "command", None) == "serve"
    flag = {
        "port": "--grpc-port" if serve else "--port",
        "admin_port": "--admin-port",
        "balancer_port": "--balancer-port",
        "http_port": "--port (the HTTP API)" if serve else "--http-port",
    }
    try:
        check_bindable(host, {flag[k]: v for k, v in ports.items()})
        if node is not None:  # the leader's store, for every node
            check_bindable(node.master_addr, {"--master-port (the leader's store, on --master-addr)": node.master_port})
        if metrics is not None and args.metrics_port:
            check_bindable(host, {f"--metrics-port, {name}": p for name, p in metrics.items()})
    except OSError as e:
        print(f"{prog}: error: {e.strerror}", file=sys.stderr, flush=True)
        return 1
    mkw = {}
    if metrics is not None:
        mkw = dict(
            metrics_ports=[metrics[f"rank{r}"] if r in here else 0 for r in range(world)],
            per_expert_metrics=args.per_expert_metrics,
            metrics_peers={k: metrics[k] for k in ("balancer", *fronts)},
        )
    try:
        cluster = LocalCluster(
            args.model,
            admin_port=ports["admin_port"],
            admin_host=host,
            admin_token=token,
            admin_tls_cert=args.tls_cert or "",
            admin_tls_key=args.tls_key or "",
            max_message_bytes=opts.max_message_bytes,
            grace_s=opts.grace_s,
            startup_timeout_s=args.startup_timeout,
            log_dir=args.log_dir,
            tokenizer_dir=getattr(args, "tokenizer_dir", None) or "",
            nodes=node,
            authkey=key,
            **mkw,
            **kw,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None

    # Ctrl-C at a terminal reaches the whole foreground process group: the ranks block SIGINT
    # (a blocked mask survives fork and exec) and the front end and the balancer sit in
    # sessions of their own, so that this process alone decides: a signal while starting stops
    # everything at once, a signal once ready drains the front end first, as SIGTERM does.
    stop = threading.Event()
    starting = [True]

    def on_signal(*_):
        stop.set()
        if starting[0]:
            raise KeyboardInterrupt

    children: list[subprocess.Popen] = []
    try:
        try:
            start_cluster(cluster, len(here), on_signal, getattr(args, "startup_progress", False), args.model)
        except ClusterError as e:
            print(f"{prog}: the cluster did not start: {e}", file=sys.stderr, flush=True)
            return 1
        assert cluster.authkey is not None and cluster.run_dir is not None  # set by cluster.start()
        env = child_env(
            MOESERVE_PARENT_PID=str(os.getpid()),
            MOESERVE_ADMIN_TOKEN=token,
            **{F.CONTROL_KEY_ENV: cluster.authkey.hex()},
        )
        api_key = F.api_key(args)
        if api_key:
            env[F.API_KEY_ENV] = api_key  # not on the command line, where ps shows it
        common = [
            "--host",
            host,
            "--max-message-bytes",
            str(opts.max_message_bytes),
            "--grace-period",
            str(opts.grace_s),
        ]
        if args.tls_cert:
            common += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
        chost, cport = cluster.control_address
        tokenizer = getattr(args, "tokenizer_dir", None) or args.model
        front = [
            *module_command("moeserve", "frontend"),
            "--port",
            str(ports["port"]),
            "--control-address",
            f"{chost}:{cport}",
            "--model",
            tokenizer,
            "--max-model-len",
            str(args.max_model_len),
            *common,
        ]
        served = getattr(args, "served_model_name", None) or [getattr(args, "model_name", None) or args.model]
        if http_port is not None:
            front += ["--http-port", str(ports["http_port"]), *F.door_argv(args), "--served-model-name", *served]
            front += frontend_text_flags(args)
        bal = [
            *module_command("moeserve", "balancer"),
            "--balancer-port",
            str(ports["balancer_port"]),
            "--admin-address",
            f"{host}:{ports['admin_port']}",
            "--eplb-step-interval",
            str(loop.step_interval),
            "--eplb-min-balancedness",
            str(loop.min_balancedness),
            "--eplb-min-gain",
            str(loop.min_gain),
            "--eplb-move-cost",
            str(loop.move_cost),
            "--eplb-move-budget",
            str(loop.move_budget),
            "--balancer-poll-interval",
            str(args.balancer_poll_interval),
            *common,
        ]
        if loop.step_model is not None:  # the entry picked here, by name
            bal += [
                "--eplb-step-model",
                os.path.abspath(args.eplb_step_model),
                "--eplb-step-model-gpu",
                loop.step_model.gpu,
                "--eplb-step-model-shape",
                loop.step_model.shape,
            ]
        if args.tls_cert:
            bal += ["--ca-file", args.tls_cert]
        if frontends > 1:  # the processes share the serving and HTTP ports (SO_REUSEPORT)
            front.append("--reuse-port")
        commands = {name: list(front) for name in fronts}
        if metrics is not None:
            for name in fronts:
                commands[name] += ["--metrics-port", str(metrics[name])]
            bal += ["--metrics-port", str(metrics["balancer"])]
        commands["balancer"] = bal
        logs = args.log_dir or cluster.run_dir

        def spawn(name, cmd):
            with open(os.path.join(logs, f"{name}.log"), "ab") as out:
                return subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=set_death_signal,
                )

        offsets = {}
        for name in fronts:
            log_path = os.path.join(logs, f"{name}.log")
            offsets[name] = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        children.extend(spawn(name, cmd) for name, cmd in commands.items())
        addrs = {
            "serving": f"{host}:{ports['port']}",
            "admin": f"{host}:{ports['admin_port']}",
            "balancer": f"{host}:{ports['balancer_port']}",
        }
        ca = args.tls_cert if args.tls_cert else None
        alive = lambda: cluster.alive and all(c.poll() is None for c in children)  # noqa: E731
        for addr in addrs.values():
            wait_serving(addr, args.startup_timeout, ca, alive=alive)
        if frontends > 1:  # the health check above reached one of them: each says it listens
            for name in fronts:
                wait_logged(
                    os.path.join(logs, f"{name}.log"),
                    offsets[name],
                    "serving front end on",
                    args.startup_timeout,
                    alive,
                )
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        scheme = "https" if args.tls_cert else "http"  # the HTTP API serves the same certificate
        if http_port is not None:
            wait_http(f"{scheme}://{shown}:{ports['http_port']}/health", args.startup_timeout, alive=alive, ca_file=ca)
        print(f"serving  {addrs['serving']}\nadmin    {addrs['admin']}\nbalancer {addrs['balancer']}", flush=True)
        if node is not None:
            print(
                f"nodes    {multinode.describe(node, cluster.config)}; the leader's store on "
                f"{node.master_addr}:{node.master_port}",
                flush=True,
            )
        if http_port is not None:
            base = f"{scheme}://{shown}:{ports['http_port']}"
            print(
                f"http     {base}/v1 (OpenAI API: /v1/completions, /v1/chat/completions, /v1/models; "
                f"{base}/health, /version, /metrics)\nmodel    {', '.join(served)}"
                f"{'' if args.model in served else f' ({args.model})'}"
                f"{'; API key required' if api_key else ''}",
                flush=True,
            )
        if metrics is not None:
            print(metrics_list(metrics, host, cluster.config), flush=True)
        if not F.token(args):
            print(f"admin token {token}", flush=True)
        starting[0] = False
        print("ready", flush=True)
        if stop.is_set():
            return 0
        code = 0
        told = Replacements(prog, cluster)
        while not stop.wait(0.2):
            told.say()
            # The front end and the balancer keep no state: a lost one is started again while the
            # ranks serve on (clients that retry are served); a lost rank the launcher could not
            # replace ends the cluster.
            for i, (name, cmd) in enumerate(commands.items()):
                if children[i].poll() is not None and cluster.alive and not stop.is_set():
                    print(
                        f"{prog}: the {describe_service(name)} exited "
                        f"({describe_exit(children[i].returncode)}); starting it again",
                        file=sys.stderr,
                        flush=True,
                    )
                    children[i] = spawn(name, cmd)
            if not cluster.alive:
                print(
                    f"{prog}: the cluster stopped: {cluster.error or 'a rank exited'}; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
        if stop.is_set():
            print(
                f"{prog}: stopping: draining in-flight requests (up to {opts.grace_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return code
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted while starting; stopped", file=sys.stderr, flush=True)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        starting[0] = False
        _shutdown(children, cluster, opts.grace_s)


def frontend_text_flags(args) -> list[str]:
    """The HTTP API's flags for the front end: --max-logprobs, the generation config (auto: the
    model folder's, which may not be the tokenizer folder the front end is given), its
    overrides and the chat template (a file by its absolute path)."""
    out = ["--max-logprobs", str(args.max_logprobs)]
    which = args.generation_config
    out += [
        "--generation-config",
        args.model if which == "auto" else which if which == "vllm" else os.path.abspath(which),
    ]
    if args.override_generation_config:
        out += ["--override-generation-config", args.override_generation_config]
    if args.chat_template:
        t = args.chat_template
        out += ["--chat-template", os.path.abspath(t) if os.path.isfile(t) else t]
    if getattr(args, "enable_auto_tool_choice", False):
        out.append("--enable-auto-tool-choice")
    if getattr(args, "tool_call_parser", None):
        out += ["--tool-call-parser", args.tool_call_parser]
    return out


def wait_http(url: str, timeout_s: float, alive=lambda: True, ca_file: str | None = None) -> None:
    """Block until ``url`` answers 200 (an https URL: trusting ``ca_file``)."""
    import ssl
    import urllib.error
    import urllib.request

    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # a local address: no proxy
    if ca_file:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca_file)))
    opener = urllib.request.build_opener(*handlers)

    def answers() -> bool:
        try:
            with opener.open(url, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    poll_until(
        answers, timeout_s, alive, f"the process serving {url} exited", f"{url} did not answer within {timeout_s:.0f} s"
    )


def describe_service(name: str) -> str:
    """``frontend`` -> "front end", ``frontend2`` -> "front end 2", others as they are."""
    if name.startswith("frontend"):
        return "front end" + (f" {name[8:]}" if name[8:] else "")
    return name


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
            what = describe_service(name)
        lines.append(f"metrics  {what:<28} http://{shown}:{port}/metrics")
    return "\n".join(lines)


def _shutdown(children, cluster, grace_s: float) -> None:
    """The front ends drain (their requests need the ranks) and the balancer stops, all at once,
    then the ranks."""
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 10
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    cluster.stop()
