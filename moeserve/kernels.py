"""Triton kernels of the direct (NVLink) exchange: rows written straight into peers' buffers.

Dimension letters: T tokens of a router, K top-k, N = T*K (token, k) pairs, H hidden, R ranks,
P slots per MoE layer, W workers, S = P / W slots per worker, C rows a receive buffer holds
(its capacity), I expert intermediate size.

The kernels take *device-side* counts and destinations, so that no host synchronisation is
needed anywhere in a MoE layer: a kernel is launched over an upper bound of rows known on the
host (N, or C) and rows past the device-side total do nothing. Peers' buffers are reached
through tables of raw device addresses [R] (int64), one per rank, from torch's symmetric
memory (``moeserve.nvlink``); a store through a peer's address goes over NVLink. Each step of
the exchange is one launch, and there is no sort: slot choice and per-block histograms
(``route``), block prefixes and the counts' publication (``publish``), the layout (``prep``),
the rows (``scatter_pairs``, which ranks each pair within its slot as a stable sort would) and
the way back (``return_rows``): at a few thousand tokens a layer is bound by host launches,
not bytes (a stable ``torch.sort`` alone costs ~60 us of host time on an H200 machine).

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
import os

import torch


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except Exception:                                    # ImportError, or a broken install
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels():
    import importlib
    import sys
    name = "moeserve._triton_kernels"
    # A fresh module per cache generation: TRITON_INTERPRET is read when the kernels are defined.
    sys.modules.pop(name, None)
    k = importlib.import_module(name)
    return dict(route=k.route_kernel, publish=k.publish_kernel, prep=k.prep_kernel, scatter=k.scatter_pairs_kernel,
                ret=k.return_rows_kernel, silu_mul=k.silu_mul_kernel, weighted_sum=k.weighted_sum_kernel)


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
TUNING = {"scatter": (8, 1024, 8), "return": (16, 512, 8)}   # picked from 28 pairs timed on 2 x H200

BLOCK_PAIRS = 256        # pairs per block of route/scatter (the unit of the stable in-block ranking)


def num_blocks(n: int) -> int:
    return (n + BLOCK_PAIRS - 1) // BLOCK_PAIRS


def route(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, offset: int, num_slots: int,
          single: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of a router's pairs and their per-block histogram, in one launch.

    ids:     int64 [T, K] logical expert ids; log2phy int64 [E, X] (-1 padded), logcnt int64 [E].
    offset:  router index + step (the replica rule of ``moeserve.dispatch.choose_slots``:
             token t takes replica (t + offset) mod logcnt[e]; replica 0 when ``single``).
    returns  (slots int32 [N] in flat (token, k) order, hist int32 [nb, PB]: pairs per slot in
             each block of BLOCK_PAIRS pairs, PB = next power of two >= num_slots).
    """
    t, k = ids.shape
    n = t * k
    pb = _pow2(num_slots)
    nb = num_blocks(n)
    slots = torch.empty(n, dtype=torch.int32, device=ids.device)
    hist = torch.empty(nb, pb, dtype=torch.int32, device=ids.device)
    if n:
        _kernels()["route"][(nb,)](ids, log2phy, logcnt, slots, hist, n, offset, K=k, X=log2phy.shape[1],
                                   SINGLE=single, B=BLOCK_PAIRS, PB=pb, num_warps=4)
    return slots, hist


