#!/usr/bin/env python3
"""Router-side FP8 linear layers (shared experts, dense MLPs) side by side in one run, timed as a
served step runs them: inside a CUDA graph (launch overhead excluded, as graph replay does).

    python3 benchmarks/fp8_linears.py                      # 1 GPU: ERNIE's and Scout's shapes
    python3 benchmarks/fp8_linears.py --rows 64,256 --shapes ernie_shared_gu

Variants of y = x @ W.T for a weight [N, K] with one float32 scale per output channel:

- ``bf16``: ``F.linear`` on the dequantized bf16 weight (cuBLAS), the baseline;
- ``fp8-wo``: ``kernels.fp8_linear`` weight-only (the grouped expert kernel with one slot, codes
  converted to bf16 in registers): what a QuantLinear runs by default;
- ``fp8-a8-triton``: the same with the rows quantized per row first, products on FP8 tensor cores;
- ``fp8-a8-cublas``: ``kernels.fp8_scaled_linear``: the rows quantized per row, then cuBLAS's FP8
  GEMM with row-wise scales (``torch._scaled_mm``): what a QuantLinear runs with W8A8 on;
- ``quant-rows``: the per-row quantization alone (part of both W8A8 variants).

Each call is captured ``--reps`` times into one CUDA graph, cycling ``--copies`` weights so that
L2 never holds one; time = the graph's replay / reps (median of ``--iters``). GB/s counts the
weight bytes read (bf16: 2 per weight; FP8: 1 per weight + the scales). Error: relative L2
against x @ W.T in fp32 on the dequantized weights. Prints a table and writes JSON (``--json``,
default benchmarks/results/fp8-linears.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moeserve import kernels  # noqa: E402
from moeserve.models.quant import QuantLinear, quantize  # noqa: E402

SHAPES = {  # name: (K, N) of x [M, K] @ W [N, K].T
    "ernie_shared_gu": (2560, 3072),  # ERNIE-4.5-21B-A3B: 2 shared experts of 1536, gate or up
    "ernie_shared_down": (3072, 2560),
    "ernie_dense_gu": (2560, 12288),  # its first layer's dense MLP
    "ernie_dense_down": (12288, 2560),
    "scout_shared_gu": (5120, 8192),  # Llama 4 Scout's shared expert, gate or up
    "scout_shared_down": (8192, 5120),
    "ernie_shared_gate_up": (2560, 6144),  # gate and up merged (moeserve.models.layers.merge_linears)
    "scout_shared_gate_up": (5120, 16384),
}
VARIANTS = ("bf16", "fp8-wo", "fp8-a8-triton", "fp8-a8-cublas", "quant-rows")


def graph_time(fn, reps: int, iters: int) -> float:
    """Seconds per call of fn(i) (i = 0 .. reps-1), replayed from one CUDA graph of reps calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / reps)
    return float(np.median(ts))


def add_graph_args(p: argparse.ArgumentParser, json_name: str, copies_help: str | None = None) -> None:
    """The options of a benchmark timed with ``graph_time``: --copies, --reps, --iters, --json."""
    p.add_argument("--copies", type=int, default=4, help=copies_help)
    p.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", json_name))


def graph_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[int]:
    """Check ``add_graph_args``' options and parse --rows (a comma list of 1 .. 65536): the rows."""
    for flag in ("copies", "reps", "iters"):
        if not 1 <= getattr(a, flag) <= 1000:
            p.error(f"--{flag} must be 1 .. 1000, got {getattr(a, flag)}")
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be a comma list of integers, got {a.rows!r}")
    if not all(1 <= r <= 65536 for r in rows):
        p.error(f"--rows must each be 1 .. 65536, got {a.rows}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="16,64,256,512,2048")
    p.add_argument("--variants", default=",".join(VARIANTS))
    add_graph_args(p, "fp8-linears.json", "weights cycled (L2 never holds one)")
    a = p.parse_args()
    rows = graph_args(p, a)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}: allowed {', '.join(VARIANTS)}")
    shapes = a.shapes.split(",")
    unknown = [sh for sh in shapes if sh not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}: allowed {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = dict(command=" ".join(["python3"] + sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    out["cases"] = []
    head = f"{'shape':<19}{'rows':>6}" + "".join(f"{v + ' us':>17}" for v in variants) + f"{'best fp8/bf16':>15}"
    print(head)
    for name in shapes:
        k, n = SHAPES[name]
        w16, lins = [], []
        for _ in range(a.copies):
            w = torch.randn(n, k, device=dev) * k**-0.5
            codes, scale = quantize(w, (1, k))  # one scale per output channel
            lin = QuantLinear(codes, scale, (1, k))
            w16.append(lin.weight(torch.bfloat16))
            lins.append(lin.prepared())
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ lins[0].weight(torch.float32).T
            c = a.copies
            calls = {
                "bf16": lambda i: torch.nn.functional.linear(x, w16[i % c]),
                "fp8-wo": lambda i: kernels.fp8_linear(x, lins[i % c].codes_kn(), lins[i % c].scale_kn(), (k, 1)),
                "fp8-a8-triton": lambda i: kernels.fp8_linear(
                    x, lins[i % c].codes_kn(), lins[i % c].scale_kn(), (k, 1), True
                ),
                "fp8-a8-cublas": lambda i: kernels.fp8_scaled_linear(
                    x, lins[i % c].codes_kn(), lins[i % c].scale_row()
                ),
                "quant-rows": lambda i: kernels.quant_rows(x),
            }
            case = dict(shape=name, K=k, N=n, rows=m)
            line = f"{name:<19}{m:>6}"
            for v in variants:
                t = graph_time(calls[v], a.reps, a.iters)
                nbytes = 2 * k * n if v == "bf16" else (0 if v == "quant-rows" else k * n + 4 * n)
                r = dict(us=t * 1e6, GBps=nbytes / t / 1e9 if nbytes else None)
                if v != "quant-rows":
                    y = calls[v](0).float()
                    r["rel_err"] = float((y - ref).norm() / ref.norm())
                case[v] = r
                line += f"{t * 1e6:>10.1f}" + (f" {r['GBps']:>5.0f}GB" if nbytes else " " * 8)
            fp8 = [case[v]["us"] for v in variants if v.startswith("fp8")]
            if "bf16" in case and fp8:
                case["best_fp8_over_bf16"] = min(fp8) / case["bf16"]["us"]
                line += f"{case['best_fp8_over_bf16']:>15.2f}"
            print(line, flush=True)
            out["cases"].append(case)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
