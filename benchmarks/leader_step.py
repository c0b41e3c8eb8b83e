#!/usr/bin/env python3
"""The leader's host work per decode step, without ranks: schedule, the header's wire round
trip (``moeserve.dataplane.header_wire``: encode on the leader, decode on a rank; the old
pickle round trip beside it), consuming the results, and framing the step's events for the
front end (``router.engine.channel``: one pickled frame of every token event), at each batch of
``--seqs`` running sequences spread over ``--routers`` routers, the heap made before the requests
frozen out of the collector's reach as a rank's is (``moeserve.ops.gcpause``).

    python benchmarks/leader_step.py                       # 256, 512, 1024 sequences over 2 routers
    python benchmarks/leader_step.py --seqs 512 --routers 1

Prints a table (ms per step, mean of ``--steps`` steps after 10) and writes JSON (``--json``,
default benchmarks/results/leader-step.json). Except the framing, which the leader's channel
thread does, this work runs on rank 0's step loop between two steps: in the synchronous step
protocol every millisecond of it is a millisecond of decode step time; with asynchronous steps
(the default, emulated here: a step's tokens come back with the next step's results) it
overlaps the GPU's step and costs step time only where the whole host path is longer than the
GPU's (docs/dataplane.md, "Asynchronous steps").
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from servinglib.common import write_rows  # noqa: E402

from moeserve.config import ClusterConfig, EplbConfig, Limits  # noqa: E402
from moeserve.dataplane import header_wire  # noqa: E402
from moeserve.dataplane.protocol import RankResult  # noqa: E402
from moeserve.ops import gcpause  # noqa: E402
from moeserve.placement import Placement  # noqa: E402
from moeserve.router.engine.api import GenerateRequest, ModelShape  # noqa: E402
from moeserve.router.engine.channel import _compact, _frame  # noqa: E402
from moeserve.router.engine.leader import Engine  # noqa: E402

L, E = 8, 16
PARTS = ("schedule", "header_wire", "header_pickle", "on_results", "event_frame")


def measure(seqs: int, routers: int, steps: int) -> dict:
    """ms per step of each part of ``PARTS`` for ``seqs`` decoding sequences over ``routers``
    co-located ranks (each a router and a worker)."""
    W = routers
    cfg = ClusterConfig(
        model_dir="unused",
        routers=routers,
        workers=W,
        colocated=True,
        eplb=EplbConfig(enable_eplb=True, num_redundant_experts=0),
        limits=Limits(
            max_model_len=2048,
            max_num_seqs=-(-seqs // routers),
            max_num_batched_tokens=max(8192, seqs),
            max_waiting=100000,
        ),
    )
    shape = ModelShape(L, E, 1, 200000, (2,), 16, tuple(range(L)), L)
    eng = Engine(cfg, shape, Placement(np.tile(np.arange(E), (L, 1)), E, W, version=1))
    eng.scheduler.set_capacity([40000] * routers)
    gcpause.freeze_startup_heap()  # as a rank does once it is ready: full collections skip what came before
    events: list = []
    for i in range(seqs):
        eng.submit(GenerateRequest(tuple(range(5, 133)), 256, ignore_eos=True), lambda ev, i=i: events.append((i, ev)))
    total = dict.fromkeys(PARTS, 0.0)
    n, words, pickled = 0, 0, 0
    prev = None  # like routers with asynchronous steps: a step's tokens come with the next
    while n < steps + 10:
        t0 = time.perf_counter()
        h = eng.next_header()
        t1 = time.perf_counter()
        if not h.forward:
            raise RuntimeError(f"the sequences finished after {n} steps: ask fewer --steps")
        d = pickle.dumps(h)
        pickle.loads(d)
        t2 = time.perf_counter()
        w = header_wire.encode(h)
        header_wire.decode(w)
        t3 = time.perf_counter()
        res = [RankResult(r) for r in range(routers)]
        for r in range(routers):
            if prev is not None:
                res[r].tokens_step = prev.step
                res[r].tokens = {sid: 7 for sid in prev.work[r].sampled_ids()}
            if h.read_load:
                res[r].logical_load = np.zeros((L, E), np.int64)
                res[r].worker_load = np.zeros((L, W), np.int64)
        prev = h
        res = [pickle.loads(pickle.dumps(x)) for x in res]
        events.clear()
        t4 = time.perf_counter()
        eng.on_results(h, res)
        t5 = time.perf_counter()
        _frame(("events", _compact([(i % 64, i, ev) for i, ev in events])))
        t6 = time.perf_counter()
        n += 1
        if n > 10:
            for part, dt in zip(PARTS, (t1 - t0, t3 - t2, t2 - t1, t5 - t4, t6 - t5)):
                total[part] += dt
            words, pickled = len(w), len(d)
    out = {f"{part}_ms": 1e3 * total[part] / steps for part in PARTS}
    out["step_loop_ms"] = out["schedule_ms"] + out["header_wire_ms"] + out["on_results_ms"]
    return dict(seqs=seqs, routers=routers, steps=steps, header_bytes=8 * words, pickle_bytes=pickled, **out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="256,512,1024", help="comma list of running sequences (256,512,1024)")
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--steps", type=int, default=100, help="steps timed after 10 (100; at most 240)")
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "leader-step.json")
    )
    a = p.parse_args(argv)
    try:
        sizes = [int(x) for x in a.seqs.split(",")]
    except ValueError:
        p.error(f"--seqs must be a comma list of sequence counts, got {a.seqs!r}")
    if not sizes or min(sizes) < 1 or max(sizes) > 65536:
        p.error(f"--seqs must be 1 .. 65536 each, got {a.seqs!r}")
    if a.routers not in (1, 2, 4, 8, 16):
        p.error(f"--routers must divide the 16 experts: 1, 2, 4, 8 or 16, got {a.routers}")
    if not 1 <= a.steps <= 240:  # the sequences ask 256 tokens: steps + 10 of them must not finish
        p.error(f"--steps must be 1 .. 240, got {a.steps}")
    rows = [measure(s, a.routers, a.steps) for s in sizes]
    print(
        f"{'seqs':>6} {'routers':>7} {'schedule':>9} {'header':>8} {'(pickle)':>9} {'on_results':>10} "
        f"{'step loop':>9} {'events':>8} {'header KB':>9}   ms per step"
    )
    for r in rows:
        print(
            f"{r['seqs']:>6} {r['routers']:>7} {r['schedule_ms']:>9.2f} {r['header_wire_ms']:>8.2f} "
            f"{r['header_pickle_ms']:>9.2f} {r['on_results_ms']:>10.2f} {r['step_loop_ms']:>9.2f} "
            f"{r['event_frame_ms']:>8.2f} {r['header_bytes'] / 1024:>9.1f}"
        )
    write_rows(a.json, __file__, argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
