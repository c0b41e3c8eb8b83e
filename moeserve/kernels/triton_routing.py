"""The Triton kernel behind ``moeserve.kernels.fused_route`` (imported only when Triton is present).

After the gate's matmul torch's routing (``moeserve.models.routing.route``) is ~9 launches per
MoE layer on the GPU: the softmax or sigmoid, the correction bias, ``torch.topk`` (two kernels),
the gather, the sum, the floor, the division and the cast; an ERNIE-4.5 decode step spent ~25 us
per layer in them on an H200. This kernel does the same in one launch, in fp32 throughout, for
the routings that take the top-k on the scores without expert groups (every family but Llama 4,
GPT-OSS and DeepSeek-V3's grouped selection, which keep torch's).

Rows are independent: a token's ids and weights do not depend on the other tokens of the launch
or on how many there are (batch invariant).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)  # what ATen's softmax and sigmoid compile to
    return tl.exp(x)  # the interpreter has no libdevice


@triton.jit
def _div(a, b, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.math.div_rn(a, b)  # IEEE division, as torch's
    return a / b


# Not specialized: the row count follows the batch (tests/test_triton_specialization.py). The
# launcher passes contiguous 16-byte-aligned tensors only, so the alignment specialization is one key.
@triton.jit(do_not_specialize=["n_rows"])
def fused_route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    n_rows,
    renorm_min,
    scale,
    E: tl.constexpr,
    EB: tl.constexpr,
    K: tl.constexpr,
    KB: tl.constexpr,
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    FLOOR: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISE: tl.constexpr,
):
    # Rows [ROWS] of logits [n_rows, E] (contiguous, any float dtype; EB and KB: E and K padded to
    # powers of two). s = softmax (exp(x - max) / sum, SOFTMAX) or sigmoid 1 / (1 + exp(-x)) of the
    # row in fp32; choice = s + bias [E] fp32 (HAS_BIAS); the K ids of the largest choices, descending,
    # by K arg-maxes (the lowest index of equal values first) -> ids int64 [n_rows, K]; their
    # unbiased s, summed in k order, divided by the sum (RENORM; floored at renorm_min, FLOOR),
    # times scale (SCALE), rounded once to w_ptr's dtype -> weights [n_rows, K].
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, EB)[None, :]  # [1, EB]
    row_ok = rows < n_rows
    m = row_ok[:, None] & (cols < E)
    if PARTS == 3:  # gate_parts' partial logits [n_rows, 3E] (hi, mid, lo), summed (lo + mid) + hi
        base = logits_ptr + rows[:, None] * (3 * E) + cols
        lo = tl.load(base + 2 * E, mask=m, other=0.0)
        mid = tl.load(base + E, mask=m, other=0.0)
        x = (lo + mid) + tl.load(base, mask=m, other=float("-inf"))
    else:
        x = tl.load(logits_ptr + rows[:, None] * E + cols, mask=m, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        x_max = tl.max(x, axis=1)  # [ROWS]
        x_max = tl.where(row_ok, x_max, 0.0)  # rows past n_rows: all -inf, kept finite
        p = _exp(x - x_max[:, None], PRECISE)  # padded columns: exp(-inf) = 0
        total = tl.where(row_ok, tl.sum(p, axis=1), 1.0)
        s = _div(p, total[:, None], PRECISE)
    else:
        s = _div(1.0, 1.0 + _exp(-x, PRECISE), PRECISE)
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
    choice = tl.where(cols < E, choice, float("-inf"))
    kcols = tl.arange(0, KB)[None, :]  # [1, KB]
    ids = tl.zeros((ROWS, KB), dtype=tl.int32)
    weights = tl.zeros((ROWS, KB), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(K):
        idx = tl.argmax(choice, axis=1, tie_break_left=True)  # [ROWS]
        hit = cols == idx[:, None]  # [ROWS, EB]
        w = tl.sum(tl.where(hit, s, 0.0), axis=1)  # the one chosen score, exactly
        total += w  # in k order
        ids = tl.where(kcols == k, idx[:, None], ids)
        weights = tl.where(kcols == k, w[:, None], weights)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        if FLOOR:
            total = tl.maximum(total, renorm_min)
        total = tl.where(row_ok, total, 1.0)  # rows past n_rows: not stored, kept finite
        weights = _div(weights, total[:, None], PRECISE)
    if SCALE:
        weights = weights * scale
    out = rows[:, None] * K + kcols
    ok = row_ok[:, None] & (kcols < K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)
    tl.store(w_ptr + out, weights.to(w_ptr.dtype.element_ty), mask=ok)
