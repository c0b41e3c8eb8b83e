#!/usr/bin/env python3
"""The paged attention kernel (moeserve/kernels/triton_attention.py) at serving shapes, beside
torch's scaled_dot_product_attention and FlashAttention-2's varlen forward where they serve (no
cached keys), with its launch configuration swept.

    python3 benchmarks/attention.py                 # 1 GPU: every shape and case, today's tiles
    python3 benchmarks/attention.py --tune          # and every candidate prefill tiling
    python3 benchmarks/attention.py --smoke         # CPU: tiny shapes, Triton's interpreter

Shapes (``--shapes``): the attention of Scout (40 query heads over 8 KV heads, dim 128, 8,192-token
chunks), ERNIE-4.5-21B (20 over 4) and Qwen3-30B (32 over 4). Cases (``--cases``):

- ``prefill:N`` one sequence's first N tokens (context 0), ``prefill:AxN`` A such sequences in
  one launch (the 8,192-token chunk of a burst of 2,048-token prompts is ``4x2048``);
- ``cached:NxC`` N new tokens after C cached ones (a prefix-cache hit: ``64x2048``);
- ``decode:SxC`` S sequences of one new token at context C.

Each is timed inside a CUDA graph (the serving path replays graphs) with the tiling that
``moeserve.models.attention.attention_config`` picks today; ``--tune`` adds every candidate of
``CANDIDATES`` for the cases that take the prefill tiling. Where a case has no cached keys,
``torch.nn.functional.scaled_dot_product_attention`` (causal, grouped heads, per sequence) runs
beside it on the same q, k and v: its time, and the reference each output is checked against
(with cached keys, moeserve's torch path in fp32 is); so does ``flash_varlen`` (column ``flash``:
the ``MOESERVE_ATTENTION_PREFILL=flash`` backend, all of a case's prompts in one launch, where
torch has FlashAttention for the device and every prompt lies within its first chunk).
FLOPs are the causal ones (4 Hq D per visible (query, key) pair; a chunked layer sees its chunk
only), reported as TFLOP/s beside the measured bf16 GEMM peak of the same run
(``servinglib.roofline.measure_peak``). Prints a table and writes JSON (``--json``, default
benchmarks/results/attention.json); exits 1 when a configuration's output differs from the
reference by more than ``TOLERANCE`` (bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moeserve.models import attention as A  # noqa: E402
from moeserve.models.paged import PagedBatch  # noqa: E402

SHAPES = {  # name: (query heads, kv heads, head dim, chunk)
    "scout": (40, 8, 128, 8192),
    "ernie": (20, 4, 128, 0),
    "qwen3": (32, 4, 128, 0),
}
SMOKE_SHAPES = {"tiny": (4, 2, 16, 0), "tiny_chunked": (6, 2, 16, 24)}
CASES = ("prefill:2048", "prefill:8192", "prefill:4x2048", "cached:64x2048", "decode:256x384")
SMOKE_CASES = ("prefill:40", "prefill:2x24", "cached:8x40", "decode:4x30")
BLOCK = 16  # tokens per KV block (the serving default)
TOLERANCE = 0.02  # bf16: largest |difference| / largest |reference| of a correct kernel
# prefill tilings swept by --tune: (BM, BN, num_warps, num_stages)
CANDIDATES = tuple(
    (bm, bn, w, st)
    for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
    if not (bm == 128 and bn == 128 and st == 3)  # over the shared memory of one SM
)


def parse_case(case: str) -> tuple[str, list[int], list[int]]:
    """``kind:spec`` -> (kind, new tokens per sequence, cached tokens per sequence)."""
    kind, _, spec = case.partition(":")
    try:
        if kind == "prefill":
            count, _, n = spec.rpartition("x")
            return kind, [int(n)] * int(count or 1), [0] * int(count or 1)
        if kind == "cached":
            n, c = spec.split("x")
            return kind, [int(n)], [int(c)]
        if kind == "decode":
            s, c = spec.split("x")
            return kind, [1] * int(s), [int(c)] * int(s)
    except ValueError:
        pass
    raise ValueError(f"case {case!r}: expected prefill:N, prefill:AxN, cached:NxC or decode:SxC")


def causal_pairs(lens: list[int], starts: list[int], chunk: int) -> int:
    """(query, key) pairs attended: each new token at position p sees keys up to p (from its
    chunk's start in a chunked layer)."""
    total = 0
    for n, c in zip(lens, starts):
        for p in range(c, c + n):
            total += p + 1 - ((p // chunk) * chunk if chunk else 0)
    return total


def make_case(shape: tuple, case: str, dtype: torch.dtype, dev: torch.device, seed: int = 0) -> dict:
    """q [T, Hq, D], pools [N, Hkv, D] holding every sequence's keys, its PagedBatch, and the
    per-sequence k, v [len, Hkv, D] of a case without cached keys (for SDPA)."""
    hq, hkv, d, chunk = shape
    kind, lens, starts = parse_case(case)
    g = torch.Generator(device="cpu").manual_seed(seed)
    tables, nxt = [], 1  # block 0 stays unused
    for n, c in zip(lens, starts):
        blocks = -(-(n + c) // BLOCK)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
    pool_shape = (nxt * BLOCK, hkv, d)
    k_pool = (torch.randn(pool_shape, generator=g) * 0.5).to(dtype).to(dev)
    v_pool = torch.randn(pool_shape, generator=g).to(dtype).to(dev)
    q = (torch.randn(sum(lens), hq, d, generator=g) * 0.5).to(dtype).to(dev)
    batch = PagedBatch.build(lens, starts, tables, BLOCK, dev, num_blocks=nxt)
    seqs = []
    for n, c, t in zip(lens, starts, tables):
        slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c + n)], device=dev)
        seqs.append((k_pool[slots], v_pool[slots]))
    return dict(
        kind=kind,
        lens=lens,
        starts=starts,
        q=q,
        k_pool=k_pool,
        v_pool=v_pool,
        batch=batch,
        seqs=seqs,
        chunk=chunk,
        pairs=causal_pairs(lens, starts, chunk),
        scale=d**-0.5,
    )


def sdpa(c: dict) -> torch.Tensor | None:
    """torch's attention of a case without cached keys, per sequence (None otherwise)."""
    if any(c["starts"]) or c["kind"] == "decode":
        return None
    q, outs, at = c["q"], [], 0
    hq, hkv = q.shape[1], c["k_pool"].shape[1]
    for n, (k, v) in zip(c["lens"], c["seqs"]):
        qs = q[at : at + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        ks, vs = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if c["chunk"] and n > c["chunk"]:
            pos = torch.arange(n, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] // c["chunk"] == pos[:, None] // c["chunk"])
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1), attn_mask=mask
            )
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
        at += n
    return torch.cat(outs)


