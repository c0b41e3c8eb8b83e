#!/usr/bin/env python3
"""Fit the step-time model of one MoE layer on one worker (``moeserve.balancer.policy.cost``).

    python benchmarks/calibrate.py [--shape NAME=H,I ...] [--out FILE] [--repeats N] [--smoke]

Measures, on the current device (CUDA when present, else the CPU):
  - a copy of a large buffer (device to device): the HBM rate (bytes read + written / s);
  - the grouped matmul of one layer, as a worker runs it (``expert_worker/store.py``): for bf16
    on CUDA the kernel ``expert_block_m_for`` picks (the Triton decode kernels of
    ``moeserve.kernels.expert_mlp`` at <= 64 pairs per slot on average, else
    ``torch._grouped_mm``, gate_up then down); elsewhere a loop of matmuls over slots; at a grid
    of (busy slots, pairs per slot).
Then fits, per shape, time = layer_overhead + slot_overhead * busy + max(busy * expert_bytes /
hbm, pairs * flops_per_pair / matmul) by least squares over the grid (the HBM rate from the
copy as a starting point, the matmul rate from the largest-pairs rows), prints a table of
measured vs predicted and writes the JSON table ``policy/cost.py`` loads.

``--smoke`` runs tiny shapes and a short grid on whatever device there is, so a test can check
the plumbing on a CPU; its table says so in ``measured_on`` and ``note``. A table made on a CPU
is an example of the format, never a GPU's parameters.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moeserve import kernels  # noqa: E402
from moeserve.balancer.policy.cost import FORMAT, StepModel, parse_table  # noqa: E402
from moeserve.expert_worker.store import expert_block_m_for  # noqa: E402

SHAPES = {  # name: hidden, intermediate (per expert)
    "llama4-scout": (5120, 8192),
    "ernie45-21b": (2560, 1536),
    "deepseek-v3": (7168, 2048),
}
SMOKE_SHAPES = {"smoke-tiny": (64, 128)}


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(torch, device, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    _sync(torch, device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def copy_rate(torch, device, nbytes: int, repeats: int) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(torch, device, lambda: dst.copy_(src), repeats)


def grouped_layer(torch, device, dtype, hidden: int, inter: int, slots: int):
    """Weights of ``slots`` experts laid out as the store keeps them, and a function running
    ``pairs`` rows per slot through the first ``busy`` of them."""
    gate_up = torch.randn(slots, hidden, 2 * inter, dtype=dtype, device=device) * 0.02
    down = torch.randn(slots, inter, hidden, dtype=dtype, device=device) * 0.02
    grouped = device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    def make(busy: int, pairs: int):
        x = torch.randn(busy * pairs, hidden, dtype=dtype, device=device)
        if grouped:
            offs = torch.arange(1, busy + 1, dtype=torch.int32, device=device) * pairs
            # the kernel a worker picks for this step (ExpertStore.set_step_pairs): the Triton
            # decode kernels at few rows per slot, torch._grouped_mm above
            block_m = expert_block_m_for(busy * pairs, slots)
            if block_m:

                def run():
                    return kernels.expert_mlp(x, gate_up[:busy], down[:busy], offs, block_m)

                return run

            def run():
                gu = torch._grouped_mm(x, gate_up[:busy], offs=offs)
                h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
                return torch._grouped_mm(h, down[:busy], offs=offs)
        else:

            def run():
                outs = []
                for j in range(busy):
                    gu = x[j * pairs : (j + 1) * pairs] @ gate_up[j]
                    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
                    outs.append(h @ down[j])
                return torch.cat(outs)

        return run

    return make, (
        "Triton decode kernels at <= 64 pairs per slot, else torch._grouped_mm" if grouped else "matmul loop over slots"
    )


def fit(rows: list[dict], expert_bytes: int, flops_per_pair: float, hbm0: float) -> dict:
    """Least-squares fit of the model to ``rows`` (busy, pairs, seconds): a small grid search over
    the two rates around their first guesses, the two overheads solved linearly for each."""
    busy = np.array([r["busy"] for r in rows], dtype=np.float64)
    pairs = np.array([r["busy"] * r["pairs_per_slot"] for r in rows], dtype=np.float64)
    t = np.array([r["seconds"] for r in rows])
    big = pairs >= np.quantile(pairs, 0.75)
    mm0 = float(np.median(pairs[big] * flops_per_pair / t[big]))
    best = None
    for hbm in hbm0 * np.geomspace(0.25, 2.0, 25):
        for mm in mm0 * np.geomspace(0.5, 4.0, 25):
            bound = np.maximum(busy * expert_bytes / hbm, pairs * flops_per_pair / mm)
            a = np.stack([np.ones_like(busy), busy], 1)
            coef, *_ = np.linalg.lstsq(a, t - bound, rcond=None)
            coef = np.maximum(coef, 0.0)
            pred = a @ coef + bound
            err = float(np.mean(((pred - t) / t) ** 2))
            if best is None or err < best[0]:
                best = (err, hbm, mm, float(coef[0]), float(coef[1]))
    err, hbm, mm, layer_over, slot_over = best
    return {
        "hbm_bytes_per_s": hbm,
        "matmul_flops_per_s": mm,
        "layer_overhead_s": layer_over,
        "slot_overhead_s": slot_over,
        "rms_relative_error": float(np.sqrt(err)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        help="NAME=HIDDEN,INTERMEDIATE (repeatable); default: " + ", ".join(SHAPES),
    )
    ap.add_argument("--slots", type=int, default=16, help="slots of the layer (the most that are busy)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--copy-mb", type=int, default=1024, help="size of the copy benchmark's buffer")
    ap.add_argument(
        "--out", default=None, help="where to write the table (default: benchmarks/results/step_model_<device>.json)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and grid: a test of the plumbing")
    a = ap.parse_args(argv)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_bytes = 2 if dtype == torch.bfloat16 else 4
    shapes = dict(SMOKE_SHAPES) if a.smoke else {}
    for spec in a.shape:
        try:
            name, dims = spec.split("=")
            h, i = (int(v) for v in dims.split(","))
        except ValueError:
            ap.error(f"--shape {spec!r}: expected NAME=HIDDEN,INTERMEDIATE, e.g. llama4-scout=5120,8192")
        shapes[name] = (h, i)
    if not shapes:
        shapes = dict(SHAPES)
    slots = min(a.slots, 4) if a.smoke else a.slots
    repeats = min(a.repeats, 3) if a.smoke else a.repeats
    busy_grid = sorted({1, max(1, slots // 4), max(1, slots // 2), slots})
    pairs_grid = [1, 4, 16] if a.smoke else [1, 4, 16, 64, 256, 1024]
    copy_bytes = (4 << 20) if a.smoke else a.copy_mb << 20

    hbm = copy_rate(torch, device, copy_bytes, repeats)
    print(
        f"device: {gpu}; dtype {str(dtype).removeprefix('torch.')}; copy rate {hbm / 1e9:.1f} GB/s "
        f"(read + written, {copy_bytes >> 20} MiB)"
    )
    entries, fits, all_rows = [], {}, []
    for name, (h, i) in shapes.items():
        make, how = grouped_layer(torch, device, dtype, h, i, slots)
        rows = []
        for busy in busy_grid:
            for pps in pairs_grid:
                sec = _time(torch, device, make(busy, pps), repeats)
                rows.append({"shape": name, "busy": busy, "pairs_per_slot": pps, "seconds": sec})
        model0 = StepModel(gpu, name, h, i, dtype_bytes, 1.0, 1.0, 0.0)
        f = fit(rows, model0.expert_bytes, model0.flops_per_pair, hbm)
        m = StepModel(
            gpu,
            name,
            h,
            i,
            dtype_bytes,
            f["hbm_bytes_per_s"],
            f["matmul_flops_per_s"],
            f["slot_overhead_s"],
            f["layer_overhead_s"],
        )
        entries.append(m.to_entry())
        fits[name] = {"kernel": how, "rms_relative_error": f["rms_relative_error"]}
        print(
            f"\n{name} (H={h}, I={i}, {how}): HBM {m.hbm_bytes_per_s / 1e9:.1f} GB/s, matmul "
            f"{m.matmul_flops_per_s / 1e12:.2f} TFLOP/s, per slot {m.slot_overhead_s * 1e6:.2f} us, per layer "
            f"{m.layer_overhead_s * 1e6:.2f} us; rms relative error {f['rms_relative_error']:.3f}"
        )
        print(f"{'busy':>5s} {'pairs/slot':>10s} {'measured us':>12s} {'model us':>10s}")
        for r in rows:
            pred = float(m.time(r["busy"], r["busy"] * r["pairs_per_slot"]))
            r["predicted"] = pred
            print(f"{r['busy']:5d} {r['pairs_per_slot']:10d} {r['seconds'] * 1e6:12.1f} {pred * 1e6:10.1f}")
        all_rows += rows

    cmd = "python benchmarks/calibrate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = {
        "format": FORMAT,
        "measured_on": gpu,
        "command": cmd.strip(),
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": (
            "SMOKE RUN: tiny shapes, a test of the plumbing; not a model of any GPU"
            if a.smoke
            else (
                "measured on a CPU: an example of the format, NOT a GPU's parameters"
                if device.type != "cuda"
                else "grouped-matmul microbenchmark; copy rate as the HBM starting point"
            )
        ),
        "fit": fits,
        "rows": all_rows,
        "entries": entries,
    }
    parse_table(table)  # what we write must load
    out = (
        Path(a.out)
        if a.out
        else ROOT
        / "benchmarks"
        / "results"
        / (f"step_model_{'smoke' if a.smoke else ('cpu' if device.type != 'cuda' else 'gpu')}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
