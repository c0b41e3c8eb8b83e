"""The Triton kernel behind ``moeserve.kernels.fused_route`` (imported only when Triton is present).

After the gate's matmul torch's routing (``moeserve.models.routing.route``) is ~9 launches per
MoE layer on the GPU: the softmax or sigmoid, the correction bias, ``torch.topk`` (two kernels),
the gather, the sum, the floor, the division and the cast; an ERNIE-4.5 decode step spent ~25 us
per layer in them on an H200. This kernel does the same in one launch, in fp32 throughout, for
the routings that take the top-k on the scores (every family but Llama 4 and GPT-OSS), and with
``N_GROUP`` > 1 DeepSeek-V3's group-limited selection before the top-k (``MOESERVE_FUSED_GROUPED_ROUTING=0`` leaves it to torch:
``moeserve.kernels.GROUPED_ROUTING_DEVICES``).

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


@triton.jit
def _group_limited(choice, cols, E: tl.constexpr, EB: tl.constexpr, N_GROUP: tl.constexpr, GB: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    # models.routing.group_limited: the experts are N_GROUP consecutive groups of E / N_GROUP; a
    # group's score is the sum of its two best choices (its best alone in groups of one); the
    # TOPK_GROUP best groups (the lowest index first among equal scores) keep their choices, every
    # other expert's becomes -inf. choice [ROWS, EB] with -inf past E; GB: N_GROUP padded to a
    # power of two.
    gs: tl.constexpr = E // N_GROUP
    grp = cols // gs  # [1, EB]: each expert's group (padding columns: N_GROUP or more)
    gcols = tl.arange(0, GB)[None, :]  # [1, GB]
    gscore = tl.full((ROWS, GB), float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        v = tl.where(grp == g, choice, float("-inf"))
        best = tl.max(v, axis=1)  # [ROWS]
        if gs > 1:
            first = tl.argmax(v, axis=1, tie_break_left=True)
            best = best + tl.max(tl.where(cols == first[:, None], float("-inf"), v), axis=1)
        gscore = tl.where(gcols == g, best[:, None], gscore)
    kept = tl.zeros((ROWS, EB), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        gi = tl.argmax(gscore, axis=1, tie_break_left=True)  # [ROWS]
        kept = tl.where(grp == gi[:, None], 1, kept)
        gscore = tl.where(gcols == gi[:, None], float("-inf"), gscore)
    return tl.where(kept != 0, choice, float("-inf"))


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
    N_GROUP: tl.constexpr,
    GB: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
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
    if N_GROUP > 1:  # only the experts of the TOPK_GROUP best of N_GROUP groups stay choosable
        choice = _group_limited(choice, cols, E, EB, N_GROUP, GB, TOPK_GROUP, ROWS)
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
