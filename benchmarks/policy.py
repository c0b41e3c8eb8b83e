#!/usr/bin/env python3
"""Placement policies side by side: the project's policy vs the DeepSeek reference drop-in.

    python benchmarks/policy.py [--traces DIR] [--json OUT] [--seed N] [--only SUBSTR] [--follow-check]

Scenarios (a policy yardstick's, its generator written here so the project runs on its own):
Zipf(s) expert popularity permuted per layer, multinomial sampling of each window's tokens,
log-normal drift (sigma 0.1) between windows;
a policy plans on window t (given its previous plan) and is scored on window t ("in") and t+1
("next"). ``--traces DIR`` adds real SGLang expert counts (one snapshot each; "shift" scores
the plan on another workload of the same model) and fails if DIR is missing.

Reported per scenario and policy: balancedness in/next, slots moved per call (fraction, calls
after the first), slots moved across workers (the new expert was not on the slot's worker:
its weights cross the wire), bytes moved per call (across-worker slots x expert bytes), ms per
call (median and max of 5, the first with no placement in force; one thread), and the speedup
over the reference drop-in measured side by side and over the published reference's time
(``PUBLISHED_MS``). Also: the trade-off curve (next, moved at move budgets 5, 10, 20, 100 % and
unlimited), and the hierarchical scenario with groups pinned to nodes vs hot experts'
redundant replicas allowed off their node, with the share of tokens that then cross nodes.

``--follow-check`` adds the check of replica counts following the traffic: every
synthetic scenario at seeds 1-3 with Zipf (1.0, 1.5) and drift 0.2, and at the defaults (seed
--seed, Zipf (0.8, 1.2), drift 0.1): next-window balancedness of the policy (counts follow the
traffic), of the policy before (``follow_counts=False``) and of the reference, slots moved per
call and ms per call; "ok" when the policy's next is within 0.01 of the reference's and it
moves at most 10 % of the slots per call.

Expert bytes (bf16, 2 bytes per parameter; gate, up and down projections):
  DeepSeek-V3 44 M parameters (7168 x 2048 x 3), Llama 4 Scout 126 M (5120 x 8192 x 3),
  Llama 4 Maverick taken as Scout's 126 M (same expert shape per the model cards),
  ERNIE-4.5-21B 11.8 M (2560 x 1536 x 3); real traces: Qwen3-235B 18.9 M (4096 x 1536 x 3),
  Qwen3-30B 4.7 M (2048 x 768 x 3), Qwen2-57B 27.5 M (3584 x 2560 x 3).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # one thread, set before numpy is imported

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from moeserve.balancer.policy import cross_node_share, evaluate, make_policy, place, place_reference  # noqa: E402
from moeserve.placement import balancedness  # noqa: E402

BF16 = 2
SYNTHETIC = {
    # name: layers, logical experts, slots, groups, nodes, workers, tokens per window per layer, expert params
    "deepseek-v3-32gpu-hier": dict(
        layers=58, log=256, phy=288, groups=8, nodes=4, gpus=32, tokens=8 * 4096 * 8, params=7168 * 2048 * 3
    ),
    "deepseek-v3-32gpu-global": dict(
        layers=58, log=256, phy=288, groups=1, nodes=1, gpus=32, tokens=8 * 4096 * 8, params=7168 * 2048 * 3
    ),
    "llama4-scout-8gpu": dict(
        layers=48, log=16, phy=32, groups=1, nodes=1, gpus=8, tokens=4096, params=5120 * 8192 * 3
    ),
    "llama4-maverick-8gpu": dict(
        layers=24, log=128, phy=144, groups=1, nodes=1, gpus=8, tokens=4096, params=5120 * 8192 * 3
    ),
    "ernie45-21b-2gpu": dict(
        layers=27, log=64, phy=96, groups=1, nodes=1, gpus=2, tokens=4096 * 6, params=2560 * 1536 * 3
    ),
}
ZIPF = (0.8, 1.2)
WINDOWS = 6
REAL = [  # name, counts file, slots, workers, file to score the plan on (shift), expert params
    ("qwen3-235b", "qwen3_235b_a22b_counts.json", 160, 32, None, 4096 * 1536 * 3),
    ("qwen3-235b", "qwen3_235b_a22b_counts.json", 144, 16, None, 4096 * 1536 * 3),
    ("qwen3-30b", "qwen3_30b_a3b_counts.json", 160, 32, None, 2048 * 768 * 3),
    ("qwen2-57b", "qwen2_57b_a14b_counts_multi.json", 96, 32, "qwen2_57b_a14b_counts_sharegpt.json", 3584 * 2560 * 3),
    ("qwen2-57b", "qwen2_57b_a14b_counts_multi.json", 72, 8, "qwen2_57b_a14b_counts_sharegpt.json", 3584 * 2560 * 3),
]
# The published reference policy's time per call (ms) on these scenarios, for the speedup column.
PUBLISHED_MS = {
    "deepseek-v3-32gpu-hier/zipf0.8": 370,
    "deepseek-v3-32gpu-hier/zipf1.2": 358,
    "deepseek-v3-32gpu-global/zipf0.8": 804,
    "deepseek-v3-32gpu-global/zipf1.2": 776,
    "llama4-scout-8gpu/zipf0.8": 34,
    "llama4-scout-8gpu/zipf1.2": 34,
    "llama4-maverick-8gpu/zipf0.8": 75,
    "llama4-maverick-8gpu/zipf1.2": 75,
    "ernie45-21b-2gpu/zipf0.8": 37,
    "ernie45-21b-2gpu/zipf1.2": 37,
    "qwen3-235b/slots160/workers32": 683,
    "qwen3-235b/slots144/workers16": 415,
    "qwen3-30b/slots160/workers32": 348,
    "qwen2-57b/slots96/workers32": 118,
    "qwen2-57b/slots72/workers8": 45,
}
BUDGETS = (0.05, 0.10, 0.20, 1.0, None)


def windows(
    rng: np.random.Generator, layers: int, experts: int, tokens: int, n: int, zipf_s: float, drift: float = 0.1
) -> list[np.ndarray]:
    """n windows of token counts [layers, experts]: Zipf popularity, permuted per layer, sampled
    multinomially each window, drifting log-normally between windows (the yardstick's model)."""
    ranks = np.arange(1, experts + 1, dtype=np.float64)
    popularity = np.stack([rng.permutation(ranks**-zipf_s) for _ in range(layers)])
    out = []
    for _ in range(n):
        share = popularity / popularity.sum(1, keepdims=True)
        out.append(np.stack([rng.multinomial(tokens, row) for row in share]).astype(np.float64))
        popularity = popularity * np.exp(rng.normal(0.0, drift, popularity.shape))
    return out


def run_synthetic(policy, s: dict, wins: list[np.ndarray], expert_bytes: int, with_share: bool = False) -> dict:
    ins, nxt, moved, across, nbytes, ms, shares, cur = [], [], [], [], [], [], [], None
    args = (s["phy"], s["gpus"], s["groups"], s["nodes"])
    for t in range(WINDOWS - 1):
        t0 = time.perf_counter()
        p2l = np.asarray(policy(wins[t].copy(), *args, None if cur is None else cur.copy()))
        ms.append((time.perf_counter() - t0) * 1e3)
        ins.append(balancedness(wins[t], p2l, s["gpus"]).mean())
        nxt.append(balancedness(wins[t + 1], p2l, s["gpus"]).mean())
        if with_share:
            shares.append(cross_node_share(wins[t], p2l, s["groups"], s["nodes"]))
        if cur is not None:
            r = evaluate(wins[t], cur, p2l, s["gpus"], expert_bytes)
            moved.append(r.slots_moved / p2l.size)
            across.append(r.slots_moved_across_workers / p2l.size)
            nbytes.append(r.bytes_moved)
        cur = p2l
    out = dict(
        in_=float(np.mean(ins)),
        next=float(np.mean(nxt)),
        moved=float(np.mean(moved)),
        moved_across=float(np.mean(across)),
        bytes_moved=float(np.mean(nbytes)),
        ms=float(np.median(ms)),
        ms_max=float(np.max(ms)),
    )
    if with_share:
        out["cross_node_share"] = float(np.mean(shares))
    return out


def run_real(policy, counts: np.ndarray, shift: np.ndarray | None, slots: int, workers: int) -> dict:
    t0 = time.perf_counter()
    p2l = np.asarray(policy(counts.copy(), slots, workers, 1, 1, None))
    ms = (time.perf_counter() - t0) * 1e3
    out = dict(in_=float(balancedness(counts, p2l, workers).mean()), ms=ms, ms_max=ms)
    if shift is not None:
        out["shift"] = float(balancedness(shift, p2l, workers).mean())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", help="directory with the real expert-count traces (fails if missing)")
    ap.add_argument(
        "--json",
        default=str(Path(__file__).parent / "results" / "policy.json"),
        help="where to write the results (default: benchmarks/results/policy.json)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="run scenarios whose name contains this")
    ap.add_argument(
        "--follow-check",
        action="store_true",
        help="add the check of replica counts following the traffic: seeds 1-3 at Zipf (1.0, 1.5) "
        "with drift 0.2, and the defaults",
    )
    a = ap.parse_args(argv)
    if a.traces is not None and not Path(a.traces).is_dir():
        ap.error(f"--traces {a.traces}: no such directory")

    results: dict = {
        "seed": a.seed,
        "env": environment(),
        "synthetic": {},
        "real": {},
        "tradeoff": {},
        "hierarchical": {},
    }
    for name, s in SYNTHETIC.items():
        for z in ZIPF:
            key = f"{name}/zipf{z}"
            if a.only not in key:
                continue
            wins = windows(np.random.default_rng(a.seed), s["layers"], s["log"], s["tokens"], WINDOWS, z)
            eb = s["params"] * BF16
            ours = run_synthetic(place, s, wins, eb)
            ref = run_synthetic(place_reference, s, wins, eb)
            ours["speedup_vs_dropin"] = ref["ms"] / ours["ms"]
            ours["speedup_vs_published"] = PUBLISHED_MS[key] / ours["ms"]
            results["synthetic"][key] = {"policy": ours, "reference": ref}
            curve = {}
            for b in BUDGETS:
                r = ours if b == 0.10 else run_synthetic(make_policy(b), s, wins, eb)
                curve["unlimited" if b is None else f"{round(b * 100)}%"] = {k: r[k] for k in ("next", "moved")}
            results["tradeoff"][key] = curve
            if s["groups"] > 1 and s["nodes"] > 1:
                results["hierarchical"][key] = {
                    "pinned": run_synthetic(place, s, wins, eb, with_share=True),
                    "cross_node_replicas": run_synthetic(
                        make_policy(cross_node_replicas=True), s, wins, eb, with_share=True
                    ),
                    "reference": run_synthetic(place_reference, s, wins, eb, with_share=True),
                }
    if a.traces is not None:
        for name, f, slots, workers, shift, _params in REAL:
            key = f"{name}/slots{slots}/workers{workers}"
            if a.only not in key:
                continue
            path = Path(a.traces) / f
            if not path.exists():
                ap.error(f"--traces {a.traces}: {f} is missing")
            counts = np.array(json.loads(path.read_text())["counts"], dtype=np.float64)
            sh = (
                np.array(json.loads((Path(a.traces) / shift).read_text())["counts"], dtype=np.float64)
                if shift
                else None
            )
            ours, ref = (
                run_real(place, counts, sh, slots, workers),
                run_real(place_reference, counts, sh, slots, workers),
            )
            ours["speedup_vs_dropin"] = ref["ms"] / ours["ms"]
            ours["speedup_vs_published"] = PUBLISHED_MS[key] / ours["ms"]
            results["real"][key] = {"policy": ours, "reference": ref}

    if a.follow_check:
        results["follow_check"] = follow_check(a.seed, a.only)
    results["env"]["loadavg_after"] = os.getloadavg()[0]
    print_tables(results)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=1))
    print(
        f"\nload average before/after: {results['env']['loadavg_before']:.2f} / {results['env']['loadavg_after']:.2f} "
        f"({results['env']['cpus']} CPUs; times above are one thread)"
    )
    print(f"wrote {a.json}")
    return 0


