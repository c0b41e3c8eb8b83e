"""moeserve's kernels: the Triton kernels of the serving path, their launchers and torch
fallbacks, CUDA-graph capture and the log of Triton compiles.

Modules: this one (the launchers of the direct exchange's kernels, the grouped expert MLP of
decode steps, silu-and-multiply, the weighted sum over k, the fused norms and RoPE and the fused
routing); ``triton_exchange``, ``triton_experts``, ``triton_attention``, ``triton_sampling``,
``triton_norms`` and ``triton_routing`` (the ``@triton.jit`` kernels, imported only when Triton
is present); ``cudagraph`` (capture that keeps the allocator's
caches); ``compilelog`` (every Triton compile while serving, logged).

The direct (NVLink) exchange: rows written straight into peers' buffers.

Dimension letters: T tokens of a router, K top-k, N = T*K (token, k) pairs, H hidden, R ranks,
P slots per MoE layer, W workers, S = P / W slots per worker, C rows a receive buffer holds
(its capacity), I expert intermediate size.

The kernels take *device-side* counts and destinations, so that no host synchronisation is
needed anywhere in a MoE layer: a kernel is launched over an upper bound of rows known on the
host (N, or C) and rows past the device-side total do nothing. Peers' buffers are reached
through tables of raw device addresses [R] (int64), one per rank, from torch's symmetric
memory (``moeserve.dataplane.nvlink``); a store through a peer's address goes over NVLink. Each step of
the exchange is one launch (two for the slot choice with break-even counts), and there is no
sort: slot choice and per-block histograms (``route``), block prefixes and the counts'
publication (``publish``), the layout (``prep``), the rows (``scatter_pairs``, which ranks each
pair within its slot as a stable sort would) and the way back (``return_rows``): at a few
thousand tokens a layer is bound by host launches, not bytes (a stable ``torch.sort`` alone
costs ~60 us of host time on an H200 machine).

Rounding follows torch's: a scaled row is ``x * w`` computed in fp32 and rounded once to the
dtype (as ``torch.mul`` does); silu is ``x / (1 + exp(-x))`` with IEEE division and libdevice's
``exp`` (what ATen's kernel compiles to), rounded to the dtype before the product with the up
projection; the weighted sum over k accumulates in fp32 in k order and rounds once.

Triton is imported lazily: the data plane must import without it (CPU, gloo). Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is how the tests check them
(the interpreter truncates fp32 -> bf16 instead of rounding to nearest, so bf16 results may
differ from torch's in the last bit there, never on the GPU).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch

from moeserve.config import env_switch


@functools.cache
def available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def fresh_module(name: str):
    """Import a module of Triton kernels anew: TRITON_INTERPRET is read when kernels are
    defined, so each cache generation (tests switch it) gets its own copy. Callers cache it."""
    import importlib
    import sys

    sys.modules.pop(name, None)
    return importlib.import_module(name)


@functools.cache
def _kernels():
    k = fresh_module("moeserve.kernels.triton_exchange")
    return dict(
        route=k.route_kernel,
        expert_count=k.expert_count_kernel,
        publish=k.publish_kernel,
        prep=k.prep_kernel,
        scatter=k.scatter_pairs_kernel,
        ret=k.return_rows_kernel,
        silu_mul=k.silu_mul_kernel,
        weighted_sum=k.weighted_sum_kernel,
    )


@functools.cache
def _expert_kernels():
    return fresh_module("moeserve.kernels.triton_experts")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def _block(n: int) -> int:
    """Columns per iteration: the largest power of two <= 1024 dividing n (no masked tail), or
    the next power of two when n has no such divisor >= 64."""
    b = 1024
    while b >= 64:
        if n % b == 0:
            return b
        b //= 2
    return min(1024, max(16, _pow2(n)))


# (rows per program, columns per iteration, warps) of the two row-moving kernels.
TUNING = {"scatter": (8, 1024, 8), "return": (16, 512, 8)}  # picked from 28 pairs timed on 2 x H200

BLOCK_PAIRS = 256  # pairs per block of route/scatter (the unit of the stable in-block ranking)


def num_blocks(n: int) -> int:
    return (n + BLOCK_PAIRS - 1) // BLOCK_PAIRS


def pair_args(
    x: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None, n: int, offset: int = 0
) -> torch.Tensor:
    """The int64 [5] host table the routing kernels read their inputs from: addresses of x
    [T, H], ids int64 [T, K] and the per-pair weights [N] (0 when absent), N, and the replica
    offset. Copied to the device before the kernels run (``NvlinkExchange`` keeps one device
    copy, so that kernels captured once in a CUDA graph read each step's tensors)."""

    def addr(t):
        return 0 if t is None else t.data_ptr()

    return torch.tensor([addr(x), addr(ids), addr(weights), n, offset], dtype=torch.long)


def route(
    args: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    num_slots: int,
    single: bool,
    k: int,
    capacity: int,
    breakeven: torch.Tensor | None = None,
    router: int = 0,
    num_routers: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of a router's pairs and their per-block histogram.

    args:      device int64 [5] from ``pair_args``: ids int64 [T, K] contiguous, N = T*K, and
               the offset, router index + step (the replica rule of ``moeserve.dataplane.exchange.
               choose_slots``: token t takes replica (t + offset) mod logcnt[e]; replica 0 when
               ``single``).
    log2phy:   int64 [E, X] (-1 padded), logcnt int64 [E].
    breakeven: int64 [E] break-even counts b, or None (no threshold: one launch). With it, a
               first kernel counts this router's N pairs per expert (a histogram over all of
               them, atomically summed over blocks into a zeroed [E] buffer) and the route kernel
               applies choose_slots' break-even rule: estimate n = count x ``num_routers``; at or
               below b[e] > 0 every pair of e takes replica (offset - ``router``) mod logcnt[e]
               (the step's, the same on every router), above it (t + offset) mod
               min(logcnt[e], ceil(n / b[e])). Fixed grids, nothing read back: capturable.
    capacity:  the most pairs (the grid covers it; blocks past N do nothing).
    returns    (slots int32 [capacity], first N valid, in flat (token, k) order; hist int32
               [capacity blocks, PB]: pairs per slot in each block of BLOCK_PAIRS pairs, first
               ceil(N / BLOCK_PAIRS) valid; PB = next power of two >= num_slots).
    """
    pb = _pow2(num_slots)
    nb = max(1, num_blocks(capacity))
    dev = log2phy.device
    slots = torch.empty(nb * BLOCK_PAIRS, dtype=torch.int32, device=dev)
    hist = torch.empty(nb, pb, dtype=torch.int32, device=dev)
    use_b = breakeven is not None and not single
    if use_b:
        eb = _pow2(max(2, log2phy.shape[0]))
        ecnt = torch.zeros(eb, dtype=torch.int32, device=dev)
        _kernels()["expert_count"][(nb,)](args, ecnt, B=BLOCK_PAIRS, EB=eb, num_warps=4)
    else:
        ecnt = breakeven = logcnt  # not read
    _kernels()["route"][(nb,)](
        args,
        log2phy,
        logcnt,
        slots,
        hist,
        ecnt,
        breakeven,
        router,
        K=k,
        X=log2phy.shape[1],
        SINGLE=single,
        BREAKEVEN=use_b,
        NR=num_routers,
        B=BLOCK_PAIRS,
        PB=pb,
        num_warps=4,
    )
    return slots, hist


def publish(
    args: torch.Tensor,
    hist: torch.Tensor,
    prefix: torch.Tensor,
    counts_table: torch.Tensor,
    rank: int,
    sent: torch.Tensor,
    num_slots: int,
) -> None:
    """From the block histograms [nb, PB] of the N pairs in ``args``: prefix [nb, PB] (pairs of
    each slot in earlier blocks), this router's pairs per slot c [P] into row ``rank`` of every
    rank's counts [R, P] (addresses in ``counts_table`` [R]), and c added to ``sent`` (int64
    [P], contiguous)."""
    pb = _pow2(num_slots)
    _kernels()["publish"][(1,)](
        args,
        hist,
        prefix,
        counts_table,
        sent,
        rank,
        R=counts_table.numel(),
        P=num_slots,
        PB=pb,
        B=BLOCK_PAIRS,
        CH=max(1, min(32, 4096 // pb)),
        num_warps=4,
    )


def prep(
    counts: torch.Tensor, rank: int, worker: int, num_workers: int, shift: torch.Tensor, offs: torch.Tensor
) -> None:
    """From every rank's counts [R, P]: shift [P] (the rows of the slots before p on p's worker
    plus the rows earlier ranks send to p; a pair's row there is shift[p] + its rank among this
    router's pairs of slot p) and, when ``worker >= 0``, the worker's cumulative rows per slot,
    offs int32 [S]."""
    r, p = counts.shape
    s = p // num_workers
    _kernels()["prep"][(1,)](
        counts, shift, offs, rank, worker, R=r, W=num_workers, S=s, RB=_pow2(r), WB=_pow2(num_workers), SB=_pow2(s)
    )


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def scatter_pairs(
    args: torch.Tensor,
    dtype: torch.dtype,
    hidden_size: int,
    k: int,
    scaled: bool,
    slots: torch.Tensor,
    prefix: torch.Tensor,
    shift: torch.Tensor,
    slots_per_worker: int,
    worker_base: int,
    rows_table: torch.Tensor,
    meta_table: torch.Tensor,
    meta_base: int,
) -> None:
    """Write the rows of the N (token, k) pairs in ``args`` into their workers' receive buffers.

    args:         device int64 [5] from ``pair_args``: x [T, H] contiguous of ``dtype``, and
                  when ``scaled`` the per-pair weights [N] of ``dtype``; the row sent is
                  ``x[token] * w[pair]`` rounded to the dtype, as ``torch.mul`` rounds it.
    slots, prefix from ``route`` / ``publish`` (capacity-sized; the grid covers them and stops
                  at N); shift int64 [P] from ``prep``.
    worker_base:  world rank of worker 0 (workers are ranks worker_base .. worker_base + W - 1).
    rows_table:   int64 [R] addresses of every rank's receive buffer [C, H] (of ``dtype``);
    meta_table:   int64 [R] addresses of every rank's int64 [C] return addresses; a pair's
                  return address is ``meta_base + pair``.
    A worker's rows end up slot-major, by sending rank inside a slot and in pair order inside
    a rank: the order a stable sort by slot gives.
    """
    rows, block_h, num_warps = TUNING["scatter"]
    _kernels()["scatter"][(prefix.shape[0], BLOCK_PAIRS // rows)](
        args,
        slots,
        prefix,
        shift,
        rows_table,
        meta_table,
        meta_base,
        worker_base,
        H=hidden_size,
        K=k,
        S=slots_per_worker,
        PB=prefix.shape[1],
        DTYPE=_tl_dtype(dtype),
        SCALE=scaled,
        B=BLOCK_PAIRS,
        ROWS=rows,
        BLOCK_H=min(_block(hidden_size), block_h),
        num_warps=num_warps,
    )


def return_rows(
    y: torch.Tensor, meta: torch.Tensor, total: torch.Tensor, out_table: torch.Tensor, capacity: int
) -> None:
    """Send expert outputs back: row j < total of ``y`` [C, H] goes to rank ``meta[j] // capacity``,
    row ``meta[j] % capacity`` of its output buffer (address in ``out_table`` [R]).
    total: int32/int64 [1] on the device. Rows past it are not read."""
    c, h = y.shape
    if c == 0:
        return
    rows, block_h, num_warps = TUNING["return"]
    _kernels()["ret"][((c + rows - 1) // rows,)](
        y, meta, total, out_table, capacity, H=h, ROWS=rows, BLOCK_H=min(_block(h), block_h), num_warps=num_warps
    )


# Programs of the kernels over a worker's rows (silu_mul, quant_rows), each taking every P-th row
# below the device total: a worker's buffer holds max_num_batched_tokens x top_k rows (ERNIE's
# 8,192 x 8) while a decode step fills a fraction, and a program per row of the capacity left
# most of them loading the total only to exit.
ROW_PROGRAMS = 1024


def silu_mul(gu: torch.Tensor, total: torch.Tensor | None = None, programs: int | None = None) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for the first ``total`` rows (device scalar [1]; None: every
    row) of gu [C, 2I] (contiguous); returns [C, I] (rows past total are left unwritten). Each
    product rounds as torch's ``F.silu(g) * u``: silu in fp32 rounded to the dtype, the product
    in fp32 rounded. ``programs``: the grid (default ``ROW_PROGRAMS``, at most C; a
    benchmark's measurement knob: every grid computes the same values)."""
    c, two_i = gu.shape
    i = two_i // 2
    if gu.stride(1) != 1 or (c > 1 and gu.stride(0) != two_i):
        raise ValueError(f"silu_mul: gu must be contiguous [C, 2I], got strides {tuple(gu.stride())}")
    if programs is not None and programs < 1:
        raise ValueError(f"silu_mul: programs must be >= 1, got {programs}")
    out = gu.new_empty(c, i)
    if c:
        has_total = total is not None
        grid = min(c, programs or ROW_PROGRAMS)
        _kernels()["silu_mul"][(grid,)](
            gu, out, total if has_total else gu, c, I=i, BLOCK=_block(i), PRECISE=not _interpreted(),
            HAS_TOTAL=has_total, num_warps=4,
        )  # fmt: skip
    return out


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T*K, H] (token, k) order, w [T, K] (cast to x's dtype first, as the bmm it replaces
    did) -> [T, H]: sum_k w[t, k] * x[t*K + k], fp32 accumulation in k order."""
    t, k = w.shape
    h = x.shape[1]
    out = x.new_empty(t, h)
    if t:
        _kernels()["weighted_sum"][(t,)](x, w.to(x.dtype).contiguous(), out, H=h, K=k, BLOCK_H=_block(h), num_warps=4)
    return out


@functools.cache
def _norm_kernels():
    return fresh_module("moeserve.kernels.triton_norms")


NORM_MAX_H = 16384  # widest row a norm program holds in registers (one tile per row)


def _cuda_switch(name: str, on: str, off: str, default: str = "1") -> tuple[str, ...]:
    """The devices a 0/1 variable ``name`` (``config.env_switch``) lets a CUDA path take:
    ("cuda",) or ()."""
    return ("cuda",) if env_switch(name, default, on, off) else ()


# Where the models' norms, RoPE and MLP activations take the fused kernels (tests add "cpu": the
# interpreter); MOESERVE_FUSED_NORMS=0 keeps torch's sequences everywhere (side-by-side runs and checks).
def _norm_devices() -> tuple[str, ...]:
    return _cuda_switch("MOESERVE_FUSED_NORMS", "fused on CUDA", "torch's")


NORM_DEVICES: tuple[str, ...] = _norm_devices()
# The dtypes that take them: fp32 is the exactness mode and keeps torch's sequences (ERNIE fp32
# on 1 x H200 met its 1e-4 contract with them, 4.5e-5; with the kernels the model's own
# batched-vs-alone floor had two routing flips at the same seed: docs/engine.md).
NORM_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


@functools.cache
def _norm_tile(width: int) -> tuple[int, int, int]:
    """(columns, rows, warps) of a norm program over rows of ``width``: the whole row in one
    tile, several rows per program when rows are narrow (a head of 64-256), ~16 values a thread."""
    block = _pow2(width)
    rows = max(1, min(16, 4096 // block))
    return block, rows, max(1, min(8, rows * block // 512))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous and 16-byte aligned (the one alignment key the norm kernels are
    compiled for), else a copy that is."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def fused_norms_take(
    x: torch.Tensor, weight: torch.Tensor | None, weight_first: bool = False, max_width: bool = True
) -> bool:
    """Whether ``rms_norm`` / ``head_rope`` (and ``silu_mul`` for an MLP: ``max_width`` False,
    it loops over a row) serve x [..., H]: a CUDA tensor of a half dtype (``NORM_DTYPES``) with
    Triton present, a row that fits one tile, and a weight whose product rounds as the kernel's
    (the dtype of x, or any with ``weight_first``); otherwise the caller keeps its torch path."""
    return (
        x.device.type in NORM_DEVICES
        and available()
        and x.dtype in NORM_DTYPES
        and 0 < x.shape[-1] <= (NORM_MAX_H if max_width else 1 << 30)
        and (weight is None or weight_first or weight.dtype == x.dtype)
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_first: bool = False,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of ``triton_norms.rms_norm_kernel`` over the rows of x [..., H]: returns (y, s)
    with s = x + residual rounded to x's dtype (None without a residual) and y the RMS norm of
    s (or x) scaled by ``weight`` [H] (None: unscaled) as ``moeserve.models.layers.rms_norm``
    rounds it. The caller checks ``fused_norms_take`` first."""
    h = x.shape[-1]
    x2 = _dense(x.reshape(-1, h))
    res = None if residual is None else _dense(residual.reshape(-1, h).to(x.dtype))
    w = None if weight is None else _dense(weight)
    n = x2.shape[0]
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if res is not None else None
    if n:
        block, rows, warps = _norm_tile(h)
        _norm_kernels().rms_norm_kernel[((n + rows - 1) // rows,)](
            x2, res if res is not None else x2, w if w is not None else x2, out, total if total is not None else out,
            n, float(eps), H=h, BLOCK_H=block, ROWS=rows, HAS_RES=res is not None, HAS_WEIGHT=w is not None,
            WEIGHT_FIRST=weight_first, num_warps=warps,
        )  # fmt: skip
    return out.view(x.shape), None if total is None else total.view(x.shape)


def head_rope(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    interleaved: bool,
    eps: float,
    pre_weight: torch.Tensor | None = None,
    post_norm: bool = False,
) -> torch.Tensor:
    """One launch of ``triton_norms.head_rope_kernel`` over x [T, heads, D] (D a power of two):
    the RMS norm weighted by ``pre_weight`` [D] when given, the rotary embedding by cos/sin
    [T, D/2] fp32 when given, then a weightless RMS norm with ``post_norm``, each rounded to x's
    dtype as the torch sequence of ``moeserve.models.layers.Attention`` rounds it. x may be a
    view whose tokens are ``x.stride(0)`` apart (q or k of a merged qkv product, read in place);
    returns a contiguous [T, heads, D]."""
    t, heads, d = x.shape
    if d & (d - 1):
        raise ValueError(f"head_rope needs a power-of-two head dim, got {d}")
    if x.stride(2) == 1 and x.stride(1) == d and x.data_ptr() % 16 == 0 and x.stride(0) % 16 == 0:
        x2, stride_t = x, x.stride(0)  # read in place (the strides the kernel is compiled for)
    else:
        x2, stride_t = _dense(x.reshape(t * heads, d)), heads * d
    rope = cos is not None and sin is not None
    c = _dense(cos.float()) if cos is not None and rope else x2
    s = _dense(sin.float()) if sin is not None and rope else x2
    w = _dense(pre_weight) if pre_weight is not None else x2
    n = t * heads
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        _, rows, warps = _norm_tile(d)
        _norm_kernels().head_rope_kernel[((n + rows - 1) // rows,)](
            x2, w, c, s, out, n, heads, stride_t, float(eps), D=d, ROWS=rows, PRE_NORM=pre_weight is not None, ROPE=rope,
            POST_NORM=post_norm, INTERLEAVED=interleaved, num_warps=warps,
        )  # fmt: skip
    return out.view(t, heads, d)


@functools.cache
def _routing_kernels():
    return fresh_module("moeserve.kernels.triton_routing")


ROUTING_MAX_E = 512  # most experts a routing program holds in registers (one tile per row)
ROUTING_MAX_K = 16


# Where ``models.routing.route`` takes the fused routing kernel (tests add "cpu": the
# interpreter); MOESERVE_FUSED_ROUTING=0 keeps torch's sequence everywhere (side-by-side runs).
def _routing_devices() -> tuple[str, ...]:
    return _cuda_switch("MOESERVE_FUSED_ROUTING", "fused on CUDA", "torch's")


ROUTING_DEVICES: tuple[str, ...] = _routing_devices()


class RoutingKind(Protocol):
    """What ``fused_route_takes`` reads of a routing function (``models.config.RoutingSpec``)."""

    @property
    def scoring(self) -> str: ...

    @property
    def topk_first(self) -> bool: ...

    @property
    def n_group(self) -> int: ...

    @property
    def topk_group(self) -> int: ...


# Where the fused routing kernel also takes DeepSeek-V3's group-limited selection (tests add
# "cpu"); MOESERVE_FUSED_GROUPED_ROUTING=0 keeps torch's sequence. On an H100 the kernel took
# 10.5 / 15.4 us against torch's 69.5 / 127.4 at 256 / 2,048 rows, ids and weights bit-identical
# (benchmarks/norm_kernels.py --cases dsv3_route; results/router-kernels-grouped-routing-h100.json),
# and DeepSeek-V3 with EPLB on gave EPLB off's tokens through it
# (results/gpu-correctness-eplb-off-dsv3-fused-grouped-h100.json).
def _grouped_routing_devices() -> tuple[str, ...]:
    return _cuda_switch("MOESERVE_FUSED_GROUPED_ROUTING", "fused on CUDA", "torch's grouped selection", default="1")


GROUPED_ROUTING_DEVICES: tuple[str, ...] = _grouped_routing_devices()
ROUTING_MAX_GROUPS = 64  # expert groups a routing program scores (one unrolled pass each)


def fused_route_takes(logits: torch.Tensor, spec: RoutingKind, top_k: int, parts: int = 1) -> bool:
    """Whether ``fused_route`` serves gate logits [T, E] (``parts`` > 1: [T, parts x E], the
    partial logits of ``gate_parts``) routed by ``spec`` to ``top_k`` experts: a tensor on a
    device of ``ROUTING_DEVICES`` (CUDA, never under the interpreter) with Triton present, a
    float dtype, the top-k taken on the scores (not ``topk_first``), E <= ``ROUTING_MAX_E`` and
    1 <= K <= ``ROUTING_MAX_K``, K <= E; expert groups (``n_group`` > 1) only on a device of
    ``GROUPED_ROUTING_DEVICES``, with E a multiple of at most ``ROUTING_MAX_GROUPS`` groups and
    K within the ``topk_group`` groups kept; otherwise the caller keeps its torch path."""
    e = logits.shape[-1] // parts
    g = spec.n_group
    grouped_ok = g <= 1 or (
        logits.device.type in GROUPED_ROUTING_DEVICES
        and g <= ROUTING_MAX_GROUPS
        and e % g == 0
        and top_k <= spec.topk_group * (e // g)
    )
    return (
        logits.device.type in ROUTING_DEVICES
        and not (logits.device.type == "cuda" and _interpreted())
        and available()
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and parts in (1, GATE_PARTS)
        and (parts == 1 or logits.dtype == torch.float32)
        and not spec.topk_first
        and grouped_ok
        and spec.scoring in ("softmax", "sigmoid")
        and 1 <= top_k <= min(ROUTING_MAX_K, e)
        and e <= ROUTING_MAX_E
    )


# An fp32 gate of bf16 rows on tensor cores (``gate_parts``): the fp32 weight split into three
# bf16 parts whose sum is the weight exactly, one bf16 GEMM of the rows by all three with fp32
# output, the three partial logits summed in fp32. Each product of a bf16 row value and a bf16
# part is exact in fp32, so the logits are the fp32 GEMM's up to the order of fp32 sums. Where
# it runs: GATE_SPLIT_DEVICES (CUDA where torch's GEMM gives bf16 operands an fp32 output; tests
# add "cpu", where the GEMM is emulated in fp32); MOESERVE_GATE_SPLIT=0 keeps x.float() and the
# fp32 GEMM (a measurement switch).
GATE_PARTS = 3


def _gate_split_devices() -> tuple[str, ...]:
    return _cuda_switch("MOESERVE_GATE_SPLIT", "split on CUDA", "fp32 GEMM")


GATE_SPLIT_DEVICES: tuple[str, ...] = _gate_split_devices()


@functools.cache
def _mm_fp32_out(device: str) -> bool:
    """Whether torch's GEMM takes bf16 operands to an fp32 output on ``device`` (``mm.dtype``)."""
    try:
        a = torch.ones(2, 16, dtype=torch.bfloat16, device=device)
        return bool(torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def gate_split_takes(weight: torch.Tensor) -> bool:
    """Whether an fp32 gate ``weight`` [E, H] on its device takes ``gate_parts`` (its rows bf16)."""
    dev = weight.device.type
    return (
        weight.dtype == torch.float32
        and dev in GATE_SPLIT_DEVICES
        and (dev != "cuda" or (torch.cuda.is_available() and _mm_fp32_out(str(weight.device))))
    )


def gate_split_on(x: torch.Tensor) -> bool:
    """Whether rows on ``x``'s device take a gate's parts now (``GATE_SPLIT_DEVICES`` is read
    at each call, so a benchmark can run both paths of one block side by side)."""
    return x.device.type in GATE_SPLIT_DEVICES


def gate_parts(weight: torch.Tensor) -> torch.Tensor | None:
    """fp32 [E, H] -> bf16 [3E, H]: (hi, mid, lo), each the bf16 rounding of what the parts
    before it left, so that (hi + mid) + lo == weight exactly in fp32 (24 significant bits in
    three of 8; bf16 has fp32's exponent range). Checked once here: None where a weight is not
    so split (past bf16's largest finite value, or not finite), for the caller's fp32 GEMM."""
    w = weight.float()
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    if not torch.equal((hi.float() + mid.float()) + lo.float(), w):
        return None
    return torch.cat([hi, mid, lo]).contiguous()


def gate_split_logits(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """bf16 rows x [T, H] by ``gate_parts`` [3E, H] -> the partial logits [T, 3E] in fp32 (one
    GEMM; on CPU emulated: x.float() @ parts.float().T, the same exact products)."""
    if x.device.type == "cuda":
        return torch.mm(x, parts.t(), out_dtype=torch.float32)
    return x.float() @ parts.float().t()


def sum_gate_parts(partial: torch.Tensor) -> torch.Tensor:
    """[T, 3E] partial logits -> [T, E]: (lo + mid) + hi in fp32, the smallest first."""
    e = partial.shape[1] // GATE_PARTS
    return (partial[:, 2 * e :] + partial[:, e : 2 * e]) + partial[:, :e]


@functools.cache
def _routing_tile(e: int) -> tuple[int, int, int]:
    """(padded experts, rows, warps) of a routing program over rows of ``e`` logits: one token
    per program and one warp (the K arg-maxes are warp shuffles). On an H200, in a graph of 28
    launches, ERNIE's routing (E 64, K 6) took 2.6-2.8 us a layer at T 1-256 this way against
    9.6-10.2 with 8 tokens on 2 warps and 17-26 us for torch's sequence; Qwen3's (128, 8) 3.0-3.2,
    DeepSeek-V3's without groups (256, 8) 3.3-3.5."""
    block = _pow2(e)
    return block, 1, 1 if block <= 256 else 2


def fused_route(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    renorm_min: float | None,
    scaling_factor: float,
    out_dtype: torch.dtype,
    parts: int = 1,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of ``triton_routing.fused_route_kernel``: gate logits [T, E] (``parts`` 3:
    the partial logits [T, 3E] of ``gate_split_logits``, summed as ``sum_gate_parts`` sums them
    while loaded) -> (ids int64
    [T, K], weights [T, K] in ``out_dtype``), ``models.routing.route``'s routing without groups:
    scores s = softmax or sigmoid (``scoring``) of the logits in fp32; ids the top-k of s +
    ``correction_bias`` [E] (fp32, or None), with ``n_group`` > 1 among the experts of the
    ``topk_group`` best of ``n_group`` consecutive groups (a group scored by the sum of its two
    best choices, as ``models.routing.group_limited``), in descending order, the lowest index first among
    equal values (torch.topk leaves ties unspecified; in fp32 they are vanishingly rare);
    weights the unbiased s of the ids, divided by their sum (``renormalize``; the sum floored
    at ``renorm_min`` when it is set and not 0), times ``scaling_factor``, rounded once.

    Rounding: fp32 throughout with libdevice's exp and IEEE division (torch's), so only the
    order of the softmax's and the k weights' sums differs from torch's. Nothing is read back
    and only E, K, the tile and the flags are constexprs (the token count is not specialized):
    graph-capturable, one compile per routing whatever the batch. The caller checks
    ``fused_route_takes`` first."""
    t, e = logits.shape
    e //= parts
    x = _dense(logits)
    bias = None if correction_bias is None else _dense(correction_bias.reshape(e).float())
    ids = torch.empty(t, k, dtype=torch.long, device=logits.device)
    weights = torch.empty(t, k, dtype=out_dtype, device=logits.device)
    if t:
        block, rows, warps = _routing_tile(e)
        floor = bool(renormalize and renorm_min)
        _routing_kernels().fused_route_kernel[((t + rows - 1) // rows,)](
            x, bias if bias is not None else x, ids, weights, t, float(renorm_min or 0.0), float(scaling_factor),
            E=e, EB=block, K=k, KB=_pow2(k), ROWS=rows, N_GROUP=n_group, GB=_pow2(n_group), TOPK_GROUP=topk_group,
            PARTS=parts, SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None,
            RENORM=bool(renormalize), FLOOR=floor, SCALE=scaling_factor != 1.0, PRECISE=not _interpreted(),
            num_warps=warps,
        )  # fmt: skip
    return ids, weights


# (BN, BK, warps, stages) of the grouped expert kernels, per projection and rows per pass:
# weights are streamed once per step, [BK, BN] tiles at a time, so these set how close a decode
# step gets to HBM rate. Picked from 24 candidates timed by ``benchmarks/expert_kernel.py --tune``
# on an H200 (results/expert-kernel.json): gate_up 4.05 TB/s at Scout's decode shape (3.16 at
# ERNIE's), down 3.85 (3.14); 64-row passes of down with BK 128 do not fit shared memory.
EXPERT_TUNING = {"gate_up": (128, 64, 8, 3), "down": (128, 128, 4, 4), "down_bm64": (128, 64, 4, 4)}
# FP8 codes are half the bytes per element: the same tiles carry half the bytes in flight, so
# FP8 takes its own (``benchmarks/expert_kernel.py --fp8 --tune``); block-scaled weights take K
# tiles of their scale block (128 at most) whatever the table's BK (``_expert_matmul``).
EXPERT_TUNING_FP8 = {  # (BN, BK, warps, stages, transposed): codes stored [N, K] (ExpertSpec.views)
    # weight-only, the tiles best over both Scout's and ERNIE's layer (results/expert-kernel-fp8-nk-tune.json:
    # gate_up 1.93 / 1.35 TB/s of codes, down 1.91 / 1.38)
    "gate_up": (64, 128, 4, 4, True),
    "down": (128, 128, 4, 4, True),
    "down_bm64": (128, 64, 4, 4, True),
}


# MOESERVE_FP8_TUNING: a JSON object of the same keys ([BN, BK, warps, stages, swap]) that
# replaces the table's entries (what ``benchmarks/expert_kernel.py --fp8 --tune`` prints);
# MOESERVE_EXPERT_TUNING the same for the bf16 table. Either applies to every expert shape, over
# ``EXPERT_TUNING_SHAPES`` too (a measurement switch: the tiles a sweep found, end to end).
TUNING_KEYS = ("gate_up", "down", "gate_up_bm64", "down_bm64", "gate_up_bm128", "down_bm128")


def parse_tuning(text: str, name: str, fp8: bool) -> dict[str, tuple]:
    """The tiles of ``name``'s value ``text``: a JSON object of ``TUNING_KEYS`` to [BN, BK, warps,
    stages] (FP8: and a 0/1 transposed flag), BN and BK powers of two 16-256, warps 1-16 a power
    of two, stages 1-8. Anything else raises ValueError naming the variable and what is allowed."""
    want = "[BN, BK, warps, stages, transposed]" if fp8 else "[BN, BK, warps, stages]"
    allowed = f"a JSON object of {', '.join(TUNING_KEYS)} to {want}, BN and BK powers of two 16-256, warps 1-16 a power of two, stages 1-8"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}={text!r} is not JSON ({e}): allowed {allowed}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{name}={text!r}: allowed {allowed}")
    out = {}
    for key, tile in raw.items():
        ok = key in TUNING_KEYS and isinstance(tile, list) and len(tile) == (5 if fp8 else 4)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in tile[:4])
        if ok:
            bn, bk, warps, stages = tile[:4]
            pow2 = all(16 <= v <= 256 and v & (v - 1) == 0 for v in (bn, bk))
            ok = pow2 and warps in (1, 2, 4, 8, 16) and 1 <= stages <= 8 and (not fp8 or tile[4] in (0, 1, False, True))
        if not ok:
            raise ValueError(f"{name}: {key!r}: {tile!r} is not a tile: allowed {allowed}")
        out[key] = tuple(tile[:4]) + ((bool(tile[4]),) if fp8 else ())
    return out


def _tuning_from_env(table: dict, name: str, fp8: bool) -> None:
    """``name``: a JSON object of ``table``'s keys whose tiles replace the table's entries."""
    if os.environ.get(name):
        table.update(parse_tuning(os.environ[name], name, fp8))


# each table's variable (``--tune`` prints the line to set)
_TUNING_ENV = {"bf16": "MOESERVE_EXPERT_TUNING", "fp8": "MOESERVE_FP8_TUNING", "w8a8": "MOESERVE_FP8_A8_TUNING"}
_tuning_from_env(EXPERT_TUNING, _TUNING_ENV["bf16"], fp8=False)
_tuning_from_env(EXPERT_TUNING_FP8, _TUNING_ENV["fp8"], fp8=True)
# W8A8 (``ExpertScales.act_quant``, where ``models.quant.activations_quantized`` says): both operands
# FP8 codes, the product on FP8 tensor cores, computed transposed (codes [BN, BK] x rows^T [BK,
# BM]) with K-tiles of 128 codes at every rows-per-pass: the rows are the MMA's N side, so a row's
# sums are the same instructions in the same K order whatever BM a step picks, and a token's
# output does not depend on how many rows its slot got (EPLB on gives the tokens of EPLB off:
# results/gpu-correctness-eplb-off-fp8-w8a8.json; with the rows as the M side and BK 256/128 by
# BM, ERNIE matched 6 % of tokens). On an H200 (results/expert-kernel-w8a8-swap.json, 256
# tokens) Scout's layer takes 0.60-0.66 ms against bf16's 1.0, ERNIE's 0.34-0.38 against 0.47-0.50.
EXPERT_TUNING_FP8_A8 = {
    "gate_up": (64, 128, 4, 3, True),
    "down": (128, 128, 8, 3, True),
    "gate_up_bm64": (64, 128, 4, 3, True),
    "down_bm64": (128, 128, 8, 3, True),
    # prefill's 128-row passes (``FP8_PREFILL_BM``, taken only where a worker's
    # MOESERVE_FP8_PREFILL_BLOCK_M asks): column tiles of 128 on two warpgroups, as Hopper's FP8
    # GEMMs tile a compute-bound product; not yet timed on a GPU (benchmarks/README.md, open targets)
    "gate_up_bm128": (128, 128, 8, 3, True),
    "down_bm128": (128, 128, 8, 3, True),
}
# MOESERVE_FP8_A8_TUNING: the same for the W8A8 table
_tuning_from_env(EXPERT_TUNING_FP8_A8, _TUNING_ENV["w8a8"], fp8=True)
# The tables a variable replaced at import: those take no shape entries (read once, not per launch)
TUNING_FROM_ENV = frozenset(name for name, var in _TUNING_ENV.items() if os.environ.get(var))
EXPERT_MAX_BM = 64
# Rows per pass of W8A8 expert steps with more than EXPERT_MAX_BM rows a slot on average (a
# prefill), where a worker takes them (``store.fp8_prefill_block_m``): the rows are the MMA's N
# side in the transposed W8A8 product, so a larger pass keeps each row's K order (bitwise the
# same rows as 64-row passes, which a GPU must show: benchmarks/expert_kernel.py's
# ``bitwise_same``) while a slot of ~800 rows reads its panel half as often and each tile does
# twice the FLOPs per byte.
FP8_PREFILL_BM = 128
FP8_BLOCK_BK_MAX = 128  # K tile of block-scaled FP8 weights: their K block, at most this (``_expert_matmul``)
# Programs per (slot, column tile), each taking every G-th pass of BM rows: a hot slot (skewed
# routing) is worked on by G programs at once, which share its weight panel through L2; with
# at most BM rows in every slot (balanced decode) the G - 1 others exit at once.
EXPERT_PASS_GROUPS = 4


# Per expert shape (hidden H, intermediate I): entries that replace a table's at that shape, by
# table ("bf16", "fp8", "w8a8"), as vLLM's fused-MoE configs are keyed by the experts' shape: the
# tables above are the best over Scout's and ERNIE's layers together, and a small expert's short
# K loop wants other tiles than a large one's.
EXPERT_TUNING_SHAPES: dict[str, dict[tuple[int, int], dict[str, tuple]]] = {
    "bf16": {
        # Qwen3-30B-A3B (H 2,048, I 768), 16-32 rows per pass: on an H200 at 256 tokens gate_up
        # 3.24 TB/s against the table's 2.94, down 2.62 against 2.25 (results/expert-kernel-qwen3-tune.json).
        # Scout's layers have none: the table's tiles are Scout's best on the H200
        # (results/expert-kernel-tune.json).
        (2048, 768): {"gate_up": (128, 64, 8, 4), "down": (64, 64, 4, 3)},
        # ERNIE-4.5-21B (H 2,560, I 1,536), 64 rows per pass: BN 256, never swept before, on an H100
        # at 512 tokens gate_up 2.34 TB/s and down 2.18 against the table's 2.19 and 2.02
        # (results/expert-kernel-ernie-bn256-bf16{,-512}-h100.json); end to end ERNIE-28L's decode
        # of 512 sequences 23.93 ms against 24.80 (results/serving-ernie28-decode512-*-h100.json)
        (2560, 1536): {"gate_up_bm64": (256, 64, 8, 3), "down_bm64": (256, 32, 4, 3)},
    },
    "fp8": {},
    # W8A8 has none: at ERNIE's 32 rows per pass its down projection streamed 1.47 TB/s of codes
    # with 4 warps against 1.26 with the table's 8 in the sweep
    # (results/expert-kernel-ernie-w8a8-bm32-tune-h100.json), and it kept every row bitwise at
    # 64, 32 and 16 rows and EPLB on = off, but the layer took 0.372 against 0.374 ms and
    # ERNIE-28L's FP8 step 14.01 against 14.01 ms on an H100
    # (results/serving-ernie28-fp8-down-4warps-h100.json): nothing to gain
    "w8a8": {},
}


@functools.cache  # read at every expert launch: the same few (kind, block_m) pairs
def tuning_keys(kind: str, block_m: int) -> tuple[str, ...]:
    """The keys of a tiling table that passes of ``block_m`` rows read, first found first:
    ``{kind}_bm128`` at 128 and more, then ``{kind}_bm64`` from 64, then ``kind``."""
    keys = (f"{kind}_bm128",) if block_m >= 128 else ()
    return keys + ((f"{kind}_bm64",) if block_m >= 64 else ()) + (kind,)


def tuning_key(kind: str, block_m: int) -> str:
    """The most specific key of a tiling table for passes of ``block_m`` rows (``tuning_keys``)."""
    return tuning_keys(kind, block_m)[0]


def expert_tuning(
    kind: str, block_m: int, fp8: bool = False, a8: bool = False, shape: tuple[int, int] | None = None
) -> tuple:
    """(BN, BK, warps, stages[, transposed]) of ``kind`` (gate_up, down) for passes of
    ``block_m`` rows: bf16, FP8 weight-only, or (``a8``) FP8 rows and weights; ``shape`` (H, I)
    takes that expert shape's entries of ``EXPERT_TUNING_SHAPES`` first (unless the table's
    environment variable replaced the table, ``TUNING_FROM_ENV``)."""
    name = "w8a8" if fp8 and a8 else "fp8" if fp8 else "bf16"
    table = EXPERT_TUNING_FP8_A8 if fp8 and a8 else EXPERT_TUNING_FP8 if fp8 else EXPERT_TUNING
    entry = EXPERT_TUNING_SHAPES[name].get((shape[0], shape[1])) if shape is not None else None
    if not entry or name in TUNING_FROM_ENV:
        entry = {}
    # the most specific key first, the shape's entry over the table at each (no merged table
    # built per launch)
    for key in tuning_keys(kind, block_m):
        if tile := entry.get(key) or table.get(key):
            return tile
    raise KeyError(f"no {name} tile for {kind!r}")  # every table has both kinds' base keys


def expert_block_m(rows_per_slot: int) -> int:
    """Rows per pass of the grouped expert kernels for an expected ``rows_per_slot``: the next
    power of two, 16 (the smallest MMA height) to ``EXPERT_MAX_BM``. A slot with more rows takes
    more passes (each reads the slot's weights again), so this is a speed choice, never a
    correctness one."""
    return min(EXPERT_MAX_BM, max(16, _pow2(max(1, rows_per_slot))))


def expert_mlp(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    offs: torch.Tensor,
    block_m: int = 16,
    scales: ExpertScales | None = None,
    act: ExpertAct | None = None,
) -> torch.Tensor:
    """The grouped SwiGLU expert MLP of rows already grouped by slot, in two launches with
    device-side counts (nothing read back, graph-capturable).

    rows:    [C, H] slot-major; rows offs[-1] .. C-1 are not read.
    gate_up: [S, H, 2I] (gate columns, then up), down: [S, I, H]; last dims contiguous
             (``ExpertSpec.views`` of the slot buffer).
    offs:    int32 [S] inclusive cumulative rows per slot, on the device.
    block_m: rows per pass (``expert_block_m``).
    scales:  for FP8 weights (``gate_up``, ``down`` of float8_e4m3fn): their float32 block
             scales and block shapes (``ExpertScales``); the codes are converted to the rows'
             dtype in registers (exact), each tile's product scaled (weight-only).
    act:     the activation and the biases (``ExpertAct``; default SwiGLU without biases):
             GPT-OSS's clamped SwiGLU, gate_up_bias [S, 2I] and down_bias [S, H] (the slot
             buffer's views, last dim contiguous) each added to its rounded product.
    returns  [C, H] in rows' dtype; rows past offs[-1] are undefined.

    Program (slot, column tile) streams its slot's [K, BN] weight panel once per ``block_m``
    rows, so a slot with no rows costs nothing and a decode step reads each used expert once.
    Rounding as ``torch._grouped_mm`` + ``silu_mul``: fp32 accumulation, gate_up rounded to the
    dtype, silu in fp32 rounded, times up rounded, down accumulated in fp32 and rounded once
    (fp32 operands use IEEE fp32 products, not TF32).
    """
    c, hdim = rows.shape
    s, k_gu, two_i = gate_up.shape
    i = two_i // 2
    if k_gu != hdim or tuple(down.shape) != (s, i, hdim) or offs.numel() != s:
        raise ValueError(
            f"expert_mlp: rows [C, {hdim}], gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
            f"offs [{offs.numel()}] do not agree (want gate_up [S, H, 2I], down [S, I, H], offs [S])"
        )

    def dense_dim(t):  # N contiguous; FP8 codes may be [N, K] bytes viewed as [K, N] (ExpertSpec.views)
        return t.stride(2) == 1 or (scales is not None and t.stride(1) == 1)

    if rows.stride(1) != 1 or not dense_dim(gate_up) or not dense_dim(down):
        raise ValueError(
            "expert_mlp: the last dim of rows and of bf16 weights must be contiguous (FP8 codes: the K dim)"
        )
    if c == 0 or s == 0:
        return rows.new_empty(c, hdim)
    if scales is None:
        a = act or ExpertAct()
        h = _expert_matmul(
            rows, gate_up, offs, block_m, expert_tuning("gate_up", block_m, shape=(hdim, i)), True, act=a
        )
        return _expert_matmul(h, down, offs, block_m, expert_tuning("down", block_m, shape=(hdim, i)), False, act=a)
    if act is not None and (act.gate_up_bias is not None or act.kind != "silu"):
        raise ValueError("expert_mlp: FP8 experts are SwiGLU without biases")
    a8 = scales.act_quant
    total = offs[-1:]
    x, xs = quant_rows(rows, total) if a8 else (rows, None)
    gu = _expert_matmul(
        x,
        gate_up,
        offs,
        block_m,
        expert_tuning("gate_up", block_m, True, a8, (hdim, i)),
        True,
        scales.gate_up,
        scales.gate_up_block,
        xs=xs,
        out_dtype=rows.dtype,
    )
    h, hs = quant_rows(gu, total) if a8 else (gu, None)
    return _expert_matmul(
        h,
        down,
        offs,
        block_m,
        expert_tuning("down", block_m, True, a8, (hdim, i)),
        False,
        scales.down,
        scales.down_block,
        xs=hs,
        out_dtype=rows.dtype,
    )


def quant_rows(x: torch.Tensor, total: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row FP8: x [C, K] -> (codes [C, K] float8_e4m3fn, scales float32 [C]) with
    scale = max|x[r]| / 448 (1 for a zero row) and codes = e4m3(x / scale), rounded to nearest
    and clamped to +-448. ``total`` (int32 device [1]): only rows < total are written (the rest of
    a receive buffer is not read). The activations of ``expert_mlp`` with ``act_quant`` scales."""
    c, k = x.shape
    q = torch.empty(c, k, dtype=torch.float8_e4m3fn, device=x.device)
    sc = torch.empty(c, dtype=torch.float32, device=x.device)
    if c:
        if total is None:
            total = torch.full((1,), c, dtype=torch.int32, device=x.device)
        _expert_kernels().quant_rows_kernel[(min(c, ROW_PROGRAMS),)](
            x, q, sc, total, x.stride(0), K=k, BLOCK=min(_block(k), 4096), num_warps=8 if k >= 4096 else 4
        )
    return q, sc


def silu_mul_quant(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_rows(silu_mul(gu))`` in one launch, bitwise the same: gu [C, 2I] (contiguous) ->
    (codes [C, I] float8_e4m3fn, scales float32 [C]). The input of a W8A8 SwiGLU's down
    projection (shared experts, dense MLPs on cuBLAS's FP8 GEMM): h = silu(gate) * up is never
    written, so the step saves a launch and h's round trip through memory per layer."""
    c, two_i = gu.shape
    i = two_i // 2
    if two_i % 2 or gu.stride(1) != 1 or (c > 1 and gu.stride(0) != two_i):
        raise ValueError(f"silu_mul_quant: gu must be contiguous [C, 2I], got {tuple(gu.shape)} {tuple(gu.stride())}")
    q = torch.empty(c, i, dtype=torch.float8_e4m3fn, device=gu.device)
    sc = torch.empty(c, dtype=torch.float32, device=gu.device)
    if c:
        _expert_kernels().silu_mul_quant_kernel[(min(c, ROW_PROGRAMS),)](
            gu, q, sc, c, I=i, BLOCK=min(_block(i), 4096), PRECISE=not _interpreted(), num_warps=8 if i >= 4096 else 4
        )
    return q, sc


class ExpertAct(NamedTuple):
    """The expert MLP's activation and biases: ``kind`` "silu" (SwiGLU) or "clamped_swiglu"
    (GPT-OSS: ``alpha``, ``limit``; ``moeserve.models.moe.activate``), and the slots' biases
    ``gate_up_bias`` [S, 2I], ``down_bias`` [S, H] (None: no biases)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


class ExpertScales(NamedTuple):
    """The float32 scales of FP8 expert weights: ``gate_up`` [S, Kb, 2 Nb] (the gate's blocks,
    then the up projection's) and ``down`` [S, Kb', Nb'], each block ``(bk, bn)`` of inputs x
    outputs (``moeserve.models.moe.ExpertQuant``)."""

    gate_up: torch.Tensor
    gate_up_block: tuple[int, int]
    down: torch.Tensor
    down_block: tuple[int, int]
    act_quant: bool = False  # W8A8: rows quantized per row (``quant_rows``), products on FP8 tensor cores


def fp8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], act_quant: bool = False
) -> torch.Tensor:
    """x [M, K] @ W for FP8 codes [K, N] (x @ W layout, last dim contiguous) with float32 scales
    [ceil(K/bk), ceil(N/bn)] per ``block`` = (bk, bn): the expert kernel with one slot, so a
    quantized dense layer or shared expert of a decode step streams its codes once. ``act_quant``:
    x quantized per row first and the product on FP8 tensor cores (``quant_rows``)."""
    m = x.shape[0]
    offs = torch.full((1,), m, dtype=torch.int32, device=x.device)  # one slot holding every row
    bm = expert_block_m(m)
    x = x.contiguous()
    xq, xs = quant_rows(x) if act_quant else (x, None)
    return _expert_matmul(
        xq,
        codes.unsqueeze(0),
        offs,
        bm,
        expert_tuning("down", bm, True, act_quant),
        False,
        scale.unsqueeze(0),
        block,
        xs=xs,
        out_dtype=x.dtype,
    )


def fp8_scaled_linear(x: torch.Tensor, codes: torch.Tensor, scale_row: torch.Tensor) -> torch.Tensor:
    """W8A8 x [M, K] @ W with one scale per output channel: x quantized per row
    (``quant_rows``), the product on FP8 tensor cores by cuBLAS (``torch._scaled_mm``, row-wise
    scales, fp32 accumulation) and written in x's dtype. codes [K, N] is the [N, K] bytes viewed
    transposed (``QuantLinear.codes_kn``), scale_row float32 [1, N]. A dense layer's rows are
    many and share one weight: there cuBLAS's FP8 GEMM is faster than the grouped expert kernel
    with one slot (benchmarks/fp8_linears.py)."""
    xq, xs = quant_rows(x.contiguous())
    return fp8_scaled_codes_linear(xq, xs, codes, scale_row, x.dtype)


def fp8_scaled_codes_linear(
    xq: torch.Tensor, xs: torch.Tensor, codes: torch.Tensor, scale_row: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``fp8_scaled_linear`` of rows already quantized (codes xq [M, K] float8_e4m3fn, scales
    xs float32 [M]: ``quant_rows`` or ``silu_mul_quant``), the output in ``out_dtype``."""
    return torch._scaled_mm(xq, codes, scale_a=xs.view(-1, 1), scale_b=scale_row, out_dtype=out_dtype)


def fp8_scaled_linear_supported(k: int, n: int, block: tuple[int, int], codes: torch.Tensor) -> bool:
    """Whether ``fp8_scaled_linear`` takes FP8 weights [K, N] scaled in blocks of ``block`` =
    (bk, bn): one scale over all of K (per channel or per tensor), K and N multiples of 16 (what
    cuBLAS's FP8 GEMM needs), the codes the transposed view of [N, K] bytes."""
    return block[0] >= k and k % 16 == 0 and n % 16 == 0 and codes.stride(0) == 1 and codes.stride(1) == k


class FP8Weight(Protocol):
    """What ``warm_up_fp8_linears`` reads of a quantized linear layer (``models.quant.QuantLinear``)."""

    block: tuple[int, int]

    def codes_kn(self) -> torch.Tensor: ...

    def scale_kn(self) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def warm_up_fp8_linears(layers: Iterable[FP8Weight], dtype: torch.dtype) -> int:
    """Compile what a call of each quantized linear layer runs (``fp8_linear`` for every
    rows-per-pass, or ``quant_rows`` before cuBLAS's FP8 GEMM) for every weight shape of
    ``layers`` (the ``QuantLinear`` s of a router's model) before serving. Returns the calls run."""
    shapes: dict[tuple, FP8Weight] = {}
    for q in layers:
        shapes.setdefault((tuple(q.codes_kn().shape), q.block, bool(getattr(q, "act_quant", False))), q)
    n = 0
    for q in shapes.values():
        kn = q.codes_kn()
        for bm in expert_block_ms():
            q(torch.zeros(bm, kn.shape[0], dtype=dtype, device=kn.device))
            n += 1
    return n


def fp8_blocks_supported(k: int, block: tuple[int, int]) -> bool:
    """Whether the Triton expert kernel takes FP8 weights of inner size ``k`` scaled in blocks
    of ``block`` = (bk, bn): one scale over all of K, or K blocks of a power of two >= 16 (a
    tile of the kernel's K loop must lie in one block)."""
    bk = block[0]
    return bk >= k or (bk >= 16 and bk & (bk - 1) == 0)


def expert_block_ms(prefill: bool = False) -> list[int]:
    """Every rows-per-pass ``expert_block_m`` can give (16, 32, 64), and ``FP8_PREFILL_BM``
    with ``prefill``: each is a constexpr of the kernels, so each is a compile of its own."""
    bms = {expert_block_m(1 << i) for i in range(EXPERT_MAX_BM.bit_length() + 1)}
    return sorted(bms | ({FP8_PREFILL_BM} if prefill else set()))


def warm_up_expert_mlp(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: ExpertScales | None = None,
    dtype: torch.dtype | None = None,
    act: ExpertAct | None = None,
    block_ms: list[int] | None = None,
) -> list[int]:
    """Compile both expert kernels for every rows per pass of ``block_ms`` (default
    ``expert_block_ms()``) before serving (~1 s each on an H200 host; a step that meets one
    first would wait for it), on views with the strides the steps use: one layer's ``gate_up``
    [S, H, 2I] and ``down`` [S, I, H] of the slot buffer; the rows are [BM, H] contiguous, as
    the receive buffer is. Reads the weights, writes nothing of the caller's. Returns the block
    sizes run."""
    s, h, _ = gate_up.shape
    dtype = dtype or gate_up.dtype  # the rows' (FP8 weights: the compute dtype)
    done = []
    for bm in block_ms or expert_block_ms():
        rows = torch.zeros(bm, h, dtype=dtype, device=gate_up.device)
        offs = torch.full((s,), bm, dtype=torch.int32, device=gate_up.device)  # every row in slot 0
        expert_mlp(rows, gate_up, down, offs, bm, scales, act)
        done.append(bm)
    return done


def expert_gate_up(
    rows: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor, block_m: int = 16, tuning: tuple | None = None
) -> torch.Tensor:
    """First half of ``expert_mlp``: rows [C, H] -> silu(gate) * up [C, I]. ``tuning`` (BN, BK,
    warps, stages) overrides ``expert_tuning`` (benchmarks/expert_kernel.py --tune)."""
    return _expert_matmul(rows, gate_up, offs, block_m, tuning or expert_tuning("gate_up", block_m), gated=True)


def expert_down(
    h: torch.Tensor, down: torch.Tensor, offs: torch.Tensor, block_m: int = 16, tuning: tuple | None = None
) -> torch.Tensor:
    """Second half of ``expert_mlp``: h [C, I] -> [C, H]."""
    return _expert_matmul(h, down, offs, block_m, tuning or expert_tuning("down", block_m), gated=False)


def _expert_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    block_m: int,
    tuning: tuple,
    gated: bool,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = (0, 0),
    act: ExpertAct | None = None,
    xs: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One launch of ``expert_matmul_kernel``: x [C, K] slot-major through w [S, K, N] ([S, K,
    2N] gated: act(gate, up)) -> [C, N]; with ``scale`` [S, Kb, Nb] w holds FP8 codes scaled
    per ``block`` = (bk, bn); ``act``: the activation (gated) and the bias of this product
    (``gate_up_bias`` gated, else ``down_bias``); ``xs`` [C]: x holds FP8 codes with these
    per-row scales (``quant_rows``), the output in ``out_dtype``."""
    c, k = x.shape
    s, _, n = w.shape
    n = n // 2 if gated else n
    if xs is not None and (scale is None or x.dtype != torch.float8_e4m3fn or out_dtype is None):
        raise ValueError("FP8 rows (xs) need FP8 weights with scales and an out_dtype")
    out = torch.empty(c, n, dtype=out_dtype or x.dtype, device=x.device)
    interp = _interpreted()
    bn, bk, warps, stages = tuning[:4]
    bk = min(bk, max(16, _pow2(k)))
    quant = scale is not None
    if quant and len(tuning) != 5:
        raise ValueError(f"FP8 tile {tuning!r}: want (BN, BK, warps, stages, transposed)")
    sbk, sbn = block if quant else (k, n)
    if quant:
        if not fp8_blocks_supported(k, block):
            raise ValueError(
                f"FP8 scale blocks {list(block)} over K={k}: the kernel needs one block or powers of two >= 16"
            )
        if sbk < k:
            # K tiles of one whole scale block (128 at most) at every rows per pass, whatever the
            # table says: a tile narrower than its block scales each part's product apart, so a
            # row's sums would follow BM, and a step's BM follows its slot count (EPLB on or off)
            bk = min(sbk, FP8_BLOCK_BK_MAX)  # (sbk < K: already within K's power of two)
    sc = scale if scale is not None else w
    act = act or ExpertAct()
    bias = act.gate_up_bias if gated else act.down_bias
    if bias is not None and (bias.shape != (s, w.shape[2]) or bias.stride(1) != 1):
        raise ValueError(
            f"expert bias {tuple(bias.shape)} for weights {tuple(w.shape)}: want [S, N], last dim contiguous"
        )
    if act.kind not in ("silu", "clamped_swiglu"):
        raise ValueError(f"expert activation {act.kind!r}: allowed silu, clamped_swiglu")
    extra = {} if interp else dict(num_warps=warps, num_stages=stages)
    _expert_kernels().expert_matmul_kernel[(EXPERT_PASS_GROUPS, s, -(-n // bn))](
        x,
        w,
        sc,
        out,
        offs,
        k,
        n,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        sc.stride(0) if quant else 0,
        sc.stride(1) if quant else 0,
        out.stride(0),
        BM=block_m,
        BN=bn,
        BK=bk,
        EVEN_K=k % bk == 0,
        GATED=gated,
        PRECISION=_precision(x.dtype),
        PRECISE=not interp,
        INTERPRET=interp,
        G=EXPERT_PASS_GROUPS,
        QUANT=quant,
        SBK=sbk,
        SBN=sbn,
        NB=-(-n // sbn) if quant else 0,
        SWAP=bool(quant and tuning[4]),  # FP8 tiles carry their transposed flag
        xs_ptr=xs if xs is not None else sc,  # (not read without A8)
        A8=xs is not None,
        b_ptr=bias if bias is not None else out,  # (not read without a bias)
        stride_bs=bias.stride(0) if bias is not None else 0,
        alpha=float(act.alpha),
        limit=float(act.limit),
        HAS_BIAS=bias is not None,
        ACT=int(act.kind == "clamped_swiglu"),
        **extra,
    )
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands
