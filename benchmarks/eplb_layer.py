#!/usr/bin/env python3
"""The MoE layer with EPLB off, token-balanced and cost-aware, against the ideal.

The command for 2 x H200 (about 2-4 minutes; it stops starting new cases after --deadline-s,
500 s by default, and writes its JSON after every case, so it stays under 10 minutes):

    python3 benchmarks/eplb_layer.py --backend nccl --ranks 2 --step-model benchmarks/results/step_model_h200.json

On a CPU (gloo, small shapes, a test of the plumbing; its times say nothing about a GPU):

    python3 benchmarks/eplb_layer.py --backend gloo --ranks 2 --smoke

Without any rank or device, the step model's predictions only (placements planned and every
router's replica choice simulated; real shapes with the H200 table by default):

    python3 benchmarks/eplb_layer.py --predict-only

For each shape (Scout: 16 experts + 4 redundant, top-1; ERNIE-21B: 64 + 32, top-6), tokens per
rank (128, 512, 2048, 8192 on the direct exchange; 2048 and 8192 on the collective one too) and
routing (uniform, Zipf 1.2), four policies on the same two co-located ranks:

- off:   one slot per expert, no redundant slot (b = 0);
- token: today's token-balanced EPLB (``make_policy()``, the redundant slots, b = 0);
- cost:  ``make_policy(step_model=entry)``: the token plan put in force, then one cost-aware call
         on a second window with its ``steps``; and the break-even counts the policy plans with
         that placement on that window (``rule.plan_breakeven``, b per (layer, expert))
         installed in ``RouterMaps`` (a replica is used only when the step's count passes b);
- ideal: uniform routing with EPLB off (the uniform "off" row of the same size).

Each placement is planned on a window (``--window-steps`` steps of every router's routing) drawn
from the benchmark's own load generator (``dispatch.routing_ids``) with other seeds than the
timed routing. The six rows of a (shape, exchange, size) -- {uniform, Zipf} x {off, token, cost} --
are built together and timed in ``--repeats`` interleaved repeats (the order rotates per repeat),
each the median of ``--iters`` steps of ``--layers`` MoE layers, the slowest rank's; the row's
figure is the median of the repeats, printed with their spread ((max - min) / median). The step
number rotates with every timed step, as in serving (it picks the replica under the rule).

The step model (``balancer/policy/cost.py``) predicts every row from the exact busy slots and
pairs of every worker, found by replaying every router's replica choice (``RouterMaps.slots_of``,
b included) on the timed routing: ``pred table`` with the calibration table's entry, ``pred fit``
with that entry's layer overhead, HBM and matmul rates refitted on the uniform rows of the same
(shape, exchange) (the slot overhead kept; the exchange's cost falls into those parameters). The
check: cost <= 1.02 x min(off, token) per (shape, exchange, size, routing), and the fitted model
within 10 % of every measured Zipf row.

Prints a table and writes JSON (``--json``, default benchmarks/results/eplb-layer.json; with
--smoke or gloo: eplb-layer-cpu.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import dispatch as D  # noqa: E402

from moeserve.balancer.policy import cost as C  # noqa: E402
from moeserve.balancer.policy import make_policy  # noqa: E402
from moeserve.balancer.policy.rule import plan_breakeven  # noqa: E402
from moeserve.placement import balancedness  # noqa: E402
from moeserve.router.dispatcher import RouterMaps  # noqa: E402

POLICIES = ("off", "token", "cost")
ZIPF = (0.0, 1.2)
TOLERANCE = 1.02  # cost <= 1.02 x min(off, token)
MODEL_ERROR = 0.10  # |fitted model / measured - 1| on Zipf rows
PREDICT_STEPS = 16  # step numbers over which a row's prediction is taken (the replica rotation)
H200_TABLE = os.path.join(HERE, "results", "step_model_h200.json")
CPU_TABLE = os.path.join(HERE, "results", "step_model_cpu_example.json")


# ---- the step model of a shape -----------------------------------------------------------------


def pick_model(table_path: str, gpu: str, hidden: int, inter: int, dtype_bytes: int) -> tuple[C.StepModel, str]:
    """The table's entry for this GPU and shape; where none has the shape (the CPU example),
    the table's one entry's rates with this shape, said so in the note returned."""
    table = C.load_table(table_path)
    entries = [m for m in table.entries if m.gpu == gpu] or list(table.entries)
    note = "" if any(m.gpu == gpu for m in table.entries) else f"no entry for {gpu!r}: used {entries[0].gpu!r}'s; "
    same = [m for m in entries if (m.hidden_size, m.intermediate_size, m.dtype_bytes) == (hidden, inter, dtype_bytes)]
    if same:
        return same[0], note + f"{os.path.basename(table_path)}: {same[0].gpu} / {same[0].shape}"
    m = dataclasses.replace(
        entries[0], shape=f"H{hidden}-I{inter}", hidden_size=hidden, intermediate_size=inter, dtype_bytes=dtype_bytes
    )
    return m, note + (
        f"{os.path.basename(table_path)} has no entry of this shape: {entries[0].gpu} / "
        f"{entries[0].shape}'s rates with this shape (plumbing only, not a model of this device)"
    )


# ---- load, plans, the replica choice replayed ----------------------------------------------------


def perms_of(e: int, layers: int):
    return [torch.randperm(e, generator=torch.Generator().manual_seed(100 + l)) for l in range(layers)]


def timed_ids(router: int, layer: int, tokens: int, m: dict, zipf: float, perm) -> torch.Tensor:
    """The routing a router times (same seeds as dispatch.bench_layer)."""
    return D.routing_ids(torch.Generator().manual_seed(router * 1000 + layer), tokens, m["experts"], m["k"], zipf, perm)


_WINDOWS: dict = {}


def window_load(m: dict, tokens: int, zipf: float, routers: int, layers: int, steps: int, seed: int) -> np.ndarray:
    """[L, E] pairs per expert over ``steps`` steps of every router (seeds apart from the timed ones)."""
    key = (tuple(sorted(m.items())), tokens, zipf, routers, layers, steps, seed)
    if key not in _WINDOWS:
        _WINDOWS[key] = _window_load(m, tokens, zipf, routers, layers, steps, seed)
    return _WINDOWS[key].copy()


def _window_load(m, tokens, zipf, routers, layers, steps, seed):
    e, perms = m["experts"], perms_of(m["experts"], layers)
    load = np.zeros((layers, e))
    for s in range(steps):
        for src in range(routers):
            for l in range(layers):
                g = torch.Generator().manual_seed(seed + 7919 * s + 97 * src + l)
                ids = D.routing_ids(g, tokens, e, m["k"], zipf, perms[l])
                load[l] += np.bincount(ids.reshape(-1).numpy(), minlength=e)
    return load


def plan(
    policy: str, m: dict, tokens: int, zipf: float, workers: int, layers: int, window_steps: int, model: C.StepModel
) -> dict:
    """phy2log [L, P] and b [L, E] of one policy, planned on windows of this distribution."""
    e = m["experts"]
    if policy == "off":
        return dict(phy2log=np.tile(np.arange(e), (layers, 1)), breakeven=np.zeros((layers, e), np.int64))
    p = e + m["redundant"]
    load = window_load(m, tokens, zipf, workers, layers, window_steps, 50_000)
    token = make_policy()(load, p, workers, 1, 1, None)
    if policy == "token":
        return dict(phy2log=token, breakeven=np.zeros((layers, e), np.int64))
    # The cost-aware policy's first call (no placement in force) is the token plan; the next
    # window's call, with its steps, is the cost-aware one.
    load2 = window_load(m, tokens, zipf, workers, layers, window_steps, 70_000)
    cost = make_policy(step_model=model)
    first = cost(load, p, workers, 1, 1, None)
    phy2log = cost(load2, p, workers, 1, 1, first, steps=window_steps)
    # b per (layer, expert), planned with the placement on the same window
    b = plan_breakeven(model, load2, phy2log, workers, window_steps)
    return dict(phy2log=phy2log, breakeven=b, moved_from_token=int((phy2log != first).sum()))


def replay(
    m: dict, phy2log: np.ndarray, b: np.ndarray, tokens: int, zipf: float, routers: int, workers: int, steps
) -> tuple[np.ndarray, np.ndarray]:
    """Every worker's busy slots and pairs [S, L, W] at the given step numbers, from every
    router's timed routing and replica choice (``RouterMaps.slots_of``: the rule both
    exchanges apply, b included)."""
    e, layers, p = m["experts"], phy2log.shape[0], phy2log.shape[1]
    maps = RouterMaps(phy2log, e, m["redundant"] + 1, "cpu", breakeven=b)
    perms = perms_of(e, layers)
    ids = [[timed_ids(r, l, tokens, m, zipf, perms[l]) for l in range(layers)] for r in range(routers)]
    busy = np.zeros((len(steps), layers, workers))
    pairs = np.zeros_like(busy)
    for i, s in enumerate(steps):
        for l in range(layers):
            cnt = torch.zeros(p, dtype=torch.long)
            for r in range(routers):
                slots = maps.slots_of(l, ids[r][l], r + s, r, routers)
                cnt += torch.bincount(slots, minlength=p)
            c = cnt.numpy().reshape(workers, p // workers)
            busy[i, l], pairs[i, l] = (c > 0).sum(1), c.sum(1)
    return busy, pairs


def predict_ms(model: C.StepModel, busy: np.ndarray, pairs: np.ndarray) -> float:
    """ms per MoE layer: per step the mean over layers of the slowest worker, median over steps."""
    t = model.time(busy, pairs).max(2).mean(1)
    return float(np.median(t)) * 1e3


def fit_uniform(model: C.StepModel, rows: list[dict]) -> tuple[C.StepModel, float]:
    """The model with layer_overhead_s, hbm_bytes_per_s and matmul_flops_per_s refitted on
    ``rows`` (each with busy, pairs [S, L, W] and the measured median_ms): least relative
    squares by coordinate search over the two rates (log grid, refined) with the overhead in
    closed form (it adds to every worker alike). Returns the model and its RMS relative error."""
    meas = np.array([r["median_ms"] for r in rows]) / 1e3

    def rest(mdl):  # prediction without the layer overhead
        z = dataclasses.replace(mdl, layer_overhead_s=0.0)
        return np.array([predict_ms(z, r["busy"], r["pairs"]) for r in rows]) / 1e3

    def with_overhead(mdl):
        g = rest(mdl)
        lo = max(0.0, float(np.sum((1 - g / meas) / meas) / np.sum(1 / meas**2)))
        mdl = dataclasses.replace(mdl, layer_overhead_s=lo)
        return mdl, float(np.sqrt(np.mean(((lo + g) / meas - 1) ** 2)))

    best, err = with_overhead(model)
    for span in (8.0, 2.0, 1.25):
        for _ in range(3):
            for key in ("matmul_flops_per_s", "hbm_bytes_per_s"):
                for f in np.geomspace(1 / span, span, 17):
                    cand, e = with_overhead(dataclasses.replace(best, **{key: getattr(best, key) * f}))
                    if e < err - 1e-12:
                        best, err = cand, e
    return best, err


# ---- the timed rows ------------------------------------------------------------------------------


class Row:
    def __init__(self, shape, kind, tokens, zipf, policy, placement):
        self.shape, self.kind, self.tokens, self.zipf, self.policy = shape, kind, tokens, zipf, policy
        self.phy2log, self.b = placement["phy2log"], placement["breakeven"]
        self.moved = placement.get("moved_from_token")
        self.times: list[float] = []
        self.step = 0
        self.fn = None

    def run(self):
        return self.fn()


def build_rows(rank, world, device, dtype, name, m, kind, tokens, capacity, placements, layers, stores):
    """The six rows of one (shape, exchange, size): backends with their maps, stores and routing."""
    from moeserve.dataplane.exchange import Topology
    from moeserve.models.moe import ExpertSpec, RoutingResult
    from moeserve.router.dispatcher import DistributedExperts

    e = m["experts"]
    spec = ExpertSpec(m["hidden"], m["inter"], dtype=dtype)
    perms = perms_of(e, layers)
    rows = []
    for zipf in ZIPF:
        for policy in POLICIES:
            pl = placements[(zipf, policy)]
            row = Row(name, kind, tokens, zipf, policy, pl)
            phy2log, p = pl["phy2log"], pl["phy2log"].shape[1]
            topo = Topology.build(world, world, True, p)
            ex = D.make_exchange(kind, topo, rank, device, m["hidden"], dtype, capacity * m["k"], m["k"])
            key = phy2log.tobytes()
            if key not in stores:
                stores[key] = D.make_store(spec, rank, phy2log, world, device, None)
            maps = RouterMaps(phy2log, e, m["redundant"] + 1, device, breakeven=pl["breakeven"])
            backend = DistributedExperts(ex, maps, rank, layers, stores[key])
            routings = []
            for l in range(layers):
                ids = timed_ids(rank, l, tokens, m, zipf, perms[l])
                w = torch.rand(tokens, m["k"], generator=torch.Generator().manual_seed(5 + l)).to(dtype)
                routings.append(RoutingResult(ids.to(device), w.to(device), weights_on_input=m["k"] == 1))
            hidden = (
                torch.randn(tokens, m["hidden"], generator=torch.Generator().manual_seed(rank)).to(dtype).to(device)
            )

            def fn(backend=backend, routings=routings, hidden=hidden, row=row):
                backend.step = row.step  # the replica rotation of serving
                row.step += 1
                x = hidden
                for l in range(layers):
                    x = backend.combine(backend.dispatch(l, x, routings[l]))
                return x

            row.fn = fn
            rows.append(row)
    return rows


# ---- one process per rank --------------------------------------------------------------------------


def cases(args):
    """(shape, exchange, sizes) in run order: the sweep on its exchange, then the collective one."""
    out = []
    for name in args.models:
        out.append((name, args.exchange, args.sizes))
        if args.exchange != "collective" and args.collective_sizes:
            out.append((name, "collective", args.collective_sizes))
    return out


def models_of(args) -> dict:
    base = D.SMALL if args.small else D.MODELS
    return {k: dict(base[k]) for k in args.models}


_PLANS: dict = {}


def plans_for(name, m, tokens, world, args, model):
    """Every (routing, policy)'s placement for one shape and size (the same on both exchanges)."""
    key = (name, tokens)
    if key not in _PLANS:
        _PLANS[key] = {
            (z, p): plan(p, m, tokens, z, world, args.layers, args.window_steps, model) for z in ZIPF for p in POLICIES
        }
    return _PLANS[key]


