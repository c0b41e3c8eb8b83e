#!/usr/bin/env python3
"""The router's fused small kernels (norms and RoPE, moeserve/kernels/triton_norms.py; the MLP
activation, ``kernels.silu_mul``) against the torch sequences they replace, side by side in one
run on one GPU: time per call at serving shapes, and agreement.

    python3 benchmarks/norm_kernels.py                      # 1 GPU, every case and model
    python3 benchmarks/norm_kernels.py --rows 256 --cases qwen3_qk,scout_residual

Cases (``--cases``), each timed inside a CUDA graph (launch overhead excluded, as graph replay
does) with the torch path (``kernels.NORM_DEVICES = ()``) and the fused kernel:

- ``<shape>_residual``: h + delta, then the RMS norm of the sum with a bf16 weight (every layer
  of every family twice: after attention and after the MLP);
- ``qwen3_qk``: Qwen3's q_norm / k_norm then rotate-half RoPE on q [T, 32, 128] and k [T, 4, 128];
- ``scout_qk``: Llama 4's interleaved RoPE then its weightless qk-norm on q [T, 40, 128] and k [T, 8, 128];
- ``ernie_qk``: ERNIE's interleaved RoPE on q [T, 20, 128] and k [T, 4, 128];
- ``<shape>_silu``: silu(gate) * up of a shared expert's merged gate_up output [T, 2F] (ERNIE's
  two shared experts F 3,072; Scout's F 8,192), against ``F.silu(g) * u`` on its strided halves;
- ``<shape>_silu_quant``: the same activation quantized per row for a W8A8 down projection,
  ``kernels.silu_mul_quant`` (one launch, h never written) against ``quant_rows(silu_mul(gu))``
  (the two launches it replaces) in the torch column; bf16 only; the codes and scales must be
  bit-identical (exit 1 otherwise);
- ``ernie_expert_silu``: a worker's activation between a bf16 step's two ``torch._grouped_mm``
  (ERNIE's I 1,536: gu [C, 3,072] for C = 8,192 x 8 rows of buffer, the first ``--rows`` x 8
  below the device total): the served fixed grid (``kernels.ROW_PROGRAMS`` programs
  striding over the rows) in the fused column, and in the torch column the same kernel with one
  program per buffer row (the grid before), so both columns compute the same values;
- ``<shape>_gate``: an fp32 gate of bf16 rows and its routing, ``MoEBlock.route`` (ERNIE's H
  2,560 x E 64, top-6 by the fused routing kernel; DeepSeek-V3's 7,168 x 256, top-8 of 4 groups,
  on the fused side by the fused kernel too, see ``dsv3_route``): the weight's three bf16 parts in one tensor-core GEMM
  (``kernels.gate_parts``) against ``x.float()`` and cuBLAS's fp32 GEMM; bf16 rows only (fp32
  rows keep the fp32 GEMM); agreement over the chosen ids and their weights;
- ``dsv3_route``: DeepSeek-V3's group-limited routing of fp32 logits [T, 256] (8 groups, the
  best 4, top-8) by the fused routing kernel (on by default; on here whatever ``MOESERVE_FUSED_GROUPED_ROUTING`` says)
  against torch's sequence.

Agreement: the share of output elements bit-identical to the torch path and the largest
difference relative to the largest value (a bf16 step is 2^-8 of a value: 3.9e-3). Then whole
models (``--models``): tiny random fp32 checkpoints of each family (moeserve init-model) on the
GPU, the kernels taking fp32 here (serving leaves fp32 to torch's sequences,
``kernels.NORM_DTYPES``), the logits of a 2 x 24-token batch with the torch path and with the
fused kernels: max |dlogit| (the fp32 contract is 1e-4); and whether each kernel is batch
invariant (rows of a 256-row launch bit-identical to the same rows launched alone or in
slices). Prints a table and writes JSON (``--json``, default
benchmarks/results/norm-kernels.json); exits 1 when an fp32 case or model breaks its tolerance
or a kernel is not batch invariant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_linears import add_graph_args, graph_args, graph_time  # noqa: E402
from servinglib.shapes import DSV3_7, ERNIE28  # noqa: E402

from moeserve import kernels  # noqa: E402
from moeserve.models import init_model, layers, load_model  # noqa: E402
from moeserve.models.config import RopeConfig, RoutingSpec, parse_config  # noqa: E402
from moeserve.models.routing import MoEBlock, route  # noqa: E402

HIDDEN = {"scout": 5120, "ernie": 2560, "qwen3": 2048}
QK = {  # name: (q heads, kv heads, head dim, interleaved, pre-norm, post-norm)
    "qwen3_qk": (32, 4, 128, False, True, False),
    "scout_qk": (40, 8, 128, True, False, True),
    "ernie_qk": (20, 4, 128, True, False, False),
}
SILU = {"ernie_silu": 2 * 3072, "scout_silu": 2 * 8192}  # merged gate_up widths of the shared experts
SILU_QUANT = {f"{k}_quant": w for k, w in SILU.items()}  # the same before a W8A8 down projection
EXPERT_SILU = {"ernie_expert_silu": (2 * 1536, 8, 8192 * 8)}  # (2I, top-k, buffer rows) of a worker's step


def _gate(config: dict) -> tuple[int, int, int, RoutingSpec]:
    """(H, E, K, routing) of a published config's fp32 gate, as the model reads it."""
    cfg = parse_config(config)
    return cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.routing


