#!/usr/bin/env python3
"""Dispatch + combine throughput, MoE-layer step time with and without EPLB, migration speed.

    python benchmarks/dispatch.py --backend nccl --ranks 2            # 2 GPUs, bf16, real shapes
    python benchmarks/dispatch.py --backend gloo --ranks 2 --small    # CPU, small shapes

Co-located ranks (each a router and a worker), the project's own code path: ``DistributedExperts``
(slot choice, sort, exchange, combine), ``ExpertStore`` (regroup by slot, grouped matmul) and
``run_moves`` (weight migration). Every figure is measured side by side with its raw
reference in the same run:

- dispatch+combine: one MoE layer's exchange with the experts replaced by identity, against
  ``all_to_all_single`` there and back with the same split sizes. Bytes = rows sent to another
  rank x hidden x dtype size, both ways (the share is the ratio of times for those bytes).
- MoE-layer step: routing ids -> dispatch -> grouped expert matmuls at real expert sizes ->
  combine, per layer; uniform routing, Zipf 1.2 routing on the default placement, and Zipf 1.2
  routing on the placement the project's policy computes from a previous window of the same
  distribution (EPLB), with predicted balancedness.
- migration: every expert of one layer moved between the two halves at once (no budget),
  against one ``send``/``recv`` of the same bytes; and the stall of one step's moves under the
  default per-step budget.

Prints a table and writes JSON (``--json``, default benchmarks/results/dispatch-<backend>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moeserve.dataplane.collective import CollectiveExchange  # noqa: E402
from moeserve.dataplane.exchange import Topology  # noqa: E402
from moeserve.dataplane.nvlink import NvlinkExchange  # noqa: E402
from moeserve.expert_worker.migration import run_moves, warm_up_pairs  # noqa: E402
from moeserve.expert_worker.store import ExpertStore  # noqa: E402
from moeserve.models.moe import ExpertSpec, RoutingResult  # noqa: E402
from moeserve.router.dispatcher import DistributedExperts, RouterMaps  # noqa: E402

MODELS = {
    # name: hidden, expert intermediate, logical experts, top-k, redundant slots for the EPLB runs
    "scout": dict(hidden=5120, inter=8192, experts=16, k=1, redundant=4),
    "ernie21b": dict(hidden=2560, inter=1536, experts=64, k=6, redundant=32),
}
SMALL = {
    "scout": dict(hidden=256, inter=384, experts=16, k=1, redundant=4),
    "ernie21b": dict(hidden=128, inter=96, experts=64, k=6, redundant=32),
}


def routing_ids(gen: torch.Generator, tokens: int, experts: int, k: int, zipf: float, perm) -> torch.Tensor:
    """[T, K] distinct expert ids per token; Zipf(s) popularity (s = 0: uniform), permuted."""
    if zipf == 0:
        pop = torch.ones(experts)
    else:
        pop = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** zipf
        pop = pop[perm]
    # Gumbel top-k draws K distinct experts with probability proportional to popularity.
    g = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen, dtype=torch.float64)))
    return torch.topk(torch.log(pop) + g, k, dim=1).indices


def timed(fn, iters: int, device) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, ranks aligned before each run."""
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=CPU_GROUP)
    return float(t.item())


def sum_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=CPU_GROUP)
    return float(t.item())


CPU_GROUP = None


def make_store(spec, worker, phy2log, workers, device, gen):
    """An ExpertStore with random weights per logical expert (same on every rank)."""
    s = phy2log.shape[1] // workers
    logical = phy2log[:, worker * s : (worker + 1) * s]
    bufs = []
    for layer in range(phy2log.shape[0]):
        b = torch.empty(s, spec.numel, dtype=spec.dtype, device=device)
        for i, e in enumerate(logical[layer].tolist()):
            g = torch.Generator(device=device).manual_seed(1000 * layer + e)
            b[i] = (torch.randn(spec.numel, generator=g, device=device) * 0.02).to(spec.dtype)
        bufs.append(b)
    return ExpertStore(spec, worker, bufs, logical)