FOLLOW_RUNS = [(1, (1.0, 1.5), 0.2), (2, (1.0, 1.5), 0.2), (3, (1.0, 1.5), 0.2)]


def follow_check(default_seed: int, only: str) -> dict:
    """The follow check's scenarios: the policy, the policy before replica counts followed the traffic,
    and the reference, on every synthetic scenario (see the module's docstring)."""
    before = make_policy(follow_counts=False)
    out = {}
    for seed, zipfs, drift in FOLLOW_RUNS + [(default_seed, ZIPF, 0.1)]:
        for name, s in SYNTHETIC.items():
            for z in zipfs:
                key = f"{name}/zipf{z}"
                if only not in key:
                    continue
                wins = windows(np.random.default_rng(seed), s["layers"], s["log"], s["tokens"], WINDOWS, z, drift)
                eb = s["params"] * BF16
                row = {
                    "policy": run_synthetic(place, s, wins, eb),
                    "before": run_synthetic(before, s, wins, eb),
                    "reference": run_synthetic(place_reference, s, wins, eb),
                }
                row["ok"] = bool(
                    row["policy"]["next"] >= row["reference"]["next"] - 0.01 and row["policy"]["moved"] <= 0.10
                )
                out[f"seed{seed}/drift{drift}/{key}"] = row
    return out