GATES = {"ernie_gate": _gate(ERNIE28), "dsv3_gate": _gate(DSV3_7)}  # (H, E, K, routing) of fp32 gates
ROUTES = {"dsv3_route": "dsv3_gate"}  # routing alone: the gate whose routing (E, K, spec) it times
CASES = (
    tuple(f"{s}_residual" for s in HIDDEN)
    + tuple(QK)
    + tuple(SILU)
    + tuple(SILU_QUANT)
    + tuple(EXPERT_SILU)
    + tuple(GATES)
    + tuple(ROUTES)
)
MODELS = ("llama4", "ernie45", "qwen3_moe", "mixtral", "gpt_oss")
FP32_CASE_RTOL = 1e-5
FP32_LOGITS_ATOL = 1e-4


class TorchPath:
    """Within it, the models' norms and RoPE take the torch path and fp32 gates the fp32 GEMM
    (no device takes the kernels or the gate's parts)."""

    def __enter__(self):
        self.saved = kernels.NORM_DEVICES, kernels.GATE_SPLIT_DEVICES, kernels.GROUPED_ROUTING_DEVICES
        kernels.NORM_DEVICES = kernels.GATE_SPLIT_DEVICES = kernels.GROUPED_ROUTING_DEVICES = ()

    def __exit__(self, *exc):
        kernels.NORM_DEVICES, kernels.GATE_SPLIT_DEVICES, kernels.GROUPED_ROUTING_DEVICES = self.saved


