"""``moeserve demo``: the whole system in one command (see moeserve/demo.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moeserve.cli import UsageError
from moeserve.cli import flags as F


def register(subparsers) -> None:
    from moeserve.demo import default_cache_dir

    p = subparsers.add_parser(
        "demo",
        help="see EPLB work: a local cluster, skewed traffic, one live rebalance, checks",
        description="Write (or reuse) a small Llama 4-style checkpoint with hot experts, start a local cluster "
        "(router, expert workers, front end, balancer, metrics), drive a workload through the SDK, "
        "rebalance once, and show balancedness and worker load before and after. Exits 1 when a "
        "check fails (tokens differ from the EPLB-off run, or balancedness did not improve).",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        metavar="DIR",
        help=f"where the checkpoint is kept between runs (default {default_cache_dir()})",
    )
    p.add_argument("--workers", type=int, default=2, metavar="W", help="expert workers (default 2, at least 2)")
    p.add_argument("--routers", type=int, default=1, metavar="R", help="router ranks (default 1)")
    p.add_argument(
        "--num-redundant-experts", type=int, default=2, metavar="N", help="redundant slots per MoE layer (default 2)"
    )
    p.add_argument(
        "--requests", type=int, default=24, metavar="N", help="requests before and after the rebalance (default 24)"
    )
    p.add_argument("--max-tokens", type=int, default=24, metavar="N", help="greedy tokens per request (default 24)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N", help="requests in flight at once (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoint and the prompts (default 0)")
    p.add_argument(
        "--metrics-port",
        type=F.port,
        default=0,
        metavar="M",
        help="moeserve up --metrics-port: leader M, balancer M+1, front end M+2, other ranks after "
        "(default 0: free ports)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw the load before and after the rebalance (needs matplotlib: the plot extra)",
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="keep the cluster serving after the demo, until Ctrl-C (to look at its metrics)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeserve.demo import DemoOptions, DemoUsageError, run_demo

    try:
        opts = DemoOptions(
            cache_dir=args.cache_dir,
            routers=args.routers,
            workers=args.workers,
            num_redundant_experts=args.num_redundant_experts,
            requests=args.requests,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            seed=args.seed,
            metrics_port=args.metrics_port,
            plot=args.plot,
            keep_running=args.keep_running,
            progress=not args.no_progress,
        )
        result = run_demo(opts)
    except DemoUsageError as e:
        raise UsageError(str(e)) from None
    return 0 if result.ok else 1
