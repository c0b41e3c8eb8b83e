"""Batched attention of a mixed step (prefill chunks and decodes) over the paged KV cache.

Dimension letters: T new tokens of a step (all sequences, flattened), S sequences, Hq query
heads, Hkv key/value heads, G = Hq / Hkv, D head dim, N flat slots of a layer's pool, B block
size, MB block-table width, Q = max new tokens of a sequence (max_query_len), L = max keys of
a sequence (max_seq_len), C the chunk size of Llama 4's chunked local attention.

The semantics are those of ``Attention._attend`` (the eager oracle of ``layers.py``), for every
sequence at once: query i of sequence s sits at absolute position ``seq_lens[s] - q_len[s] + i``
and sees the keys at positions ``k <= q_pos`` (causal, so a chunk starting after cached tokens
sees them all plus its own causal part) and, with a chunk size C, only those with
``k // C == q_pos // C``. Scores are ``(q @ k^T) * scale``; RoPE, qk-norm and NoPE temperature
tuning are applied to q and k before (``Attention``).

Two implementations, one per device:
- ``paged_attention_torch``: CPU and the fallback. Vectorised over sequences (no Python loop):
  each sequence's keys are gathered through its block table into a padded [S, L, Hkv, D] and
  its queries into [S, Q, Hq, D]; one batched masked matmul / softmax / matmul. Memory grows as
  S * Q * L, acceptable for the CPU tests and small batches, not for serving.
- ``paged_attention_triton``: CUDA. One launch of a varlen flash-attention over the paged
  cache for the whole mixed step (``moeserve.kernels.triton_attention``); a second, tiny launch only
  when the key range is split into segments (long decodes with too few programs to fill the GPU).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from typing import Protocol

import torch

from moeserve.kernels import available as triton_available
from moeserve.kernels import compilelog, fresh_module
from moeserve.models import paged
from moeserve.models.paged import FreshSuffix, PagedBatch


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    chunk: int | None,
    softmax_fp32: bool,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's queries q [T, Hq, D] over one layer's pools k_pool, v_pool
    [N, Hkv, D], which already hold this step's keys (written at ``batch.slot_mapping``).
    Returns [T, Hq, D] in q's dtype. ``window``: a sliding window (keys k > q_pos - window);
    ``sinks`` [Hq]: one more logit per head in every softmax (GPT-OSS). ``k_new``, ``v_new``
    [T, Hkv, D]: the step's own keys and values (what was written), which the prefill backends
    ``flash`` and ``sdpa`` read for the step's fresh prompts (``MOESERVE_ATTENTION_PREFILL``).

    backend: "torch", "triton", or None for the device's choice (Triton on CUDA when it is
    installed, torch otherwise).
    """
    if backend is None:
        backend = "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "triton":
        return paged_attention_triton(
            q, k_pool, v_pool, batch, scale=scale, chunk=chunk, window=window, sinks=sinks, k_new=k_new, v_new=v_new
        )
    if backend == "torch":
        return paged_attention_torch(
            q, k_pool, v_pool, batch, scale=scale, chunk=chunk, softmax_fp32=softmax_fp32, window=window, sinks=sinks
        )
    raise ValueError(f"unknown attention backend {backend!r}; allowed: 'torch', 'triton'")


