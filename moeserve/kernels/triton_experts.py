"""Triton kernel of the grouped expert MLP for steps with few rows per slot (decode).

Imported lazily through ``moeserve.kernels`` (never at data-plane import). See
``moeserve.kernels.expert_mlp`` for shapes and rounding, and ``expert_mlp_fp8`` for FP8 weights
(codes converted to the rows' dtype in registers, exactly; each [BK, BN] tile's product scaled
by its block's scale, or the whole sum once when a scale covers every K). With HAS_BIAS each
slot's bias row is added to the rounded product and rounded again (as ``x @ W`` then ``+ b``);
ACT 1 is GPT-OSS's clamped SwiGLU, op by op as ``moeserve.models.moe.activate`` rounds it.
With A8 the rows are FP8 codes too, each with its own float32 scale (``quant_rows_kernel``): the
product runs on FP8 tensor cores and the row's scale multiplies the sums with the weights'.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rows(
    x_ptr,
    w,
    sc,
    out_ptr,
    m0,
    end,
    rn,
    n_ok,
    K: tl.constexpr,
    N: tl.constexpr,
    stride_x,
    stride_wk,
    stride_wn,
    stride_sk,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    PRECISE: tl.constexpr,
    INTERPRET: tl.constexpr,
    QUANT: tl.constexpr,
    SBK: tl.constexpr,
    SBN: tl.constexpr,
    NB: tl.constexpr,
    bias,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    xs_ptr,
    A8: tl.constexpr,
):
    # rows m0 .. m0 + BM - 1 (< end) of one slot through its weight columns rn; GATED: the gate
    # columns rn and the up columns N + rn, out = silu(gate) * up. QUANT: w holds FP8 codes and
    # sc the slot's float32 scales [ceil(K/SBK), 2 NB or NB], one per SBK x SBN block (the up
    # columns' from column NB on)
    rm = m0 + tl.arange(0, BM)
    m_ok = rm < end
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if QUANT:
        sn = rn // SBN
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:
            a_mask = m_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            k_ok = rk < K
            a_mask = m_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & n_ok[None, :]
        a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=a_mask, other=0.0)
        b = tl.load(w + rk[:, None] * stride_wk + rn[None, :] * stride_wn, mask=w_mask, other=0.0)
        if GATED:  # both panels' loads before the products, as the tuned kernel had them
            bu = tl.load(w + rk[:, None] * stride_wk + (N + rn)[None, :] * stride_wn, mask=w_mask, other=0.0)
        if QUANT and not A8:  # e4m3 codes are exact in bf16 and fp32 (A8: both operands FP8 codes)
            b = b.to(a.dtype)
            if GATED:
                bu = bu.to(a.dtype)
        if INTERPRET:  # the interpreter's dot mishandles bf16: exact products in fp32
            a, b = a.to(tl.float32), b.to(tl.float32)
        if QUANT and SBK < K:  # a scale per K block (BK divides SBK): each tile's product scaled
            kb = k0 // SBK
            sv = tl.load(sc + kb * stride_sk + sn, mask=n_ok, other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION) * sv[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            if INTERPRET:
                bu = bu.to(tl.float32)
            if QUANT and SBK < K:
                su = tl.load(sc + kb * stride_sk + NB + sn, mask=n_ok, other=0.0)
                acc_u += tl.dot(a, bu, input_precision=PRECISION) * su[None, :]
            else:
                acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    if QUANT and SBK >= K:  # one scale over every K: the sums scaled once
        acc = acc * tl.load(sc + sn, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_u = acc_u * tl.load(sc + NB + sn, mask=n_ok, other=0.0)[None, :]
    if A8:  # each row's own activation scale
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
        acc = acc * xs[:, None]
        if GATED:
            acc_u = acc_u * xs[:, None]
    if HAS_BIAS:  # the slot's bias row: [N] (down), or the gate's [N] then the up's [N]
        b_g = tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            b_u = tl.load(bias + N + rn, mask=n_ok, other=0.0).to(tl.float32)
        else:
            b_u = b_g
    else:
        b_g = tl.zeros((BN,), dtype=tl.float32)
        b_u = b_g
    _store(acc, acc_u, out_ptr, rm, rn, m_ok, n_ok, stride_out, GATED, PRECISE, b_g, b_u, alpha, limit, HAS_BIAS, ACT)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    return tl.exp(x)  # the interpreter has no libdevice


@triton.jit
def _store(
    acc,
    acc_u,
    out_ptr,
    rm,
    rn,
    m_ok,
    n_ok,
    stride_out,
    GATED: tl.constexpr,
    PRECISE: tl.constexpr,
    b_g,
    b_u,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    # acc [BM, BN] (and acc_u, gated) in fp32 -> out rows rm, columns rn, rounded at every step
    # the torch path rounds (each op's fp32 result rounded to the dtype)
    dt = out_ptr.dtype.element_ty
    if GATED:
        g = acc.to(dt)
        u = acc_u.to(dt)
        if HAS_BIAS:
            g = (g.to(tl.float32) + b_g[None, :]).to(dt)
            u = (u.to(tl.float32) + b_u[None, :]).to(dt)
        if ACT == 0:  # silu(g) * u
            gf = g.to(tl.float32)
            sl = tl.math.div_rn(gf, 1.0 + _exp(-gf, PRECISE)).to(dt)
            out = (sl.to(tl.float32) * u.to(tl.float32)).to(dt)
        else:  # (clamp(u) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))
            gc = tl.minimum(g.to(tl.float32), limit).to(dt)
            uc = tl.minimum(tl.maximum(u.to(tl.float32), -limit), limit).to(dt)
            ga = (gc.to(tl.float32) * alpha).to(dt)
            sg = tl.math.div_rn(1.0, 1.0 + _exp(-ga.to(tl.float32), PRECISE)).to(dt)
            glu = (gc.to(tl.float32) * sg.to(tl.float32)).to(dt)
            u1 = (uc.to(tl.float32) + 1.0).to(dt)
            out = (u1.to(tl.float32) * glu.to(tl.float32)).to(dt)
    else:
        out = acc.to(dt)
        if HAS_BIAS:
            out = (out.to(tl.float32) + b_g[None, :]).to(dt)
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _rows_swapped(
    x_ptr,
    w,
    sc,
    out_ptr,
    m0,
    end,
    rn,
    n_ok,
    K: tl.constexpr,
    N: tl.constexpr,
    stride_x,
    stride_wk,
    stride_wn,
    stride_sk,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    PRECISE: tl.constexpr,
    INTERPRET: tl.constexpr,
    SBK: tl.constexpr,
    SBN: tl.constexpr,
    NB: tl.constexpr,
    xs_ptr,
    A8: tl.constexpr,
):
    # As _rows with FP8 weights, computed transposed: out^T [BN, BM] = W^T [BN, BK] x^T [BK, BM],
    # so that the converted codes are the product's first operand (held in registers) and the
    # rows its second (the MMA's N side, which may be as small as the rows a decode step has)
    rm = m0 + tl.arange(0, BM)
    m_ok = rm < end
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    sn = rn // SBN
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:
            a_mask = m_ok[None, :]
            w_mask = n_ok[:, None]
        else:
            k_ok = rk < K
            a_mask = m_ok[None, :] & k_ok[:, None]
            w_mask = k_ok[None, :] & n_ok[:, None]
        a = tl.load(x_ptr + rm[None, :] * stride_x + rk[:, None], mask=a_mask, other=0.0)  # [BK, BM]
        b = tl.load(w + rk[None, :] * stride_wk + rn[:, None] * stride_wn, mask=w_mask, other=0.0)  # [BN, BK]
        if GATED:
            bu = tl.load(w + rk[None, :] * stride_wk + (N + rn)[:, None] * stride_wn, mask=w_mask, other=0.0)
        if not A8:
            b = b.to(a.dtype)
            if GATED:
                bu = bu.to(a.dtype)
        if INTERPRET:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if SBK < K:
            kb = k0 // SBK
            sv = tl.load(sc + kb * stride_sk + sn, mask=n_ok, other=0.0)
            acc += tl.dot(b, a, input_precision=PRECISION) * sv[:, None]
        else:
            acc = tl.dot(b, a, acc, input_precision=PRECISION)
        if GATED:
            if INTERPRET:
                bu = bu.to(tl.float32)
            if SBK < K:
                su = tl.load(sc + kb * stride_sk + NB + sn, mask=n_ok, other=0.0)
                acc_u += tl.dot(bu, a, input_precision=PRECISION) * su[:, None]
            else:
                acc_u = tl.dot(bu, a, acc_u, input_precision=PRECISION)
    if SBK >= K:
        acc = acc * tl.load(sc + sn, mask=n_ok, other=0.0)[:, None]
        if GATED:
            acc_u = acc_u * tl.load(sc + NB + sn, mask=n_ok, other=0.0)[:, None]
    if A8:
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
        acc = acc * xs[None, :]
        if GATED:
            acc_u = acc_u * xs[None, :]
    zero = tl.zeros((BN,), dtype=tl.float32)  # FP8 experts have no biases
    _store(
        tl.trans(acc),
        tl.trans(acc_u),
        out_ptr,
        rm,
        rn,
        m_ok,
        n_ok,
        stride_out,
        GATED,
        PRECISE,
        zero,
        zero,
        0.0,
        0.0,
        False,
        0,
    )


@triton.jit
def _pass(
    x_ptr,
    w,
    sc,
    bias,
    out_ptr,
    m0,
    end,
    rn,
    n_ok,
    K: tl.constexpr,
    N: tl.constexpr,
    stride_x,
    stride_wk,
    stride_wn,
    stride_sk,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    PRECISE: tl.constexpr,
    INTERPRET: tl.constexpr,
    QUANT: tl.constexpr,
    SBK: tl.constexpr,
    SBN: tl.constexpr,
    NB: tl.constexpr,
    SWAP: tl.constexpr,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    xs_ptr,
    A8: tl.constexpr,
):
    # one pass: rows m0 .. m0 + BM - 1 (< end) of one slot (weights w, scales sc, bias) through
    # the columns rn (inlined by Triton: the same code as the calls written out in the loop)
    if SWAP:
        _rows_swapped(
            x_ptr, w, sc, out_ptr, m0, end, rn, n_ok, K, N, stride_x, stride_wk, stride_wn, stride_sk, stride_out,
            BM, BN, BK, EVEN_K, GATED, PRECISION, PRECISE, INTERPRET, SBK, SBN, NB, xs_ptr, A8,
        )  # fmt: skip
    else:
        _rows(
            x_ptr, w, sc, out_ptr, m0, end, rn, n_ok, K, N, stride_x, stride_wk, stride_wn, stride_sk, stride_out,
            BM, BN, BK, EVEN_K, GATED, PRECISION, PRECISE, INTERPRET, QUANT, SBK, SBN, NB, bias, alpha, limit,
            HAS_BIAS, ACT, xs_ptr, A8,
        )  # fmt: skip


@triton.jit
def expert_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    offs_ptr,
    K: tl.constexpr,
    N: tl.constexpr,
    stride_x,
    stride_ws,
    stride_wk,
    stride_wn,
    stride_ss,
    stride_sk,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    PRECISE: tl.constexpr,
    INTERPRET: tl.constexpr,
    G: tl.constexpr,
    QUANT: tl.constexpr,
    SBK: tl.constexpr,
    SBN: tl.constexpr,
    NB: tl.constexpr,
    SWAP: tl.constexpr,
    b_ptr,
    stride_bs,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    xs_ptr,
    A8: tl.constexpr,
):
    # Program (g, s, j): out[r, jBN:(j+1)BN] for the rows r of slot s, in passes g, g + G, .. of BM
    # rows: x[r] @ W[s][:, jBN:(j+1)BN] (W[s] is [K, N]), or with GATED silu of that times
    # x[r] @ W[s][:, N + jBN:..] (W[s] is [K, 2N]: gate columns, then up). The G programs of a tile
    # are launched together (g varies fastest), so a slot with more than BM rows reads its weight
    # panel from HBM about once, the other passes from L2.
    g = tl.program_id(0)
    s = tl.program_id(1)
    j = tl.program_id(2)
    end = tl.load(offs_ptr + s).to(tl.int64)  # rows [start, end) of slot s (offs: inclusive cumsum)
    prev = tl.load(offs_ptr + tl.maximum(s - 1, 0)).to(tl.int64)
    start = tl.where(s > 0, prev, 0)
    rn = j * BN + tl.arange(0, BN)
    n_ok = rn < N
    w = w_ptr + s.to(tl.int64) * stride_ws
    sc = s_ptr + s.to(tl.int64) * stride_ss
    bias = b_ptr + s.to(tl.int64) * stride_bs
    if INTERPRET:  # the interpreter cannot range() over a runtime bound
        m0 = start + g * BM
        while m0 < end:
            _pass(
                x_ptr, w, sc, bias, out_ptr, m0, end, rn, n_ok, K, N, stride_x, stride_wk, stride_wn, stride_sk,
                stride_out, BM, BN, BK, EVEN_K, GATED, PRECISION, PRECISE, INTERPRET, QUANT, SBK, SBN, NB, SWAP,
                alpha, limit, HAS_BIAS, ACT, xs_ptr, A8,
            )  # fmt: skip
            m0 += G * BM
    else:
        for m0 in range(start + g * BM, end, G * BM):
            _pass(
                x_ptr, w, sc, bias, out_ptr, m0, end, rn, n_ok, K, N, stride_x, stride_wk, stride_wn, stride_sk,
                stride_out, BM, BN, BK, EVEN_K, GATED, PRECISION, PRECISE, INTERPRET, QUANT, SBK, SBN, NB, SWAP,
                alpha, limit, HAS_BIAS, ACT, xs_ptr, A8,
            )  # fmt: skip


@triton.jit
def _e4m3_grid(v):
    # v (fp32, |v| <= 448) rounded to nearest even on e4m3's grid, so that the cast to FP8 is
    # exact (Triton's interpreter rounds a carry into the next binade wrongly): a step of
    # 2^(e - 3) in the binade [2^e, 2^(e+1)), 2^-9 below 2^-6 (the subnormals)
    a = tl.abs(v)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)
    r = (a / step + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to an integer, ties to even
    return tl.where(v < 0, -r * step, r * step)


@triton.jit
def _row_scale(amax):
    # a row's FP8 scale from its max |x|: max / 448 (e4m3's largest), 1 for a zero row
    return tl.where(amax > 0, amax / 448.0, 1.0)


@triton.jit
def _e4m3_codes(x, s):
    # x / s clamped to +-448 and rounded onto e4m3's grid (fp32; the caller casts to FP8)
    return _e4m3_grid(tl.minimum(tl.maximum(x / s, -448.0), 448.0))


@triton.jit(do_not_specialize_on_alignment=["total_ptr"])  # offs[-1:]: any int32 of a slot table
def quant_rows_kernel(x_ptr, q_ptr, s_ptr, total_ptr, stride_x, K: tl.constexpr, BLOCK: tl.constexpr):
    # rows pid, pid + P, .. < total (P programs, whatever the buffer's capacity): s = max|x| / 448
    # (1 for a zero row), q = e4m3(x / s); rows past total untouched
    total = tl.load(total_ptr).to(tl.int64)
    r = tl.program_id(0).to(tl.int64)
    while r < total:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + r * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        m = tl.max(amax, axis=0)
        s = _row_scale(m)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + r * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
            q = _e4m3_codes(x, s)
            tl.store(q_ptr + r * K + rk, q.to(q_ptr.dtype.element_ty), mask=rk < K)
        tl.store(s_ptr + r, s)
        r += tl.num_programs(0)


@triton.jit(do_not_specialize=["rows"])
def silu_mul_quant_kernel(
    gu_ptr, q_ptr, s_ptr, rows, I: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr
):  # fmt: skip
    # rows pid, pid + P, .. < rows of gu [rows, 2I]: h = silu(gu[:, :I]) * gu[:, I:] rounded to
    # gu's dtype as silu_mul_kernel rounds it, then h quantized per row as quant_rows_kernel
    # does (s = max|h| / 448, 1 for a zero row; q = e4m3(h / s)). h is computed twice (for its
    # max, then for its codes) and never written: one launch and one read of gu instead of
    # silu_mul's write of h and quant_rows' read of it.
    r = tl.program_id(0).to(tl.int64)
    while r < rows:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, I, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            h = _silu_mul_row(gu_ptr, r, cols, I, PRECISE)
            amax = tl.maximum(amax, tl.abs(h))
        m = tl.max(amax, axis=0)
        s = _row_scale(m)
        for c0 in range(0, I, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            h = _silu_mul_row(gu_ptr, r, cols, I, PRECISE)
            q = _e4m3_codes(h, s)
            tl.store(q_ptr + r * I + cols, q.to(q_ptr.dtype.element_ty), mask=cols < I)
        tl.store(s_ptr + r, s)
        r += tl.num_programs(0)


@triton.jit
def _silu_mul_row(gu_ptr, r, cols, I: tl.constexpr, PRECISE: tl.constexpr):
    # silu(g) * u of row r's columns cols (0 past I), rounded as silu_mul_kernel: silu in fp32
    # rounded to the dtype, the product in fp32 rounded; returned in fp32. The arithmetic of
    # triton_exchange.silu_mul_kernel, op for op (tests/test_expert_kernels.py holds them bitwise)
    m = cols < I
    a = tl.load(gu_ptr + r * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * 2 * I + I + cols, mask=m, other=0.0)
    sl = tl.math.div_rn(a, 1.0 + _exp(-a, PRECISE)).to(u.dtype)
    return (sl.to(tl.float32) * u.to(tl.float32)).to(u.dtype).to(tl.float32)
