#!/usr/bin/env python3
"""The leader's host work per decode step, without ranks: schedule, the header's wire round
trip (``moeserve.dataplane.header_wire``: encode on the leader, decode on a rank; the old
pickle round trip beside it), and consuming the results, for 512 running sequences over 2
routers (256 each).

    python benchmarks/leader_step.py

Prints one line (ms per step, mean of 100 steps after 10). This host work sits between two
GPU steps in the synchronous step protocol, so every millisecond of it is a millisecond of
decode step time; with asynchronous steps (the default, emulated here: a step's tokens come
back with the next step's results) it overlaps the GPU's step and costs step time only where
the whole host path is longer than the GPU's (docs/dataplane.md, "Asynchronous steps").
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pickle
import time

import numpy as np

from moeserve.config import ClusterConfig, EplbConfig, Limits
from moeserve.dataplane import header_wire
from moeserve.dataplane.protocol import RankResult
from moeserve.placement import Placement
from moeserve.router.engine.api import GenerateRequest, ModelShape
from moeserve.router.engine.leader import Engine

L, E, W = 8, 16, 2
cfg = ClusterConfig(
    model_dir="unused",
    routers=2,
    workers=W,
    colocated=True,
    eplb=EplbConfig(enable_eplb=True, num_redundant_experts=0),
    limits=Limits(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192, max_waiting=100000),
)
shape = ModelShape(L, E, 1, 200000, (2,), 16, tuple(range(L)), L)
eng = Engine(cfg, shape, Placement(np.tile(np.arange(E), (L, 1)), E, W, version=1))
eng.scheduler.set_capacity([40000, 40000])
events = []
for _i in range(512):
    eng.submit(GenerateRequest(tuple(range(5, 133)), 256, ignore_eos=True), events.append)
t_sched = t_res = t_pick = t_wire = 0.0
n = 0
prev = None  # like routers with asynchronous steps: a step's tokens come with the next
while True:
    t0 = time.perf_counter()
    h = eng.next_header()
    t1 = time.perf_counter()
    if not h.forward:
        break
    d = pickle.dumps(h)
    pickle.loads(d)
    t2 = time.perf_counter()
    w = header_wire.encode(h)
    header_wire.decode(w)
    t2w = time.perf_counter()
    res = [RankResult(r) for r in range(2)]
    for r in range(2):
        if prev is not None:
            res[r].tokens_step = prev.step
            res[r].tokens = {sid: 7 for sid in prev.work[r].sampled_ids()}
        if h.read_load:
            res[r].logical_load = np.zeros((L, E), np.int64)
            res[r].worker_load = np.zeros((L, W), np.int64)
    prev = h
    res = [pickle.loads(pickle.dumps(x)) for x in res]
    t3 = time.perf_counter()
    eng.on_results(h, res)
    t4 = time.perf_counter()
    n += 1
    if n > 10:
        t_sched += t1 - t0
        t_pick += t2 - t1
        t_res += t4 - t3
        t_wire += t2w - t2
    if n == 110:
        break
k = n - 10
print(
    f"per step, 512 seqs over 2 routers: schedule {1e3 * t_sched / k:.2f} ms, header encode+decode {1e3 * t_wire / k:.2f} ms "
    f"({8 * len(w)} bytes; pickle+unpickle {1e3 * t_pick / k:.2f} ms, {len(d)} bytes), on_results {1e3 * t_res / k:.2f} ms"
)