def attention_probs(
    scores: torch.Tensor, sinks: torch.Tensor | None, softmax_fp32: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Softmax of masked scores [..., Hkv, G, Q, L] over L, in fp32 when ``softmax_fp32``, in
    ``dtype``. With ``sinks`` [Hq] (Hq = Hkv * G), as transformers' GPT-OSS: each head's sink
    logit joins its row, the row's max is subtracted, the softmax taken and the sink's column
    dropped."""
    if sinks is not None:
        hkv, g = scores.shape[-4], scores.shape[-3]
        sink = sinks.to(scores.dtype).view(hkv, g, 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        if softmax_fp32:
            return torch.softmax(combined.float(), dim=-1)[..., :-1].to(dtype)
        return torch.softmax(combined, dim=-1)[..., :-1].to(dtype)
    if softmax_fp32:
        return torch.softmax(scores.float(), dim=-1).to(dtype)
    return torch.softmax(scores, dim=-1)


# -- torch ---------------------------------------------------------------------------------------


def paged_attention_torch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    chunk: int | None,
    softmax_fp32: bool,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The padded, vectorised formulation (see the module docstring): q [T, Hq, D] -> [T, Hq, D].

    Same arithmetic as the eager ``_attend``: scores in q's dtype times scale, masked with -inf,
    softmax (in fp32 when ``softmax_fp32``, cast back), then probs @ V. Padding keys get -inf
    and zero values (a padded slot may hold anything, and 0 * NaN would not be 0); padding
    query rows are computed and dropped.
    """
    t, hq, d = q.shape
    s, qmax, lmax, bs = batch.num_seqs, batch.max_query_len, batch.max_seq_len, batch.block_size
    if t == 0:
        return q.new_empty(0, hq, d)
    hkv = k_pool.shape[1]
    g = hq // hkv
    dev = q.device
    qs = batch.query_start.long()  # [S + 1]
    q_len = qs[1:] - qs[:-1]  # [S]
    ctx = batch.seq_lens.long() - q_len  # [S] cached before the step
    qi = torch.arange(qmax, device=dev)  # [Q]
    q_ok = qi[None, :] < q_len[:, None]  # [S, Q]
    q_idx = torch.where(q_ok, qs[:-1, None] + qi[None, :], 0)  # [S, Q] row of q (0 for padding)
    q_pos = ctx[:, None] + qi[None, :]  # [S, Q]
    ki = torch.arange(lmax, device=dev)  # [L]
    k_ok = ki[None, :] < batch.seq_lens.long()[:, None]  # [S, L]
    slots = batch.block_tables.long()[:, ki // bs] * bs + ki % bs  # [S, L] flat slots
    keys = k_pool[slots]  # [S, L, Hkv, D]
    values = v_pool[slots].masked_fill(~k_ok[:, :, None, None], 0)  # [S, L, Hkv, D]

    qh = q[q_idx].view(s, qmax, hkv, g, d).permute(0, 2, 3, 1, 4)  # [S, Hkv, G, Q, D]
    kh = keys.permute(0, 2, 1, 3).unsqueeze(2)  # [S, Hkv, 1, L, D]
    vh = values.permute(0, 2, 1, 3).unsqueeze(2)  # [S, Hkv, 1, L, D]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [S, Hkv, G, Q, L]
    visible = (ki[None, None, :] <= q_pos[:, :, None]) & k_ok[:, None, :]  # [S, Q, L]
    if chunk:
        visible = visible & ((ki // chunk)[None, None, :] == (q_pos // chunk)[:, :, None])
    if window:
        visible = visible & (ki[None, None, :] > q_pos[:, :, None] - window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = attention_probs(scores, sinks, softmax_fp32, q.dtype)
    out = torch.matmul(probs, vh)  # [S, Hkv, G, Q, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(s * qmax, hq, d)  # [S * Q, Hq, D]
    # Back to the flat token order without a boolean index (no host synchronisation): token i
    # of the step is row (its sequence) * Q + (i - query_start[its sequence]).
    tok = torch.arange(t, device=dev)
    seq = torch.searchsorted(qs[1:], tok, right=True).clamp(max=s - 1)  # [T]
    # tokens past the last sequence's (a mixed-step graph's padding: moeserve.router.graphs) read row 0
    return out[torch.where(tok < qs[-1], seq * qmax + tok - qs[seq], 0)]


# -- Triton --------------------------------------------------------------------------------------


@functools.cache
def _kernels():
    return fresh_module("moeserve.kernels.triton_attention")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _num_sms(device: torch.device) -> int | None:
    """The SMs a launch on ``device`` spreads over (None off CUDA: no split-KV)."""
    return _cuda_sms(device.index or 0) if device.type == "cuda" else None


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Rows per program (BM) and keys per iteration (BN) of the two shapes of step; untuned starting
# points (FlashAttention-2 / vLLM-like), to be timed on the H200s. A decode-only step uses the
# smallest MMA height (16 rows: one token's G heads, or a few tokens); any step with a longer
# query uses 64-row tiles so that each key tile read serves 64 / G query tokens.
TUNING = {
    "decode": dict(BM=16, BN=64, num_warps=4, num_stages=2, SKIP_MASK=False),
    "prefill": dict(BM=64, BN=64, num_warps=4, num_stages=2, SKIP_MASK=True),
}
TILING_ENV = "MOESERVE_ATTENTION_PREFILL_TILING"
TILING_BOUNDS = dict(BM=(16, 256), BN=(16, 256), num_warps=(1, 16), num_stages=(1, 6))  # powers of two but stages


def prefill_tiling_from_env(environ=os.environ) -> dict | None:
    """``MOESERVE_ATTENTION_PREFILL_TILING=BM,BN,warps,stages`` (a measurement switch, read once
    per process): the prefill tiling ``benchmarks/attention.py --tune`` found, tried end to end
    beside today's in one run before it becomes the default. Anything else is refused by name."""
    raw = environ.get(TILING_ENV, "")
    if not raw:
        return None
    allowed = (
        "four integers BM,BN,warps,stages: BM and BN powers of two in 16..256, warps 1, 2, 4, 8 or 16, stages 1..6"
    )
    try:
        values = [int(x) for x in raw.split(",")]
    except ValueError:
        values = []
    if len(values) != 4:
        raise ValueError(f"{TILING_ENV}={raw!r}: allowed {allowed}")
    out = dict(zip(TILING_BOUNDS, values))
    for key, (lo, hi) in TILING_BOUNDS.items():
        v = out[key]
        if not lo <= v <= hi or (key != "num_stages" and v & (v - 1)):
            raise ValueError(f"{TILING_ENV}={raw!r}: {key} {v} is out of range; allowed {allowed}")
    return out


TUNING["prefill"].update(prefill_tiling_from_env() or {})

PREFILL_ENV = "MOESERVE_ATTENTION_PREFILL"
PREFILL_BACKENDS = {
    "triton": "the paged Triton kernel for every sequence (the default)",
    "flash": "a step's trailing fresh prompts through FlashAttention-2's varlen kernel in torch "
    "(torch.ops.aten._flash_attention_forward) on the step's own keys, the rest through the paged Triton kernel",
    "sdpa": "a step's trailing fresh prompts through torch's scaled_dot_product_attention, one call per "
    "prompt on the step's own keys (torch picks its kernel), the rest through the paged Triton kernel",
    "auto": "sdpa where the step's dtype is 16-bit on CUDA, triton otherwise (fp32, the exactness mode, "
    "keeps the paged kernel)",
}


def prefill_backend_from_env(environ=os.environ) -> str:
    """``MOESERVE_ATTENTION_PREFILL=triton|flash|sdpa|auto`` (a measurement switch, read once per
    process): which kernel attends a step's fresh prompts (sequences that start at position 0).
    Anything else is refused by name."""
    raw = environ.get(PREFILL_ENV, "") or "triton"
    if raw not in PREFILL_BACKENDS:
        allowed = "; ".join(f"{k!r}: {v}" for k, v in PREFILL_BACKENDS.items())
        raise ValueError(f"{PREFILL_ENV}={raw!r}: allowed {allowed}")
    return raw


PREFILL = {"backend": prefill_backend_from_env()}
paged.SPLIT_FRESH["on"] = PREFILL["backend"] != "triton"  # only the other backends read the split


def flash_supported(q: torch.Tensor) -> bool:
    """Whether torch's FlashAttention-2 varlen forward runs q's device and dtype (CUDA, sm80
    or newer, 16-bit; torch builds without it report False)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal varlen attention of fresh sequences over their own keys: q [Tf, Hq, D], k, v
    [Tf, Hkv, D], sequence i is rows ``cu_seqlens[i] .. cu_seqlens[i+1]`` of all three
    (int32 [F + 1]); ``window``: keys k > q_pos - window only. Returns [Tf, Hq, D]. Grouped heads
    natively (Hq a multiple of Hkv). Softmax in fp32, P rounded to the inputs' dtype for P @ V,
    as the Triton kernel does."""
    extra = {} if not window else dict(window_size_left=window - 1, window_size_right=0)
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale, **extra
    )[0]


# The sdpa backend launches once per prompt and layer: a step with more fresh prompts than this
# (a chunk of many short prompts, where the launches would cost more than the kernel saves)
# keeps the paged kernel. 8 covers a 8,192-token chunk of 2,048-token prompts.
SDPA_MAX_PROMPTS = 8


# Prompt lengths for SDPA: each fresh prompt is padded (zeros after its last token) to a bucket,
# so that a kernel which builds a plan per shape (cuDNN's: ~10-36 ms per new length on an H100,
# benchmarks/attention.py) builds one per bucket, all of them before the server is ready
# (``warm_up_sdpa``), instead of one per prompt length while serving. Causal attention is exact
# under such padding: a real row attends to rows at or before it only, never to the pad after
# it, and the pad rows' outputs are dropped. Buckets: multiples of 64 up to 1,024 tokens (at
# most 63 pad rows), then SDPA_BUCKETS_PER_OCTAVE per doubling (at most 1/8 of a prompt is
# padding); 40 buckets up to 8,192 tokens.
SDPA_MIN_BUCKET = 64
SDPA_BUCKETS_PER_OCTAVE = 8


def sdpa_bucket(n: int) -> int:
    """The length a fresh prompt of ``n`` tokens is padded to for SDPA (``n`` >= 1)."""
    if n <= SDPA_MIN_BUCKET:
        return SDPA_MIN_BUCKET
    step = max(SDPA_MIN_BUCKET, (1 << ((n - 1).bit_length() - 1)) // SDPA_BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


def sdpa_buckets(max_len: int) -> list[int]:
    """Every bucket a prompt of 1 .. ``max_len`` tokens pads to, ascending."""
    out = [SDPA_MIN_BUCKET]
    while out[-1] < sdpa_bucket(max_len):
        out.append(sdpa_bucket(out[-1] + 1))
    return out


# The SDPA shapes this process has launched: (bucket, Hq, Hkv, Dqk, Dv, dtype, device). A shape
# first seen after ``compilelog.watch`` (the rank is serving) is logged as a compile: the warm-up
# missed it, and cuDNN built a plan while a step waited.
SDPA_SHAPES: set[tuple] = set()


def _sdpa_padded(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """x [n, H, D] -> [1, H, length, D]: a contiguous copy, zero rows after the n real ones (one
    stride pattern per bucket, whatever x's strides: the plan's key holds the strides)."""
    buf = x.new_empty(length, x.shape[1], x.shape[2])
    buf[:n] = x
    buf[n:].zero_()  # finite pad: a masked key's value still meets a zero weight
    return buf.transpose(0, 1)[None]


def sdpa_prompts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: tuple[int, ...],
    *,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of fresh sequences over their own keys through torch's
    ``scaled_dot_product_attention``, one call per sequence (grouped heads natively,
    ``enable_gqa``; torch picks the kernel: cuDNN, FlashAttention, memory-efficient or, on the
    CPU, its own): q [Tf, Hq, D], k, v [Tf, Hkv, D], sequence i is the next ``lens[i]`` rows of
    all three, padded to ``sdpa_bucket(lens[i])`` rows. Writes into ``out`` [Tf, Hq, D] (a new
    tensor when None) and returns it. No window: the caller declines a windowed layer whose
    window a prompt exceeds."""
    out = q.new_empty(q.shape) if out is None else out
    at = 0
    for n in lens:
        length = sdpa_bucket(n)
        shape = (length, q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, q.device)
        if shape not in SDPA_SHAPES:
            SDPA_SHAPES.add(shape)
            compilelog.planned(
                f"sdpa[length={length}, heads={q.shape[1]}/{k.shape[1]}, dims={q.shape[2]}/{v.shape[2]}]"
            )
        # [1, H, L, D]: torch's fused kernels (FlashAttention, cuDNN, memory-efficient) take
        # 4-D inputs only; a 3-D call would fall back to the math kernel, which materializes
        # the [H, L, L] scores
        qs, ks, vs = (_sdpa_padded(x[at : at + n], n, length) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[at : at + n] = o[0, :, :n].transpose(0, 1)
        at += n
    return out


def warm_up_sdpa(
    num_heads: int, num_kv_heads: int, dqk: int, dv: int, max_len: int, dtype: torch.dtype, device, scale: float
) -> int:
    """Launch ``sdpa_prompts`` once at every bucket up to ``max_len`` tokens (the longest fresh
    prompt a step can carry), so that every plan a kernel builds per shape is built before
    serving. Returns the launches."""
    n = 0
    for length in sdpa_buckets(max_len):
        q = torch.zeros(length, num_heads, dqk, dtype=dtype, device=device)
        k = torch.zeros(length, num_kv_heads, dqk, dtype=dtype, device=device)
        v = torch.zeros(length, num_kv_heads, dv, dtype=dtype, device=device)
        sdpa_prompts(q, k, v, (length,), scale=scale)
        n += 1
    return n


def sdpa_serves(x) -> bool:
    """Whether the ``sdpa`` prefill backend serves a step whose queries are ``x`` (a tensor, or
    anything with its ``is_cuda`` and ``dtype``): the switch says ``sdpa``, or ``auto`` and x is
    16-bit on CUDA."""
    backend = PREFILL["backend"]
    return backend == "sdpa" or (backend == "auto" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


def sdpa_takes(f: FreshSuffix | None, x) -> bool:
    """Whether the ``sdpa`` prefill backend takes a step's fresh prompts ``f`` (queries ``x``):
    it serves x (``sdpa_serves``) and there are at most ``SDPA_MAX_PROMPTS`` of them (what each
    attention adds to this is its own: ``fresh_suffix`` for the paged layers,
    ``mla.fresh_prompts`` for MLA)."""
    return f is not None and len(f.lens) <= SDPA_MAX_PROMPTS and sdpa_serves(x)


def fresh_suffix(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    batch: PagedBatch,
    chunk: int | None,
    sinks: torch.Tensor | None,
    k_new: torch.Tensor | None,
    window: int | None = None,
) -> FreshSuffix | None:
    """The step's trailing fresh prompts when the ``flash`` or ``sdpa`` prefill backend may
    attend them: the switch is on, the step's keys were passed, no sink logits (neither kernel
    has them), the pools hold q's dtype (what was written is what is read), every such prompt
    lies in its first attention chunk (Llama 4's chunked layers are causal there) and, for
    ``sdpa``, within its sliding window (SDPA's causal mask has none) and there are at most
    ``SDPA_MAX_PROMPTS`` of them; ``flash`` runs where torch has FlashAttention for q
    (``flash_supported``)."""
    f = batch.fresh
    backend = PREFILL["backend"]
    if backend == "auto":
        backend = "sdpa" if sdpa_serves(q) else "triton"
    if backend == "triton" or f is None or k_new is None or sinks is not None:
        return None
    if k_pool.dtype != q.dtype or k_new.dtype != q.dtype or (chunk and f.max_len > chunk):
        return None
    if backend == "sdpa":
        return f if sdpa_takes(f, q) and not (window and f.max_len > window) else None
    return f if flash_supported(q) else None


MAX_SEGMENTS = 16  # split-KV segments at most (a power of two: the reduction's arange)
MIN_KEYS_PER_SEGMENT = 256  # a segment shorter than this costs more in partials than it saves


class BatchShape(Protocol):
    """The host ints of a step that ``attention_config`` reads: a PagedBatch, or its shape alone
    (``moeserve.router.graphs`` asks for the split of a step it has not built yet)."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...


def one_tile_per_sequence(max_query_len: int, g: int, bm: int) -> bool:
    """Whether every sequence's new tokens times its G heads fit one ``bm``-row tile (decode-like:
    a step of a few such sequences splits their keys over segments). True for a decode step's
    16-row tile and also for the 64-row prefill tile of queries of 17 / G .. 64 / G tokens."""
    return max_query_len * g <= bm


def attention_config(
    batch: BatchShape, num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int | None = None
) -> dict:
    """Launch parameters of a step (host ints only, so the choice is free and graph-capturable
    for a fixed shape): BM, BQ = BM // G query tokens per program, BN, warps, stages, the grid's
    query-tile count T // BQ + S, and NS key segments (1 = no split)."""
    g = num_heads // num_kv_heads
    cfg = dict(TUNING["decode" if batch.max_query_len * g <= TUNING["decode"]["BM"] else "prefill"])
    cfg["BM"] = max(cfg["BM"], _pow2(g))
    if head_dim > 128:
        cfg["BN"] = 32  # keep the [BM, DP] accumulator and [BN, DP] tiles in registers
    cfg["BQ"] = cfg["BM"] // g
    cfg["tiles"] = batch.num_tokens // cfg["BQ"] + batch.num_seqs
    ns = 1
    if num_sms and one_tile_per_sequence(batch.max_query_len, g, cfg["BM"]):
        # Decode-like (one tile per sequence): with fewer programs than ~2 waves of SMs, split
        # each sequence's keys so that every SM gets work; each segment keeps >= MIN keys.
        programs = batch.num_seqs * num_kv_heads
        while (
            ns < MAX_SEGMENTS
            and programs * ns * 2 <= 2 * num_sms
            and batch.max_seq_len >= 2 * ns * MIN_KEYS_PER_SEGMENT
        ):
            ns *= 2
    cfg["NS"] = ns
    return cfg


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    chunk: int | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_segments: int | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton varlen paged flash-attention: q [T, Hq, D] -> [T, Hq, D] (q's dtype), one
    launch per call (two with a split key range). ``window``: keys k > q_pos - window only;
    ``sinks`` [Hq]: the running max and sum of each head start from its sink logit.

    The softmax runs online in fp32 (base 2, scale folded in) and P is rounded to the pools'
    dtype for the P @ V product, as FlashAttention does; with fp32 tensors both products use
    IEEE fp32 (not TF32), so the result matches the torch path to rounding.
    ``num_segments`` (a power of two) forces the split (tests); None picks it from the shape.

    With ``MOESERVE_ATTENTION_PREFILL=flash`` (or ``sdpa``) and the step's own keys ``k_new``,
    ``v_new`` [T, Hkv, D], the step's trailing fresh prompts (``fresh_suffix``) go through
    ``flash_varlen`` (``sdpa_prompts``) instead and the kernel runs over the sequences before
    them only (``FreshSuffix.head``).
    """
    t, hq, d = q.shape
    f = fresh_suffix(q, k_pool, batch, chunk, sinks, k_new, window) if t else None
    if f is not None:
        assert k_new is not None and v_new is not None
        t0 = f.first_token
        if sdpa_serves(q):
            out = q.new_empty(t, hq, d)
            sdpa_prompts(q[t0:], k_new[t0:], v_new[t0:], f.lens, scale=scale, out=out[t0:])
        else:
            tail = flash_varlen(q[t0:], k_new[t0:], v_new[t0:], f.cu_seqlens, f.max_len, scale=scale, window=window)
            if f.head is None:
                return tail
            out = q.new_empty(t, hq, d)
            out[t0:] = tail
        if f.head is not None:
            _paged_triton(q[:t0], k_pool, v_pool, f.head, out[:t0], scale, chunk, window, sinks, num_segments)
        return out
    out = q.new_empty(t, hq, d)
    if t == 0:
        return out
    _paged_triton(q, k_pool, v_pool, batch, out, scale, chunk, window, sinks, num_segments)
    return out


def _paged_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: PagedBatch,
    out: torch.Tensor,
    scale: float,
    chunk: int | None,
    window: int | None,
    sinks: torch.Tensor | None,
    num_segments: int | None,
) -> None:
    """The paged kernel's launch(es) for q [T, Hq, D] into ``out`` [T, Hq, D] (a view may do)."""
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    if k_pool.stride(2) != 1 or v_pool.stride() != k_pool.stride() or q.stride(2) != 1:
        raise ValueError(
            "paged_attention_triton: the head dim of q and of the pools must be contiguous, "
            "and k and v pools must share strides"
        )
    sms = _num_sms(q.device)
    cfg = attention_config(batch, hq, hkv, d, sms)
    ns = num_segments if num_segments is not None else cfg["NS"]
    if ns < 1 or ns & (ns - 1):
        raise ValueError(f"num_segments must be a power of two >= 1, found {ns}")
    dp = max(16, _pow2(d))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands
    if ns > 1:
        part = torch.empty(t, hq, ns, dp, dtype=torch.float32, device=q.device)
        stat = torch.empty(t, hq, ns, 2, dtype=torch.float32, device=q.device)
    else:
        part = stat = out  # not read: the NS == 1 branch is compiled out
    k = _kernels()
    extra = {} if _interpreted() else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    k.paged_attention_kernel[(cfg["tiles"], hkv, ns)](
        q,
        k_pool,
        v_pool,
        out,
        part,
        stat,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start,
        out if sinks is None else sinks,  # (not read without sinks; an aligned fresh tensor keeps one compile)
        batch.num_seqs,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        out.stride(0),
        out.stride(1),
        batch.block_tables.stride(0),
        HQ=hq,
        G=hq // hkv,
        D=d,
        DP=dp,
        B=batch.block_size,
        CHUNK=chunk or 0,
        WINDOW=window or 0,
        HAS_SINKS=sinks is not None,
        BM=cfg["BM"],
        BQ=cfg["BQ"],
        BN=cfg["BN"],
        NS=ns,
        SKIP_MASK=cfg["SKIP_MASK"],
        PRECISION=precision,
        INTERPRET=_interpreted(),
        **extra,
    )
    if ns > 1:
        k.paged_attention_reduce_kernel[(t, hq)](
            part,
            stat,
            out,
            out.stride(0),
            out.stride(1),
            HQ=hq,
            D=d,
            DP=dp,
            NS=ns,
            **({} if _interpreted() else dict(num_warps=1)),
        )


def warm_up_attention(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    num_heads: int,
    block_size: int,
    variants: Iterable[tuple[int | None, int | None, torch.Tensor | None]],
    scale: float,
    max_fresh: int = 0,
) -> int:
    """Compile ``paged_attention_triton`` for every launch configuration a step can pick, before
    serving: for each kind of layer the model has, ``(chunk, window, sinks)`` as its layers call
    the kernel (None: global, no window, no sinks; one layer's sinks [Hq] stand for all, as they
    share a dtype), the decode tile at every split (1 .. MAX_SEGMENTS segments, with the
    reduction), the prefill tile at every split for a query just past the decode tile (a few
    sequences of 17 / G .. 64 / G new tokens each over long contexts split their keys too) and
    the prefill tile unsplit (and, with ``MOESERVE_ATTENTION_PREFILL=flash``, one launch
    of ``flash_varlen``; with ``sdpa``, ``warm_up_sdpa`` at every bucket up to ``max_fresh``
    tokens, the longest fresh prompt a step carries). ``k_pool`` and ``v_pool``: one layer's
    views of the router's pool (every layer's have the same strides, so the same keys). Reads
    block 0 of the pool, writes nothing of it. Returns the launches."""
    hkv, d = k_pool.shape[1], k_pool.shape[2]
    device, dtype = k_pool.device, k_pool.dtype
    g = num_heads // hkv
    prefill = max(TUNING["prefill"]["BM"], 2 * TUNING["decode"]["BM"]) // g + 1  # a query no decode tile holds
    # the shortest query past the decode tile: the prefill tile, still one per sequence, so split too
    short = TUNING["decode"]["BM"] // g + 1  # (1 where G > 16: every step takes the prefill tile)
    keys = 2 * MAX_SEGMENTS * MIN_KEYS_PER_SEGMENT  # long enough for every split
    shapes = [([1], [keys - 1])] + ([([short], [keys - short])] if short > 1 else []) + [([prefill], [0])]
    kinds: dict[tuple[int, int, bool], torch.Tensor | None] = {}
    for chunk, window, sinks in variants:
        kinds.setdefault((chunk or 0, window or 0, sinks is not None), sinks)
    n = 0
    sdpa_fresh = False
    for (chunk, window, _), sinks in sorted(kinds.items(), key=lambda kv: kv[0]):
        for lens, starts in shapes:
            blocks = -(-(starts[0] + lens[0]) // block_size)
            batch = PagedBatch.build(lens, starts, [[0] * blocks], block_size, device)
            q = torch.zeros(lens[0], num_heads, d, dtype=dtype, device=device)
            bm = attention_config(batch, num_heads, hkv, d)["BM"]
            one_tile = one_tile_per_sequence(lens[0], g, bm)
            splits = [1 << i for i in range(MAX_SEGMENTS.bit_length())] if one_tile else [1]
            for ns in splits:
                paged_attention_triton(
                    q,
                    k_pool,
                    v_pool,
                    batch,
                    scale=scale,
                    chunk=chunk or None,
                    window=window or None,
                    sinks=sinks,
                    num_segments=ns,
                )
                n += 1
            k_new, v_new = k_pool[: lens[0]], v_pool[: lens[0]]
            if lens[0] > 1 and fresh_suffix(q, k_pool, batch, chunk or None, sinks, k_new, window or None) is not None:
                # the flash or sdpa prefill backend: nothing to compile, but flash's first launch loads
                # the module and cuDNN's SDPA builds a plan per length (every bucket, once, below)
                assert batch.fresh is not None
                if sdpa_serves(q):
                    sdpa_fresh = True
                else:
                    flash_varlen(q, k_new, v_new, batch.fresh.cu_seqlens, lens[0], scale=scale, window=window or None)
                    n += 1
    if sdpa_fresh:
        n += warm_up_sdpa(num_heads, hkv, d, d, max(max_fresh, prefill), dtype, device, scale)
    return n