def case_fn(name: str, rows: int, dtype: torch.dtype, dev: torch.device, copies: int):
    """fn(i) running the case on inputs i % copies (L2 never holds them all), and its output of copy 0."""
    g = torch.Generator(device=dev).manual_seed(rows)
    if name in SILU:
        w2 = SILU[name]
        gus = [torch.randn(rows, w2, device=dev, generator=g).to(dtype) * 3 for _ in range(copies)]
        return lambda i: layers.silu_mul(gus[i % copies]), rows * w2 * 3 // 2
    if name in SILU_QUANT:
        w2 = SILU_QUANT[name]
        gus = [torch.randn(rows, w2, device=dev, generator=g).to(dtype) * 3 for _ in range(copies)]

        def silu_quant(i):
            if kernels.NORM_DEVICES == ():  # the torch column (TorchPath): the two launches
                q, sc = kernels.quant_rows(kernels.silu_mul(gus[i % copies]))
            else:
                q, sc = kernels.silu_mul_quant(gus[i % copies])
            return q.view(torch.uint8).float(), sc

        return silu_quant, rows * w2 * 3 // 4  # in bf16 units: read gu, write one byte per h
    if name in EXPERT_SILU:
        w2, k, capacity = EXPERT_SILU[name]
        total = torch.tensor([rows * k], dtype=torch.int32, device=dev)
        bufs = [torch.randn(capacity, w2, device=dev, generator=g).to(dtype) * 3 for _ in range(copies)]

        def expert_silu(i):
            before = kernels.NORM_DEVICES == ()  # the torch column (TorchPath): a program per buffer row
            return kernels.silu_mul(bufs[i % copies], total, capacity if before else None)[: rows * k]

        return expert_silu, rows * k * w2 * 3 // 2
    if name in ROUTES:
        _, e, k, spec = GATES[ROUTES[name]]
        logits = [torch.randn(rows, e, device=dev, generator=g) for _ in range(copies)]
        bias = torch.randn(e, device=dev, generator=g) * 0.05

        def routing(i):
            r = route(spec, logits[i % copies], k, bias, dtype)
            return r.ids.float(), r.weights.float()

        return routing, rows * e * 2  # in bf16 units: the fp32 logits
    if name in GATES:
        h, e, k, spec = GATES[name]
        xs = [torch.randn(rows, h, device=dev, generator=g).to(dtype) for _ in range(copies)]
        w = torch.randn(e, h, device=dev, generator=g) * h**-0.5
        block = MoEBlock(spec, k, w, correction_bias=torch.randn(e, device=dev, generator=g) * 0.05)
        if block.gate_parts is None:
            raise SystemExit(f"{name}: this GPU's torch gives no fp32 output of a bf16 GEMM (mm.dtype)")

        def gate(i):
            r = block.route(xs[i % copies])
            return r.ids.float(), r.weights.float()

        return gate, rows * h + e * h * 3  # in bf16 units: x, the three parts
    if name.endswith("_residual"):
        h = HIDDEN[name.split("_")[0]]
        xs = [torch.randn(rows, h, device=dev, generator=g).to(dtype) for _ in range(copies)]
        ds = [torch.randn(rows, h, device=dev, generator=g).to(dtype) for _ in range(copies)]
        w = (1 + 0.3 * torch.randn(h, device=dev, generator=g)).to(dtype)
        return lambda i: layers.add_rms_norm(xs[i % copies], ds[i % copies], w, 1e-5), h * rows * 2
    hq, hkv, d, interleaved, pre, post = QK[name]
    att = layers.Attention.__new__(layers.Attention)  # only the q/k transforms are used
    att.q_norm = (1 + 0.3 * torch.randn(d, device=dev, generator=g)).to(dtype) if pre else None
    att.k_norm = (1 + 0.3 * torch.randn(d, device=dev, generator=g)).to(dtype) if pre else None
    att.use_rope, att.qk_norm, att.interleaved, att.eps, att.head_dim = True, post, interleaved, 1e-6, d
    inv = layers.rope_inv_freq(d, RopeConfig(theta=500000.0)).to(dev)
    rope = layers.rope_cos_sin(torch.randint(0, 8192, (rows,), device=dev, generator=g), inv)
    qs = [torch.randn(rows, hq, d, device=dev, generator=g).to(dtype) for _ in range(copies)]
    ks = [torch.randn(rows, hkv, d, device=dev, generator=g).to(dtype) for _ in range(copies)]

    def fn(i):
        return att._heads(qs[i % copies], att.q_norm, rope), att._heads(ks[i % copies], att.k_norm, rope)

    return fn, rows * (hq + hkv) * d


def agreement(got, ref) -> dict:
    got = torch.cat([t.reshape(-1) for t in got]) if isinstance(got, tuple) else got.reshape(-1)
    ref = torch.cat([t.reshape(-1) for t in ref]) if isinstance(ref, tuple) else ref.reshape(-1)
    rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
    return dict(bit_identical=(got == ref).float().mean().item(), max_rel=rel)


