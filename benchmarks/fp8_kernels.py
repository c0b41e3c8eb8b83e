#!/usr/bin/env python3
"""FP8 grouped expert kernels of a decode step, variants side by side in one run: which layout and
which product read FP8 codes nearest HBM rate.

    python3 benchmarks/fp8_kernels.py                        # 1 GPU: Scout and ERNIE, 256 tokens
    python3 benchmarks/fp8_kernels.py --shapes scout --tokens 64,256

Variants (per-channel weight scales, one float32 per output channel; rows grouped by slot as
the direct exchange delivers them):

- ``kn``: today's kernel (``moeserve.kernels.expert_mlp`` with ``ExpertScales``): codes stored
  [S, K, N] (N contiguous), converted to bf16 in registers (weight-only);
- ``nk-wo``: codes stored [S, N, K] (K contiguous, the checkpoint's own nn.Linear layout),
  converted in registers, the product x @ W^T (weight-only);
- ``nk-wo-swap``: the same computed transposed, W [BN, BK] x x^T [BK, BM];
- ``nk-w8a8``: the rows quantized per row to FP8 first (dynamic per-token scales, as the
  compressed-tensors checkpoints declare ``input_activations``), the product on FP8 tensor cores
  (both operands K-major), scaled by the row's and the channel's scale;
- ``nk-w8a8-swap``: the same computed transposed;
- ``sgmm``: ``torch._scaled_grouped_mm`` (PyTorch's CUTLASS grouped FP8 GEMM) on the [N, K] codes
  with the rows quantized per row, the SwiGLU between by ``kernels.silu_mul``; its row invariance
  is checked too (a row's output alone in its slot against among the step's rows, bitwise).

Each variant's tilings (BN, BK, warps, stages) are swept; bytes = the codes and scales of the slots
that got rows; rate = bytes / median of ``--iters`` launches (CUDA events), layers cycled so that L2
never holds one. The W8A8 variants' times include quantizing their input rows (a kernel per
projection). Error: relative L2 against the dequantized weights in fp32. Prints a table and writes
JSON (``--json``, default benchmarks/results/fp8-kernels.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from expert_kernel import time_fn  # noqa: E402  (benchmarks/, the script's own folder)

from moeserve import kernels  # noqa: E402

SHAPES = {
    "scout": dict(hidden=5120, inter=8192, slots=16, top_k=1),
    "ernie": dict(hidden=2560, inter=1536, slots=64, top_k=6),
    "qwen3": dict(hidden=2048, inter=768, slots=144, top_k=8),
}
VARIANTS = ("nk-wo", "nk-wo-swap", "nk-w8a8", "nk-w8a8-swap", "kn-w8a8", "kn-w8a8-swap", "sgmm")
TILES = list(itertools.product((64, 128), (128, 256), (4, 8), (3, 4)))  # BN, BK, warps, stages
FP8_MAX = 448.0


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, BLOCK: tl.constexpr):
    # one row: s = max|x| / 448 (1 for a zero row), q = x / s in e4m3
    r = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK)
    ok = rk < K
    x = tl.load(x_ptr + r * K + rk, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(q_ptr + r * K + rk, (x / s).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + r, s)


@triton.jit
def grouped_nk_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    offs_ptr,
    K: tl.constexpr,
    N: tl.constexpr,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_ss,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GATED: tl.constexpr,
    SWAP: tl.constexpr,
    A8: tl.constexpr,
):
    # program (s, j): out[r, jBN:(j+1)BN] for the rows r of slot s; w[s] is [NW, K] (K contiguous;
    # NW = 2N gated: the gate's rows, then the up's), ws[s] [NW] float32; A8: x holds e4m3 codes
    # with a float32 scale per row in xs
    s = tl.program_id(0)
    j = tl.program_id(1)
    end = tl.load(offs_ptr + s).to(tl.int64)
    prev = tl.load(offs_ptr + tl.maximum(s - 1, 0)).to(tl.int64)
    start = tl.where(s > 0, prev, 0)
    rn = j * BN + tl.arange(0, BN)
    n_ok = rn < N
    w = w_ptr + s.to(tl.int64) * stride_ws
    sg = tl.load(ws_ptr + s.to(tl.int64) * stride_ss + rn, mask=n_ok, other=0.0)
    if GATED:
        su = tl.load(ws_ptr + s.to(tl.int64) * stride_ss + N + rn, mask=n_ok, other=0.0)
    else:
        su = sg
    for m0 in range(start, end, BM):
        rm = m0 + tl.arange(0, BM)
        m_ok = rm < end
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            wt = tl.load(w + rn[:, None] * stride_wn + rk[None, :] * stride_wk, mask=n_ok[:, None], other=0.0)
            if GATED:
                wu = tl.load(w + (N + rn)[:, None] * stride_wn + rk[None, :] * stride_wk, mask=n_ok[:, None], other=0.0)
            xt = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
            if not A8:
                wt = wt.to(xt.dtype)
                if GATED:
                    wu = wu.to(xt.dtype)
            if SWAP:
                acc = tl.dot(wt, tl.trans(xt), acc)
                if GATED:
                    acc_u = tl.dot(wu, tl.trans(xt), acc_u)
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
                if GATED:
                    acc_u = tl.dot(xt, tl.trans(wu), acc_u)
        if SWAP:
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        acc = acc * sg[None, :]
        acc_u = acc_u * su[None, :]
        if A8:
            xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
            acc = acc * xs[:, None]
            acc_u = acc_u * xs[:, None]
        dt = out_ptr.dtype.element_ty
        if GATED:
            g = acc.to(dt).to(tl.float32)
            sl = (g / (1.0 + tl.exp(-g))).to(dt)
            res = (sl.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)
        else:
            res = acc.to(dt)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], res, mask=m_ok[:, None] & n_ok[None, :])


def quant_rows(x):
    q = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    if x.shape[0]:
        quant_rows_kernel[(x.shape[0],)](x, q, s, K=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return q, s


def nk_matmul(x, w, ws, offs, bm, tile, gated, swap, a8, xs=None, kn=False):
    # w [S, NW, K] (K contiguous), or with kn [S, K, NW] (NW contiguous, today's layout)
    c, k = x.shape
    s = w.shape[0]
    nw = w.shape[2] if kn else w.shape[1]
    sn, sk = (w.stride(2), w.stride(1)) if kn else (w.stride(1), w.stride(2))
    n = nw // 2 if gated else nw
    out = torch.empty(c, n, device=x.device, dtype=torch.bfloat16 if a8 else x.dtype)
    bn, bk, warps, stages = tile
    grouped_nk_kernel[(s, triton.cdiv(n, bn))](
        x,
        xs if xs is not None else ws,
        w,
        ws,
        out,
        offs,
        k,
        n,
        w.stride(0),
        sn,
        sk,
        ws.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        GATED=gated,
        SWAP=swap,
        A8=a8,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def nk_mlp(rows, gu, gus, dn, dns, offs, bm, tiles, variant):
    swap = variant.endswith("swap")
    a8 = "w8a8" in variant
    kn = variant.startswith("kn")
    if a8:
        q, qs = quant_rows(rows)
        h = nk_matmul(q, gu, gus, offs, bm, tiles[0], True, swap, True, qs, kn)
        q2, qs2 = quant_rows(h)
        return nk_matmul(q2, dn, dns, offs, bm, tiles[1], False, swap, True, qs2, kn)
    h = nk_matmul(rows, gu, gus, offs, bm, tiles[0], True, swap, False, None, kn)
    return nk_matmul(h, dn, dns, offs, bm, tiles[1], False, swap, False, None, kn)


def sgmm(x, xs, w, ws, offs):
    """x [C, K] e4m3 codes with a float32 scale per row xs [C]; w [S, N, K] codes, ws [S, N]."""
    return torch._scaled_grouped_mm(
        x, w.transpose(1, 2), xs, ws, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )


def sgmm_mlp(rows, gq, gs, dq, ds, offs):
    q, qs = quant_rows(rows)
    g = sgmm(q, qs, gq, gs, offs)
    h = kernels.silu_mul(g, offs[-1:])
    q2, qs2 = quant_rows(h)
    return sgmm(q2, qs2, dq, ds, offs)


def row_invariant(fn, rows, offs, s):
    """Whether slot 0's first row gets the same output bitwise alone in its slot (every other
    slot's rows as they are) as among all of slot 0's rows."""
    o = offs.tolist()
    n0 = o[0]
    if n0 < 2:
        return None
    full = fn(rows, offs)[0]
    alone_rows = torch.cat([rows[:1], rows[n0:]])
    alone_offs = torch.tensor([1] + [x - n0 + 1 for x in o[1:]], dtype=torch.int32, device=rows.device)
    return bool(torch.equal(fn(alone_rows, alone_offs)[0], full))


def quantize_nk(w):  # w [S, N, K] bf16 -> codes [S, N, K], scales [S, N] (per output channel)
    amax = w.abs().amax(dim=2).float().clamp_min(1e-12)
    sc = amax / FP8_MAX
    return (w.float() / sc[..., None]).to(torch.float8_e4m3fn), sc


def counts_for(rng, tokens, k, slots):
    ids = np.stack([rng.choice(slots, size=k, replace=False) for _ in range(tokens)])
    return np.bincount(ids.reshape(-1), minlength=slots)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="scout,ernie")
    p.add_argument("--tokens", default="256")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=420, help="stop sweeping tiles after this long")
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8-kernels.json")
    )
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    t_start = time.time()
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    out = dict(command=" ".join(["python3"] + sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    out["cases"] = []
    print(f"{'shape':<7}{'tokens':>7}{'variant':>14}{'best tile':>22}{'ms':>8}{'GB/s':>7}{'x bf16':>8}{'rel err':>9}")
    for name in a.shapes.split(","):
        sh = SHAPES[name]
        h, i, s, k = sh["hidden"], sh["inter"], sh["slots"], sh["top_k"]
        layers = []
        for _ in range(a.layers):
            gu = torch.randn(s, 2 * i, h, device=dev, dtype=torch.bfloat16) * h**-0.5  # [S, 2I, H] (N, K)
            dn = torch.randn(s, h, i, device=dev, dtype=torch.bfloat16) * i**-0.5  # [S, H, I]
            gq, gs = quantize_nk(gu)
            dq, ds = quantize_nk(dn)
            # today's layout [S, K, N] of the same codes and scales, and the bf16 weights
            kn = dict(
                gu=gq.transpose(1, 2).contiguous(),
                dn=dq.transpose(1, 2).contiguous(),
                gus=gs.unsqueeze(1).contiguous(),  # [S, 1, 2I]: one block over every K
                dns=ds.unsqueeze(1).contiguous(),
                gu16=(gq.float() * gs[..., None]).to(torch.bfloat16).transpose(1, 2).contiguous(),
                dn16=(dq.float() * ds[..., None]).to(torch.bfloat16).transpose(1, 2).contiguous(),
            )
            layers.append(dict(gq=gq, gs=gs, dq=dq, ds=ds, kn=kn))
            del gu, dn
        per_slot = 3 * h * i + 4 * (2 * i + h)  # codes and scales
        for tokens in [int(t) for t in a.tokens.split(",")]:
            c = counts_for(rng, tokens, k, s)
            m = int(c.sum())
            rows = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
            offs = torch.tensor(np.cumsum(c), dtype=torch.int32, device=dev)
            used = int((c > 0).sum())
            nbytes = used * per_slot
            bm = kernels.expert_block_m(2 * -(-m // s))
            L0 = layers[0]
            with torch.no_grad():  # the reference: the dequantized weights in fp32
                ref = []
                o = offs.tolist()
                for x in range(s):
                    a0 = o[x - 1] if x else 0
                    r = rows[a0 : o[x]].float()
                    gw = L0["gq"][x].float() * L0["gs"][x][:, None]
                    dw = L0["dq"][x].float() * L0["ds"][x][:, None]
                    g = r @ gw.T
                    hh = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
                    ref.append(hh @ dw.T)
                ref = torch.cat(ref)

            def rel(y):
                return float((y[:m].float() - ref).norm() / ref.norm())

            def bf16(j):
                kn = layers[j]["kn"]
                return kernels.expert_mlp(rows, kn["gu16"], kn["dn16"], offs, bm)

            def today(j):
                kn = layers[j]["kn"]
                sc = kernels.ExpertScales(kn["gus"], (h, 1), kn["dns"], (i, 1))
                return kernels.expert_mlp(rows, kn["gu"], kn["dn"], offs, bm, sc)

            def today_at(r, o):  # today's kernel, W8A8 as served (per-channel scales, dynamic rows)
                L = layers[0]
                gus, dns = L["gs"].unsqueeze(1).contiguous(), L["ds"].unsqueeze(1).contiguous()
                sc = kernels.ExpertScales(gus, (h, 1), dns, (i, 1), act_quant=True)
                gu_v, dn_v = L["gq"].transpose(1, 2), L["dq"].transpose(1, 2)  # [N, K] codes seen as [K, N]
                return kernels.expert_mlp(r, gu_v, dn_v, o, bm, sc)

            t16 = time_fn(bf16, a.iters, a.layers)
            b16 = used * 3 * h * i * 2
            case = dict(shape=name, tokens=tokens, rows=m, used_slots=used, block_m=bm, bytes_fp8=nbytes)
            case["bf16"] = dict(s=t16, GBps=b16 / t16 / 1e9, rel_err=rel(bf16(0)))
            t0 = time_fn(today, a.iters, a.layers)
            case["kn"] = dict(s=t0, GBps=nbytes / t0 / 1e9, over_bf16=t0 / t16, rel_err=rel(today(0)))
            print(f"{name:<7}{tokens:>7}{'bf16':>14}{'':>22}{1e3 * t16:>8.3f}{b16 / t16 / 1e9:>7.0f}{1:>8.2f}")
            print(
                f"{name:<7}{tokens:>7}{'kn':>14}{'':>22}{1e3 * t0:>8.3f}{nbytes / t0 / 1e9:>7.0f}"
                f"{t0 / t16:>8.2f}{case['kn']['rel_err']:>9.1e}",
                flush=True,
            )
            for variant in a.variants.split(","):
                if variant == "sgmm":
                    L = layers
                    try:
                        tv = time_fn(
                            lambda j: sgmm_mlp(rows, L[j]["gq"], L[j]["gs"], L[j]["dq"], L[j]["ds"], offs),
                            a.iters,
                            a.layers,
                        )
                        xq, xqs = quant_rows(rows)
                        t1 = time_fn(lambda j: sgmm(xq, xqs, L[j]["gq"], L[j]["gs"], offs), a.iters, a.layers)
                        err = rel(sgmm_mlp(rows, L[0]["gq"], L[0]["gs"], L[0]["dq"], L[0]["ds"], offs))
                        inv = row_invariant(
                            lambda r, o: sgmm_mlp(r, L[0]["gq"], L[0]["gs"], L[0]["dq"], L[0]["ds"], o), rows, offs, s
                        )
                        inv_today = row_invariant(lambda r, o: today_at(r, o), rows, offs, s)
                    except Exception as e:  # noqa: BLE001 - what this torch build refuses is the answer
                        print(f"  sgmm: {type(e).__name__}: {str(e)[:300]}")
                        case["sgmm"] = dict(error=f"{type(e).__name__}: {e}")
                        continue
                    case["sgmm"] = dict(
                        s=tv,
                        GBps=nbytes / tv / 1e9,
                        over_bf16=tv / t16,
                        rel_err=err,
                        gate_up_s=t1,
                        row_invariant=inv,
                        today_row_invariant=inv_today,
                    )
                    print(
                        f"{name:<7}{tokens:>7}{'sgmm':>14}{'gate_up ' + format(1e3 * t1, '.3f'):>22}{1e3 * tv:>8.3f}"
                        f"{nbytes / tv / 1e9:>7.0f}{tv / t16:>8.2f}{err:>9.1e}  row-invariant {inv} (today's {inv_today})",
                        flush=True,
                    )
                    continue
                results = {"gate_up": [], "down": []}
                # each projection's tiles swept alone (the other at a fixed tile), then the pair timed
                h_in = torch.randn(m, i, device=dev, dtype=torch.bfloat16)
                a8 = "w8a8" in variant
                swap = variant.endswith("swap")
                kn = variant.startswith("kn")

                def wts(j, kn=kn):  # codes and per-channel scales in the variant's layout
                    L = layers[j]
                    if kn:
                        return L["kn"]["gu"], L["gs"], L["kn"]["dn"], L["ds"]
                    return L["gq"], L["gs"], L["dq"], L["ds"]

                if a8:
                    xq, xqs = quant_rows(rows)
                    hq, hqs = quant_rows(h_in)
                for tile in TILES:
                    if time.time() - t_start > a.budget_s:
                        break
                    try:
                        if a8:
                            t1 = time_fn(
                                lambda j: nk_matmul(xq, *wts(j)[:2], offs, bm, tile, True, swap, True, xqs, kn),
                                a.iters,
                                a.layers,
                            )
                            t2 = time_fn(
                                lambda j: nk_matmul(hq, *wts(j)[2:], offs, bm, tile, False, swap, True, hqs, kn),
                                a.iters,
                                a.layers,
                            )
                        else:
                            t1 = time_fn(
                                lambda j: nk_matmul(rows, *wts(j)[:2], offs, bm, tile, True, swap, False, None, kn),
                                a.iters,
                                a.layers,
                            )
                            t2 = time_fn(
                                lambda j: nk_matmul(h_in, *wts(j)[2:], offs, bm, tile, False, swap, False, None, kn),
                                a.iters,
                                a.layers,
                            )
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit
                        print(f"  {variant} {tile}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    results["gate_up"].append((tile, t1))
                    results["down"].append((tile, t2))
                if not results["gate_up"]:
                    print(f"  {variant}: no tile ran")
                    continue
                best = tuple(min(results[kd], key=lambda x: x[1])[0] for kd in ("gate_up", "down"))

                def run(j, best=best, variant=variant, wts=wts):
                    return nk_mlp(rows, *wts(j), offs, bm, best, variant)

                tv = time_fn(run, a.iters, a.layers)
                err = rel(run(0))
                case[variant] = dict(
                    s=tv,
                    GBps=nbytes / tv / 1e9,
                    over_bf16=tv / t16,
                    rel_err=err,
                    best=[list(b) for b in best],
                    sweep={kd: [[list(t), x] for t, x in v] for kd, v in results.items()},
                )
                print(
                    f"{name:<7}{tokens:>7}{variant:>14}{str(best[0]) + str(best[1]):>22}{1e3 * tv:>8.3f}"
                    f"{nbytes / tv / 1e9:>7.0f}{tv / t16:>8.2f}{err:>9.1e}",
                    flush=True,
                )
            out["cases"].append(case)
        layers = []
        torch.cuda.empty_cache()
    out["elapsed_s"] = time.time() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.json} ({out['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
