#!/usr/bin/env python3
"""Soak: a `moeserve up` cluster under steady streams for a long while, with attacks and faults.

    python benchmarks/soak.py --minutes 5                 # CPU, tiny checkpoint, 2 routers + 2 workers

Steady greedy streams through the HTTP API (server-sent events) and the SDK (gRPC), whose every
token is checked against the single-process model. First a clean phase (`--clean-minutes`,
default 1: only the streams), then the attack phase (`--minutes`): every `--attack-every`
seconds one of the requests the front door must refuse or bound (a `top_k` of 2**63, a prompt
id of 10**30, a lone surrogate, a 5.5 MB and a 1.2 MB `chat_template_kwargs` value (over the
body limit and under it: 413 and the budget's 400), 150k empty messages, a
64 MB header line, 100 slowloris connections, a request of 4 prompts x n=64 with logprobs and
one with prompt logprobs and penalties, a `logit_bias` id past int32, a `min_tokens` of 2**63, a
stranger's write to the ranks' store), a live rebalance through the balancer every
`--rebalance-every` seconds (20), and one router killed (SIGKILL) at `--kill-at` of the phase;
the launcher replaces it and it rejoins.

Reports requests completed, lost and with wrong tokens (both must be 0), what each attack got
(each must get what the front door answers it), the inter-token p50/p99 of the good streams in
the clean phase and in the attack phase outside the recovery window (from the kill until the
replacement rejoined, plus 2 s; the p99 must be within 2x of the clean one), and the front end's
resident memory at the start and end of the attack phase (flat: within 50 MB). Prints a table
and writes JSON (default benchmarks/results/soak.json) with the command, the commit and the
machine (CPUs, load average before and after). Not part of CI (a short run of it is:
tests/test_soak.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import secrets
import signal
import socket
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servinglib.common import git_commit  # noqa: E402

STARTUP_TIMEOUT_S = 600.0
RSS_FLAT_MB = 50.0
P99_RATIO = 2.0


def rss_mb(pid: int | None) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, TypeError):
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


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
        return {}


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    if "moeserve.cluster.rank" in cmd:
        return f"rank{environ(pid).get('RANK', '?')}"
    for word in ("frontend", "balancer"):
        if f"moeserve {word}" in cmd:
            return word
    return cmd.split()[0] if cmd else "?"


def pid_of(up_pid: int, name: str) -> int | None:
    return next((p for p in descendants(up_pid) if name_of(p) == name), None)


def memory(up_pid: int) -> dict[str, float]:
    return {name_of(p): round(rss_mb(p), 1) for p in [up_pid, *descendants(up_pid)] if name_of(p) != "?"}


def percentile(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# -- the good streams ---------------------------------------------------------------------------


def http_stream(port: int, prompt: list[int], max_tokens: int, on_token) -> list[int]:
    """One streamed completion over the HTTP API: its generated ids (``on_token()`` at each)."""
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        ids: list[int] = []
        done = False
        while True:
            line = r.fp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"an error event: {event['error'].get('message', '')[:200]}")
            new = event["choices"][0].get("token_ids") or []
            if new:
                on_token()
            ids.extend(new)
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        return ids
    finally:
        conn.close()


# -- the attacks ----------------------------------------------------------------------------------


def post(port: int, body: bytes, path: str = "/v1/completions") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def huge_header(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        try:
            for _ in range(64):
                s.sendall(b"a" * (1 << 20))
        except OSError:
            pass
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
    return int(got.split(b" ")[1]) if got.startswith(b"HTTP/1.1 ") else -1


def slowloris(port: int, n: int = 100) -> int:
    """n connections that send half a header line and wait: the status each gets (408) once the
    server closes it, as the most common one."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        socks.append(s)
    statuses = []
    for s in socks:
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
        s.close()
        statuses.append(int(got.split(b" ")[1]) if got.startswith(b"HTTP/1.1 ") else -1)
    return max(set(statuses), key=statuses.count)