class IdentityStore:
    """Experts replaced by identity: the dispatch path without the expert matmuls (the worker
    needs no permutation of rows: each source block arrives grouped by slot)."""

    def compute(self, layer, rows, received):
        return rows

    capturable = True

    def compute_slot_major(self, layer, rows, offs, total):
        return rows


_NVLINK = {}
_LAYER_OUT = {}


def make_exchange(kind, topo, rank, device, hidden, dtype, pairs, top_k):
    """The exchange of ``kind``; nvlink exchanges are kept per shape and grown, never shrunk
    (their buffers are symmetric memory, set up collectively)."""
    if kind == "collective":
        return CollectiveExchange(topo, rank, device=device)
    key = (topo, hidden, dtype, top_k)
    ex = _NVLINK.get(key)
    if ex is None or ex.pair_capacity < pairs:
        _NVLINK.pop(key, None)
        ex = _NVLINK[key] = NvlinkExchange(topo, rank, device, hidden, dtype, pair_capacity=pairs, top_k=top_k)
    ex.reset_graphs()  # each case brings its own maps and stores
    return ex


def bench_exchange(rank, world, device, dtype, model, tokens, zipf, iters, kinds, capacity):
    """dispatch+combine of one MoE layer (identity experts) with each exchange kind, against
    two all_to_all_single of the same split sizes, in the same run; checks every kind returns
    the rows the collective one returns."""
    topo = Topology.build(world, world, True, model["experts"])
    phy2log = np.tile(np.arange(model["experts"]), (1, 1))
    maps = RouterMaps(phy2log, model["experts"], 1, device)
    gen = torch.Generator().manual_seed(rank)
    perm = torch.randperm(model["experts"], generator=torch.Generator().manual_seed(7))
    ids = routing_ids(gen, tokens, model["experts"], model["k"], zipf, perm).to(device)
    w = torch.rand(tokens, model["k"], device=device).to(dtype)
    routing = RoutingResult(ids, w, weights_on_input=model["k"] == 1)
    hidden = torch.randn(tokens, model["hidden"], device=device).to(dtype)

    coll = DistributedExperts(CollectiveExchange(topo, rank, device=device), maps, rank, 1, IdentityStore())
    h = coll.dispatch(0, hidden, routing)
    want = coll.combine(h)
    send, recv = h.rows.pending.send_splits, h.rows.pending.recv_splits
    sbuf = torch.randn(sum(send), model["hidden"], device=device).to(dtype)
    rbuf = torch.empty(sum(recv), model["hidden"], device=device, dtype=dtype)
    back = torch.empty_like(sbuf)

    def raw():
        dist.all_to_all_single(rbuf, sbuf, recv, send)
        dist.all_to_all_single(back, rbuf, send, recv)

    for _ in range(3):
        raw()
    t_raw = max_over_ranks(timed(raw, iters, device))
    esize = torch.empty((), dtype=dtype).element_size()
    remote = (sum(send) - send[rank]) + (sum(recv) - recv[rank])  # rows out + rows in, other ranks
    mb = max_over_ranks(remote * model["hidden"] * esize / 2 / 1e6)  # per rank each way
    bytes_total = sum_over_ranks(remote * model["hidden"] * esize)
    rows = []
    for kind in kinds:
        ex = make_exchange(kind, topo, rank, device, model["hidden"], dtype, capacity * model["k"], model["k"])
        backend = DistributedExperts(ex, maps, rank, 1, IdentityStore())

        def ours():
            backend.combine(backend.dispatch(0, hidden, routing))

        got = backend.combine(backend.dispatch(0, hidden, routing))
        equal = max_over_ranks(0.0 if torch.equal(got, want) else 1.0) == 0.0
        for _ in range(3):
            ours()
        t_ours = max_over_ranks(timed(ours, iters, device))
        rows.append(
            dict(
                exchange=kind,
                mb_per_rank_each_way=mb,
                ours_ms=t_ours * 1e3,
                raw_ms=t_raw * 1e3,
                ours_gbps=bytes_total / world / t_ours / 1e9,
                raw_gbps=bytes_total / world / t_raw / 1e9,
                share=t_raw / t_ours,
                equal_to_collective=equal,
            )
        )
    return rows


