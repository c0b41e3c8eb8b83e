#!/usr/bin/env python3
"""The grouped expert MLP of a decode step: the Triton kernels (moeserve.kernels.expert_mlp)
against torch._grouped_mm + silu_mul + torch._grouped_mm, side by side in one run, in GB/s of
expert weights read.

    python3 benchmarks/expert_kernel.py                 # 1 GPU, bf16, Scout and ERNIE decode shapes
    python3 benchmarks/expert_kernel.py --tune          # also time each kernel's candidate tilings
    python3 benchmarks/expert_kernel.py --fp8           # also FP8 weights (per channel, 128x128 blocks),
                                                        # weight-only and W8A8 (rows quantized per row)

Per case: S slots of one MoE layer on one GPU (Scout: 16 experts of H 5120 x I 8192; ERNIE-4.5-
21B: 64 experts of H 2560 x I 1536), T decode tokens routed top-K uniformly at random (and, for
``skew``, 2 hot experts taking ~80 % of the pairs; for ``concentrated``, every token to the same K
experts, as random dummy weights route ERNIE's); rows grouped by slot as the direct exchange
delivers them. Bytes = the weights of the slots that got rows (what must be read); rate = bytes
/ median time of ``--iters`` launches timed with CUDA events, the layers' weights cycled so
that no launch finds its weights in L2. Prints a table and writes JSON (``--json``, default
benchmarks/results/expert-kernel.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moeserve import kernels  # noqa: E402
from moeserve.expert_worker.store import expert_block_m_for  # noqa: E402

SHAPES = {
    "scout": dict(hidden=5120, inter=8192, slots=16, top_k=1),
    "ernie": dict(hidden=2560, inter=1536, slots=64, top_k=6),
    "qwen3": dict(hidden=2048, inter=768, slots=144, top_k=8),  # Qwen3-30B-A3B, 128 experts + 16 redundant
    "gptoss": dict(hidden=2880, inter=2880, slots=36, top_k=4),  # GPT-OSS-20B's shape, bf16 (no biases here)
}
# the tilings --tune times: (BN, BK) choices per kernel kind, each with warps (4, 8) and stages
# (3, 4), the FP8 kernels also with and without the swapped product; --tune-bn / --tune-bk /
# --tune-stages replace those choices (a tiling whose shared memory does not fit is skipped)
TUNE_BN_BK = {"bf16": ((32, 64, 128), (64, 128)), "fp8": ((64, 128), (64, 128)), "w8a8": ((64, 128), (128, 256))}


def candidates(kind: str, bn=None, bk=None, stages=None) -> list[tuple]:
    """The tilings --tune times for kernel kind ``kind`` (bf16, fp8, w8a8): (BN, BK, warps,
    stages), and for FP8 the swap flag; ``bn`` / ``bk`` / ``stages`` replace the kind's
    choices."""
    bns, bks = TUNE_BN_BK[kind]
    grid = [bn or bns, bk or bks, (4, 8), stages or (3, 4)] + ([] if kind == "bf16" else [(False, True)])
    return list(itertools.product(*grid))


def counts_for(rng, tokens, k, slots, skew):
    if skew == "concentrated":  # every token to the same K experts
        return np.bincount(np.repeat(np.arange(k), tokens), minlength=slots)
    if skew == "skew":
        p = np.full(slots, 0.2 / (slots - 2))
        p[:2] = 0.4
    else:
        p = np.full(slots, 1.0 / slots)
    ids = np.stack([rng.choice(slots, size=k, replace=False, p=p) for _ in range(tokens)])
    return np.bincount(ids.reshape(-1), minlength=slots)


def time_fn(fn, iters, layers):
    for i in range(3):
        fn(i % layers)
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i % layers)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return float(np.median(ts))


def tune_fp8(case, rows, offs, bm, used, h, i, layers, a8=False, bn=None, bk=None, stages=None):
    """Time every ``candidates("fp8")`` (``a8``: ``"w8a8"``) tiling of both FP8 kernels
    (per-channel scales; ``a8``: rows quantized per row, outside the timing): GB/s of codes."""
    _, blocks, layers8 = case
    h_in = torch.randn(rows.shape[0], i, device=rows.device, dtype=rows.dtype)
    x, xs, hx, hs = rows, None, h_in, None
    if a8:
        (x, xs), (hx, hs) = kernels.quant_rows(rows), kernels.quant_rows(h_in)
    res = {"gate_up": [], "down": []}
    for cand in candidates("w8a8" if a8 else "fp8", bn, bk, stages):

        def gu(j, cand=cand):
            w = layers8[j]
            return kernels._expert_matmul(
                x, w["gate_up"], offs, bm, cand, True, w["gate_up_scale"], blocks[0], xs=xs, out_dtype=rows.dtype
            )

        def dn(j, cand=cand):
            w = layers8[j]
            return kernels._expert_matmul(
                hx, w["down"], offs, bm, cand, False, w["down_scale"], blocks[1], xs=hs, out_dtype=rows.dtype
            )

        try:
            t1, t2 = time_fn(gu, 10, layers), time_fn(dn, 10, layers)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile
            print(f"  fp8 {cand}: {type(e).__name__}")
            continue
        res["gate_up"].append((cand, used * 2 * h * i / t1 / 1e9))
        res["down"].append((cand, used * h * i / t2 / 1e9))
    for kind, lst in res.items():
        lst.sort(key=lambda x: -x[1])
        print(f"  tune fp8 {kind}: " + ", ".join(f"{c} {g:.0f} GB/s" for c, g in lst[:5]), flush=True)
    down, gu = list(res["down"][0][0]), list(res["gate_up"][0][0])
    env = "MOESERVE_FP8_A8_TUNING" if a8 else "MOESERVE_FP8_TUNING"
    if bm >= 64:  # tuned at 64- (or prefill's 128-) row passes: those entries only
        best = {kernels.tuning_key("gate_up", bm): gu, kernels.tuning_key("down", bm): down}
    elif a8:  # 64-row passes: BK 128 (shared memory), with the best tiles' other choices
        best = {
            "gate_up": gu,
            "down": down,
            "gate_up_bm64": [gu[0], 128, *gu[2:]],
            "down_bm64": [down[0], 128, *down[2:]],
        }
    else:  # 64-row passes keep a BK of 64 (shared memory), with the best down tile's other choices
        best = {"gate_up": gu, "down": down, "down_bm64": [down[0], 64, *down[2:]]}
    print(f"{env}={json.dumps(best)}  # {bm} rows per pass", flush=True)
    return {kind: [[list(c), g] for c, g in lst] for kind, lst in res.items()} | {"block_m": bm, "best": best}


def _pow2(v: str, flag: str) -> int:
    """One tile size of --tune-bn / --tune-bk: a power of two from 16 to 256 (the bounds
    ``kernels.parse_tuning`` holds the tables to)."""
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 16 or n > 256 or n & (n - 1):
        raise ValueError(f"{flag}: {v!r} is not a power of two from 16 to 256")
    return n


def _stages(v: str) -> int:
    """One choice of --tune-stages: 1 to 8 (the bounds ``kernels.parse_tuning`` holds)."""
    if not v.isdigit() or not 1 <= int(v) <= 8:
        raise ValueError(f"--tune-stages: {v!r} is not a stage count from 1 to 8")
    return int(v)


def _block_m(v: str) -> int:
    """One choice of --block-m: 0 for auto (the step's own choice), or 16, 32, 64, or
    ``kernels.FP8_PREFILL_BM`` (W8A8's prefill passes; the other kernels take 64 there)."""
    if v == "auto":
        return 0
    allowed = kernels.expert_block_ms(prefill=True)
    if not v.isdigit() or int(v) not in allowed:
        raise ValueError(f"--block-m: {v!r} is not auto or one of {', '.join(map(str, allowed))}")
    return int(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="scout,ernie")
    p.add_argument("--tokens", default="64,256")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--layers", type=int, default=4, help="layers of weights cycled (L2 never holds one)")
    p.add_argument("--tune", action="store_true", help="time every candidate tiling of each kernel (256 tokens)")
    p.add_argument("--tune-kinds", default="bf16,fp8,w8a8", help="which kernels --tune sweeps (bf16,fp8,w8a8)")
    p.add_argument("--tune-bn", default=None, help="BN choices --tune sweeps, e.g. 128,256 (default: per kind)")
    p.add_argument("--tune-bk", default=None, help="BK choices --tune sweeps, e.g. 32,64 (default: per kind)")
    p.add_argument("--tune-stages", default=None, help="pipeline stages --tune sweeps, e.g. 3,4,6 (default: 3,4)")
    p.add_argument(
        "--block-m",
        default="auto",
        help="rows per pass, side by side: a comma list of auto (the step's choice) and 16, 32, 64, 128 "
        "(128: W8A8's prefill passes, the other kernels at 64)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also the kernels on FP8 codes of the same weights with per-channel and 128 x 128 block scales "
        "(bytes: codes and scales)",
    )
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "expert-kernel.json")
    )
    a = p.parse_args()
    try:
        bn, bk = (
            tuple(_pow2(v, flag) for v in arg.split(",")) if arg else None
            for arg, flag in ((a.tune_bn, "--tune-bn"), (a.tune_bk, "--tune-bk"))
        )
        stages = tuple(_stages(v) for v in a.tune_stages.split(",")) if a.tune_stages else None
        bms = [_block_m(v) for v in a.block_m.split(",")]
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the kernels are checked on CPU by tests/test_expert_kernels.py)")
    dev = torch.device("cuda")
    out = dict(
        command=" ".join(["python3"] + sys.argv),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        tuning=dict(kernels.EXPERT_TUNING),
        tuning_fp8=dict(kernels.EXPERT_TUNING_FP8),
        tuning_fp8_a8=dict(kernels.EXPERT_TUNING_FP8_A8),
        cases=[],
        tune={},
    )
    try:
        out["git"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            or None
        )
    except OSError:
        out["git"] = None
    print(
        f"{'shape':<7}{'tokens':>7}{'routing':>13}{'bm':>4}{'used':>6}{'GB':>7}{'grouped_mm ms':>15}{'GB/s':>7}"
        f"{'triton ms':>11}{'GB/s':>7}{'speedup':>9}{'max err':>9}"
    )
    first_outputs: dict[tuple, tuple[int, torch.Tensor]] = {}  # (shape, tokens, routing, kind) -> (bm, output)
    for name in a.shapes.split(","):
        sh = SHAPES[name]
        h, i, s, k = sh["hidden"], sh["inter"], sh["slots"], sh["top_k"]
        gu = [torch.randn(s, h, 2 * i, device=dev, dtype=torch.bfloat16) * h**-0.5 for _ in range(a.layers)]
        dn = [torch.randn(s, i, h, device=dev, dtype=torch.bfloat16) * i**-0.5 for _ in range(a.layers)]
        per_expert = (3 * h * i) * 2
        fp8 = {}
        if a.fp8:
            from moeserve.models.moe import ExpertQuant, ExpertSpec

            for label, blocks in (("fp8-channel", ((h, 1), (i, 1))), ("fp8-block128", ((128, 128), (128, 128)))):
                spec = ExpertSpec(h, i, dtype=torch.bfloat16, quant=ExpertQuant(*blocks))
                layers = []
                for j in range(a.layers):  # quantized from the bf16 layer, on the device, slot by slot
                    buf = torch.stack([spec.flat({"gate_up": gu[j][x], "down": dn[j][x]}) for x in range(s)])
                    layers.append(spec.views(buf))
                fp8[label] = (spec, blocks, layers)
        for tokens, skew, bm_choice in itertools.product(
            [int(t) for t in a.tokens.split(",")], ("uniform", "skew", "concentrated"), bms
        ):
            rng = np.random.default_rng(tokens * 7919 + ("uniform", "skew", "concentrated").index(skew))
            c = counts_for(rng, tokens, k, s, skew)  # the same counts for every rows-per-pass
            m = int(c.sum())
            gen = torch.Generator(device=dev).manual_seed(tokens * 7919 + len(skew))
            rows = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=gen)  # the same for every bm
            offs = torch.tensor(np.cumsum(c), dtype=torch.int32, device=dev)
            total = offs[-1:]
            used = int((c > 0).sum())
            nbytes = used * per_expert
            # the step's choice (store.expert_block_m_for), bf16 and FP8; a chosen pass of more than
            # kernels.EXPERT_MAX_BM rows (FP8_PREFILL_BM) is W8A8's alone, the others take 64
            cap = kernels.EXPERT_MAX_BM
            bm = min(bm_choice, cap) or expert_block_m_for(m, s, "triton")
            bm8 = min(bm_choice, cap) or expert_block_m_for(m, s, "triton", quantized=True)
            bm8a = bm_choice or expert_block_m_for(m, s, "triton", quantized=True, a8=True)

            def ref(j):
                g = torch._grouped_mm(rows, gu[j], offs=offs)
                return torch._grouped_mm(kernels.silu_mul(g, total), dn[j], offs=offs)

            def tri(j):
                return kernels.expert_mlp(rows, gu[j], dn[j], offs, bm)

            out16 = tri(0)
            err = float((ref(0).float() - out16.float()).abs().max())
            first16 = first_outputs.setdefault((name, tokens, skew, "bf16"), (bm, out16))
            t_ref, t_tri = time_fn(ref, a.iters, a.layers), time_fn(tri, a.iters, a.layers)
            fp8_rows = {}
            for (label, (spec8, blocks, layers8)), a8 in itertools.product(fp8.items(), (False, True)):

                def q8(j, layers8=layers8, blocks=blocks, a8=a8):
                    w = layers8[j]
                    sc = kernels.ExpertScales(w["gate_up_scale"], blocks[0], w["down_scale"], blocks[1], a8)
                    return kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, bm8a if a8 else bm8, sc)

                t8 = time_fn(q8, a.iters, a.layers)
                b8 = used * spec8.nbytes
                out8 = q8(0)
                rel = float((out8.float() - ref(0).float()).norm() / ref(0).float().norm())
                lb = label + ("-w8a8" if a8 else "")
                # every row's output bitwise as at the first rows-per-pass of this case (W8A8 must be:
                # a step's rows per pass depends on the slot count, EPLB on or off)
                bm_used = bm8a if a8 else bm8
                first = first_outputs.setdefault((name, tokens, skew, lb), (bm_used, out8))
                fp8_rows[lb] = dict(
                    s=t8,
                    bytes=b8,
                    GBps=b8 / t8 / 1e9,
                    over_bf16_triton=t8 / t_tri,
                    rel_err=rel,
                    block_m=bm_used,
                    same_as_bm=first[0],
                    bitwise_same=bool(torch.equal(first[1], out8)),
                )
            row = dict(
                shape=name,
                tokens=tokens,
                skew=skew,
                top_k=k,
                slots=s,
                used_slots=used,
                rows=m,
                block_m=bm,
                bytes=nbytes,
                grouped_mm_s=t_ref,
                triton_s=t_tri,
                grouped_mm_GBps=nbytes / t_ref / 1e9,
                triton_GBps=nbytes / t_tri / 1e9,
                speedup=t_ref / t_tri,
                max_abs_diff=err,
                same_as_bm=first16[0],
                bitwise_same=bool(torch.equal(first16[1], out16)),
                fp8=fp8_rows,
            )
            out["cases"].append(row)
            print(
                f"{name:<7}{tokens:>7}{skew:>13}{bm:>4}{used:>6}{nbytes / 1e9:>7.2f}{1e3 * t_ref:>15.3f}"
                f"{row['grouped_mm_GBps']:>7.0f}{1e3 * t_tri:>11.3f}{row['triton_GBps']:>7.0f}"
                f"{row['speedup']:>9.2f}{err:>9.3g}"
                + ("" if row["bitwise_same"] else f" (NOT bitwise as at bm{first16[0]})")
                + "".join(
                    f"  {lb} bm{f['block_m']} {1e3 * f['s']:.3f} ms {f['GBps']:.0f} GB/s x{f['over_bf16_triton']:.2f}"
                    f" err {f['rel_err']:.1e}"
                    + ("" if f["bitwise_same"] else f" NOT bitwise as at bm{f['same_as_bm']}")
                    for lb, f in fp8_rows.items()
                )
            )
            if (
                a.tune
                and "bf16" in a.tune_kinds
                and tokens == max(int(t) for t in a.tokens.split(","))
                and skew == "uniform"
                and bm_choice == bms[0]
            ):
                h_in = kernels.expert_gate_up(rows, gu[0], offs, bm)
                res = {"gate_up": [], "down": []}
                for cand in candidates("bf16", bn, bk, stages):
                    try:
                        t1 = time_fn(lambda j: kernels.expert_gate_up(rows, gu[j], offs, bm, cand), 10, a.layers)
                        t2 = time_fn(lambda j: kernels.expert_down(h_in, dn[j], offs, bm, cand), 10, a.layers)
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile
                        print(f"  {cand}: {type(e).__name__}")
                        continue
                    res["gate_up"].append((cand, used * 2 * h * i * 2 / t1 / 1e9))
                    res["down"].append((cand, used * h * i * 2 / t2 / 1e9))
                for kind, lst in res.items():
                    lst.sort(key=lambda x: -x[1])
                    print(f"  tune {name} {kind}: " + ", ".join(f"{c} {g:.0f} GB/s" for c, g in lst[:5]))
                best = {kernels.tuning_key(kind, bm): list(lst[0][0]) for kind, lst in res.items() if lst}
                print(f"MOESERVE_EXPERT_TUNING={json.dumps(best)}  # {name}, {bm} rows per pass", flush=True)
                out["tune"][name] = {kind: [[list(c), g] for c, g in lst] for kind, lst in res.items()} | {
                    "block_m": bm,
                    "best": best,
                }
            if (
                a.tune
                and fp8
                and tokens == max(int(t) for t in a.tokens.split(","))
                and skew == "uniform"
                and bm_choice == bms[0]
            ):
                if "fp8" in a.tune_kinds.split(","):
                    out["tune"][f"{name}-fp8"] = tune_fp8(
                        fp8["fp8-channel"], rows, offs, bm8, used, h, i, a.layers, bn=bn, bk=bk, stages=stages
                    )
                if "w8a8" in a.tune_kinds.split(","):
                    out["tune"][f"{name}-fp8-w8a8"] = tune_fp8(
                        fp8["fp8-channel"], rows, offs, bm8a, used, h, i, a.layers, a8=True, bn=bn, bk=bk, stages=stages
                    )
        gu = dn = []  # free the device memory before the next shape
        fp8 = {}
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"elapsed {time.time() - t0:.0f} s")
