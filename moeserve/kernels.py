"""Triton kernels of the direct (NVLink) exchange: rows written straight into peers' buffers.

Dimension letters: T tokens of a router, K top-k, N = T*K (token, k) pairs, H hidden, R ranks,
C rows a receive buffer holds (its capacity), I expert intermediate size.

The kernels take *device-side* counts and destinations, so that no host synchronisation is
needed anywhere in a MoE layer: a kernel is launched over an upper bound of rows known on the
host (N, or C) and rows past the device-side total do nothing. Peers' buffers are reached
through a table of raw device addresses [R] (int64), one per rank, from torch's symmetric
memory (``moeserve.nvlink``); a store through a peer's address goes over NVLink.

Triton is imported lazily: the data plane must import without it (CPU, gloo). Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is how the tests check them.
"""
from __future__ import annotations

import functools

import torch


def available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except Exception:                                    # ImportError, or a broken install
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_rows_kernel(x_ptr, order_ptr, scale_ptr, dest_ptr, row_ptr, rows_table, meta_table, meta_base,
                            H: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per sent row j (rows sorted by slot): pair src = order[j] of token src // K.
        j = tl.program_id(0).to(tl.int64)
        src = tl.load(order_ptr + j)
        tok = src // K
        d = tl.load(dest_ptr + j)
        p = tl.load(row_ptr + j)
        dst = tl.load(rows_table + d).to(tl.pointer_type(x_ptr.dtype.element_ty))
        meta = tl.load(meta_table + d).to(tl.pointer_type(tl.int64))
        tl.store(meta + p, meta_base + src)
        if SCALE:
            s = tl.load(scale_ptr + src).to(tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = cols < H
            v = tl.load(x_ptr + tok * H + cols, mask=m)
            if SCALE:
                v = (v.to(tl.float32) * s).to(x_ptr.dtype.element_ty)
            tl.store(dst + p * H + cols, v, mask=m)

    @triton.jit
    def return_rows_kernel(y_ptr, meta_ptr, total_ptr, out_table, capacity, H: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per received row j < total: back to rank meta // capacity, row meta % capacity.
        j = tl.program_id(0).to(tl.int64)
        total = tl.load(total_ptr).to(tl.int64)
        if j < total:
            meta = tl.load(meta_ptr + j)
            src = meta // capacity
            row = meta % capacity
            dst = tl.load(out_table + src).to(tl.pointer_type(y_ptr.dtype.element_ty))
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                m = cols < H
                tl.store(dst + row * H + cols, tl.load(y_ptr + j * H + cols, mask=m), mask=m)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, total_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
        # out[j] = silu(gu[j, :I]) * gu[j, I:] for rows j < total, rounded as torch rounds it
        # (silu to the dtype, then the product).
        j = tl.program_id(0).to(tl.int64)
        total = tl.load(total_ptr).to(tl.int64)
        if j < total:
            for c0 in range(0, I, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                m = cols < I
                a = tl.load(gu_ptr + j * 2 * I + cols, mask=m).to(tl.float32)
                u = tl.load(gu_ptr + j * 2 * I + I + cols, mask=m)
                s = (a / (1.0 + tl.exp(-a))).to(u.dtype)
                tl.store(out_ptr + j * I + cols, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=m)

    return scatter_rows_kernel, return_rows_kernel, silu_mul_kernel


def _block(n: int) -> int:
    b = 64
    while b < min(n, 1024):
        b *= 2
    return b


def scatter_rows(x: torch.Tensor, order: torch.Tensor, k: int, scale: torch.Tensor | None, dest: torch.Tensor,
                 row: torch.Tensor, rows_table: torch.Tensor, meta_table: torch.Tensor, meta_base: int) -> None:
    """Write the rows of N (token, k) pairs into their destinations' receive buffers.

    x:          [T, H] hidden (contiguous).
    order:      int64 [N]: the pair index (token * K + k) of each row, in send order.
    scale:      [N] factor per pair (indexed by pair index) or None; the row sent is
                ``x[token] * scale[pair]`` rounded to x's dtype, as ``torch.mul`` rounds it.
    dest, row:  int64 [N]: destination rank and row in its receive buffer, per sent row.
    rows_table: int64 [R] device addresses of every rank's receive buffer [C, H] (x's dtype).
    meta_table: int64 [R] device addresses of every rank's int64 [C] return-address buffer;
                row p of rank d gets ``meta_base + pair``.
    """
    n = order.numel()
    if n == 0:
        return
    h = x.shape[1]
    scatter_k, _, _ = _kernels()
    scatter_k[(n,)](x, order, scale if scale is not None else order, dest, row, rows_table, meta_table, meta_base,
                    H=h, K=k, SCALE=scale is not None, BLOCK_H=_block(h), num_warps=4)


def return_rows(y: torch.Tensor, meta: torch.Tensor, total: torch.Tensor, out_table: torch.Tensor,
                capacity: int) -> None:
    """Send expert outputs back: row j < total of ``y`` [C, H] goes to rank ``meta[j] // capacity``,
    row ``meta[j] % capacity`` of its output buffer (address in ``out_table`` [R]).
    total: int32/int64 [1] on the device. Rows past it are not read."""
    c, h = y.shape
    if c == 0:
        return
    _, return_k, _ = _kernels()
    return_k[(c,)](y, meta, total, out_table, capacity, H=h, BLOCK_H=_block(h), num_warps=4)


def silu_mul(gu: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for the first ``total`` rows (device scalar [1]) of gu [C, 2I];
    returns [C, I] (rows past total are left unwritten)."""
    c, two_i = gu.shape
    i = two_i // 2
    out = gu.new_empty(c, i)
    if c:
        _, _, silu_k = _kernels()
        silu_k[(c,)](gu, out, total, I=i, BLOCK=_block(i), num_warps=4)
    return out