def bench_layer(rank, world, device, dtype, model, tokens, zipf, eplb, layers, iters, routers=0, kind="collective"):
    """ms per MoE layer. routers=0: co-located (every rank routes T tokens and holds slots);
    routers=R: disaggregated, ranks 0 .. R-1 route T tokens each, the others hold the slots."""
    from moeserve.balancer.policy import place
    from moeserve.dataplane.exchange import idle_walk
    from moeserve.placement import balancedness

    e = model["experts"]
    r = model["redundant"] if eplb else 0
    p = e + r
    n_routers = routers or world
    n_workers = world - routers if routers else world
    topo = Topology.build(n_routers, n_workers, not routers, p)
    ex = make_exchange(kind, topo, rank, device, model["hidden"], dtype, tokens * model["k"], model["k"])
    router, worker = topo.router_index(rank), topo.worker_index(rank)
    perms = [torch.randperm(e, generator=torch.Generator().manual_seed(100 + l)) for l in range(layers)]
    if eplb:
        # Plan on a previous window of the same distribution (all routers' routing, summed).
        load = np.zeros((layers, e))
        for l in range(layers):
            for src in range(n_routers):
                g = torch.Generator().manual_seed(50_000 + 97 * src + l)
                ids = routing_ids(g, tokens, e, model["k"], zipf, perms[l])
                load[l] += np.bincount(ids.reshape(-1).numpy(), minlength=e)
        phy2log = place(load, p, n_workers, 1, 1, None)
    else:
        phy2log = np.tile(np.arange(p) % e, (layers, 1))
    spec = ExpertSpec(model["hidden"], model["inter"], dtype=dtype)
    store = make_store(spec, worker, phy2log, n_workers, device, None) if worker is not None else None
    loads = np.zeros((layers, e))
    if router is not None:
        maps = RouterMaps(phy2log, e, r + 1, device)
        backend = DistributedExperts(ex, maps, router, layers, store)
        routings = []
        for l in range(layers):
            ids = routing_ids(torch.Generator().manual_seed(router * 1000 + l), tokens, e, model["k"], zipf, perms[l])
            loads[l] += np.bincount(ids.reshape(-1).numpy(), minlength=e)
            w = torch.rand(tokens, model["k"]).to(dtype)
            routings.append(RoutingResult(ids.to(device), w.to(device), weights_on_input=model["k"] == 1))
        hidden = torch.randn(tokens, model["hidden"], device=device).to(dtype)

        def step():
            x = hidden
            for l in range(layers):
                x = backend.combine(backend.dispatch(l, x, routings[l]))
            return x
    else:

        def step():
            idle_walk(ex, layers, model["hidden"], dtype, store)

    for _ in range(2):
        step()
    t = max_over_ranks(timed(step, iters, device)) / layers
    # The same outputs whatever the exchange: compare with the first kind's run of this case.
    x = step()
    key = (model["hidden"], tokens, zipf, eplb, routers)
    diff = 0.0
    if x is not None:
        x = x.float().clone()
        ref = _LAYER_OUT.setdefault(key, x)
        diff = float((x - ref).abs().max()) if x.numel() else 0.0
    diff = max_over_ranks(diff)
    all_load = torch.tensor(loads)
    dist.all_reduce(all_load, group=CPU_GROUP)
    bal = float(np.mean(balancedness(all_load.numpy(), phy2log, n_workers)))
    return dict(
        exchange=kind,
        layer_ms=t * 1e3,
        max_diff_vs_first_exchange=diff,
        balancedness=bal,
        slots=p,
        routers=n_routers,
        workers=n_workers,
        layout="disaggregated" if routers else "co-located",
    )


