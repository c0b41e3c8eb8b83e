"""Operator commands against running services (through the SDK):

- ``moeserve placement show|apply FILE|dump FILE`` (admin): the placement in force, applying a
  placement file (moeserve JSON or SGLang .json/.pt) live, writing the placement to a file;
- ``moeserve load [--dump FILE]`` (admin): the load window and its balancedness;
  ``moeserve load --plot FILE.png [DUMP [DUMP]]``: a heatmap of the load per expert and per
  slot, of the live window or of dumps (two dumps: before and after, side by side);
- ``moeserve rebalance [--dry-run] [--wait]`` (balancer);
- ``moeserve status`` (admin).

Every command takes ``--address``, ``--admin-token`` (or $MOESERVE_ADMIN_TOKEN), ``--ca-file``
and ``--timeout``; ``--json`` prints the result as JSON. A failed call prints the status code
and the server's message and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from moeserve.cli import UsageError
from moeserve.cli import flags as F


def register(subparsers) -> None:
    p = subparsers.add_parser("placement", help="show, apply or dump the placement (admin API)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("show", help="print the placement in force")
    F.add_client_flags(s, "8001")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("apply", help="apply a placement file live")
    s.add_argument("file", metavar="FILE", help="moeserve placement JSON, or SGLang expert-location .json / .pt")
    s.add_argument("--format", choices=("moeserve", "sglang-json", "sglang-pt"), help="default: from the file")
    s.add_argument("--expected-version", type=int, help="refuse unless this version is in force")
    s.add_argument("--dry-run", action="store_true", help="validate and plan only")
    s.add_argument("--no-wait", action="store_true", help="return once the migration started")
    F.add_client_flags(s, "8001")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("dump", help="write the placement in force to a moeserve JSON file")
    s.add_argument("file", metavar="FILE")
    F.add_client_flags(s, "8001")
    p.set_defaults(func=run_placement)

    p = subparsers.add_parser("load", help="print the load window and its balancedness (admin API)")
    F.add_client_flags(p, "8001")
    p.add_argument("--window-steps", type=int, default=0, help="only the last N steps (default: the whole window)")
    p.add_argument(
        "--dump", metavar="FILE", help="also write the load (since start and window) and the placement as JSON"
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the load per expert and per slot (matplotlib: pip install 'moeserve[plot]'); "
        "of the DUMP files when given, else of the live window",
    )
    p.add_argument(
        "dumps",
        nargs="*",
        metavar="DUMP",
        help="with --plot: files written by --dump (two: before and after a rebalance, side by side)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_load)

    p = subparsers.add_parser("rebalance", help="rebalance now (balancer)")
    F.add_client_flags(p, "8002")
    p.add_argument("--dry-run", action="store_true", help="plan and predict only")
    p.add_argument("--wait", action="store_true", help="return when the migration ended")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_rebalance)

    p = subparsers.add_parser("status", help="print the cluster's status (admin API)")
    F.add_client_flags(p, "8001")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_status)


def _client(args):
    from moeserve.client import Client

    try:
        return Client(args.address, F.token(args), timeout=args.timeout, ca_file=args.ca_file)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None


def _jsonable(v):
    if dataclasses.is_dataclass(v):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _call(fn, about: str = ""):
    """``fn()``; a failed call prints its status and message (after ``about``: the file the call
    was about) and exits 1."""
    from moeserve.client import MoeserveError

    try:
        return fn()
    except MoeserveError as e:
        print(f"error: {e.code.name}: {about + ': ' if about else ''}{e.message}", file=sys.stderr)
        raise SystemExit(1) from None


def _bal(b) -> str:
    return f"mean {b.mean:.4f} (sum ratio {b.sum_ratio:.4f}); per layer " + " ".join(f"{x:.3f}" for x in b.per_layer)


def run_placement(args: argparse.Namespace) -> int:
    c = _client(args)
    if args.action == "show":
        p = _call(c.placement)
        if args.json:
            print(json.dumps(_jsonable(p)))
        else:
            print(
                f"placement version {p.version}: {p.phy2log.shape[0]} MoE layers x {p.phy2log.shape[1]} slots, "
                f"{p.num_logical} logical experts on {p.num_workers} workers"
            )
            s = p.phy2log.shape[1] // p.num_workers
            for layer, row in enumerate(p.phy2log):
                workers = " | ".join(" ".join(map(str, row[w * s : (w + 1) * s])) for w in range(p.num_workers))
                print(f"  layer {layer} (v{p.layer_versions[layer]}): {workers}")
            b = p.breakeven
            if b.any():
                print(
                    "break-even counts b (the replica rule; 0: every replica always used): "
                    + (
                        f"{int(b.flat[0])} for every layer and expert"
                        if (b == b.flat[0]).all()
                        else f"{int(b.min())}..{int(b.max())} per (layer, expert)"
                    )
                )
    elif args.action == "apply":
        try:
            res = _call(
                lambda: c.apply_placement(
                    file=args.file,
                    file_format=args.format,
                    expected_version=args.expected_version,
                    dry_run=args.dry_run,
                    wait=not args.no_wait,
                ),
                args.file,
            )
        except OSError as e:
            raise UsageError(f"cannot read {args.file}: {e.strerror}") from None
        except ValueError as e:  # the SDK's own checks (an unknown format name)
            raise UsageError(f"{args.file}: {e}") from None
        if args.json:
            print(json.dumps(_jsonable(res)))
        else:
            print(f"{'dry run: ' if res.dry_run else ''}{res.moves} slot moves, {res.bytes} bytes")
            print(f"balancedness before: {_bal(res.balancedness_before)}")
            print(f"balancedness after:  {_bal(res.balancedness_after)}")
            if res.migration:
                print(
                    f"migration {res.migration_id}: {res.migration.state} (target version {res.migration.target_version})"
                )
    else:
        p = _call(c.placement)
        p.save(args.file)
        print(f"wrote placement version {p.version} to {args.file}")
    return 0


def _plot(path: str, pictures) -> None:
    from moeserve.ops.plot import PlotUnavailable, plot_load

    try:
        plot_load(pictures, path)
    except PlotUnavailable as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(f"--plot: {e}") from None
    print(f"wrote {path}")


def _dump_of(c) -> dict:
    d = _call(c.dump_load)
    p = _call(c.placement)
    return {
        "format": "moeserve.load/1",
        **_jsonable(d),
        "placement": {
            "phy2log": p.phy2log.tolist(),
            "version": int(p.version),
            "num_workers": p.num_workers,
            "breakeven": p.breakeven.tolist(),
        },
    }


def run_load(args: argparse.Namespace) -> int:
    if args.dumps:
        if not args.plot:
            raise UsageError("DUMP files are read by --plot: moeserve load --plot FILE.png DUMP [DUMP]")
        from moeserve.ops.plot import LoadPicture

        try:
            pics = [LoadPicture.from_dump(f) for f in args.dumps]
        except ValueError as e:
            raise UsageError(str(e)) from None
        if len(pics) == 2 and pics[0].title == pics[1].title:
            pics = [dataclasses.replace(pics[0], title="before"), dataclasses.replace(pics[1], title="after")]
        _plot(args.plot, pics)
        return 0
    c = _client(args)
    rep = _call(lambda: c.expert_load(args.window_steps))
    if args.dump or args.plot:
        d = _dump_of(c)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(d, f)
    if args.plot:
        from moeserve.ops.plot import LoadPicture

        p = d["placement"]
        _plot(
            args.plot,
            [
                LoadPicture(
                    f"window of {rep.steps} steps (placement v{p['version']})",
                    np.asarray(rep.load),
                    np.asarray(p["phy2log"]),
                    p["num_workers"],
                    rep.steps,
                )
            ],
        )
    if args.json:
        print(json.dumps(_jsonable(rep)))
        return 0
    print(
        f"load over {rep.steps} steps (window {rep.window_size}, {rep.total_steps} since start), "
        f"placement version {rep.placement_version}, {rep.steps_since_placement_change} steps since it changed"
    )
    print(f"balancedness measured:  {_bal(rep.measured)}")
    print(f"balancedness predicted: {_bal(rep.predicted)}")
    for layer, row in enumerate(rep.load):
        print(f"  layer {layer}: " + " ".join(map(str, row)))
    if args.dump:
        print(f"wrote the load to {args.dump}")
    return 0


def run_rebalance(args: argparse.Namespace) -> int:
    c = _client(args)
    res = _call(lambda: c.rebalance(dry_run=args.dry_run, wait=args.wait))
    if args.json:
        print(json.dumps(_jsonable(res)))
        return 0
    print(
        f"plan from version {res.base_version}: {res.slots_moved} slots change, {res.slots_moved_across_workers} "
        f"across workers, {res.bytes_moved} bytes"
    )
    print(f"balancedness before: {_bal(res.balancedness_before)}")
    print(f"balancedness after:  {_bal(res.balancedness_after)}")
    if res.predicted_step_s_before > 0:
        print(
            f"predicted MoE step time: {res.predicted_step_s_before * 1e3:.3f} ms -> "
            f"{res.predicted_step_s_after * 1e3:.3f} ms (step model)"
        )
    if res.breakeven is not None and res.breakeven.size:
        print(f"break-even counts sent: {int(res.breakeven.min())}..{int(res.breakeven.max())}")
    if res.applied:
        state = res.migration.state if res.migration else "started"
        print(f"applied: migration {res.migration_id} {state}")
    else:
        print(f"not applied: {res.note}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    c = _client(args)
    s = _call(c.status)
    if args.json:
        print(json.dumps(_jsonable(s)))
        return 0
    print(
        f"step {s.step} ({s.forward_steps} forward), up {s.uptime_s:.0f} s, placement version {s.placement_version}, "
        f"{s.running} running, {s.waiting} waiting{', ERROR: ' + s.error if s.error else ''}"
    )
    print(f"model: {_jsonable(s.model)}")
    print(f"eplb: {_jsonable(s.eplb)}")
    hit = f"{100 * s.prefix_cache_hits / s.prefix_cache_queries:.1f} %" if s.prefix_cache_queries else "-"
    print(
        f"kv cache: {s.kv_blocks_used}/{s.kv_blocks_total} blocks in use, {s.kv_blocks_cached} cached, "
        f"{s.preemptions} preemptions; prefix cache hits {s.prefix_cache_hits}/{s.prefix_cache_queries} "
        f"prompt tokens ({hit})"
    )
    for r in s.ranks:
        print(f"  rank {r.rank}: {r.role}")
    if s.migration:
        m = s.migration
        print(
            f"migration {m.migration_id}: {m.state}, {m.moves_done}/{m.moves_total} moves, "
            f"{m.layers_committed}/{m.layers_total} layers"
        )
    return 0
