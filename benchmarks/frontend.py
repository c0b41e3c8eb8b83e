#!/usr/bin/env python3
"""The serving front end's ceiling, without a GPU: how many tokens per second one front-end
process (``moeserve frontend``) streams to clients, and its CPU per token.

A leader's engine runs in this process with a stand-in step driver in place of the ranks: every
``--step-ms`` it answers a step as rank 0 does with asynchronous steps (each running sequence
gets a token, delivered with the next step's results), so the leader asks for
``seqs / step-ms`` tokens per second. The real front-end process serves it over the real local
channel, and the serving benchmark's client processes (``servinglib.clients``, the SDK's
streaming call, or with ``--api http`` streamed ``/v1/completions``) send a burst of ``seqs``
requests at once. Each case runs once with
``$MOESERVE_STREAM_COALESCE=1`` (the default: the tokens a stream fell behind on leave in one
message) and once with ``=0`` (one message per token), side by side on one leader.

    python benchmarks/frontend.py                                   # 256 and 1,024 streams, 20 ms steps
    python benchmarks/frontend.py --seqs 1024 --step-ms 24 --client-procs 8
    python benchmarks/frontend.py --api http                        # the OpenAI API's SSE

Prints a table and writes JSON (``--json``, default benchmarks/results/frontend.json): per
case the leader's step time and the tokens per second it asked for, the tokens per second the
clients got, the front end's CPU (seconds, us per token, share of one core), messages per
token, the clients' CPU, and the clients' inter-token gap p50 / p99 while every stream runs.
The front end and the clients share the machine's cores: on a 2-core machine the clients'
own CPU (an SDK stream costs more per message than the front end) caps what they receive; the
front end's CPU per token is the figure that carries over to a serving host.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import subprocess
import sys
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from servinglib.clients import drive  # noqa: E402
from servinglib.common import pct, write_rows  # noqa: E402
from servinglib.figures import burst_plan  # noqa: E402
from servinglib.httpclient import SERVER_FLAGS  # noqa: E402

from moeserve.config import ClusterConfig, EplbConfig, Limits  # noqa: E402
from moeserve.dataplane import header_wire  # noqa: E402
from moeserve.dataplane.protocol import RankResult  # noqa: E402
from moeserve.placement import Placement  # noqa: E402
from moeserve.router.engine.api import ModelShape  # noqa: E402
from moeserve.router.engine.channel import ChannelServer  # noqa: E402
from moeserve.router.engine.leader import Engine  # noqa: E402

L, E, VOCAB, TOKEN, BLOCK = 2, 4, 1000, 7, 16


class PacedRanks:
    """Rank 0's side of the step protocol for a one-rank cluster whose router samples TOKEN:
    ``next_header``, then (every ``step_s``) the results, a step's tokens coming back with the
    next step's as with asynchronous steps."""

    def __init__(self, engine: Engine, step_s: float):
        self.engine, self.step_s = engine, step_s
        self.steps = 0
        self.thread = threading.Thread(target=self._run, name="paced-ranks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        outputs = None
        nxt = time.monotonic()
        while True:
            h = self.engine.next_header()
            header_wire.encode(h)  # as the leader broadcasts it
            if h.stop:
                return
            if h.forward:
                self.steps += 1
                nxt = max(nxt + self.step_s, time.monotonic())
                time.sleep(max(0.0, nxt - time.monotonic()))
            res = RankResult(0)
            if outputs is not None:
                res.tokens_step, res.tokens = outputs
            outputs = (h.step, {sid: TOKEN for sid in h.work[0].sampled_ids()}) if h.forward else None
            if h.read_load:
                res.logical_load = np.zeros((L, E), dtype=np.int64)
                res.worker_load = np.zeros((L, 1), dtype=np.int64)
            if h.report:
                res.slot_digest = np.zeros((L, E, 2))
            self.engine.on_results(h, [res])


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_frontend(
    channel: tuple, key: bytes, coalesce: bool, max_model_len: int, api: str = "grpc"
) -> tuple[subprocess.Popen, str, collections.deque[str]]:
    """The front-end process; the address ``drive`` takes for ``api`` (gRPC's HOST:PORT, or the
    HTTP API's http://HOST:PORT); the last 40 lines of its log, kept as it writes them."""
    env = dict(os.environ, MOESERVE_CONTROL_KEY=key.hex(), MOESERVE_STREAM_COALESCE="1" if coalesce else "0")
    env["PYTHONPATH"] = os.path.abspath(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    from moeserve.ops.ports import free_port

    metrics = free_port()  # the front end's metrics on, as in a cluster (they cost CPU per token)
    http = ["--http-port", str(free_port(exclude=[metrics])), *SERVER_FLAGS] if api == "http" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeserve", "frontend", "--port", "0", "--host", "127.0.0.1"]
        + ["--control-address", f"{channel[0]}:{channel[1]}", "--max-model-len", str(max_model_len)]
        + ["--metrics-port", str(metrics), *http],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    lines = []
    base = None
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("HTTP API on "):  # http://HOST:PORT/v1
            base = line.split(" on ", 1)[1].strip().removesuffix("/v1")
        if line.startswith("serving front end on "):
            tail: collections.deque[str] = collections.deque(lines, maxlen=40)
            threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
            return proc, base if api == "http" and base else line.split(" on ", 1)[1].strip(), tail
    proc.kill()
    raise RuntimeError("the front end did not start:\n" + "".join(lines[-20:]))


def messages(rec: dict) -> int:
    """The stream messages a record got: tokens of one message share their arrival time."""
    ts = rec["tokens"]
    return sum(1 for k, t in enumerate(ts) if k == 0 or t != ts[k - 1])


def run_case(channel, key, ranks: PacedRanks, a, seqs: int, coalesce: bool) -> dict:
    proc, address, log_tail = start_frontend(channel, key, coalesce, a.prompt + a.output + 16, a.api)
    try:
        plan = burst_plan(np.random.default_rng(a.seed), seqs, a.prompt, a.output, VOCAB)
        stats: dict = {}
        at: dict = {}  # at the common start, after the clients connected and warmed up

        def started(_t0) -> None:
            at.update(steps=ranks.steps, cpu=_cpu_s(proc.pid))

        recs = drive(address, plan, a.client_procs, a.timeout, api=a.api, stats=stats, on_start=started)
        cpu, steps = _cpu_s(proc.pid) - at["cpu"], ranks.steps - at["steps"]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    bad = [r for r in recs if r["error"] or len(r["tokens"]) != a.output]
    if bad:
        raise RuntimeError(
            f"{len(bad)} of {seqs} streams failed or came short: {bad[0]['error'] or 'short'}; "
            f"the front end's last lines:\n{''.join(log_tail)}"
        )
    tokens = sum(len(r["tokens"]) for r in recs)
    first, last = max(r["tokens"][0] for r in recs), min(r["tokens"][-1] for r in recs)
    wall = max(r["tokens"][-1] for r in recs) - min(r["tokens"][0] for r in recs)
    gaps = [b - x for r in recs for x, b in zip(r["tokens"], r["tokens"][1:]) if x >= first and b <= last]
    msgs = sum(messages(r) for r in recs)
    return dict(
        api=a.api,
        seqs=seqs,
        coalesce=coalesce,
        step_ms=a.step_ms,
        leader_tok_s_asked=1e3 * seqs / a.step_ms,
        leader_steps=steps,
        tokens=tokens,
        wall_s=wall,
        tok_s=tokens / wall if wall > 0 else None,
        frontend_cpu_s=cpu,
        frontend_cpu_us_per_token=1e6 * cpu / tokens,
        frontend_cores=cpu / wall if wall > 0 else None,
        messages_per_token=msgs / tokens,
        client_cpu_s=stats.get("client_cpu_s"),
        client_cpu_us_per_token=1e6 * stats["client_cpu_s"] / tokens if stats.get("client_cpu_s") else None,
        gap_p50_s=pct(gaps, 50),
        gap_p99_s=pct(gaps, 99),
        gaps=len(gaps),
    )


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="256,1024", help="comma list of streams at once (256,1024)")
    p.add_argument("--step-ms", type=float, default=20.0, help="the leader's step time, ms (20)")
    p.add_argument("--prompt", type=int, default=16, help="prompt ids per request (16)")
    p.add_argument("--output", type=int, default=256, help="tokens per request (256)")
    p.add_argument("--coalesce", default="on,off", help="on, off or on,off: $MOESERVE_STREAM_COALESCE per case")
    p.add_argument("--client-procs", type=int, default=2, help="client processes (2)")
    p.add_argument(
        "--api",
        choices=("grpc", "http"),
        default="grpc",
        help="grpc: the SDK's GenerateStream (default); http: streamed /v1/completions (needs httpx)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a burst may take (300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "frontend.json")
    )
    a = p.parse_args(argv)
    try:
        a.seq_list = [int(x) for x in a.seqs.split(",")]
    except ValueError:
        p.error(f"--seqs must be a comma list of stream counts, got {a.seqs!r}")
    if not a.seq_list or min(a.seq_list) < 1 or max(a.seq_list) > 8192:
        p.error(f"--seqs must be 1 .. 8192 each, got {a.seqs!r}")
    if not 0.1 <= a.step_ms <= 10000:
        p.error(f"--step-ms must be 0.1 .. 10000, got {a.step_ms}")
    modes = a.coalesce.split(",")
    if not modes or not set(modes) <= {"on", "off"} or len(set(modes)) < len(modes):
        p.error(f"--coalesce is on, off or on,off, got {a.coalesce!r}")
    a.modes = [m == "on" for m in modes]
    for name, lo, hi in (("prompt", 1, 4096), ("output", 2, 4096), ("client_procs", 1, 64)):
        v = getattr(a, name)
        if not lo <= v <= hi:
            p.error(f"--{name.replace('_', '-')} must be {lo} .. {hi}, got {v}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    top = max(a.seq_list)
    cfg = ClusterConfig(
        model_dir="unused",
        routers=1,
        workers=1,
        colocated=True,
        eplb=EplbConfig(enable_eplb=False, num_redundant_experts=0),
        limits=Limits(
            max_model_len=a.prompt + a.output + 16,
            max_num_seqs=top + 8,  # the clients' warm-up streams too
            max_num_batched_tokens=max(8192, (top + 8) * a.prompt),
            max_waiting=100000,
        ),
    )
    shape = ModelShape(L, E, 1, VOCAB, (2,), 16, tuple(range(L)), L)
    eng = Engine(cfg, shape, Placement(np.tile(np.arange(E), (L, 1)), E, 1, version=1))
    eng.scheduler.set_capacity([(top + 8) * (-(-(a.prompt + a.output + 16) // BLOCK) + 1)])
    ranks = PacedRanks(eng, a.step_ms / 1e3)
    key = secrets.token_bytes(16)
    server = ChannelServer(eng, key)
    server.start()
    rows = []
    try:
        for seqs in a.seq_list:
            for coalesce in a.modes:
                r = run_case(server.address, key, ranks, a, seqs, coalesce)
                rows.append(r)
                print(
                    f"[frontend] {seqs} streams, coalesce {'on' if coalesce else 'off'}: "
                    f"{r['tok_s']:.0f} tok/s, front end {r['frontend_cpu_us_per_token']:.1f} us/token",
                    flush=True,
                )
    finally:
        eng.request_stop()
        server.close()
    print(
        f"{'api':>4} {'seqs':>6} {'coalesce':>8} {'step ms':>7} {'asked/s':>8} {'got tok/s':>9} {'got/asked':>9} "
        f"{'fe us/tok':>9} {'fe cores':>8} {'msg/tok':>7} {'cl us/tok':>9} {'gap p50':>8} {'gap p99':>8}"
    )
    for r in rows:
        print(
            f"{r['api']:>4} {r['seqs']:>6} {'on' if r['coalesce'] else 'off':>8} {r['step_ms']:>7.1f} "
            f"{r['leader_tok_s_asked']:>8.0f} {r['tok_s']:>9.0f} {r['tok_s'] / r['leader_tok_s_asked']:>9.2f} "
            f"{r['frontend_cpu_us_per_token']:>9.1f} {r['frontend_cores']:>8.2f} {r['messages_per_token']:>7.2f} "
            f"{r['client_cpu_us_per_token'] or 0:>9.1f} {1e3 * (r['gap_p50_s'] or 0):>7.1f}m "
            f"{1e3 * (r['gap_p99_s'] or 0):>7.1f}m"
        )
    write_rows(a.json, __file__, argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