def sdpa_inputs(c: dict) -> dict | None:
    """The step's own q, k, v [T, H, D] of a case the ``sdpa`` prefill backend serves: no cached
    keys, every prompt within its first chunk (any device and dtype; None otherwise)."""
    if any(c["starts"]) or c["kind"] == "decode" or (c["chunk"] and max(c["lens"]) > c["chunk"]):
        return None
    k = torch.cat([k for k, _ in c["seqs"]])  # [T, Hkv, D]: the step's own keys, as a layer passes them
    v = torch.cat([v for _, v in c["seqs"]])
    return dict(q=c["q"], k=k, v=v, scale=c["scale"])


def flash_inputs(c: dict, own: dict | None) -> dict | None:
    """The arguments of ``moeserve.models.attention.flash_varlen`` (FlashAttention-2's varlen
    forward, the ``MOESERVE_ATTENTION_PREFILL=flash`` backend) for a case it serves: the cases
    of ``sdpa_inputs`` (``own``, its answer) on a device and dtype it runs (None otherwise)."""
    if own is None or not A.flash_supported(c["q"]):
        return None
    cu = torch.tensor([0] + list(itertools.accumulate(c["lens"])), dtype=torch.int32, device=c["q"].device)
    return dict(own, cu_seqlens=cu, max_len=max(c["lens"]), window=None)