def worker_main(rank, world, args, port):
    t_start = time.perf_counter()  # the deadline counts the start too
    device = D.init_rank(rank, world, args, port)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    models = models_of(args)
    out = new_output(args, world, gpu)
    last_case_s = 0.0
    for name, kind, sizes in cases(args):
        m = models[name]
        model, note = pick_model(args.step_model, gpu, m["hidden"], m["inter"], 2 if dtype == torch.bfloat16 else 4)
        out["step_models"][name] = dict(note=note, entry=model.to_entry(), breakeven=model.breakeven_count)
        stores = {}
        for tokens in sizes:
            stop = [time.perf_counter() - t_start + 1.5 * last_case_s > args.deadline_s]
            dist.broadcast_object_list(stop, src=0, group=D.CPU_GROUP)
            if stop[0]:
                out["skipped"].append(dict(model=name, exchange=kind, tokens=tokens))
                if rank == 0:
                    print(f"skipped  {name} {kind} T={tokens}: past --deadline-s {args.deadline_s}", flush=True)
                continue
            last_case_s = run_case(
                rank, world, device, dtype, args, out, name, m, kind, tokens, max(sizes), model, stores, t_start
            )
            for ex in D._NVLINK.values():
                ex.reset_graphs()  # the rows' graphs go with them
            off = np.tile(np.arange(m["experts"]), (args.layers, 1)).tobytes()
            for key in [k for k in stores if k != off]:  # only "off"'s store outlives its case
                del stores[key]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        stores.clear()
    if rank == 0:
        out["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        finish(out)
        print_table(out)
        write(out, args.json)
        print(f"wrote {args.json} ({out['elapsed_s']:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()


def run_case(rank, world, device, dtype, args, out, name, m, kind, tokens, capacity, model, stores, t_start) -> float:
    """Plan, build, warm up and time the six rows of one (shape, exchange, size); rank 0 records
    them and writes the JSON. Returns the case's seconds (every rank). Its rows, backends and
    stores other than those kept in ``stores`` are freed on return."""
    t_case = time.perf_counter()
    box = [plans_for(name, m, tokens, world, args, model) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=D.CPU_GROUP)  # every rank the same plans
    rows = build_rows(rank, world, device, dtype, name, m, kind, tokens, capacity, box[0], args.layers, stores)
    for row in rows:
        for _ in range(3):  # compile, capture, replay
            row.run()
    for rep in range(args.repeats):
        for row in rows[rep % len(rows) :] + rows[: rep % len(rows)]:  # interleaved, order rotated
            row.times.append(D.max_over_ranks(D.timed(row.run, args.iters, device)) * 1e3 / args.layers)
    seconds = [0.0]
    if rank == 0:
        record(out, rows, m, world, model, args)
        seconds[0] = time.perf_counter() - t_case
        out["cases"].append(dict(model=name, exchange=kind, tokens=tokens, seconds=round(seconds[0], 2)))
        out["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        for r in out["rows"][-len(rows) :]:
            print(row_line(r), flush=True)
        print(
            f"case     {name} {kind} T={tokens}: {seconds[0]:.1f} s, {out['elapsed_s']:.0f} s since the ranks started",
            flush=True,
        )
        finish(out)
        write(out, args.json)
    dist.broadcast_object_list(seconds, src=0, group=D.CPU_GROUP)
    return seconds[0]


def new_output(args, world, gpu):
    return dict(
        config=dict(
            backend=args.backend,
            ranks=world,
            dtype=args.dtype,
            small=args.small,
            device=gpu,
            torch=torch.__version__,
            step_model=os.path.relpath(args.step_model, os.path.join(HERE, "..")),
            sizes=args.sizes,
            collective_sizes=args.collective_sizes,
            exchange=args.exchange,
            repeats=args.repeats,
            iters=args.iters,
            layers=args.layers,
            window_steps=args.window_steps,
            command=" ".join(sys.argv),
        ),
        step_models={},
        rows=[],
        fits={},
        checks=[],
        model_error={},
        cases=[],
        skipped=[],
        elapsed_s=0.0,
    )


def record(out, rows, m, world, model, args):
    """Append the rows of one case with their spread and the table model's prediction."""
    steps = list(range(min(PREDICT_STEPS, 3 + args.repeats * args.iters)))
    for row in rows:
        busy, pairs = replay(m, row.phy2log, row.b, row.tokens, row.zipf, world, world, steps)
        med = statistics.median(row.times)
        load = np.zeros((row.phy2log.shape[0], m["experts"]))
        for r in range(world):
            perms = perms_of(m["experts"], row.phy2log.shape[0])
            for l in range(row.phy2log.shape[0]):
                load[l] += np.bincount(
                    timed_ids(r, l, row.tokens, m, row.zipf, perms[l]).reshape(-1).numpy(), minlength=m["experts"]
                )
        # b is per (layer, expert): "breakeven" is the model's b it is planned from (0: none installed)
        b = model.breakeven_count if row.b.any() else 0
        out["rows"].append(
            dict(
                model=row.shape,
                exchange=row.kind,
                tokens=row.tokens,
                zipf=row.zipf,
                policy=row.policy,
                slots=int(row.phy2log.shape[1]),
                breakeven=b,
                breakeven_range=[int(row.b.min()), int(row.b.max())],
                # experts whose step count (all routers) is at or below their b: one copy read, replicas idle
                experts_at_or_below_b=int(((load <= row.b) & (row.b > 0)).sum()),
                moved_from_token=row.moved,
                times_ms=[round(t, 4) for t in row.times],
                median_ms=med,
                spread=(max(row.times) - min(row.times)) / med,
                busy_max=float(busy.max(2).mean()),
                pairs_max=float(pairs.max(2).mean()),
                balancedness=float(np.mean(balancedness(load, row.phy2log, world))),
                pred_table_ms=predict_ms(model, busy, pairs),
                phy2log=row.phy2log.tolist(),
                _busy=busy,
                _pairs=pairs,
            )
        )


def finish(out):
    """Ideal ratios, the fit on uniform rows, the model's error on Zipf rows, the checks."""
    rows = out["rows"]
    by = {(r["model"], r["exchange"], r["tokens"], r["zipf"], r["policy"]): r for r in rows}
    for r in rows:
        ideal = by.get((r["model"], r["exchange"], r["tokens"], 0.0, "off"))
        r["x_ideal"] = r["median_ms"] / ideal["median_ms"] if ideal else None
    out["fits"], out["checks"], out["model_error"] = {}, [], {}
    for key in sorted({(r["model"], r["exchange"]) for r in rows}):
        uni = [r for r in rows if (r["model"], r["exchange"]) == key and r["zipf"] == 0.0]
        entry = C.StepModel(**out["step_models"][key[0]]["entry"])
        fitted, err = fit_uniform(
            entry, [dict(busy=r["_busy"], pairs=r["_pairs"], median_ms=r["median_ms"]) for r in uni]
        )
        out["fits"][f"{key[0]}/{key[1]}"] = dict(entry=fitted.to_entry(), uniform_rms_error=err, rows=len(uni))
        errs = []
        for r in rows:
            if (r["model"], r["exchange"]) == key:
                r["pred_fit_ms"] = predict_ms(fitted, r["_busy"], r["_pairs"])
                r["err_fit"] = r["pred_fit_ms"] / r["median_ms"] - 1
                r["err_table"] = r["pred_table_ms"] / r["median_ms"] - 1
                if r["zipf"] > 0:
                    errs.append(r["err_fit"])
        if errs:
            worst = max(errs, key=abs)
            out["model_error"][f"{key[0]}/{key[1]}"] = dict(
                max_abs_zipf_error=abs(worst), worst=worst, ok=abs(worst) <= MODEL_ERROR
            )
    for (mdl, kind, tokens, zipf, policy), r in by.items():
        if policy != "cost":
            continue
        off, token = by.get((mdl, kind, tokens, zipf, "off")), by.get((mdl, kind, tokens, zipf, "token"))
        best = min(off["median_ms"], token["median_ms"])
        out["checks"].append(
            dict(
                model=mdl,
                exchange=kind,
                tokens=tokens,
                zipf=zipf,
                cost_ms=r["median_ms"],
                best_other_ms=best,
                ratio=r["median_ms"] / best,
                ok=r["median_ms"] <= TOLERANCE * best,
            )
        )


def write(out, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    clean = dict(out, rows=[{k: v for k, v in r.items() if not k.startswith("_")} for r in out["rows"]])
    with open(path, "w") as f:
        json.dump(clean, f, indent=1)


def row_line(r) -> str:
    x = "" if r.get("x_ideal") is None else f" x{r['x_ideal']:.3f} ideal"
    return (
        f"layer    {r['model']:9s} {r['exchange']:10s} T={r['tokens']:5d} {routing(r['zipf']):8s} {r['policy']:5s} "
        f"b={r['breakeven']:<4d} {r['median_ms']:8.3f} ms/layer (spread {r['spread']:.1%}){x}, "
        f"busy max {r['busy_max']:.1f}, pred {r['pred_table_ms']:.3f} ms"
    )


def routing(z: float) -> str:
    return "uniform" if z == 0 else f"zipf {z:g}"


def print_table(out):
    print(
        "\n| model | exchange | tokens/rank | routing | policy | slots | b | busy (max worker) | ms per MoE layer "
        "(median of repeats) | spread | x ideal | pred ms (table) | pred ms (fit on uniform) | model error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        x = "" if r.get("x_ideal") is None else f"{r['x_ideal']:.3f}"
        print(
            f"| {r['model']} | {r['exchange']} | {r['tokens']} | {routing(r['zipf'])} | {r['policy']} | {r['slots']} | "
            f"{r['breakeven']} | {r['busy_max']:.1f} | {r['median_ms']:.3f} | {r['spread']:.1%} | {x} | "
            f"{r['pred_table_ms']:.3f} | {r.get('pred_fit_ms', float('nan')):.3f} | {r.get('err_fit', float('nan')):+.1%} |"
        )
    print(f"\ncost-aware <= {TOLERANCE} x min(off, token):")
    print("| model | exchange | tokens/rank | routing | cost ms | min(off, token) ms | ratio | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for c in out["checks"]:
        print(
            f"| {c['model']} | {c['exchange']} | {c['tokens']} | {routing(c['zipf'])} | {c['cost_ms']:.3f} | "
            f"{c['best_other_ms']:.3f} | {c['ratio']:.3f} | {'yes' if c['ok'] else 'NO'} |"
        )
    print(f"\nthe model fitted on uniform rows, error on Zipf rows (<= {MODEL_ERROR:.0%}):")
    for k, v in out["model_error"].items():
        f = out["fits"][k]
        print(
            f"  {k}: worst {v['worst']:+.1%} ({'ok' if v['ok'] else 'NO'}); fit on {f['rows']} uniform rows, "
            f"RMS {f['uniform_rms_error']:.1%}: layer overhead {f['entry']['layer_overhead_s'] * 1e6:.1f} us, "
            f"HBM {f['entry']['hbm_bytes_per_s'] / 1e9:.4g} GB/s, matmul {f['entry']['matmul_flops_per_s'] / 1e12:.4g} TFLOP/s"
        )
    for k, v in out["step_models"].items():
        print(f"  step model {k}: {v['note']}; b = {v['breakeven']}")
    checks = out["checks"]
    print(
        f"\nchecks: {sum(c['ok'] for c in checks)}/{len(checks)} cost-aware within {TOLERANCE}x; "
        f"model error ok on {sum(v['ok'] for v in out['model_error'].values())}/{len(out['model_error'])} "
        f"(shape, exchange); skipped cases: {len(out['skipped'])}"
    )


# ---- predictions only (no ranks) ---------------------------------------------------------------------


def predict_only(args):
    """Plans and the table model's prediction of every row (the replica choice replayed), no timing."""
    world = args.ranks
    models = models_of(args)
    gpu = args.predict_gpu
    print(
        "| model | tokens/rank | routing | policy | slots | b | busy max worker | pairs max worker | pred ms/layer | "
        "x pred ideal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    res = []
    for name in args.models:
        m = models[name]
        model, note = pick_model(args.step_model, gpu, m["hidden"], m["inter"], 2 if args.dtype == "bf16" else 4)
        for tokens in args.sizes:
            pl = plans_for(name, m, tokens, world, args, model)
            preds = {}
            for (z, pol), p in pl.items():
                busy, pairs = replay(m, p["phy2log"], p["breakeven"], tokens, z, world, world, range(PREDICT_STEPS))
                preds[(z, pol)] = (predict_ms(model, busy, pairs), busy, pairs, p)
            ideal = preds[(0.0, "off")][0]
            for (z, pol), (t, busy, pairs, p) in preds.items():
                res.append(
                    dict(model=name, tokens=tokens, zipf=z, policy=pol, pred_ms=t, breakeven=int(p["breakeven"].max()))
                )
                print(
                    f"| {name} | {tokens} | {routing(z)} | {pol} | {p['phy2log'].shape[1]} | {int(p['breakeven'].max())} | "
                    f"{busy.max(2).mean():.1f} | {pairs.max(2).mean():.0f} | {t:.3f} | {t / ideal:.3f} |"
                )
        print(f"step model {name}: {note}; b = {model.breakeven_count}")
    if args.json:
        write(dict(config=dict(predict_only=True, step_model=args.step_model), rows=res), args.json)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--small", action="store_true", help="small shapes (the default on gloo)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing test: small shapes, tiny sizes, 2 repeats")
    ap.add_argument("--models", default="scout,ernie21b")
    ap.add_argument("--sizes", default=None, help="tokens per rank of the sweep (default 128,512,2048,8192; gloo 8,64)")
    ap.add_argument(
        "--collective-sizes",
        default=None,
        help="tokens per rank also run on the collective exchange (default 2048,8192; '' none)",
    )
    ap.add_argument("--exchange", default=None, help="the sweep's exchange: nvlink (default on nccl) or collective")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats per row (default 5)")
    ap.add_argument("--iters", type=int, default=None, help="steps per repeat (default 10; smoke 2)")
    ap.add_argument("--layers", type=int, default=None, help="MoE layers per step (default 4; smoke 2)")
    ap.add_argument("--window-steps", type=int, default=8, help="steps of every router in a planning window")
    ap.add_argument(
        "--step-model",
        default=None,
        help="step-model table (default: results/step_model_h200.json on nccl, the CPU example on gloo)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=500,
        help="seconds since the ranks started after which no case starts (the last case's time x 1.5 ahead)",
    )
    ap.add_argument("--hang-s", type=float, default=570, help="dump tracebacks and exit after this long")
    ap.add_argument("--predict-only", action="store_true", help="no ranks: plans and the model's predictions only")
    ap.add_argument("--predict-gpu", default="NVIDIA H200", help="--predict-only: the table's GPU kind")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    gpu = args.backend == "nccl" and not args.predict_only
    args.small = args.small or args.smoke or (not gpu and not args.predict_only)
    args.dtype = args.dtype or ("fp32" if args.small else "bf16")
    args.sizes = [int(x) for x in (args.sizes or ("8,64" if args.small else "128,512,2048,8192")).split(",")]
    cs = args.collective_sizes if args.collective_sizes is not None else ("" if args.small else "2048,8192")
    args.collective_sizes = [int(x) for x in cs.split(",") if x]
    args.exchange = args.exchange or ("nvlink" if gpu else "collective")
    args.repeats = args.repeats or (2 if args.smoke else 5)
    args.iters = args.iters or (2 if args.smoke else 10)
    args.layers = args.layers or (2 if args.smoke else 4)
    args.models = args.models.split(",")
    args.step_model = args.step_model or (CPU_TABLE if args.small else H200_TABLE)
    if args.predict_only:
        return predict_only(args)
    args.json = args.json or os.path.join(HERE, "results", "eplb-layer-cpu.json" if args.small else "eplb-layer.json")
    if args.exchange == "nvlink" and not gpu:
        sys.exit("--exchange nvlink needs --backend nccl (CUDA devices)")
    if gpu and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--ranks {args.ranks} needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    C.load_table(args.step_model)  # a bad table fails here, not in the ranks
    D.spawn(worker_main, args)


if __name__ == "__main__":
    main()
