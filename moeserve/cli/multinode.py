"""``moeserve up`` / ``moeserve serve`` over several hosts: ``--nnodes N --node-rank K
--master-addr A --master-port P`` (torchrun's and SGLang's names), the same command on every
node but for ``--node-rank`` (docs/operations.md, "Several hosts").

Node 0 runs ranks ``0 .. B-1`` (B = world / N; rank 0 is the leader, which serves the store
on A:P), the front end, the balancer and the admin API. Node K runs ranks ``K*B .. K*B+B-1``
with node 0's config, replaces its own lost ranks, and exits 0 when node 0 stops the cluster,
1 when node 0 is gone. Every node needs the cluster's secret: ``--control-key-file`` or
``$MOESERVE_CONTROL_KEY`` (hex, at least 16 bytes).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

from moeserve.cli import UsageError
from moeserve.cli import flags as F

DEFAULT_MASTER_PORT = 29500  # torchrun's
MIN_SECRET_BYTES = 16


def add_node_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several hosts (one command per node; torchrun's and SGLang's names)")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes (hosts) of the cluster (default 1)")
    g.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="K",
        help="this node, 0..N-1; node 0 runs the leader, the front end, the balancer and the admin API (default 0)",
    )
    g.add_argument(
        "--master-addr",
        metavar="ADDR",
        help="node 0's address, the one every node reaches it at: the leader's store listens there alone "
        "(needed with --nnodes > 1)",
    )
    g.add_argument(
        "--master-port",
        type=F.port,
        default=DEFAULT_MASTER_PORT,
        metavar="PORT",
        help=f"the leader's store on --master-addr (default {DEFAULT_MASTER_PORT})",
    )
    g.add_argument(
        "--control-key-file",
        metavar="FILE",
        help=f"the cluster's secret, hex, the same on every node: every rank proves it to the store "
        f"(default: ${F.CONTROL_KEY_ENV}; a Kubernetes Secret mounted as a file)",
    )


def secret(args) -> bytes:
    """The cluster's secret from --control-key-file or $MOESERVE_CONTROL_KEY (UsageError when
    missing or not at least MIN_SECRET_BYTES bytes of hex)."""
    where = f"${F.CONTROL_KEY_ENV}"
    if args.control_key_file:
        where = f"--control-key-file {args.control_key_file}"
        try:
            text = Path(args.control_key_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"{where}: {e.strerror}") from None
    else:
        text = os.environ.get(F.CONTROL_KEY_ENV, "").strip()
        if not text:
            raise UsageError(
                f"--nnodes {args.nnodes}: every node needs the cluster's secret, the same on each: set "
                f"${F.CONTROL_KEY_ENV} or give --control-key-file (hex, e.g. from openssl rand -hex 16)"
            )
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"{where} must be hex digits") from None
    if len(key) < MIN_SECRET_BYTES:
        raise UsageError(f"{where} holds {len(key)} bytes; the secret needs at least {MIN_SECRET_BYTES}")
    return key


def layout(args):
    """(NodeLayout or None for one host, the secret or b""), from the node flags; it sets
    ``args.workers_per_node`` (from the layout, ``moeserve.cluster.nodes.check_layout``) and
    ``args.exchange`` (collective: the direct exchange reaches peers on one host only) for
    ``flags.cluster_kwargs``. UsageError naming the flag for a bad combination."""
    from moeserve.cluster.nodes import NodeLayout, check_layout

    n, k = args.nnodes, args.node_rank
    if n < 1:
        raise UsageError(f"--nnodes must be >= 1, got {n}")
    if not 0 <= k < n:
        raise UsageError(f"--node-rank must be in 0..{n - 1} (--nnodes {n}), got {k}")
    if n == 1:
        return None, b""
    if not args.master_addr:
        raise UsageError(f"--nnodes {n} needs --master-addr: node 0's address, the one every node reaches it at")
    if not args.master_port:
        raise UsageError("--master-port must be a port in 1..65535: every node must know it in advance")
    if k > 0:
        for flag in ("state_dir", "init_expert_location"):
            if getattr(args, flag, None):
                raise UsageError(
                    f"--{flag.replace('_', '-')} belongs on node 0, which keeps the placement; node {k} runs "
                    "node 0's: leave it out here"
                )
    if getattr(args, "exchange", "auto") == "nvlink":
        raise UsageError(
            "--exchange nvlink reaches peers on one host only; across nodes rows travel by the collective "
            "exchange: leave --exchange out or give collective"
        )
    routers, workers, colocated = args.routers, args.workers, args.colocated
    try:
        args.workers_per_node = check_layout(routers, workers, colocated, n, args.workers_per_node)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.exchange = "collective"
    key = secret(args)
    return NodeLayout(n, k, args.master_addr, args.master_port), key


def describe(node, cfg) -> str:
    """``node 1 of 2: ranks 2, 3 (worker 1, worker 2)``."""
    ranks = node.ranks(cfg.world_size)
    roles = []
    for r in ranks:
        role = cfg.role(r)
        roles.append(
            f"worker {role.worker_index}" if role.name == "worker" else f"{role.name} {max(role.router_index, 0)}"
        )
    return f"node {node.node_rank} of {node.nnodes}: ranks {', '.join(map(str, ranks))} ({', '.join(roles)})"


def run_node(args, kw: dict, node, key: bytes, prog: str) -> int:
    """Node K > 0: start this node's ranks with node 0's config, print ``ready`` once the
    cluster is, replace lost ranks, and return 0 when node 0 stopped the cluster (or on SIGTERM
    or Ctrl-C, which take this node's ranks out), 1 when the cluster failed or node 0 is gone."""
    from moeserve.cli.launching import Replacements, start_cluster
    from moeserve.cluster.launcher import LocalCluster
    from moeserve.router.engine.channel import ClusterError

    world = kw["routers"] if kw["colocated"] else kw["routers"] + kw["workers"]
    here = node.ranks(world)
    mkw: dict[str, Any] = {}
    if args.metrics_port is not None:  # this node's ranks: M, M+1, ... in rank order (0: free ones)
        from moeserve.ops.ports import free_port

        ports: list[int] = []
        for i in range(len(here)):
            ports.append(args.metrics_port + i if args.metrics_port else free_port(exclude=ports))
        mkw = dict(metrics_ports=[ports[r - here.start] if r in here else 0 for r in range(world)])
    try:
        cluster = LocalCluster(
            args.model,
            nodes=node,
            authkey=key,
            startup_timeout_s=args.startup_timeout,
            log_dir=args.log_dir,
            **mkw,
            **kw,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    stop = threading.Event()
    starting = [True]

    def on_signal(*_):
        stop.set()
        if starting[0]:
            raise KeyboardInterrupt

    try:
        try:
            start_cluster(cluster, len(here), on_signal, getattr(args, "startup_progress", False), args.model)
        except ClusterError as e:
            print(f"{prog}: node {node.node_rank}: the cluster did not start: {e}", file=sys.stderr, flush=True)
            return 1
        starting[0] = False
        print(
            f"{describe(node, cluster.config)} in the cluster of node 0 at {node.master_addr}:{node.master_port}",
            flush=True,
        )
        if mkw:
            for r in here:
                print(f"metrics  rank {r:<23} http://{args.host}:{mkw['metrics_ports'][r]}/metrics", flush=True)
        print("ready", flush=True)
        told = Replacements(prog, cluster)
        while not stop.wait(0.2) and cluster.alive:
            told.say()
        told.say()
        if stop.is_set():
            print(f"{prog}: stopping: node {node.node_rank}'s ranks leave the cluster", file=sys.stderr, flush=True)
            return 0
        if cluster.ended:
            print(f"{prog}: node 0 stopped the cluster", file=sys.stderr, flush=True)
            return 0
        print(f"{prog}: node {node.node_rank}: the cluster stopped: {cluster.error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted while starting; stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        starting[0] = False
        cluster.stop()