def invariant(dtype: torch.dtype, dev: torch.device) -> dict:
    """Whether each fused kernel's rows are batch invariant on this GPU: rows of a 256-row launch
    against the same rows launched alone and in slices (bit for bit), per kernel."""
    g = torch.Generator(device=dev).manual_seed(7)
    out = {}
    for h in sorted(set(HIDDEN.values())):
        x, d = (torch.randn(256, h, device=dev, generator=g).to(dtype) for _ in range(2))
        w = (1 + 0.3 * torch.randn(h, device=dev, generator=g)).to(dtype)
        y, s = kernels.rms_norm(x, w, 1e-5, residual=d)
        ok = True
        for lo, hi in ((0, 1), (100, 101), (7, 40), (255, 256)):
            y1, s1 = kernels.rms_norm(x[lo:hi].clone(), w, 1e-5, residual=d[lo:hi].clone())
            ok &= torch.equal(y1, y[lo:hi]) and torch.equal(s1, s[lo:hi])
        out[f"rms_norm_h{h}"] = ok
    for name, (hq, _, dh, interleaved, pre, post) in QK.items():
        x = torch.randn(256, hq, dh, device=dev, generator=g).to(dtype)
        w = (1 + 0.3 * torch.randn(dh, device=dev, generator=g)).to(dtype) if pre else None
        inv = layers.rope_inv_freq(dh, RopeConfig(theta=500000.0)).to(dev)
        cos, sin = layers.rope_cos_sin(torch.randint(0, 8192, (256,), device=dev, generator=g), inv)
        y = kernels.head_rope(x, cos, sin, interleaved, 1e-6, pre_weight=w, post_norm=post)
        ok = True
        for lo, hi in ((0, 1), (100, 101), (7, 40), (255, 256)):
            y1 = kernels.head_rope(x[lo:hi].clone(), cos[lo:hi].clone(), sin[lo:hi].clone(), interleaved, 1e-6, w, post)
            ok &= torch.equal(y1, y[lo:hi])
        out[name] = ok
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rows", default="64,256,2048")
    p.add_argument("--models", default=",".join(MODELS), help="tiny fp32 models checked whole ('' for none)")
    add_graph_args(p, "norm-kernels.json", "inputs cycled (L2 never holds them)")
    a = p.parse_args()
    rows = graph_args(p, a)
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown cases {bad}: allowed {', '.join(CASES)}")
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"unknown models {bad}: allowed {', '.join(MODELS)}")
    if not torch.cuda.is_available() or not kernels.available():
        p.error("needs a CUDA device and Triton")
    dev = torch.device("cuda")
    # fp32 serves through torch's sequences (kernels.NORM_DTYPES): here the kernels are measured
    # in fp32 too, against those sequences.
    kernels.NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
    # DeepSeek-V3's grouped routing takes the fused kernel unless MOESERVE_FUSED_GROUPED_ROUTING=0:
    # here it is on whatever the switch says, against torch's sequence (TorchPath).
    kernels.GROUPED_ROUTING_DEVICES = ("cuda",)
    out = dict(command=" ".join(["python3"] + sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    out["cases"], out["models"], failed = [], [], []
    print(f"{'case':<17}{'rows':>6}{'dtype':>6}{'torch us':>10}{'fused us':>10}{'speed-up':>9}{'GB/s':>7}  agreement")
    for name in cases:
        for m in rows:
            for dtype in (torch.bfloat16, torch.float32):
                if (name in GATES or name in ROUTES or name in SILU_QUANT) and dtype == torch.float32:
                    continue  # fp32 rows keep the fp32 GEMM (the exactness mode); routing: fp32 logits; W8A8: bf16
                fn, elems = case_fn(name, m, dtype, dev, a.copies)
                with TorchPath():
                    t_torch = graph_time(fn, a.reps, a.iters)
                    ref = fn(0)
                t_fused = graph_time(fn, a.reps, a.iters)
                got = fn(0)
                if name.endswith("_residual") or name in GATES or name in ROUTES or name in SILU_QUANT:  # pairs
                    got, ref = (got[0], got[1]), (ref[0], ref[1])
                agree = agreement(got, ref)
                # bytes moved by the fused kernel: read x (and delta), write y (and the sum)
                moved = elems * dtype.itemsize * (4 if name.endswith("_residual") else 1)
                dname = "bf16" if dtype == torch.bfloat16 else "fp32"
                row = dict(case=name, rows=m, dtype=dname, torch_s=t_torch, fused_s=t_fused, **agree)
                row["fused_GBps"] = moved / t_fused / 1e9
                out["cases"].append(row)
                if name in SILU_QUANT and agree["bit_identical"] < 1:
                    failed.append(f"{name} rows {m}: codes or scales differ from quant_rows(silu_mul(gu))")
                if dtype == torch.float32 and agree["max_rel"] > FP32_CASE_RTOL:
                    failed.append(f"{name} rows {m} fp32: max relative difference {agree['max_rel']:.2e}")
                print(
                    f"{name:<17}{m:>6}{dname:>6}{t_torch * 1e6:>10.1f}{t_fused * 1e6:>10.1f}{t_torch / t_fused:>8.2f}x"
                    f"{row['fused_GBps']:>7.0f}  " + ", ".join(f"{k} {v:.3g}" for k, v in agree.items())
                )
    out["batch_invariant"] = {}
    for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        inv = invariant(dtype, dev)
        out["batch_invariant"][dname] = inv
        print(f"batch invariant, {dname}: " + ", ".join(f"{k} {v}" for k, v in inv.items()))
        failed += [f"{k} {dname}: a row differs alone and in a batch" for k, v in inv.items() if not v]
    if models:
        print(f"\n{'model (fp32, tiny)':<20}{'max |dlogit| fused vs torch':>30}")
    with tempfile.TemporaryDirectory() as root:
        for fam in models:
            path = init_model(os.path.join(root, fam), family=fam, seed=3, dtype="float32")
            model = load_model(path, dtype=torch.float32, device=dev)
            ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
            with TorchPath():
                ref = model(ids)
            got = model(ids)
            diff = (got - ref).abs().max().item()
            out["models"].append(dict(family=fam, max_dlogit=diff))
            if diff >= FP32_LOGITS_ATOL:
                failed.append(f"{fam}: max |dlogit| {diff:.2e} >= {FP32_LOGITS_ATOL}")
            print(f"{fam:<20}{diff:>30.2e}")
    out["failed"] = failed
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.json}")
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