def bench_live_migration(
    rank, world, device, dtype, model, tokens, layers, budget_bytes, steady_steps=20, kind="collective"
):
    """Step times (a stack of MoE layers at real sizes, Zipf 1.2 routing) before, during and
    after a live migration scheduled by the leader's own Migrator under the per-step byte
    budget, with the commits, staging and moves the cluster's ranks perform."""
    from moeserve.balancer.policy import make_policy
    from moeserve.dataplane.protocol import StepHeader
    from moeserve.dataplane.step import run_step
    from moeserve.placement import Placement
    from moeserve.router.engine.migration import Migrator

    e, r = model["experts"], model["redundant"]
    p = e + r
    topo = Topology.build(world, world, True, p)
    ex = make_exchange(kind, topo, rank, device, model["hidden"], dtype, tokens * model["k"], model["k"])
    perms = [torch.randperm(e, generator=torch.Generator().manual_seed(100 + l)) for l in range(layers)]
    drift = [torch.randperm(e, generator=torch.Generator().manual_seed(900 + l)) for l in range(layers)]

    def window_load(perm_list, seed):
        load = np.zeros((layers, e))
        for l in range(layers):
            ids = routing_ids(torch.Generator().manual_seed(seed + l), tokens * world, e, model["k"], 1.2, perm_list[l])
            load[l] = np.bincount(ids.reshape(-1).numpy(), minlength=e)
        return load

    policy = make_policy(move_budget=None)
    start = policy(window_load(perms, 1), p, world, 1, 1, None)
    target = policy(window_load(drift, 2), p, world, 1, 1, start)  # the traffic shifted: replan
    spec = ExpertSpec(model["hidden"], model["inter"], dtype=dtype)
    store = make_store(spec, rank, start, world, device, None)
    maps = RouterMaps(start, e, r + 1, device)
    backend = DistributedExperts(ex, maps, rank, layers, store)
    routings = []
    for l in range(layers):
        ids = routing_ids(torch.Generator().manual_seed(rank * 1000 + l), tokens, e, model["k"], 1.2, drift[l])
        w = torch.rand(tokens, model["k"]).to(dtype)
        routings.append(RoutingResult(ids.to(device), w.to(device), weights_on_input=model["k"] == 1))
    hidden = torch.randn(tokens, model["hidden"], device=device).to(dtype)
    migrator = Migrator(Placement(start, e, world, version=1), spec.nbytes, budget_bytes) if rank == 0 else None

    class State:  # what run_step needs of a rank
        pass

    st = State()
    st.rank, st.topo, st.store, st.maps, st.runner, st.exchange = rank, topo, store, maps, None, ex
    st.num_layers, st.hidden_size, st.dtype = layers, model["hidden"], dtype
    st.run_moves = lambda moves: run_moves(moves, store, topo)
    times, phase, mid = [], [], None
    step = 0
    while True:
        ops = None
        if rank == 0:
            if step == steady_steps:
                mid = migrator.start(migrator.plan(target))
            ops = migrator.header_ops()
        box = [ops]
        dist.broadcast_object_list(box, src=0, group=CPU_GROUP)
        ops = box[0]
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = run_step(st, StepHeader(step, migration=ops))  # commits, staging, moves
        x = hidden
        for l in range(layers):
            x = backend.combine(backend.dispatch(l, x, routings[l]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        errs = [None] * world if rank == 0 else None
        dist.gather_object(res.staging_error, errs, dst=0, group=CPU_GROUP)
        if rank == 0 and ops is not None and ops.begin_staging_slots:
            migrator.on_staging(ops.migration_id, [x for x in errs if x])
        in_flight = rank == 0 and mid is not None and not mid.state.ended
        phase.append("migrating" if (ops is not None or in_flight) else ("before" if mid is None else "after"))
        state = [phase[-1] == "after" and phase.count("after") >= steady_steps]
        dist.broadcast_object_list(state, src=0, group=CPU_GROUP)
        step += 1
        if state[0] or step > 2000:
            break
    t = np.array(times) * 1e3
    ph = [None]
    if rank == 0:
        ph = [phase]
    dist.broadcast_object_list(ph, src=0, group=CPU_GROUP)
    phase = np.array(ph[0])
    t = np.array([max_over_ranks(x) for x in t])
    steady = np.concatenate([t[phase == "before"][2:], t[phase == "after"]])
    during = t[phase == "migrating"]
    summary = [mid.progress() if rank == 0 else None]
    dist.broadcast_object_list(summary, src=0, group=CPU_GROUP)
    return dict(
        exchange=kind,
        slots=p,
        layers=layers,
        tokens=tokens,
        step_ms=[round(float(x), 3) for x in t],
        step_phase=[str(x) for x in phase],  # every step, to find outliers
        moves=summary[0].moves_total,
        bytes=summary[0].bytes_total,
        migration_steps=int(len(during)),
        migration_s=float(during.sum() / 1e3),
        steady_p50_ms=float(np.percentile(steady, 50)),
        steady_p99_ms=float(np.percentile(steady, 99)),
        during_p50_ms=float(np.percentile(during, 50)),
        during_p99_ms=float(np.percentile(during, 99)),
        p99_ratio=float(np.percentile(during, 99) / np.percentile(steady, 99)),
        budget_mb=budget_bytes / 2**20,
    )


def bench_migration(rank, world, device, dtype, model, iters, budget_bytes):
    spec = ExpertSpec(model["hidden"], model["inter"], dtype=dtype)
    e = model["experts"]
    topo = Topology.build(world, world, True, e)
    s = topo.slots_per_worker
    phy2log = np.arange(e)[None, :]
    store = make_store(spec, rank, phy2log, world, device, None)
    store.begin_staging(s)
    from moeserve.dataplane.protocol import MoveOp

    # Every slot of worker w goes to worker (w + 1) % W: all of a layer's experts move at once.
    moves = tuple(
        MoveOp(
            moe_layer=0,
            slot=((w + 1) % world) * s + i,
            logical=int(phy2log[0, w * s + i]),
            src_worker=w,
            src_slot=w * s + i,
            dst_worker=(w + 1) % world,
            stage=i,
        )
        for w in range(world)
        for i in range(s)
    )
    t_all = max_over_ranks(timed(lambda: run_moves(moves, store, topo), iters, device))
    nbytes = s * spec.nbytes  # received per worker
    buf = torch.empty(s * spec.numel, dtype=dtype, device=device)
    rbuf = torch.empty_like(buf)

    def raw():
        ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, rbuf, (rank - 1) % world)]
        for wk in dist.batch_isend_irecv(ops):
            wk.wait()

    t_raw = max_over_ranks(timed(raw, iters, device))
    per_step = max(1, budget_bytes // spec.nbytes)
    budget_moves = tuple(m for m in moves if m.stage < per_step)
    t_budget = max_over_ranks(timed(lambda: run_moves(budget_moves, store, topo), iters, device))
    return dict(
        expert_mb=spec.nbytes / 1e6,
        moved_mb_per_worker=nbytes / 1e6,
        ours_ms=t_all * 1e3,
        raw_ms=t_raw * 1e3,
        ours_gbps=nbytes / t_all / 1e9,
        raw_gbps=nbytes / t_raw / 1e9,
        share=t_raw / t_all,
        budget_moves_per_worker=min(per_step, s),
        budget_stall_ms=t_budget * 1e3,
    )


def init_rank(rank, world, args, port) -> torch.device:
    """Join the layer benchmarks' process group (``args.backend``: nccl, one GPU a rank, or gloo
    on one CPU thread), set ``CPU_GROUP`` and warm every pair up; a hang past ``args.hang_s``
    turns into a traceback. Returns the rank's device."""
    global CPU_GROUP
    import datetime
    import faulthandler

    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=120)
    if args.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    CPU_GROUP = dist.new_group(backend="gloo")
    warm_up_pairs(rank, world, device)
    return device