def stranger_write(up_pid: int) -> int:
    """A process without the secret writes the ranks' store with torch's own client: 403 when it
    is refused, 200 when it got a key in (a real write would steer the next recovery)."""
    import subprocess

    leader = pid_of(up_pid, "rank0")
    port = int(environ(leader).get("MASTER_PORT", "0")) if leader else 0
    code = (
        "import datetime, torch.distributed as d; "
        f"d.TCPStore('127.0.0.1', {port}, 2, False, datetime.timedelta(seconds=2)).add('generation', 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return 200 if done.returncode == 0 else 403


def attacks(http_port: int, up_pid: int) -> list[tuple[str, set[int], object]]:
    """(name, the statuses the front door may answer it, a callable that runs it and returns the
    status). A request over the budget is 400, or 413 when its body is over the body limit too."""
    hi = [{"role": "user", "content": "hi"}]
    js = lambda obj: json.dumps(obj).encode()  # noqa: E731
    many = {"prompt": [[5, 6, 7, 8]] * 4, "n": 64, "max_tokens": 8, "logprobs": 5, "temperature": 0.7, "seed": 3}
    many_prompt_lp = {**many, "logprobs": None, "prompt_logprobs": 5, "presence_penalty": 1.5, "min_p": 0.05}
    short = {"prompt": [5, 6], "max_tokens": 2}
    return [
        ("top_k of 2**63", {400}, lambda: post(http_port, js({"prompt": [5, 6], "max_tokens": 2, "top_k": 2**63}))),
        ("prompt id of 10**30", {400}, lambda: post(http_port, js({"prompt": [5, 10**30], "max_tokens": 2}))),
        ("lone surrogate", {400}, lambda: post(http_port, b'{"prompt": "a \\ud800 b", "max_tokens": 2}')),
        (
            "5.5 MB chat_template_kwargs",
            {400, 413},
            lambda: post(
                http_port,
                js({"messages": hi, "max_tokens": 2, "chat_template_kwargs": {"bos_token": "x" * 5_500_000}}),
                "/v1/chat/completions",
            ),
        ),
        (
            "1.2 MB chat_template_kwargs",
            {400},
            lambda: post(
                http_port,
                js({"messages": hi, "max_tokens": 2, "chat_template_kwargs": {"bos_token": "x" * 1_200_000}}),
                "/v1/chat/completions",
            ),
        ),
        (
            "150k empty messages",
            {400, 413},
            lambda: post(
                http_port,
                js({"messages": [{"role": "user", "content": ""}] * 150_000, "max_tokens": 2}),
                "/v1/chat/completions",
            ),
        ),
        ("64 MB header line", {431}, lambda: huge_header(http_port)),
        ("100 slowloris connections", {408}, lambda: slowloris(http_port)),
        ("4 prompts x n=64 with logprobs", {200}, lambda: post(http_port, js(many))),
        ("4 prompts x n=64 with prompt logprobs", {200}, lambda: post(http_port, js(many_prompt_lp))),
        (
            "logit_bias of an id past int32",
            {400},
            lambda: post(http_port, js({**short, "logit_bias": {str(2**40): 5}})),
        ),
        ("min_tokens of 2**63", {400}, lambda: post(http_port, js({**short, "min_tokens": 2**63}))),
        ("a stranger's store write", {403}, lambda: stranger_write(up_pid)),
    ]


# -- the run ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="the attack phase (default 5)")
    ap.add_argument("--clean-minutes", type=float, default=1.0, help="the clean phase before it (default 1)")
    ap.add_argument("--http-streams", type=int, default=4)
    ap.add_argument("--grpc-streams", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rebalance-every", type=float, default=20.0)
    ap.add_argument("--attack-every", type=float, default=3.0)
    ap.add_argument("--kill-at", type=float, default=0.4, help="share of the attack phase when a router dies")
    ap.add_argument("--no-latency-check", action="store_true", help="report the p99 ratio, do not fail on it")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "soak.json"))
    args = ap.parse_args()

    load_before = round(os.getloadavg()[0], 2)
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

    routers, workers = 2, 2
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
        "--http-header-timeout",
        "2",
        log_dir=os.path.join(work, "logs"),
        token=secrets.token_hex(8),
        http_port=0,
        cwd=REPO,
    )
    try:
        up.wait_ready(STARTUP_TIMEOUT_S)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    http_port = int(up.http.rsplit(":", 1)[1])
    balancer = Client(up.balancer, up.token)

    stop = threading.Event()
    lock = threading.Lock()
    phase = ["clean"]
    stats = dict(completed=0, lost=0, wrong=0, errors=[], rebalances=0, rebalance_errors=0)
    gaps: list[tuple[str, float, float]] = []  # (phase, time of a token, gap since the stream's previous)
    window: list[float] = []  # [kill, end of recovery]

    def record(ids, i, err=None):
        with lock:
            if err is not None:
                stats["lost"] += 1
                stats["errors"].append(err[:160])
            else:
                stats["completed"] += 1
                stats["wrong"] += ids != want[i]

    def http_loop(seed: int):
        r = random.Random(seed)
        while not stop.is_set():
            i = r.randrange(len(prompts))
            last = [None]
            tag = phase[0]

            def on_token():
                now = time.monotonic()
                if last[0] is not None:
                    with lock:
                        gaps.append((tag, now, now - last[0]))
                last[0] = now

            try:
                record(http_stream(http_port, prompts[i], args.max_tokens, on_token), i)
            except Exception as e:
                record(None, i, f"HTTP: {type(e).__name__}: {e}")

    def grpc_loop(seed: int):
        client = Client(up.serving, timeout=180)
        r = random.Random(seed)
        while not stop.is_set():
            i = r.randrange(len(prompts))
            ids, last, tag = [], None, phase[0]
            try:
                for ch in client.generate_stream(
                    prompt_token_ids=prompts[i], max_tokens=args.max_tokens, ignore_eos=True
                ):
                    now = time.monotonic()
                    if ch.token_ids and last is not None:
                        with lock:
                            gaps.append((tag, now, now - last))
                    if ch.token_ids:
                        last = now
                    ids.extend(ch.token_ids)
                record(ids, i)
            except MoeserveError as e:
                record(None, i, f"gRPC {e.code.name}: {e.message}")

    threads = [threading.Thread(target=http_loop, args=(s,), daemon=True) for s in range(args.http_streams)]
    threads += [threading.Thread(target=grpc_loop, args=(100 + s,), daemon=True) for s in range(args.grpc_streams)]
    for t in threads:
        t.start()
    time.sleep(args.clean_minutes * 60)

    # -- the attack phase
    phase[0] = "attack"
    fe_start = pid_of(up.pid, "frontend")
    rss_front_start = rss_mb(fe_start)
    mem_start = memory(up.pid)
    outcomes: list[dict] = []
    plan = attacks(http_port, up.pid)
    t0 = time.monotonic()
    t_end = t0 + args.minutes * 60
    kill_at = t0 + args.kill_at * args.minutes * 60
    killed = False
    nxt_rebalance, nxt_attack, k = t0 + args.rebalance_every, t0 + 1.0, 0
    while time.monotonic() < t_end and up.alive():
        now = time.monotonic()
        if now >= nxt_rebalance:
            nxt_rebalance += args.rebalance_every
            try:
                balancer.rebalance(wait=False)
                stats["rebalances"] += 1
            except MoeserveError:
                stats["rebalance_errors"] += 1
        if not killed and now >= kill_at:
            killed = True
            victim = pid_of(up.pid, "rank1")
            if victim:
                window.append(time.monotonic())
                os.kill(victim, signal.SIGKILL)
                threading.Thread(target=watch_rejoin, args=(up, window, lock), daemon=True).start()
        if now >= nxt_attack:
            nxt_attack += args.attack_every
            name, expected, run = plan[k % len(plan)]
            k += 1
            a = time.monotonic()
            try:
                got = run()
            except Exception as e:  # the front door closed on it
                got = f"{type(e).__name__}: {e}"[:80]
            outcomes.append(
                dict(attack=name, expected=sorted(expected), got=got, seconds=round(time.monotonic() - a, 3))
            )
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(240)
    fe_end = pid_of(up.pid, "frontend")
    rss_front_end = rss_mb(fe_end)
    mem_end = memory(up.pid)
    alive = up.alive()
    up.stop(90)

    if len(window) == 1:  # the replacement never rejoined: the window runs to the end
        window.append(float("inf"))
    inside = (lambda t: window[0] <= t <= window[1] + 2.0) if window else (lambda t: False)
    clean = [g for p, _, g in gaps if p == "clean"]
    attack = [g for p, t, g in gaps if p == "attack" and not inside(t)]
    p99_clean, p99_attack = percentile(clean, 99), percentile(attack, 99)
    ratio = p99_attack / p99_clean if p99_clean and p99_attack else None
    surprises = [o for o in outcomes if o["got"] not in o["expected"]]
    result = dict(
        command=" ".join(sys.argv),
        git=git_commit(),
        device=dict(
            kind="cpu",
            machine=platform.machine(),
            cpus=os.cpu_count(),
            loadavg_before=load_before,
            loadavg_after=round(os.getloadavg()[0], 2),
        ),
        minutes=args.minutes,
        clean_minutes=args.clean_minutes,
        routers=routers,
        workers=workers,
        streams=dict(http=args.http_streams, grpc=args.grpc_streams),
        cluster_alive=alive,
        completed=stats["completed"],
        lost=stats["lost"],
        wrong_tokens=stats["wrong"],
        errors=stats["errors"][:20],
        rebalances=stats["rebalances"],
        rebalance_errors=stats["rebalance_errors"],
        router_killed=bool(window),
        recovery_window_s=round(window[1] - window[0], 2) if len(window) == 2 and window[1] != float("inf") else None,
        attacks=len(outcomes),
        attack_surprises=surprises,
        attack_outcomes=sorted({(o["attack"], str(o["got"])) for o in outcomes}),
        gap_p50_clean_s=percentile(clean, 50),
        gap_p99_clean_s=p99_clean,
        gap_p50_attack_s=percentile(attack, 50),
        gap_p99_attack_s=p99_attack,
        gap_p99_ratio=ratio,
        gaps_clean=len(clean),
        gaps_attack_outside_recovery=len(attack),
        rss_mb_front_end_attack_start=round(rss_front_start, 1),
        rss_mb_front_end_attack_end=round(rss_front_end, 1),
        front_end_restarted=fe_start != fe_end,
        rss_mb_start=mem_start,
        rss_mb_end=mem_end,
    )
    fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
    print(
        f"{'completed':>10} {'lost':>5} {'wrong':>6} {'rebal':>6} {'attacks':>8} {'surprises':>10} "
        f"{'p99 clean':>10} {'p99 attack':>11} {'ratio':>6} {'recovery s':>11} {'front RSS MB':>16}"
    )
    print(
        f"{result['completed']:>10} {result['lost']:>5} {result['wrong_tokens']:>6} {result['rebalances']:>6} "
        f"{len(outcomes):>8} {len(surprises):>10} {fmt(p99_clean):>10} {fmt(p99_attack):>11} "
        f"{(f'{ratio:.2f}' if ratio else '-'):>6} {str(result['recovery_window_s']):>11} "
        f"{rss_front_start:7.1f}->{rss_front_end:7.1f}"
    )
    for name, got in result["attack_outcomes"]:
        print(f"  {name:<32} {got}")
    if stats["errors"]:
        print("errors:", *stats["errors"][:5], sep="\n  ")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    ok = (
        alive
        and result["lost"] == 0
        and result["wrong_tokens"] == 0
        and not surprises
        and rss_front_end - rss_front_start < RSS_FLAT_MB
        and not result["front_end_restarted"]
        and (args.no_latency_check or (ratio is not None and ratio <= P99_RATIO))
    )
    return 0 if ok else 1


def watch_rejoin(up: UpProcess, window: list[float], lock) -> None:
    """The end of the recovery window: the killed router's replacement is in the world again
    (the leader's log: the world re-formed without rank 1, then with it)."""
    log = os.path.join(up.log_dir, "rank0.log")
    with open(log, errors="replace") as f:
        f.seek(0, os.SEEK_END)
        seen_without = False
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = f.readline()
            if not line:
                time.sleep(0.1)
                continue
            if "re-formed the groups" not in line:
                continue
            if "without [1]" in line:
                seen_without = True
            elif seen_without and "members [0, 1," in line:
                with lock:
                    window.append(time.monotonic())
                return


if __name__ == "__main__":
    sys.exit(main())