def environment() -> dict:
    """What the times depend on: versions, threads, and how busy the machine was."""
    import platform

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": 1,
        "loadavg_before": os.getloadavg()[0],
        "expert_bytes": "bf16, 2 bytes per parameter; parameters per expert as in this file's docstring",
    }


def print_tables(res: dict) -> None:
    print(
        "policy vs reference drop-in (in / next balancedness; moved = slots changed per call; "
        "across = slots whose weights cross the wire; GB = bytes moved per call)"
    )
    print(
        f"{'scenario':34s} {'who':4s} {'in':>6s} {'next':>6s} {'moved':>6s} {'across':>6s} {'GB':>7s} "
        f"{'ms':>6s} {'ms_max':>6s} {'x drop-in':>9s} {'x published':>11s}"
    )
    for key, r in {**res["synthetic"], **res["real"]}.items():
        for who, v in (("ours", r["policy"]), ("ref", r["reference"])):
            extra = f"{v['speedup_vs_dropin']:9.1f} {v['speedup_vs_published']:11.0f}" if who == "ours" else ""
            moved = (
                f"{v['moved']:6.3f} {v['moved_across']:6.3f} {v['bytes_moved'] / 1e9:7.2f}"
                if "moved" in v
                else f"{'shift':>6s} {v['shift']:6.3f} {'':7s}"
                if "shift" in v
                else f"{'':6s} {'':6s} {'':7s}"
            )
            print(
                f"{key if who == 'ours' else '':34s} {who:4s} {v['in_']:6.3f} {v.get('next', float('nan')):6.3f} "
                f"{moved} {v['ms']:6.1f} {v['ms_max']:6.1f} {extra}"
            )
    print("\ntrade-off: next / moved at move budgets")
    names = ["5%", "10%", "20%", "100%", "unlimited"]
    print(f"{'scenario':34s} " + " ".join(f"{n:>15s}" for n in names))
    for key, c in res["tradeoff"].items():
        print(f"{key:34s} " + " ".join(f"{c[n]['next']:.3f} / {c[n]['moved']:.3f}".rjust(15) for n in names))
    if res.get("follow_check"):
        print(
            "\nreplica counts follow the traffic: next balancedness, slots moved per call, ms per call "
            "(median / max of 5)"
        )
        print(f"{'scenario':52s} {'before':>15s} {'policy':>22s} {'reference':>15s} {'diff':>7s} ok")
        for key, r in res["follow_check"].items():
            b, p, f = r["before"], r["policy"], r["reference"]
            print(
                f"{key:52s} {b['next']:.4f} / {b['moved']:.3f} {p['next']:.4f} / {p['moved']:.3f} "
                f"{p['ms']:4.1f}/{p['ms_max']:4.1f} {f['next']:.4f} / {f['moved']:.3f} "
                f"{p['next'] - f['next']:+7.4f} {'yes' if r['ok'] else 'NO'}"
            )
        rows = list(res["follow_check"].values())
        print(
            f"all ok: {all(r['ok'] for r in rows)}; worst diff {min(r['policy']['next'] - r['reference']['next'] for r in rows):+.4f}; "
            f"largest ms per call (median of 5) {max(r['policy']['ms'] for r in rows):.1f}, slowest call "
            f"{max(r['policy']['ms_max'] for r in rows):.1f}"
        )
    if res["hierarchical"]:
        print("\nhierarchical: groups pinned to nodes vs redundant replicas allowed off their node")
        print(f"{'scenario':34s} {'variant':20s} {'in':>6s} {'next':>6s} {'moved':>6s} {'x-node tokens':>13s}")
        for key, h in res["hierarchical"].items():
            for variant, v in h.items():
                print(
                    f"{key:34s} {variant:20s} {v['in_']:6.3f} {v['next']:6.3f} {v['moved']:6.3f} {v['cross_node_share']:13.3f}"
                )


if __name__ == "__main__":
    sys.exit(main())
