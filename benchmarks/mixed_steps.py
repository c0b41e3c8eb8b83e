#!/usr/bin/env python3
"""What a step that carries a prefill chunk costs, beside its FLOP-aware roofline and its own
device time (the latency target for mixed steps: a chunk of 512, 1,024, 2,048 or 8,192 tokens at most 1.5x
the roofline and 1.1x the device time).

For each chunk size C of ``--chunks`` one co-located rank (``--load-format dummy`` weights of
``--shape``, graphs captured at start) serves, all submitted at once: ``--decodes`` D streams of
a one-token prompt and a long output, then ``--prompts`` K distinct prompts of exactly C tokens
that ask for one token each. ``--max-num-batched-tokens`` is C + D, so once the first requests
are in every step runs the D decodes and one whole C-token prompt (a fresh prefill chunk, no
prefix-cache hit), K steps in a row; then the decodes go on alone.

- **wall per mixed step**: the spacing of the C-prompts' first tokens (one per step) over the
  first half of the run (``windows``: after the first 5 prompts), and the decode streams'
  inter-token gaps inside that window (median);
- **device time per mixed step** (GPU): a ``moeserve.ops.profiling`` window of forward steps in
  the second half (``MOESERVE_PROFILE``), apart from the wall window because the profiler's
  start and end stall the step loop; its own wall per step, inflated by the tracing, is
  reported apart;
- **the FLOP-aware roofline** of that step: per class max(bytes / HBM rate, FLOPs / matmul peak)
  summed (``servinglib.roofline``): dense products over C + D tokens (the LM head over the D + 1
  sampled rows), routed experts over C + D tokens (every slot read), attention over the decodes'
  contexts and the chunk's causal (query, key) pairs; the peak and the copy rate measured in this
  run;
- the decode-only step after the chunks (the decode streams' gaps) for reference.

``--quantization fp8`` serves FP8 experts and MLPs (``LocalCluster(quantization="fp8")``, W8A8
on the GPU unless ``MOESERVE_FP8_ACTIVATIONS=weight-only``): the roofline's bytes are the FP8
weights' (``model_sizes(..., "fp8")``) and its FLOPs still at the measured bf16 peak, as the
serving benchmark's FP8 rows count them, so an FP8 class bound by FLOPs could run up to twice as
fast as its roofline says.

    python3 benchmarks/mixed_steps.py --shape scout8     # 1 GPU, C = 512, 1024, 2048, 8192
    python3 benchmarks/mixed_steps.py --shape ernie28
    python3 benchmarks/mixed_steps.py --shape ernie28 --quantization fp8
    python3 benchmarks/mixed_steps.py --smoke            # CPU: the tiny shape, gloo, fp32

Prints a table and writes JSON (``--json``, default benchmarks/results/mixed-steps-SHAPE.json,
``-fp8`` before ``.json`` with ``--quantization fp8``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # a bare checkout

from servinglib.cluster import colocated_rank  # noqa: E402
from servinglib.common import git_commit, switches  # noqa: E402
from servinglib.profiles import read_profiles  # noqa: E402
from servinglib.roofline import (  # noqa: E402
    flop_aware,
    gpu_facts,
    hbm_rates,
    kv_bytes_read,
    rate_line,
    step_classes,
)
from servinglib.shapes import SHAPES, model_sizes, weights_read_per_gpu, write_model  # noqa: E402

SKIP = 5  # C-prompts left out at the start of the wall window: the requests are all in by then


def windows(prompts: int) -> tuple[int, int, int, int]:
    """(first, last) C-prompt of the wall window and (start, count) forward steps of the profile
    window, after it: prompt i runs in about forward step i (the first steps may carry fewer
    while the requests arrive), so the profile starts 3 steps past the wall window and ends 5
    before the last prompt."""
    width = max(4, (prompts - SKIP - 10) // 2)
    start = SKIP + width + 3
    return SKIP, SKIP + width, start, max(1, prompts - start - 5)


def chunk_pairs(sizes: dict, c: int, start: int = 0) -> float:
    """(layer, query, key) pairs of a C-token chunk's causal attention after ``start`` tokens
    already in the cache (0: a fresh prompt): a chunked layer attends within its chunk, a
    sliding-window layer within its window."""
    total = 0.0
    windows = sizes.get("windows") or [None] * len(sizes["chunked"])
    q = np.arange(start, start + c, dtype=np.float64)
    for chunked, window in zip(sizes["chunked"], windows):
        seen = q % sizes["chunk"] + 1 if chunked and sizes["chunk"] else q + 1
        total += float(np.minimum(seen, window).sum() if window else seen.sum())
    return total


def chunk_keys(sizes: dict, c: int, start: int = 0) -> float:
    """(layer, key) pairs a C-token chunk after ``start`` cached tokens reads, each once: every
    key some query of the chunk sees (a full layer all ``start + c``; a chunked layer those from
    the first query's chunk on; a sliding-window layer the last ``c + window - 1``)."""
    total = 0.0
    windows = sizes.get("windows") or [None] * len(sizes["chunked"])
    end = start + c
    for chunked, window in zip(sizes["chunked"], windows):
        if chunked and sizes["chunk"]:
            total += end - start // sizes["chunk"] * sizes["chunk"]
        else:
            total += min(end, c + window - 1) if window else end
    return total


def mixed_classes(sizes: dict, weights: float, c: int, decodes: int, context: int, cached: int = 0) -> dict:
    """{class: (bytes, FLOPs)} of a step of ``decodes`` decode tokens at ``context`` and one
    ``c``-token chunk after ``cached`` tokens read from the prefix cache (``step_classes`` for
    the tokens, the chunk's attention added, the LM head's FLOPs only for the rows that sample:
    the decodes and the chunk's last token)."""
    tokens = c + decodes
    kv = kv_bytes_read(sizes, [context]) * decodes
    classes = dict(step_classes(sizes, weights, kv, tokens, [context] * decodes))
    head = sizes["vocab_size"] * sizes["hidden_size"]
    db, df = classes["dense"]
    classes["dense"] = (db, df - 2.0 * (tokens - decodes - 1) * head)
    ab, af = classes["attention"]
    chunk_kv = chunk_keys(sizes, c, cached) * sizes["kv_layer_token"]  # each key the chunk reads, once
    classes["attention"] = (ab + chunk_kv, af + chunk_pairs(sizes, c, cached) * sizes["attn_flops_per_key"])
    return classes


async def _serve(address, authkey, plan: list[tuple[tuple[int, ...], int]]) -> list[list[float]]:
    """Every request of ``plan`` ((prompt ids, max_tokens)) at once; each one's token times."""
    from moeserve.router.engine.api import FirstToken, GenerateRequest, Token
    from moeserve.router.engine.channel import AsyncEngineClient
    from moeserve.sampling import SamplingParams

    client = AsyncEngineClient(address, authkey)
    reqs = [
        GenerateRequest(prompt_ids=ids, max_tokens=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        for ids, n in plan
    ]
    times: list[list[float]] = [[] for _ in reqs]
    async for index, ev in client.generate(reqs):
        if isinstance(ev, (Token, FirstToken)):
            times[index].append(time.perf_counter())
    return times


def measure(times: list[list[float]], decodes: int, prompts: int) -> dict:
    """The wall figures of one chunk size from the token times: the C-prompts' first tokens
    (one per step) and the decode streams' gaps inside and after their window."""
    firsts = sorted(t[0] for t in times[decodes:] if t)
    if len(firsts) < prompts:
        raise RuntimeError(f"only {len(firsts)} of {prompts} prompts answered")
    first, last, _, _ = windows(prompts)
    lo, hi = firsts[first], firsts[last]
    spacing = (hi - lo) / (last - first)
    # the median spacing: one stall of the host (a preempted process) inside a narrow window
    # stretches the mean, not this
    spaced = list(np.diff(firsts[first : last + 1]))
    inside = [b - a for t in times[:decodes] for a, b in zip(t, t[1:]) if lo <= a and b <= hi]
    end = firsts[-1]
    after = [b - a for t in times[:decodes] for a, b in zip(t, t[1:]) if a > end]
    after = after[len(after) // 4 :]  # the decodes alone, once the last prompt's step is well past
    return dict(
        prompts_answered=len(firsts),
        mixed_step_s=spacing,
        mixed_step_p50_s=float(np.median(spaced)),
        mixed_gap_p50_s=float(np.median(inside)) if inside else None,
        mixed_gaps=len(inside),
        decode_step_p50_s=float(np.median(after)) if after else None,
    )


def run_chunk(a, folder: str, sizes: dict, c: int, prof_dir: str) -> dict:
    vocab = sizes["vocab_size"]
    rng = np.random.default_rng(c)
    out_len = a.prompts + 64  # the decodes outlast the chunks
    plan = [((int(rng.integers(3, vocab)),), out_len) for _ in range(a.decodes)]
    shared = tuple(int(t) for t in rng.integers(3, vocab, a.cached))  # every prompt's cached prefix
    plan += [(shared + tuple(int(t) for t in rng.integers(3, vocab, c)), 1) for _ in range(a.prompts)]
    _, _, start, count = windows(a.prompts)
    # with a shared prefix, one request computes it first (alone: its chunks of C + D tokens),
    # so that every prompt of the run finds it cached and takes one step
    warm = [(shared + tuple(int(t) for t in rng.integers(3, vocab, c)), 1)] if a.cached else []
    start += -(-(a.cached + c) // (c + a.decodes)) if warm else 0  # the forward steps it takes
    env = {"MOESERVE_PROFILE": f"{prof_dir}:{start}:{count}"} if a.profile else {}
    cluster = colocated_rank(
        folder,
        a.smoke,
        a.dtype,
        max_model_len=max(a.cached + c, out_len) + 16,
        max_num_seqs=a.decodes + 8,
        max_num_batched_tokens=c + a.decodes,
        env=env,
        **({"quantization": a.quantization} if a.quantization else {}),
    )
    try:
        if warm:
            asyncio.run(_serve(cluster.control_address, cluster.authkey, warm))
        t0 = time.perf_counter()
        times = asyncio.run(_serve(cluster.control_address, cluster.authkey, plan))
        wall = time.perf_counter() - t0
    finally:
        cluster.stop()
    res = dict(
        chunk=c,
        cached=a.cached,
        decodes=a.decodes,
        prompts=a.prompts,
        wall_s=wall,
        **measure(times, a.decodes, a.prompts),
    )
    profiles = read_profiles(prof_dir) if a.profile else {}
    p = next(iter(profiles.values()), None)
    if p is not None:
        res["profile"] = dict(
            steps=p["steps"],
            device_busy_per_step_s=p["device_busy_per_step_s"],
            profiled_wall_per_step_s=p["wall_per_step_s"],
            breakdown_device_s=p["breakdown_device_s"],
            breakdown_by_kernel_s=p["breakdown_by_kernel_s"],
            kernels=p.get("kernels", [])[:40],  # the 40 with the most device time per step
        )
        busy = p["device_busy_per_step_s"]
        res["wall_over_device"] = res["mixed_step_s"] / busy if busy else None
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="scout8", choices=sorted(SHAPES))
    p.add_argument("--chunks", default="512,1024,2048,8192", help="comma list of prefill chunk sizes (tokens)")
    p.add_argument("--decodes", type=int, default=64, help="decode streams beside each chunk (64)")
    p.add_argument("--prompts", type=int, default=40, help="C-token prompts per chunk size, one per step (40)")
    p.add_argument(
        "--cached",
        type=int,
        default=0,
        help="tokens of a prefix every prompt shares, read from the prefix cache (a multiple of the "
        "block size, 16); 0: fresh prompts (0)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: FP8 experts and MLPs quantized at load (vLLM's --quantization fp8); default bf16",
    )
    p.add_argument("--no-profile", dest="profile", action="store_false", help="no device-time profile window")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny shape, gloo, fp32, small chunks")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        chunks = [int(x) for x in a.chunks.split(",")]
    except ValueError:
        p.error(f"--chunks must be a comma list of token counts, got {a.chunks!r}")
    if not chunks or min(chunks) < 1 or max(chunks) > 65536:
        p.error(f"--chunks must be 1 .. 65536 tokens each, got {a.chunks!r}")
    if a.cached < 0 or a.cached % 16 or a.cached > 65536:
        p.error(f"--cached must be a multiple of the block size 16 in 0 .. 65536, got {a.cached}")
    if not 1 <= a.decodes <= 1024:
        p.error(f"--decodes must be 1 .. 1024, got {a.decodes}")
    if not 2 * SKIP + 14 <= a.prompts <= 1000:
        p.error(
            f"--prompts must be {2 * SKIP + 14} .. 1000 (a wall and a profile window, one prompt a step), got {a.prompts}"
        )
    if a.smoke:
        a.shape, a.dtype = "tiny", "float32"
        if a.chunks == p.get_default("chunks"):
            chunks = [16, 48]
        if a.decodes == p.get_default("decodes"):
            a.decodes = 4
        if a.prompts == p.get_default("prompts"):
            a.prompts = 2 * SKIP + 14
    elif not __import__("torch").cuda.is_available():
        p.error("needs a CUDA GPU (--smoke runs on the CPU)")
    suffix = f"-{a.quantization}" if a.quantization else ""
    path = a.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"mixed-steps-{a.shape}{suffix}.json"
    )

    work = tempfile.mkdtemp(prefix=f"mixed-steps-{a.shape}-")
    folder = write_model(os.path.join(work, "model"), SHAPES[a.shape]["config"])
    sizes = model_sizes(folder, 4 if a.dtype == "float32" else 2, a.quantization)
    facts = gpu_facts(1, a.smoke)[0]
    rates, hbm = hbm_rates([facts.get("name", "cpu")], float(facts["rate_Bps"]))
    print(rate_line(hbm), flush=True)
    peak = facts.get("peak_flops")
    weights = weights_read_per_gpu(sizes, 0, 1)
    rows = []
    for c in chunks:
        print(f"[C={c}] {a.decodes} decodes + {a.prompts} prompts of {c} tokens ...", flush=True)
        r = run_chunk(a, folder, sizes, c, os.path.join(work, f"profile-{c}"))
        context = 1 + a.prompts // 2  # the decodes' mean context over the window
        classes = mixed_classes(sizes, weights, c, a.decodes, context, a.cached)
        r["roofline"] = dict(
            classes={k: dict(bytes=b, flops=f) for k, (b, f) in classes.items()},
            peak_flops=peak,
            **{name: flop_aware(classes, rate, peak) if peak else None for name, rate in rates.items()},
        )
        fa = (r["roofline"].get("measured_copy") or {}).get("step_s")
        r["step_over_flop_aware"] = r["mixed_step_s"] / fa if fa else None
        rows.append(r)

    def ms(x):
        return f"{1e3 * x:.2f}" if isinstance(x, (int, float)) and x > 0 else "-"  # 0: no device (CPU)

    def times_(x):
        return f"{x:.2f}x" if isinstance(x, (int, float)) else "-"

    print(
        f"\n{'chunk':>6} {'decodes':>7} {'step ms':>8} {'gap p50':>8} {'device':>8} {'roofline':>9} "
        f"{'step/roof':>9} {'step/dev':>8} {'decode ms':>9}"
    )
    for r in rows:
        fa = (r["roofline"].get("measured_copy") or {}).get("step_s")
        print(
            f"{r['chunk']:>6} {r['decodes']:>7} {ms(r['mixed_step_s']):>8} {ms(r['mixed_gap_p50_s']):>8} "
            f"{ms((r.get('profile') or {}).get('device_busy_per_step_s')):>8} {ms(fa):>9} "
            f"{times_(r['step_over_flop_aware']):>9} {times_(r.get('wall_over_device')):>8} "
            f"{ms(r['decode_step_p50_s']):>9}"
        )
    if peak:
        print(f"bf16 GEMM peak {peak / 1e12:.0f} TFLOP/s, copy {rates['measured_copy'] / 1e12:.2f} TB/s (this run)")
    import torch

    doc = dict(
        command="python3 " + " ".join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])]),
        git=git_commit(),
        switches=switches(),
        device=torch.cuda.get_device_name(0) if not a.smoke else "cpu",
        torch=torch.__version__,
        shape=a.shape,
        dtype=a.dtype,
        quantization=a.quantization,
        weights_read_bytes=weights,
        rates=rates,
        hbm=hbm,
        peak_flops=peak,
        rows=rows,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
