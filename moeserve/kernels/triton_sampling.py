"""The Triton kernel behind ``moeserve.sampling`` (imported only when Triton is present).

It lives at module level so that Triton's interpreter (``TRITON_INTERPRET=1``) can patch the
``triton.language`` helpers it calls; ``moeserve.sampling`` documents and launches it, and its
torch twin (``sampling._race_torch``) is the reference it is tested against.
"""

import triton
import triton.language as tl


@triton.jit
def _keys(x, idx, t, thr, seed, pos_lo, pos_hi, n, HAS_THR: tl.constexpr, RANDOM: tl.constexpr):
    # The race keys of one tile: x [N, 4] fp32 logits at flat indices idx = 4 n + w; counter n [N].
    # RANDOM: key = x - t * log(E) with E = -log(1 - w) ~ Exp(1) (Gumbel-max in the logit domain);
    # otherwise the logits themselves (a greedy row: argmax).
    if RANDOM:
        c0 = n.to(tl.uint32)
        c1 = tl.zeros_like(c0) + pos_lo
        c2 = tl.zeros_like(c0) + pos_hi
        c3 = tl.zeros_like(c0)
        # Philox-4x32-10 keyed by the seed (lo, hi words), counter (n, position lo, position hi, 0):
        # Triton's own philox, which sampling.philox4x32 reproduces with int64 torch ops.
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
        w4 = tl.arange(0, 4)[None, :]
        bits = tl.where(
            w4 == 0, r0[:, None], tl.where(w4 == 1, r1[:, None], tl.where(w4 == 2, r2[:, None], r3[:, None]))
        )
        # (m + 0.5) / 2**32 in (0, 1), kept below 1 so that log(1 - w) stays finite.
        w = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
        y = 1.0 - w
        # -log1p(-w) by Goldberg's trick (libdevice's log1p does not run in the interpreter): exact
        # to a few ulp also for tiny w, where E is tiny and its token likely to win.
        e = tl.where(y == 1.0, w, w * tl.math.div_rn(tl.log(y), y - 1.0))
        key = x - t * tl.log(e)
    else:
        key = x
    if HAS_THR:
        key = tl.where(x >= thr, key, float("-inf"))
    return key


# Not specialized, as they follow the batch (tests/test_triton_specialization.py): S, and the
# per-row fields of SamplingTensors, views at offsets that follow B into one packed buffer.
@triton.jit(do_not_specialize=["S"], do_not_specialize_on_alignment=["temp_ptr", "thr_ptr", "seed_ptr", "pos_ptr"])
def race_kernel(
    x_ptr,
    stride_x,
    temp_ptr,
    thr_ptr,
    seed_ptr,
    pos_ptr,
    best_val_ptr,
    best_idx_ptr,
    V,
    chunk,
    S,
    HAS_THR: tl.constexpr,
    N: tl.constexpr,
):
    # S (chunks per row) is a plain argument, not a constexpr: it follows the batch size, and a
    # constexpr would compile the kernel again for every new one (~1 s each, mid-serving);
    # nor is it specialized (above).
    # Program (b, s): the best key of row b over columns [s * chunk, (s + 1) * chunk) (chunk a
    # multiple of 4 N), and its lowest index among equal keys, into best_val / best_idx [B, S]. The
    # max is exact, so the split changes nothing: the caller takes the first chunk holding the max.
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    t = tl.load(temp_ptr + b)
    thr = float("-inf")
    if HAS_THR:
        thr = tl.load(thr_ptr + b)
    seed = tl.load(seed_ptr + b)
    pos = tl.load(pos_ptr + b)
    pos_lo = (pos & 0xFFFFFFFF).to(tl.uint32)
    pos_hi = ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
    start = s * chunk
    end = tl.minimum(start + chunk, V)
    best = tl.max(tl.full((1,), float("-inf"), tl.float32), axis=0)
    best_i = start
    row = x_ptr + b * stride_x
    off = start
    while off < end:  # a while loop: the interpreter cannot range() over a runtime bound
        n = off // 4 + tl.arange(0, N)  # [N] Philox counters
        idx = 4 * n[:, None] + tl.arange(0, 4)[None, :]  # [N, 4] columns
        x = tl.load(row + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        if t > 0:
            key = _keys(x, idx, t, thr, seed, pos_lo, pos_hi, n, HAS_THR, True)
        else:
            key = _keys(x, idx, t, thr, seed, pos_lo, pos_hi, n, HAS_THR, False)
        m = tl.max(tl.max(key, axis=1), axis=0)
        j = tl.min(tl.min(tl.where(key == m, idx, V), axis=1), axis=0)  # lowest index of the max
        better = m > best  # strict: earlier tiles win ties
        best_i = tl.where(better, j, best_i)
        best = tl.where(better, m, best)
        off += 4 * N
    tl.store(best_val_ptr + b * S + s, best)
    tl.store(best_idx_ptr + b * S + s, best_i)
