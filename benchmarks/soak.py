#!/usr/bin/env python3
"""Soak: a `moeserve up` cluster under steady streams for a long while, with faults.

    python benchmarks/soak.py --minutes 10                # CPU, tiny checkpoint, 1 router + 2 workers

Steady greedy streams through the serving front end (SDK, several threads), whose every token
is checked against the single-process model; a rebalance through the balancer every 30 s; an
expert worker killed (SIGKILL) every 2 minutes (the launcher replaces it: docs/dataplane.md,
"When a peer dies"); one 8 MB text prompt a minute (refused for its length after tokenization
off the event loop). Reports requests completed, lost (must be 0), with wrong tokens (must be
0), the worst inter-token gap of the other streams while a huge prompt was in flight against
the steady one, and the resident memory of every process at start and at the end. Prints a
table and writes JSON (default benchmarks/results/soak.json). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import torch  # noqa: E402

from moeserve.client import Client, MoeserveError  # noqa: E402
from moeserve.models import init_model, load_model  # noqa: E402
from moeserve.ops.procs import UpProcess  # noqa: E402

STARTUP_TIMEOUT_S = 600.0


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):  # a child belongs to the thread that started it
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
        out += kids
        todo += kids
    return out


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
        return "?"
    if "moeserve.cluster.rank" in cmd:
        return f"rank{env.get('RANK', '?')}"
    for word in ("frontend", "balancer"):
        if f"moeserve {word}" in cmd:
            return word
    return cmd.split()[0] if cmd else "?"


def memory(up_pid: int) -> dict[str, float]:
    return {name_of(p): round(rss_mb(p), 1) for p in [up_pid, *descendants(up_pid)] if name_of(p) != "?"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rebalance-every", type=float, default=30.0)
    ap.add_argument("--kill-every", type=float, default=120.0)
    ap.add_argument("--huge-every", type=float, default=60.0)
    ap.add_argument("--huge-mb", type=float, default=8.0)
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "soak.json"))
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="moeserve-soak-")
    path = init_model(os.path.join(work, "model"), family="llama4", seed=5, hot_experts=2)
    model = load_model(path, dtype=torch.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.config.vocab_size, int(n)).tolist() for n in rng.integers(3, 24, 64)]
    with torch.inference_mode():
        want = [
            model.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, ignore_eos=True)[0, len(p) :].tolist()
            for p in prompts
        ]
    del model

    routers, workers = 1, 2
    up = UpProcess(
        path,
        "--routers",
        str(routers),
        "--workers",
        str(workers),
        "--enable-eplb",
        "--num-redundant-experts",
        "2",
        "--eplb-step-interval",
        "1000000",
        "--max-model-len",
        "512",
        log_dir=os.path.join(work, "logs"),
        token=secrets.token_hex(8),
        cwd=REPO,
    )
    try:
        up.wait_ready(STARTUP_TIMEOUT_S)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    serving = up.serving
    balancer = Client(up.balancer, up.token)
    mem_start = memory(up.pid)

    stop = threading.Event()
    lock = threading.Lock()
    stats = dict(
        completed=0, lost=0, wrong=0, errors=[], rebalances=0, rebalance_errors=0, kills=0, huge=0, huge_answers=[]
    )
    gaps: list[tuple[float, float]] = []  # (time of a token, gap since the stream's previous one)
    huge_windows: list[tuple[float, float]] = []

    def stream_loop(seed: int):
        client = Client(serving, timeout=120)
        r = random.Random(seed)
        while not stop.is_set():
            i = r.randrange(len(prompts))
            ids, last = [], None
            try:
                for ch in client.generate_stream(
                    prompt_token_ids=prompts[i], max_tokens=args.max_tokens, ignore_eos=True
                ):
                    now = time.monotonic()
                    if ch.token_ids and last is not None:
                        with lock:
                            gaps.append((now, now - last))
                    if ch.token_ids:
                        last = now
                    ids.extend(ch.token_ids)
                with lock:
                    stats["completed"] += 1
                    stats["wrong"] += ids != want[i]
            except MoeserveError as e:
                with lock:
                    stats["lost"] += 1
                    stats["errors"].append(f"{e.code.name}: {e.message[:120]}")

    def faults():
        t0 = time.monotonic()
        nxt = dict(rebalance=t0 + args.rebalance_every, kill=t0 + args.kill_every, huge=t0 + args.huge_every)
        while not stop.wait(0.5):
            now = time.monotonic()
            if now >= nxt["rebalance"]:
                nxt["rebalance"] += args.rebalance_every
                try:
                    balancer.rebalance(wait=False)
                    stats["rebalances"] += 1
                except MoeserveError:
                    stats["rebalance_errors"] += 1
            if now >= nxt["kill"]:
                nxt["kill"] += args.kill_every
                workers_ = [
                    p
                    for p in descendants(up.pid)
                    if name_of(p) in {f"rank{r}" for r in range(routers, routers + workers)}
                ]
                if workers_:
                    os.kill(random.choice(workers_), signal.SIGKILL)
                    stats["kills"] += 1
            if now >= nxt["huge"]:
                nxt["huge"] += args.huge_every
                text = "lorem ipsum " * int(args.huge_mb * (1 << 20) / 12)
                a = time.monotonic()
                try:
                    Client(serving, timeout=120).generate(text, max_tokens=1)
                    stats["huge_answers"].append("OK")
                except MoeserveError as e:
                    stats["huge_answers"].append(e.code.name)
                huge_windows.append((a, time.monotonic()))
                stats["huge"] += 1

    threads = [threading.Thread(target=stream_loop, args=(s,), daemon=True) for s in range(args.streams)]
    threads.append(threading.Thread(target=faults, daemon=True))
    for t in threads:
        t.start()
    t_end = time.monotonic() + args.minutes * 60
    while time.monotonic() < t_end and up.alive():
        time.sleep(1)
    stop.set()
    for t in threads:
        t.join(180)
    mem_end = memory(up.pid)
    alive = up.alive()
    up.stop(90)

    in_huge = [g for t, g in gaps if any(a <= t <= b for a, b in huge_windows)]
    steady = [g for t, g in gaps if not any(a - 1 <= t <= b + 1 for a, b in huge_windows)]
    result = dict(
        command=" ".join(sys.argv),
        minutes=args.minutes,
        streams=args.streams,
        cluster_alive=alive,
        completed=stats["completed"],
        lost=stats["lost"],
        wrong_tokens=stats["wrong"],
        errors=stats["errors"][:20],
        rebalances=stats["rebalances"],
        rebalance_errors=stats["rebalance_errors"],
        workers_killed=stats["kills"],
        huge_prompts=stats["huge"],
        huge_answers=stats["huge_answers"],
        steady_gap_p50_s=float(np.percentile(steady, 50)) if steady else None,
        steady_gap_p99_s=float(np.percentile(steady, 99)) if steady else None,
        steady_gap_max_s=float(max(steady)) if steady else None,
        worst_gap_during_huge_prompt_s=float(max(in_huge)) if in_huge else None,
        rss_mb_start=mem_start,
        rss_mb_end=mem_end,
    )
    print(
        f"{'completed':>10} {'lost':>5} {'wrong':>6} {'rebal':>6} {'kills':>6} {'huge':>5} "
        f"{'gap p50':>8} {'gap p99':>8} {'worst gap, huge prompt':>23}"
    )
    fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
    print(
        f"{result['completed']:>10} {result['lost']:>5} {result['wrong_tokens']:>6} {result['rebalances']:>6} "
        f"{result['workers_killed']:>6} {result['huge_prompts']:>5} {fmt(result['steady_gap_p50_s'])} "
        f"{fmt(result['steady_gap_p99_s'])} {fmt(result['worst_gap_during_huge_prompt_s']):>23}"
    )
    print("RSS MB start:", mem_start)
    print("RSS MB end:  ", mem_end)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if alive and result["lost"] == 0 and result["wrong_tokens"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