def publish(hist: torch.Tensor, prefix: torch.Tensor, counts_table: torch.Tensor, rank: int, sent: torch.Tensor,
            num_slots: int) -> None:
    """From the block histograms [nb, PB]: prefix [nb, PB] (pairs of each slot in earlier blocks),
    this router's pairs per slot c [P] into row ``rank`` of every rank's counts [R, P] (addresses
    in ``counts_table`` [R]), and c added to ``sent`` (int64 [P], contiguous)."""
    pb = _pow2(num_slots)
    _kernels()["publish"][(1,)](hist, prefix, hist.shape[0], counts_table, sent, rank, R=counts_table.numel(),
                                P=num_slots, PB=pb, CH=max(1, min(32, 4096 // pb)), num_warps=4)


def prep(counts: torch.Tensor, rank: int, worker: int, num_workers: int, shift: torch.Tensor,
         offs: torch.Tensor) -> None:
    """From every rank's counts [R, P]: shift [P] (the rows of the slots before p on p's worker
    plus the rows earlier ranks send to p; a pair's row there is shift[p] + its rank among this
    router's pairs of slot p) and, when ``worker >= 0``, the worker's cumulative rows per slot,
    offs int32 [S]."""
    r, p = counts.shape
    s = p // num_workers
    _kernels()["prep"][(1,)](counts, shift, offs, rank, worker, R=r, W=num_workers, S=s,
                             RB=_pow2(r), WB=_pow2(num_workers), SB=_pow2(s))


def scatter_pairs(x: torch.Tensor, k: int, slots: torch.Tensor, prefix: torch.Tensor, shift: torch.Tensor,
                  slots_per_worker: int, worker_base: int, scale: torch.Tensor | None, rows_table: torch.Tensor,
                  meta_table: torch.Tensor, meta_base: int) -> None:
    """Write the rows of N (token, k) pairs into their workers' receive buffers.

    x:            [T, H] hidden (contiguous); slots int32 [N] and prefix [nb, PB] from ``route`` /
                  ``publish``; shift int64 [P] from ``prep``.
    worker_base:  world rank of worker 0 (workers are ranks worker_base .. worker_base + W - 1).
    scale:        [N] factor per pair or None; the row sent is ``x[token] * scale[pair]`` rounded
                  to x's dtype, as ``torch.mul`` rounds it.
    rows_table:   int64 [R] addresses of every rank's receive buffer [C, H] (x's dtype);
    meta_table:   int64 [R] addresses of every rank's int64 [C] return addresses; a pair's
                  return address is ``meta_base + pair``.
    A worker's rows end up slot-major, by sending rank inside a slot and in pair order inside
    a rank: the order a stable sort by slot gives.
    """
    n = slots.numel()
    if n == 0:
        return
    h = x.shape[1]
    rows, block_h, num_warps = TUNING["scatter"]
    _kernels()["scatter"][(num_blocks(n), BLOCK_PAIRS // rows)](
        x, slots, prefix, shift, scale if scale is not None else x, rows_table, meta_table, meta_base, worker_base, n,
        H=h, K=k, S=slots_per_worker, PB=prefix.shape[1], SCALE=scale is not None, B=BLOCK_PAIRS, ROWS=rows,
        BLOCK_H=min(_block(h), block_h), num_warps=num_warps)


def return_rows(y: torch.Tensor, meta: torch.Tensor, total: torch.Tensor, out_table: torch.Tensor,
                capacity: int) -> None:
    """Send expert outputs back: row j < total of ``y`` [C, H] goes to rank ``meta[j] // capacity``,
    row ``meta[j] % capacity`` of its output buffer (address in ``out_table`` [R]).
    total: int32/int64 [1] on the device. Rows past it are not read."""
    c, h = y.shape
    if c == 0:
        return
    rows, block_h, num_warps = TUNING["return"]
    _kernels()["ret"][((c + rows - 1) // rows,)](y, meta, total, out_table, capacity, H=h, ROWS=rows,
                                                  BLOCK_H=min(_block(h), block_h), num_warps=num_warps)


def silu_mul(gu: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for the first ``total`` rows (device scalar [1]) of gu [C, 2I];
    returns [C, I] (rows past total are left unwritten)."""
    c, two_i = gu.shape
    i = two_i // 2
    out = gu.new_empty(c, i)
    if c:
        _kernels()["silu_mul"][(c,)](gu, out, total, I=i, BLOCK=_block(i), PRECISE=not _interpreted(), num_warps=4)
    return out


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T*K, H] (token, k) order, w [T, K] (cast to x's dtype first, as the bmm it replaces
    did) -> [T, H]: sum_k w[t, k] * x[t*K + k], fp32 accumulation in k order."""
    t, k = w.shape
    h = x.shape[1]
    out = x.new_empty(t, h)
    if t:
        _kernels()["weighted_sum"][(t,)](x, w.to(x.dtype).contiguous(), out, H=h, K=k, BLOCK_H=_block(h),
                                         num_warps=4)
    return out