def sdpa_backends(dev: torch.device) -> dict:
    """The kernels torch's SDPA may pick, by name (``torch.nn.attention.SDPBackend``): on a GPU
    cuDNN's, FlashAttention-2's and the memory-efficient one; on the CPU its own (math)."""
    from torch.nn.attention import SDPBackend

    if dev.type == "cuda":
        return dict(
            cudnn=SDPBackend.CUDNN_ATTENTION,
            flash=SDPBackend.FLASH_ATTENTION,
            efficient=SDPBackend.EFFICIENT_ATTENTION,
        )
    return dict(math=SDPBackend.MATH)


def sdpa_by_backend(c: dict, fl: dict, ref: torch.Tensor, flops: float, a, cuda: bool) -> dict:
    """``moeserve.models.attention.sdpa_prompts`` (the ``MOESERVE_ATTENTION_PREFILL=sdpa``
    backend: one call per prompt on the step's own keys) on the case, once as torch picks its
    kernel (``default``) and once forced to each kernel of ``sdpa_backends``: seconds per launch
    (in a CUDA graph), TFLOP/s, the difference to the reference, and ``first_call_s``, the wall
    time of the first eager call at a length no call had before (a kernel that builds a plan per
    shape, as cuDNN's may, pays it there: on the serving path that is a compile per new prompt
    length) against ``steady_call_s``, the same call again. A kernel that does not serve the
    case is recorded with its error."""
    from torch.nn.attention import sdpa_kernel

    lens = tuple(c["lens"])
    shorter = tuple(n - 1 for n in lens)  # a shape no call had: every prompt one token shorter
    keep = torch.cat([torch.arange(at, at + n - 1) for at, n in zip(itertools.accumulate((0,) + lens), lens)])
    keep = keep.to(fl["q"].device)
    q2, k2, v2 = (fl[x].index_select(0, keep) for x in ("q", "k", "v"))

    def one(backend) -> dict:
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with ctx:
            try:
                out = A.sdpa_prompts(fl["q"], fl["k"], fl["v"], lens, scale=fl["scale"])
                t = timed(
                    lambda: A.sdpa_prompts(fl["q"], fl["k"], fl["v"], lens, scale=fl["scale"]), a.reps, a.iters, cuda
                )
                walls = []
                for _ in range(2):
                    if cuda:
                        torch.cuda.synchronize()
                    w = time.perf_counter()
                    A.sdpa_prompts(q2, k2, v2, shorter, scale=fl["scale"])
                    if cuda:
                        torch.cuda.synchronize()
                    walls.append(time.perf_counter() - w)
            except Exception as e:  # a kernel that does not take the case (head size, GQA, dtype)
                return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return dict(
            s=t, tflops=flops / t / 1e12, rel_diff=rel_diff(out, ref), first_call_s=walls[0], steady_call_s=walls[1]
        )

    res = {"default": one(None)}
    for name, backend in sdpa_backends(fl["q"].device).items():
        res[name] = one(backend)
    return res


def triton_attention(c: dict, tiling: tuple | None) -> torch.Tensor:
    """The kernel on the case, with ``tiling`` (BM, BN, warps, stages) in place of the prefill
    tuning (None: today's)."""
    saved = dict(A.TUNING["prefill"])
    try:
        if tiling is not None:
            bm, bn, w, st = tiling
            A.TUNING["prefill"].update(BM=bm, BN=bn, num_warps=w, num_stages=st)
        return A.paged_attention_triton(
            c["q"], c["k_pool"], c["v_pool"], c["batch"], scale=c["scale"], chunk=c["chunk"] or None
        )
    finally:
        A.TUNING["prefill"].clear()
        A.TUNING["prefill"].update(saved)