def worker_main(rank, world, args, port):
    device = init_rank(rank, world, args, port)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    models = {k: dict(v) for k, v in (SMALL if args.small else MODELS).items() if k in args.models}
    for name, r in args.redundant.items():
        models[name]["redundant"] = r
    out = dict(
        config=dict(
            backend=args.backend,
            ranks=world,
            dtype=args.dtype,
            small=args.small,
            torch=torch.__version__,
            device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        ),
        exchange=[],
        layer=[],
        migration=[],
        live_migration=[],
    )
    token_list = [int(t) for t in args.tokens.split(",")]
    for name, m in models.items():
        if "exchange" in args.parts:
            for tokens in token_list:
                for z in (0.0, 1.2):
                    for r in bench_exchange(
                        rank, world, device, dtype, m, tokens, z, args.iters, args.exchange, max(token_list)
                    ):
                        out["exchange"].append(dict(model=name, tokens=tokens, zipf=z, **r))
                        if rank == 0:
                            print(
                                f"exchange {name:9s} {r['exchange']:10s} T={tokens:6d} zipf={z:.1f} "
                                f"{r['mb_per_rank_each_way']:8.1f} MB ours {r['ours_ms']:7.3f} ms raw {r['raw_ms']:7.3f} ms "
                                f"share {r['share']:.0%} equal {r['equal_to_collective']}",
                                flush=True,
                            )
        if "layer" in args.parts:
            for tokens in [int(t) for t in args.layer_tokens.split(",")]:
                for kind in args.exchange:
                    base = None
                    for z, eplb in ((0.0, False), (1.2, False), (1.2, True)):
                        r = bench_layer(
                            rank, world, device, dtype, m, tokens, z, eplb, args.layers, args.iters, args.routers, kind
                        )
                        base = base or r["layer_ms"]
                        r["vs_uniform"] = r["layer_ms"] / base
                        out["layer"].append(dict(model=name, tokens=tokens, zipf=z, eplb=eplb, **r))
                        if rank == 0:
                            print(
                                f"layer    {name:9s} {kind:10s} T={tokens:6d} zipf={z:.1f} eplb={eplb!s:5s} {r['layer_ms']:7.3f} ms/layer "
                                f"x{r['vs_uniform']:.3f} of uniform, balancedness {r['balancedness']:.3f}, "
                                f"max diff vs first exchange {r['max_diff_vs_first_exchange']:.1e}",
                                flush=True,
                            )
        if "live" in args.parts:
            kind = args.exchange[-1]
            r = bench_live_migration(
                rank, world, device, dtype, m, args.live_tokens, args.layers, args.budget_mb << 20, kind=kind
            )
            out["live_migration"].append(dict(model=name, **r))
            if rank == 0:
                print(
                    f"live     {name:9s} {kind:10s} {r['moves']} moves, {r['bytes'] / 1e9:.2f} GB in {r['migration_steps']} steps "
                    f"({r['migration_s']:.2f} s); step p99 {r['during_p99_ms']:.2f} ms during vs {r['steady_p99_ms']:.2f} ms "
                    f"steady (x{r['p99_ratio']:.3f})",
                    flush=True,
                )
        if "migration" in args.parts:
            r = bench_migration(rank, world, device, dtype, m, args.iters, args.budget_mb << 20)
            out["migration"].append(dict(model=name, **r))
            if rank == 0:
                print(
                    f"migrate  {name:9s} {r['moved_mb_per_worker']:8.1f} MB/worker ours {r['ours_gbps']:6.1f} GB/s "
                    f"raw {r['raw_gbps']:6.1f} GB/s share {r['share']:.0%}; stall/step at budget "
                    f"{r['budget_stall_ms']:.2f} ms",
                    flush=True,
                )
    if rank == 0:
        path = args.json or os.path.join(
            os.path.dirname(os.path.abspath(__file__)),
            "results",
            f"dispatch-{args.backend}{'-small' if args.small else ''}.json",
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print_table(out)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def print_table(out):
    print(
        "\n| model | exchange | tokens/rank | routing | MB/rank each way | dispatch+combine ms | raw a2a ms | GB/s ours | GB/s raw | share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out["exchange"]:
        print(
            f"| {r['model']} | {r['exchange']} | {r['tokens']} | {'uniform' if r['zipf'] == 0 else 'zipf ' + str(r['zipf'])} | "
            f"{r['mb_per_rank_each_way']:.1f} | {r['ours_ms']:.3f} | {r['raw_ms']:.3f} | {r['ours_gbps']:.1f} | "
            f"{r['raw_gbps']:.1f} | {r['share']:.0%} |"
        )
    if out["layer"]:
        print(
            "\n| model | exchange | layout | tokens/router | routing | EPLB | slots | ms per MoE layer | x uniform | balancedness |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in out["layer"]:
            print(
                f"| {r['model']} | {r['exchange']} | {r['layout']} {r['routers']}R+{r['workers']}W | {r['tokens']} | "
                f"{'uniform' if r['zipf'] == 0 else 'zipf ' + str(r['zipf'])} | "
                f"{'on' if r['eplb'] else 'off'} | {r['slots']} | {r['layer_ms']:.3f} | {r['vs_uniform']:.3f} | "
                f"{r['balancedness']:.3f} |"
            )
    if out["live_migration"]:
        print(
            "\n| model | exchange | slots | tokens/rank | moves | GB moved | steps | seconds | step p50/p99 steady ms | step p50/p99 during ms | p99 ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in out["live_migration"]:
            print(
                f"| {r['model']} | {r['exchange']} | {r['slots']} | {r['tokens']} | {r['moves']} | {r['bytes'] / 1e9:.2f} | {r['migration_steps']} | "
                f"{r['migration_s']:.2f} | {r['steady_p50_ms']:.2f} / {r['steady_p99_ms']:.2f} | "
                f"{r['during_p50_ms']:.2f} / {r['during_p99_ms']:.2f} | {r['p99_ratio']:.3f} |"
            )
    if out["migration"]:
        print(
            "\n| model | expert MB | MB moved per worker | ours GB/s | send/recv GB/s | share | stall per step at budget (ms) |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in out["migration"]:
            print(
                f"| {r['model']} | {r['expert_mb']:.1f} | {r['moved_mb_per_worker']:.0f} | {r['ours_gbps']:.1f} | "
                f"{r['raw_gbps']:.1f} | {r['share']:.0%} | {r['budget_stall_ms']:.2f} |"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--small", action="store_true", help="small shapes (CPU)")
    ap.add_argument("--tokens", default=None, help="tokens per rank for the exchange, comma separated")
    ap.add_argument("--layer-tokens", default=None, help="tokens per rank for the layer step, comma separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--budget-mb", type=int, default=512, help="migration byte budget per worker per step")
    ap.add_argument("--parts", default="exchange,layer,migration,live")
    ap.add_argument("--models", default="scout,ernie21b")
    ap.add_argument(
        "--routers",
        type=int,
        default=0,
        help="layer step only: 0 co-located; R > 0 disaggregated, R router ranks + the rest workers",
    )
    ap.add_argument("--redundant", default="", help="redundant slots per model, e.g. scout=16,ernie21b=32")
    ap.add_argument("--live-tokens", type=int, default=None, help="tokens per rank in the live-migration run")
    ap.add_argument("--hang-s", type=float, default=900, help="dump tracebacks and exit after this long")
    ap.add_argument(
        "--exchange",
        default=None,
        help="exchange kinds, comma separated: collective, nvlink (default: both on nccl, collective on gloo)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu = args.backend == "nccl"
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.tokens = args.tokens or ("2048,8192,16384,32768" if gpu else "256,1024")
    args.layer_tokens = args.layer_tokens or ("2048,8192" if gpu else "256")
    args.iters = args.iters or (20 if gpu else 5)
    args.small = args.small or not gpu
    args.parts = set(args.parts.split(","))
    args.exchange = (args.exchange or ("collective,nvlink" if gpu else "collective")).split(",")
    if not gpu and "nvlink" in args.exchange:
        sys.exit("--exchange nvlink needs --backend nccl (CUDA devices)")
    args.models = args.models.split(",")
    args.redundant = {k: int(v) for k, v in (x.split("=") for x in args.redundant.split(",") if x)}
    args.live_tokens = args.live_tokens or (4096 if gpu else 64)
    if gpu and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--ranks {args.ranks} needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    spawn(worker_main, args)


def spawn(main_fn, args) -> None:
    """Run ``main_fn(rank, world, args, port)`` in ``args.ranks`` spawned processes that meet
    at a free local port (the layer benchmarks' ranks)."""
    from moeserve.ops.ports import free_port

    port = free_port()
    torch.multiprocessing.start_processes(
        _entry, args=(main_fn, args.ranks, args, port), nprocs=args.ranks, start_method="spawn"
    )


def _entry(rank, main_fn, world, args, port):
    main_fn(rank, world, args, port)


if __name__ == "__main__":
    main()
