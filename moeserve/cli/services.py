"""One service per subcommand, for compose and Kubernetes:

- ``moeserve router --rank I ...`` / ``moeserve worker --rank I ...``: one rank of the world
  (``--rank --world-size --master-addr --master-port``, by default from torchrun's environment
  variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the same model and cluster flags on
  every rank). Ranks ``0 .. R-1`` are routers, ``R .. R+W-1`` workers (co-located: every rank
  is both). Rank 0 is the leader: it serves the local channel (``--control-host``,
  ``--control-port``, key from $MOESERVE_CONTROL_KEY) and the admin API (``--admin-port``).
- ``moeserve frontend --port P --control-address HOST:PORT``: the serving front end.
- ``moeserve balancer --balancer-port B --admin-address HOST:PORT``: the balancer.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Awaitable, Callable

from moeserve.cli import UsageError
from moeserve.cli import flags as F

DEFAULT_CONTROL_PORT = 29600


def register(subparsers) -> None:
    for name, what in (
        ("router", "a router rank (rank 0 is the leader and hosts the admin API)"),
        ("worker", "an expert-worker rank"),
    ):
        p = subparsers.add_parser(
            name,
            help=f"run {what} of a multi-process cluster",
            description=f"Run {what}. Every rank gets the same model and cluster flags.",
        )
        F.add_model_flags(p)
        F.add_state_flags(p)
        g = p.add_argument_group("rank")
        _env_arg(g, "--rank", "RANK", int, None, "this rank")
        _env_arg(g, "--world-size", "WORLD_SIZE", int, None, "routers + workers (co-located: routers)")
        _env_arg(g, "--master-addr", "MASTER_ADDR", str, "127.0.0.1", "torch.distributed store host (rank 0)")
        _env_arg(g, "--master-port", "MASTER_PORT", int, 29500, "torch.distributed store port")
        g.add_argument("--control-host", default="127.0.0.1", help="leader: where the front end reaches it")
        g.add_argument(
            "--control-port",
            type=F.port,
            default=DEFAULT_CONTROL_PORT,
            help=f"leader: the local channel's port (default {DEFAULT_CONTROL_PORT}; key from ${F.CONTROL_KEY_ENV})",
        )
        g.add_argument("--admin-port", type=F.port, default=None, help="leader: serve the admin API on this port")
        F.add_token_flag(p)
        F.add_server_flags(p)
        F.add_metrics_flags(p, per_expert=True)
        p.set_defaults(func=run_rank, role=name)

    p = subparsers.add_parser(
        "frontend",
        help="run the serving front end (gRPC Generate)",
        description="Serve moeserve.v1.Serving in front of a running leader.",
    )
    p.add_argument("--port", type=F.port, default=8000, help="serving port (default 8000)")
    p.add_argument(
        "--control-address",
        default=f"127.0.0.1:{DEFAULT_CONTROL_PORT}",
        metavar="HOST:PORT",
        help=f"the leader's local channel (key from ${F.CONTROL_KEY_ENV})",
    )
    p.add_argument("--model", metavar="DIR", help="checkpoint folder, for its tokenizer (optional)")
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="share the serving and HTTP ports with other front-end processes that set it too "
        "(SO_REUSEPORT; the kernel spreads connections over them: moeserve up --api-server-count)",
    )
    F.add_http_flags(p)
    F.add_server_flags(p)
    F.add_metrics_flags(p)
    p.set_defaults(func=run_frontend)

    p = subparsers.add_parser(
        "balancer",
        help="run the balancer service (the EPLB loop)",
        description="Serve moeserve.v1.Balancer and rebalance through the leader's admin API.",
    )
    p.add_argument("--balancer-port", type=F.port, default=8002, help="balancer port (default 8002)")
    p.add_argument("--admin-address", default="127.0.0.1:8001", metavar="HOST:PORT", help="the leader's admin API")
    p.add_argument("--ca-file", metavar="PEM", help="reach the admin API with TLS, trusting this CA")
    p.add_argument(
        "--admin-timeout", type=float, default=5.0, metavar="S", help="deadline of each admin call (default 5)"
    )
    p.add_argument(
        "--eplb-window-size",
        type=int,
        default=None,
        metavar="N",
        help="steps of load to plan on (default: the leader's whole window)",
    )
    p.add_argument(
        "--eplb-step-interval",
        type=int,
        default=3000,
        metavar="N",
        help="forward steps between periodic rebalances (default 3000)",
    )
    F.add_token_flag(p)
    F.add_balancer_flags(p)
    F.add_server_flags(p)
    F.add_metrics_flags(p)
    p.set_defaults(func=run_balancer)


def _env_arg(group, flag: str, env: str, kind, default, help_: str) -> None:
    """A flag whose default comes from environment variable ``env`` (required when neither is set)."""
    value = os.environ.get(env)
    if value is not None:
        try:
            default = kind(value)
        except ValueError:
            raise UsageError(f"${env} must be {'an integer' if kind is int else 'a string'}, got {value!r}") from None
    group.add_argument(
        flag,
        type=kind,
        default=default,
        required=default is None,
        help=f"{help_} (default: ${env}{'' if default is None else f', else {default}'})",
    )


def _logging(name: str) -> None:
    from moeserve.config import log_level

    try:
        level = log_level()
    except ValueError as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s",
    )
    if not os.environ.get("MOESERVE_PARENT_PID"):  # a launcher's child: the launcher said it once
        from moeserve import envs

        envs.warn_unknown()


def _parent_watch() -> None:
    """Exit when the process that started us (``moeserve up``) is gone: no orphans."""
    parent = os.environ.get("MOESERVE_PARENT_PID")
    if parent:
        import threading

        from moeserve.cluster.rank import _watch_parent

        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()


def control_key() -> bytes:
    key = os.environ.get(F.CONTROL_KEY_ENV)
    if not key:
        raise UsageError(
            f"set ${F.CONTROL_KEY_ENV} to the cluster's secret (hex, the same for every rank and the "
            "front end: the ranks' store and the leader's channel), e.g. "
            "$(python -c 'import secrets; print(secrets.token_hex(16))')"
        )
    try:
        return bytes.fromhex(key)
    except ValueError:
        raise UsageError(f"${F.CONTROL_KEY_ENV} must be hex digits") from None


def run_rank(args: argparse.Namespace) -> int:
    from moeserve.config import CacheConfig, ClusterConfig, EplbConfig, Limits, admin_hook, rank_layout

    kw = F.cluster_kwargs(args, leader=args.rank == 0)
    placement = kw.pop("placement", None)  # --state-dir / --init-expert-location: every rank loads it
    breakeven = kw.pop("breakeven", None)  # ... with its break-even counts, when it has them
    world = kw["routers"] if kw["colocated"] else kw["routers"] + kw["workers"]
    if args.world_size != world:
        raise UsageError(
            f"--world-size {args.world_size} does not match the cluster flags: "
            f"{'routers' if kw['colocated'] else 'routers + workers'} = {world}"
        )
    if not 0 <= args.rank < world:
        raise UsageError(f"--rank must be in 0..{world - 1}, got {args.rank}")
    router_ranks, worker_ranks = rank_layout(kw["routers"], kw["workers"], kw["colocated"])
    is_router, is_worker = args.rank in router_ranks, args.rank in worker_ranks
    if args.role == "router" and not is_router or args.role == "worker" and not is_worker:
        raise UsageError(
            f"rank {args.rank} is {'a router' if is_router else 'a worker'} "
            f"(ranks 0..{kw['routers'] - 1} are routers): use 'moeserve {'router' if is_router else 'worker'}'"
        )
    if args.rank == 0 and args.admin_port is not None and not F.token(args):
        raise UsageError(f"the admin API needs a token: --admin-token or ${F.TOKEN_ENV}")
    key = control_key()  # every rank proves it to the store (the leader's channel uses it too)
    eplb = EplbConfig(**{k: kw.pop(k) for k in list(kw) if k in EplbConfig.__dataclass_fields__})
    limits = Limits(**{k: kw.pop(k) for k in list(kw) if k in Limits.__dataclass_fields__})
    cache = CacheConfig(**{k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__})
    opts = F.server_options(args, args.admin_port or 0)
    try:
        hook = (
            {}
            if args.admin_port is None
            else admin_hook(
                args.admin_port,
                args.host,
                args.tls_cert or "",
                args.tls_key or "",
                opts.max_message_bytes,
                opts.grace_s,
            )
        )
        cfg = ClusterConfig(
            model_dir=os.path.abspath(args.model),
            eplb=eplb,
            limits=limits,
            cache=cache,
            host=args.host,
            **hook,
            phy2log=None if placement is None else tuple(tuple(int(x) for x in r) for r in placement),
            breakeven=None if breakeven is None else tuple(tuple(int(x) for x in r) for r in breakeven),
            per_expert_metrics=args.per_expert_metrics,
            **kw,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    token = F.token(args)
    if token:
        os.environ[F.TOKEN_ENV] = token
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    _logging(f"rank{args.rank}")
    _parent_watch()
    from moeserve.cluster import rank

    return rank.serve(cfg, args.rank, key, None, args.control_host, args.control_port, args.metrics_port)


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"{flag} must be HOST:PORT, got {text!r}")
    return host, int(port)


def run_frontend(args: argparse.Namespace) -> int:
    from moeserve.router.engine.channel import AsyncEngineClient
    from moeserve.services import server
    from moeserve.services.admission import Admission, AdmissionLimits, stream_coalescing, vocab_size_of
    from moeserve.services.frontend import load_tokenizer, make_server

    address = _host_port(args.control_address, "--control-address")
    key = control_key()
    try:
        stream_coalescing()  # a bad value fails the start, not the first stream
    except ValueError as e:
        raise UsageError(str(e)) from None
    opts = dataclasses.replace(F.server_options(args, args.port), reuse_port=args.reuse_port)
    api_key = F.api_key(args)
    if args.max_model_len < 1:
        raise UsageError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.http_port is not None and args.http_port == args.port and args.port != 0:
        raise UsageError(f"--http-port and --port must differ, got {args.port} for both")
    _logging("frontend")
    _parent_watch()
    metrics = None
    pm = F.start_metrics(args, "frontend")
    if pm is None and args.http_port is not None:  # /metrics on the HTTP port
        from moeserve.ops.metrics import ProcessMetrics

        pm = ProcessMetrics("frontend")
    names = args.served_model_name or [args.model or "default"]
    vllm_metrics = None
    if pm is not None:
        from moeserve.ops.metrics import FrontendMetrics
        from moeserve.ops.vllm_metrics import VllmMetrics  # vLLM's names beside moeserve's
        from moeserve.services.server import SERVING

        vllm_metrics = VllmMetrics(pm.registry, names[0])
        metrics = FrontendMetrics(pm.registry, vllm_metrics)
        from moeserve.services.metrics import grpc_interceptor

        opts = dataclasses.replace(opts, interceptors=(*opts.interceptors, grpc_interceptor(pm, SERVING)))
    from moeserve.services.readiness import Readiness, channel_probe

    door = F.door_limits(args)
    defaults = _generation_defaults(args)
    if args.max_logprobs < 0:
        raise UsageError(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
    try:
        limits = AdmissionLimits(
            max_model_len=args.max_model_len,
            vocab_size=vocab_size_of(args.model),
            max_request_tokens=args.max_request_tokens,
            choices_in_flight=args.max_choices_in_flight,
            max_logprobs=args.max_logprobs,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    tokenizer = load_tokenizer(args.model)
    if args.chat_template:
        from moeserve.services.tokenizer import chat_template_arg

        try:
            template = chat_template_arg(args.chat_template)
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
        if tokenizer is None:
            raise UsageError("--chat-template needs the model's tokenizer (tokenizer.json in --model)")
        tokenizer.chat_template = template
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, llama4_json, pythonic, llama4_pythonic)"
        )
    engine = AsyncEngineClient(address, key)
    admission = Admission(engine, tokenizer, metrics, limits)
    readiness_metrics = None
    if pm is not None:
        from moeserve.ops.metrics import ReadinessMetrics

        readiness_metrics = ReadinessMetrics(pm.registry)
    # grpc.health and /health follow it; vLLM's scheduler gauges take the status it reads
    readiness = Readiness(channel_probe(engine, vllm_metrics.update if vllm_metrics else None), readiness_metrics)
    srv = make_server(None, None, opts, admission=admission, api_key=api_key, readiness=readiness)

    def ready(port):
        print(f"serving front end on {args.host}:{port}", flush=True)
        from moeserve.ops import gcpause

        gcpause.freeze_startup_heap()  # full collections skip the start-up heap

    if args.http_port is None:
        server.run(server.serve_forever(srv, ready, after_stop=engine.close))
        return 0
    from moeserve.services.http import HttpApi, HttpServer

    api = HttpApi(
        admission,
        names,
        os.path.abspath(args.model) if args.model else "",
        api_key,
        pm.registry,
        max_body_bytes=opts.max_message_bytes,
        generation_defaults=defaults,
        vllm_metrics=vllm_metrics,
        tool_parser=args.tool_call_parser if getattr(args, "enable_auto_tool_choice", False) else None,
    )
    api.readiness = readiness
    http = HttpServer(
        api,
        args.host,
        args.http_port,
        opts.grace_s,  # HTTPS with the gRPC side's files
        ssl_certfile=opts.tls_cert,
        ssl_keyfile=opts.tls_key,
        door=door,
        reuse_port=args.reuse_port,
    )
    try:
        server.run(_serve_both(srv, http, args.host, engine.close))
    except OSError as e:
        print(f"moeserve frontend: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _generation_defaults(args) -> dict:
    """--generation-config (auto: the --model folder's generation_config.json; vllm: none; a
    folder) and --override-generation-config, as HttpApi's sampling defaults; the defaults in
    force are logged, as vLLM does."""
    import json

    from moeserve.services.tokenizer import generation_defaults

    which = args.generation_config
    folder = None if which == "vllm" else args.model if which == "auto" else which
    if folder and which != "auto" and not os.path.isdir(folder):
        raise UsageError(f"--generation-config {which}: no such folder (give auto, vllm or a folder)")
    overrides = None
    if args.override_generation_config:
        try:
            overrides = json.loads(args.override_generation_config)
        except json.JSONDecodeError as e:
            raise UsageError(f"--override-generation-config is not valid JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise UsageError("--override-generation-config must be a JSON object")
    try:
        out = generation_defaults(folder, overrides)
    except ValueError as e:
        raise UsageError(f"--generation-config: {e}") from None
    if out:
        logging.getLogger("moeserve.services").info(
            "sampling defaults from the model's generation config (--generation-config vllm turns them off): %s", out
        )
    return out


async def _serve_both(grpc_server, http, host: str, after_stop: Callable[[], Awaitable[None]]) -> None:
    """The HTTP API and the gRPC serving service on one event loop until SIGTERM or SIGINT;
    then both drain at once (new requests refused, in-flight ones get the grace period), and
    ``after_stop`` runs (the engine client's session closes)."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await http.start()
    print(f"HTTP API on {http.scheme}://{host}:{port}/v1", flush=True)
    try:
        await grpc_server.start()
    except BaseException:
        await http.stop()
        raise
    print(f"serving front end on {host}:{grpc_server.port}", flush=True)
    from moeserve.ops import gcpause

    gcpause.freeze_startup_heap()  # full collections skip the start-up heap
    await stop.wait()
    logging.getLogger("moeserve.services").info("front end: shutting down (grace %.0f s)", http.grace_s)
    await asyncio.gather(http.stop(), grpc_server.stop())
    await after_stop()


def run_balancer(args: argparse.Namespace) -> int:
    from moeserve.balancer.service import serve_balancer
    from moeserve.services import server

    _host_port(args.admin_address, "--admin-address")
    tok = F.token(args)
    if not tok:
        raise UsageError(f"the balancer needs the admin token: --admin-token or ${F.TOKEN_ENV}")
    if args.balancer_poll_interval <= 0 or args.admin_timeout <= 0:
        raise UsageError("--balancer-poll-interval and --admin-timeout must be > 0")
    cfg = F.loop_config(args, args.eplb_window_size, args.eplb_step_interval)
    opts = F.server_options(args, args.balancer_port, tok)
    _logging("balancer")
    _parent_watch()
    pm = F.start_metrics(args, "balancer")
    server.run(
        serve_balancer(
            args.admin_address,
            tok,
            cfg,
            opts,
            poll_s=args.balancer_poll_interval,
            call_timeout_s=args.admin_timeout,
            ca_file=args.ca_file,
            on_started=lambda port: print(f"balancer on {args.host}:{port}", flush=True),
            process_metrics=pm,
        )
    )
    return 0