def uses_prefill_tiling(c: dict) -> bool:
    hq, hkv = c["q"].shape[1], c["k_pool"].shape[1]
    return c["batch"].max_query_len * (hq // hkv) > A.TUNING["decode"]["BM"]


def timed(fn, reps: int, iters: int, cuda: bool) -> float:
    """Seconds per call: replayed from a CUDA graph of ``reps`` calls on a GPU; wall clock on the CPU."""
    if cuda:
        from fp8_linears import graph_time

        return graph_time(lambda i: fn(), reps, iters)
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def run_case(shape_name: str, shape: tuple, case: str, a, dev: torch.device, peak: float | None) -> dict:
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    c = make_case(shape, case, dtype, dev)
    flops = 4.0 * shape[0] * shape[2] * c["pairs"]
    row: dict = dict(shape=shape_name, case=case, tokens=sum(c["lens"]), pairs=c["pairs"], flops=flops, runs=[])
    ref = sdpa(c)
    if ref is None:  # cached keys: the torch path (moeserve's CPU attention) in fp32 is the reference
        ref = A.paged_attention_torch(
            c["q"].float(),
            c["k_pool"].float(),
            c["v_pool"].float(),
            c["batch"],
            scale=c["scale"],
            chunk=c["chunk"] or None,
            softmax_fp32=True,
        )
    else:
        t = timed(lambda: sdpa(c), a.reps, a.iters, cuda)
        row["sdpa"] = dict(s=t, tflops=flops / t / 1e12)
    sd_in = sdpa_inputs(c)
    if sd_in is not None:
        row["sdpa_backends"] = sdpa_by_backend(c, sd_in, ref, flops, a, cuda)
    fl = flash_inputs(c, sd_in)
    if fl is not None:
        out = A.flash_varlen(**fl)
        t = timed(lambda: A.flash_varlen(**fl), a.reps, a.iters, cuda)
        row["flash"] = dict(s=t, tflops=flops / t / 1e12, rel_diff=rel_diff(out, ref))
        if peak:
            row["flash"]["share_of_peak"] = flops / t / peak
    cfg = A.attention_config(c["batch"], shape[0], shape[1], shape[2], A._num_sms(dev.index or 0) if cuda else None)
    tilings: list[tuple | None] = [None]
    if a.tune and uses_prefill_tiling(c):
        tilings += list(CANDIDATES)
    for tiling in tilings:
        try:
            out = triton_attention(c, tiling)
            t = timed(lambda tiling=tiling: triton_attention(c, tiling), a.reps, a.iters, cuda)
        except Exception as e:  # a tiling the compiler refuses (shared memory): noted, not fatal
            row["runs"].append(dict(tiling=tiling, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        run = dict(
            tiling=list(tiling) if tiling else [cfg["BM"], cfg["BN"], cfg["num_warps"], cfg["num_stages"]],
            today=tiling is None,
            s=t,
            tflops=flops / t / 1e12,
            rel_diff=rel_diff(out, ref),
        )
        if peak:
            run["share_of_peak"] = flops / t / peak
        if "sdpa" in row:
            run["over_sdpa"] = row["sdpa"]["s"] / t
        row["runs"].append(run)
    ok = [r for r in row["runs"] if "s" in r]
    row["best"] = min(ok, key=lambda r: r["s"]) if ok else None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None, help=f"comma list of {','.join(SHAPES)} (smoke: {','.join(SMOKE_SHAPES)})")
    p.add_argument("--cases", default=None, help=f"comma list (default {','.join(CASES)})")
    p.add_argument("--tune", action="store_true", help="also every candidate prefill tiling")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Triton's interpreter")
    p.add_argument("--reps", type=int, default=10, help="calls per CUDA graph")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.json")
    )
    a = p.parse_args(argv)
    shapes_known = SMOKE_SHAPES if a.smoke else SHAPES
    shapes = (a.shapes or ",".join(shapes_known)).split(",")
    unknown = [s for s in shapes if s not in shapes_known]
    if unknown:
        p.error(f"unknown shapes {unknown}: allowed {', '.join(shapes_known)}")
    cases = (a.cases or ",".join(SMOKE_CASES if a.smoke else CASES)).split(",")
    for case in cases:
        try:
            parse_case(case)
        except ValueError as e:
            p.error(str(e))
    for flag in ("reps", "iters"):
        if not 1 <= getattr(a, flag) <= 1000:
            p.error(f"--{flag} must be 1 .. 1000, got {getattr(a, flag)}")
    if a.smoke:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            return run(a, shapes_known, shapes, cases, torch.device("cpu"), None)
        finally:  # (main is called from the tests too: the interpreter stays this run's)
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (--smoke runs on the CPU)")
        dev = torch.device("cuda", 0)
        from servinglib.roofline import measure_peak

        peak = measure_peak(dev)
    return run(a, shapes_known, shapes, cases, dev, peak)


def run(a, shapes_known: dict, shapes: list, cases: list, dev: torch.device, peak: float | None) -> int:
    rows = [run_case(s, shapes_known[s], case, a, dev, peak) for s in shapes for case in cases]
    bad = [
        (r["shape"], r["case"], run["tiling"])
        for r in rows
        for run in r["runs"]
        if "rel_diff" in run and run["rel_diff"] > TOLERANCE
    ]
    bad += [(r["shape"], r["case"], "flash") for r in rows if "flash" in r and r["flash"]["rel_diff"] > TOLERANCE]
    bad += [
        (r["shape"], r["case"], f"sdpa:{name}")
        for r in rows
        for name, x in r.get("sdpa_backends", {}).items()
        if x.get("rel_diff", 0.0) > TOLERANCE
    ]
    print(
        f"{'shape':<13}{'case':<16}{'today ms':>10}{'TFLOP/s':>9}{'sdpa ms':>9}{'flash ms':>9}{'TFLOP/s':>9}"
        f"{'best tiling':>20}{'best ms':>9}{'TFLOP/s':>9}"
    )
    for r in rows:
        today = next((x for x in r["runs"] if x.get("today")), None)
        best = r["best"] or {}
        sd = r.get("sdpa")
        print(
            f"{r['shape']:<13}{r['case']:<16}"
            + (f"{1e3 * today['s']:>10.3f}{today['tflops']:>9.1f}" if today else f"{'-':>10}{'-':>9}")
            + (f"{1e3 * sd['s']:>9.3f}" if sd else f"{'-':>9}")
            + (f"{1e3 * fl['s']:>9.3f}{fl['tflops']:>9.1f}" if (fl := r.get("flash")) else f"{'-':>9}{'-':>9}")
            + f"{str(best.get('tiling', '-')):>20}"
            + (f"{1e3 * best['s']:>9.3f}{best['tflops']:>9.1f}" if best else "")
        )
    names = sorted({n for r in rows for n in r.get("sdpa_backends", {})}, key=lambda n: (n != "default", n))
    if names:
        print(
            "\nMOESERVE_ATTENTION_PREFILL=sdpa (sdpa_prompts), by SDPA kernel: ms per launch / TFLOP/s / first call at a new length over the steady one"
        )
        print(f"{'shape':<13}{'case':<16}" + "".join(f"{n:>26}" for n in names))
        for r in rows:
            if "sdpa_backends" not in r:
                continue
            cells = []
            for n in names:
                x = r["sdpa_backends"].get(n, {})
                cells.append(
                    f"{1e3 * x['s']:>9.3f} /{x['tflops']:>6.1f} /{x['first_call_s'] / x['steady_call_s']:>6.1f}x"
                    if "s" in x
                    else f"{'(does not serve)':>26}"
                )
            print(f"{r['shape']:<13}{r['case']:<16}" + "".join(cells))
    if peak:
        print(f"bf16 GEMM peak measured in this run: {peak / 1e12:.0f} TFLOP/s")
    result = dict(
        command="python3 " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
        device=torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        torch=torch.__version__,
        peak_flops=peak,
        tolerance=TOLERANCE,
        rows=rows,
        out_of_tolerance=bad,
    )
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.json}")
    if bad:
        print(f"out of tolerance ({TOLERANCE}): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
