#!/usr/bin/env python3
"""Step time and throughput of generation, quiet vs. with the admin and balancer APIs hammered.

    python benchmarks/control_plane.py                     # CPU, a small skewed Llama 4 checkpoint
    python benchmarks/control_plane.py --rounds 5 --streams 32 --max-tokens 48

Starts ``moeserve up`` (2 routers, 2 workers, EPLB with 2 redundant experts) on a checkpoint
written by ``init_model(..., hot_experts=2)`` and runs the same workload (``--streams``
concurrent streaming requests of ``--max-tokens`` greedy tokens each) in three modes, side by
side and interleaved round by round so that drift in the machine hits all modes alike:

- quiet: generation alone;
- hammer100: 100 calls from 8 threads (placement, expert load, status, load dump, balancer
  status, dry-run rebalance, in turn) fired when generation starts;
- sustained: the same 8 threads calling for as long as generation runs.

Step time = the generation's wall time / the forward steps the leader ran meanwhile (from
GetStatus before and after). Every mode's tokens are checked against the quiet run's. Prints a
table and writes JSON (``--json``, default benchmarks/results/control_plane.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moeserve.client import Client, MoeserveError  # noqa: E402
from moeserve.models import init_model  # noqa: E402
from moeserve.ops.procs import UpProcess  # noqa: E402

TOKEN = "bench"
ALL_CALLS = ("placement", "expert_load", "status", "dump_load", "balancer_status", "rebalance_dry_run")
CALLS = list(ALL_CALLS)


def start_up(model: str, log_dir: str) -> tuple[UpProcess, dict]:
    """``moeserve up`` (2 routers, 2 workers, EPLB with 2 redundant experts; the balancer's loop
    held back), ready; its addresses by the names this script uses."""
    up = UpProcess(
        model,
        "--routers",
        "2",
        "--workers",
        "2",
        "--enable-eplb",
        "--num-redundant-experts",
        "2",
        "--eplb-step-interval",
        "100000000",
        log_dir=log_dir,
        token=TOKEN,
    ).wait_ready(300)
    return up, {"port": up.serving, "admin": up.admin, "balancer": up.balancer}


def one_call(name: str, admin: Client, balancer: Client) -> None:
    if name == "rebalance_dry_run":
        balancer.rebalance(dry_run=True)
    elif name == "balancer_status":
        balancer.balancer_status()
    else:
        getattr(admin, name)()


def hammer(
    addrs: dict, stop: threading.Event | None, total: int, latencies: list, errors: list
) -> list[threading.Thread]:
    """8 threads: ``total`` calls split over them, or (with ``stop``) calls until it is set."""

    def run(k: int):
        admin, balancer = Client(addrs["admin"], TOKEN), Client(addrs["balancer"], TOKEN)
        i = k
        while (i < total) if stop is None else not stop.is_set():
            t0 = time.perf_counter()
            try:
                one_call(CALLS[i % len(CALLS)], admin, balancer)
                latencies.append(time.perf_counter() - t0)
            except MoeserveError as e:
                errors.append(str(e))
            i += 8

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    return threads


def generate(addrs: dict, prompts, max_tokens: int, mode: str) -> dict:
    serving, admin = Client(addrs["port"]), Client(addrs["admin"], TOKEN)
    results = [None] * len(prompts)
    latencies, errors, stop = [], [], threading.Event()

    def stream(i, p):
        results[i] = [
            t
            for c in serving.generate_stream(prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True)
            for t in c.token_ids
        ]

    steps0 = admin.status().forward_steps
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    callers = []
    if mode == "hammer100":
        callers = hammer(addrs, None, 100, latencies, errors)
    elif mode == "sustained":
        callers = hammer(addrs, stop, 0, latencies, errors)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    for t in callers:
        t.join()
    steps = admin.status().forward_steps - steps0
    return dict(
        wall_s=wall,
        steps=steps,
        step_ms=1e3 * wall / max(steps, 1),
        tokens_per_s=sum(len(r) for r in results) / wall,
        calls=len(latencies),
        call_errors=errors,
        call_p50_ms=1e3 * statistics.median(latencies) if latencies else None,
        call_p99_ms=1e3 * sorted(latencies)[int(0.99 * (len(latencies) - 1))] if latencies else None,
        tokens=results,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three modes (default 3)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streaming requests (default 32)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    ap.add_argument(
        "--calls", default=",".join(ALL_CALLS), help=f"the call mix (default: all of {','.join(ALL_CALLS)})"
    )
    ap.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "control_plane.json")
    )
    args = ap.parse_args(argv)
    CALLS[:] = [c for c in args.calls.split(",") if c]
    if not CALLS or set(CALLS) - set(ALL_CALLS):
        ap.error(f"--calls must name some of {','.join(ALL_CALLS)}")

    work = tempfile.mkdtemp(prefix="moeserve-bench-")
    model = str(init_model(os.path.join(work, "model"), "llama4", seed=3, hot_experts=2, num_hidden_layers=6))
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, 3 + i % 9).tolist() for i in range(args.streams)]
    up, addrs = start_up(model, work)
    modes = ("quiet", "hammer100", "sustained")
    runs = {m: [] for m in modes}
    try:
        generate(addrs, prompts[:4], 8, "quiet")  # warm-up
        for r in range(args.rounds):
            for m in modes:
                runs[m].append(generate(addrs, prompts, args.max_tokens, m))
                print(f"round {r + 1} {m:10s} step {runs[m][-1]['step_ms']:.1f} ms", file=sys.stderr, flush=True)
    finally:
        up.stop(120)
    ref = runs["quiet"][0]["tokens"]
    summary = {}
    for m in modes:
        rs = runs[m]
        summary[m] = dict(
            step_ms=statistics.median(r["step_ms"] for r in rs),
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs),
            calls=sum(r["calls"] for r in rs) // len(rs),
            call_errors=sum(len(r["call_errors"]) for r in rs),
            call_p50_ms=statistics.median([r["call_p50_ms"] for r in rs if r["call_p50_ms"]] or [0]),
            call_p99_ms=max([r["call_p99_ms"] for r in rs if r["call_p99_ms"]] or [0]),
            tokens_equal=all(r["tokens"] == ref for r in rs),
        )
    quiet = summary["quiet"]["step_ms"]
    print(
        f"\ncontrol-plane load during generation: {args.streams} streams x {args.max_tokens} tokens, "
        f"2 routers + 2 workers (CPU, gloo), median of {args.rounds} rounds\n"
    )
    print(
        f"{'mode':<11} {'step ms':>8} {'x quiet':>8} {'tokens/s':>9} {'calls':>6} {'errors':>6} "
        f"{'call p50 ms':>11} {'call p99 ms':>11} {'tokens =':>8}"
    )
    for m in modes:
        s = summary[m]
        print(
            f"{m:<11} {s['step_ms']:8.1f} {s['step_ms'] / quiet:8.2f} {s['tokens_per_s']:9.1f} {s['calls']:6d} "
            f"{s['call_errors']:6d} {s['call_p50_ms']:11.1f} {s['call_p99_ms']:11.1f} {str(s['tokens_equal']):>8}"
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            dict(
                streams=args.streams,
                max_tokens=args.max_tokens,
                rounds=args.rounds,
                calls=CALLS,
                summary=summary,
                runs={m: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for m, rs in runs.items()},
            ),
            f,
            indent=1,
        )
    print(f"\nwrote {args.json}")
    return 0 if all(s["tokens_equal"] and not s["call_errors"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
