"""Triton kernels of the grouped expert MLP for steps with few rows per slot (decode).

Imported lazily through ``moeserve.kernels`` (never at data-plane import). See
``moeserve.kernels.expert_mlp`` for shapes and rounding.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _slot_rows(offs_ptr, s):
    # rows [start, end) of slot s from the inclusive cumulative counts offs [S]
    end = tl.load(offs_ptr + s).to(tl.int64)
    prev = tl.load(offs_ptr + tl.maximum(s - 1, 0)).to(tl.int64)
    start = tl.where(s > 0, prev, 0)
    return start, end


@triton.jit
def _gate_up_rows(x_ptr, w, h_ptr, m0, end, rn, n_ok, K: tl.constexpr, I: tl.constexpr, stride_x, stride_wk,
                  stride_h, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  PRECISION: tl.constexpr, PRECISE: tl.constexpr, INTERPRET: tl.constexpr):
    # rows m0 .. m0 + BM - 1 (< end) of one slot through the gate and up columns rn
    rm = m0 + tl.arange(0, BM)
    m_ok = rm < end
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:
            a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None], other=0.0)
            wg = tl.load(w + rk[:, None] * stride_wk + rn[None, :], mask=n_ok[None, :], other=0.0)
            wu = tl.load(w + rk[:, None] * stride_wk + (I + rn)[None, :], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < K
            a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w + rk[:, None] * stride_wk + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(w + rk[:, None] * stride_wk + (I + rn)[None, :], mask=k_ok[:, None] & n_ok[None, :],
                         other=0.0)
        if INTERPRET:                           # the interpreter's dot mishandles bf16: exact products in fp32
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
    # as the two-kernel path rounds: gate_up to the dtype, silu in fp32 rounded, times up
    g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h_ptr.dtype.element_ty)
    if PRECISE:
        e = libdevice.exp(-g)
    else:                                       # the interpreter has no libdevice
        e = tl.exp(-g)
    sl = tl.math.div_rn(g, 1.0 + e).to(u.dtype)
    out = (sl.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    tl.store(h_ptr + rm[:, None] * stride_h + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def expert_gate_up_kernel(x_ptr, w_ptr, h_ptr, offs_ptr, K: tl.constexpr, I: tl.constexpr, stride_x, stride_ws, stride_wk, stride_h,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                          PRECISION: tl.constexpr, PRECISE: tl.constexpr, INTERPRET: tl.constexpr, G: tl.constexpr):
    # Program (g, s, j): h[r, jBN:(j+1)BN] = silu(x[r] @ W[s][:, gate cols]) * (x[r] @ W[s][:, up cols])
    # for the rows r of slot s in passes g, g + G, .. of BM rows; W[s] is [K, 2I] (gate columns,
    # then up). The G programs of a tile are launched together (g varies fastest), so a slot with
    # more than BM rows reads its weight panel from HBM about once, the other passes from L2.
    g = tl.program_id(0)
    s = tl.program_id(1)
    j = tl.program_id(2)
    start, end = _slot_rows(offs_ptr, s)
    rn = j * BN + tl.arange(0, BN)
    n_ok = rn < I
    w = w_ptr + s.to(tl.int64) * stride_ws
    if INTERPRET:                               # the interpreter cannot range() over a runtime bound
        m0 = start + g * BM
        while m0 < end:
            _gate_up_rows(x_ptr, w, h_ptr, m0, end, rn, n_ok, K, I, stride_x, stride_wk, stride_h,
                          BM, BN, BK, EVEN_K, PRECISION, PRECISE, INTERPRET)
            m0 += G * BM
    else:
        for m0 in range(start + g * BM, end, G * BM):
            _gate_up_rows(x_ptr, w, h_ptr, m0, end, rn, n_ok, K, I, stride_x, stride_wk, stride_h,
                          BM, BN, BK, EVEN_K, PRECISION, PRECISE, INTERPRET)


@triton.jit
def _down_rows(h_ptr, w, y_ptr, m0, end, rn, n_ok, K: tl.constexpr, stride_h, stride_wk, stride_y,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
               INTERPRET: tl.constexpr):
    rm = m0 + tl.arange(0, BM)
    m_ok = rm < end
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:
            a = tl.load(h_ptr + rm[:, None] * stride_h + rk[None, :], mask=m_ok[:, None], other=0.0)
            b = tl.load(w + rk[:, None] * stride_wk + rn[None, :], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < K
            a = tl.load(h_ptr + rm[:, None] * stride_h + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w + rk[:, None] * stride_wk + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRET:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def expert_down_kernel(h_ptr, w_ptr, y_ptr, offs_ptr, K: tl.constexpr, N: tl.constexpr, stride_h, stride_ws, stride_wk, stride_y,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       PRECISION: tl.constexpr, INTERPRET: tl.constexpr, G: tl.constexpr):
    # Program (g, s, j): y[r, jBN:(j+1)BN] = h[r] @ W[s][:, jBN:(j+1)BN] for the rows r of slot s in
    # passes g, g + G, .. of BM rows; W[s] is [K, N] (K = I, N = H).
    g = tl.program_id(0)
    s = tl.program_id(1)
    j = tl.program_id(2)
    start, end = _slot_rows(offs_ptr, s)
    rn = j * BN + tl.arange(0, BN)
    n_ok = rn < N
    w = w_ptr + s.to(tl.int64) * stride_ws
    if INTERPRET:
        m0 = start + g * BM
        while m0 < end:
            _down_rows(h_ptr, w, y_ptr, m0, end, rn, n_ok, K, stride_h, stride_wk, stride_y, BM, BN, BK, EVEN_K,
                       PRECISION, INTERPRET)
            m0 += G * BM
    else:
        for m0 in range(start + g * BM, end, G * BM):
            _down_rows(h_ptr, w, y_ptr, m0, end, rn, n_ok, K, stride_h, stride_wk, stride_y, BM, BN, BK, EVEN_K,
                       PRECISION, INTERPRET)
