"""The Triton kernels behind ``moeserve.kernels.rms_norm`` and ``moeserve.kernels.rope`` (imported
only when Triton is present).

On the GPU a torch RMS norm is six or seven launches (the fp32 copy, the square, the mean, the
epsilon, the reciprocal root, the product, the cast and the weight) and a rotary embedding about
ten; at decode batches each launch reads and writes a few hundred kilobytes, so a 48-layer step
spent ~5 ms of device time in them (Qwen3-30B-A3B, results/serving-qwen3_30b-1gpu-profile.json).
These kernels do each in one launch, rounding where torch's sequence rounds (the residual sum
and the normalised row to the dtype, fp32 in between), so that only the order of the sum of
squares differs from the torch path (``moeserve.models.layers``), which the CPU keeps.

Rows are independent: a row's result does not depend on the other rows of the launch or on
how many there are, so that a batch of one and a batch of 256 agree bit for bit (the exactness
contract of EPLB on = off and of graphs = eager).
"""

import triton
import triton.language as tl


# Not specialized: the row count follows the batch (tests/test_triton_specialization.py). The
# launcher passes 16-byte-aligned tensors only, so the alignment specialization is one key.
@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_rows,
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    # Rows [ROWS] of x [n_rows, H] (contiguous). HAS_RES: s = x + res rounded to x's dtype (torch's
    # add) and stored to sum_ptr; the row normalised is s. y = s * rsqrt(mean(s^2) + eps) in fp32,
    # then (weight-last) rounded to the dtype and multiplied by the weight in fp32 and rounded
    # (torch's bf16 product), or (WEIGHT_FIRST) multiplied by the fp32 weight and rounded once.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK_H)[None, :]  # [1, BLOCK_H]
    m = (rows < n_rows) & (cols < H)
    offs = rows * H + cols
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, x, mask=m)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=1) / H  # [ROWS]
    normed = xf * tl.math.rsqrt(ms + eps)[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        if WEIGHT_FIRST:
            y = w * normed
        else:
            y = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        y = normed
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows", "heads"])
def head_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    heads,
    stride_t,
    eps,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    PRE_NORM: tl.constexpr,
    ROPE: tl.constexpr,
    POST_NORM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    # Rows [ROWS] of x [T, heads, D] (one head of one token each; a token's heads contiguous, token t
    # at t * stride_t: q or k may be a view of a merged qkv product), out [T * heads, D], in torch's order
    # (moeserve.models.layers.Attention): PRE_NORM, an RMS norm weighted by w [D] (Qwen3's
    # q_norm/k_norm), rounded to the dtype; ROPE, the rotation of each pair by the token's angle
    # (cos, sin [T, D/2] fp32), pairs (2j, 2j+1) when INTERLEAVED else (j, j + D/2), rounded;
    # POST_NORM, a weightless RMS norm (Llama 4's qk-norm), rounded.
    HALF: tl.constexpr = D // 2
    dt = x_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, D)[None, :]  # [1, D]
    m = (rows < n_rows) & (cols < D)
    src = (rows // heads) * stride_t + (rows % heads) * D  # [ROWS, 1] the row's first element in x
    x = tl.load(x_ptr + src + cols, mask=m, other=0.0).to(tl.float32)
    if ROPE:
        if INTERLEAVED:
            partner = cols ^ 1
            pair = cols // 2
            first = (cols % 2) == 0
        else:
            partner = (cols + HALF) % D
            pair = cols % HALF
            first = cols < HALF
        xp = tl.load(x_ptr + src + partner, mask=m, other=0.0).to(tl.float32)
    if PRE_NORM:
        inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # the row's, shared by its pairs
        w = tl.load(w_ptr + cols).to(tl.float32)
        x = ((x * inv).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        if ROPE:
            wp = tl.load(w_ptr + partner).to(tl.float32)
            xp = ((xp * inv).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    if ROPE:
        tok = rows // heads
        c = tl.load(cos_ptr + tok * HALF + pair, mask=m, other=0.0)
        s = tl.load(sin_ptr + tok * HALF + pair, mask=m, other=0.0)
        x = tl.where(first, x * c - xp * s, x * c + xp * s).to(dt).to(tl.float32)
    if POST_NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    tl.store(out_ptr + rows * D + cols, x.to(out_ptr.dtype.element_ty), mask=m)
