"""The Triton kernels behind ``moeserve.models.attention`` (imported only when Triton is present).

Dimension letters: T new tokens of a step, S sequences, Hq query heads, Hkv key/value heads,
G = Hq / Hkv, D head dim (DP: next power of two), N flat slots of a layer's pool, B block size,
MB block-table width, BM rows of a program (BQ query tokens x G heads, padded to a power of
two), BN keys per iteration, NS key segments of the split variant.

They live at module level so that Triton's interpreter (``TRITON_INTERPRET=1``) can patch the
``triton.language`` helpers they call; ``moeserve.models.attention`` documents and launches them.
"""

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_ptr, tile, num_seqs, BQ: tl.constexpr):
    # Sequence s owns the query tiles query_start[s] // BQ + s ..; the bases grow by at least
    # ceil(len_s / BQ) from one sequence to the next, so the owner of `tile` is the last s whose
    # base is <= tile (binary search over S + 1 entries, no host table needed). Tiles past a
    # sequence's last query are idle and return at once.
    lo = tile * 0  # tensors from the start: num_seqs == 1 arrives
    hi = num_seqs + tile * 0  # as a constexpr, and loop-carried types must not change
    while lo < hi:
        mid = (lo + hi) // 2
        base = tl.load(query_start_ptr + mid) // BQ + mid
        if base <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _key_tile(
    q,
    q_pos,
    row_ok,
    m_i,
    l_i,
    acc,
    start,
    hi,
    bt_row,
    k_ptr,
    v_ptr,
    kv_head,
    stride_kn,
    scale_log2,
    d,
    d_ok,
    B: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    CHUNK: tl.constexpr,
    WINDOW: tl.constexpr,
    BN: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One step of the online softmax: keys start .. start+BN-1, read through the block table,
    # folded into the running max m_i [BM], sum l_i [BM] and acc [BM, DP] (base 2). MASK: the
    # tile may hold keys that some row must not see (or keys >= hi); without it every key is
    # visible to every row (rows past the tile's queries hold q = 0 and are dropped), so the
    # loads go unpredicated and the causal / chunk compares are skipped.
    k_pos = start + tl.arange(0, BN)  # [BN] absolute key positions
    if MASK:
        k_ok = k_pos < hi
        blk = tl.load(bt_row + k_pos // B, mask=k_ok, other=0)
    else:
        blk = tl.load(bt_row + k_pos // B)
    slot = blk.to(tl.int64) * B + k_pos % B  # [BN] flat slots
    base = slot * stride_kn + kv_head
    k_ptrs = k_ptr + base[None, :] + d[:, None]  # [DP, BN]
    v_ptrs = v_ptr + base[:, None] + d[None, :]  # [BN, DP]
    if MASK:
        k = tl.load(k_ptrs, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    elif D < DP:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    sc = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BM, BN]
    if MASK:
        vis = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if CHUNK > 0:
            vis = vis & (k_pos[None, :] >= (q_pos[:, None] // CHUNK) * CHUNK)
        if WINDOW > 0:
            vis = vis & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        sc = tl.where(vis, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
    # exp2(-inf - -inf) = NaN out of its (still empty) sums.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(sc - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _key_range(
    q,
    q_pos,
    row_ok,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    end,
    bt_row,
    k_ptr,
    v_ptr,
    kv_head,
    stride_kn,
    scale_log2,
    d,
    d_ok,
    B: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    CHUNK: tl.constexpr,
    WINDOW: tl.constexpr,
    BN: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Key tiles lo, lo + BN, .. < hi (keys >= end masked when MASK).
    if INTERPRET:
        # Triton's interpreter cannot range() over a runtime bound; a while loop is the same
        # iteration (compiled, only the for loop is software-pipelined, hence both).
        start = lo
        while start < hi:
            m_i, l_i, acc = _key_tile(
                q,
                q_pos,
                row_ok,
                m_i,
                l_i,
                acc,
                start,
                end,
                bt_row,
                k_ptr,
                v_ptr,
                kv_head,
                stride_kn,
                scale_log2,
                d,
                d_ok,
                B,
                D,
                DP,
                CHUNK,
                WINDOW,
                BN,
                MASK,
                PRECISION,
            )
            start += BN
    else:
        for start in range(lo, hi, BN):
            m_i, l_i, acc = _key_tile(
                q,
                q_pos,
                row_ok,
                m_i,
                l_i,
                acc,
                start,
                end,
                bt_row,
                k_ptr,
                v_ptr,
                kv_head,
                stride_kn,
                scale_log2,
                d,
                d_ok,
                B,
                D,
                DP,
                CHUNK,
                WINDOW,
                BN,
                MASK,
                PRECISION,
            )
    return m_i, l_i, acc


# Arguments that follow the step's shape are not specialized: Triton would otherwise compile the
# kernel again (~1 s, mid-step) for each new class of them (an int equal to 1 or divisible by
# 16, an address 16-byte aligned): the sequence count, the block table's width, and the int32
# fields that PagedBatch packs into one buffer at offsets that follow the batch
# (tests/test_triton_specialization.py).
@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_ptr"],
)
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,  # q, o [T, Hq, D]; k, v one layer's pools [N, Hkv, D]
    part_ptr,
    stat_ptr,  # split only: partial acc [T, Hq, NS, DP] fp32, (m, l) [T, Hq, NS, 2]
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,  # int32 [S, MB], [S], [S + 1]
    sinks_ptr,  # fp32 [Hq] (read only with HAS_SINKS)
    num_seqs,
    scale_log2,  # scale * log2(e): the softmax runs in base 2
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_bt,
    HQ: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    B: tl.constexpr,
    CHUNK: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BM: tl.constexpr,
    BQ: tl.constexpr,
    BN: tl.constexpr,
    NS: tl.constexpr,
    SKIP_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Program (query tile, kv head[, segment]): BQ consecutive new tokens of one sequence times
    # the G query heads sharing kv head h, as one [BM, D] operand, so that every key tile read
    # through the block table serves all G heads (decode: BQ * G rows out of one read of the
    # keys). Online softmax over key tiles [lo, hi): hi = the tile's last query position + 1
    # (causal), lo = the chunk start of its first query (chunked attention), the first key in
    # its first query's window (sliding window) or 0; keys outside are never read (SKIP_MASK: key tiles every row sees skip the mask). With NS > 1 the key range is split into NS segments whose partial
    # results are combined by `paged_attention_reduce_kernel` (long decodes with few programs).
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    s = _find_seq(query_start_ptr, tile, num_seqs, BQ)
    q0 = tl.load(query_start_ptr + s)
    q_len = tl.load(query_start_ptr + s + 1) - q0
    j = tile - (q0 // BQ + s)  # this program's tile within its sequence
    if j * BQ >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len  # tokens cached before this step

    m_idx = tl.arange(0, BM)
    tok = j * BQ + m_idx // G  # [BM] query token within the sequence
    head = h * G + m_idx % G  # [BM] query head
    row_ok = (m_idx < BQ * G) & (tok < q_len)
    q_pos = ctx + tok  # [BM] absolute positions
    d = tl.arange(0, DP)
    d_ok = d < D
    q_row = (q0 + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BM, DP]

    last_q = ctx + tl.minimum(j * BQ + BQ, q_len) - 1
    hi = last_q + 1
    if CHUNK > 0:
        lo = ((ctx + j * BQ) // CHUNK) * CHUNK
    elif WINDOW > 0:
        lo = tl.maximum(ctx + j * BQ - WINDOW + 1, 0)
    else:
        lo = 0
    if NS > 1:
        # Split [lo, hi) into NS segments of whole key tiles; a segment past the end does nothing
        # but still records an empty (m = -inf, l = 0) partial, so the reduction needs no count.
        per = tl.cdiv(tl.cdiv(hi - lo, BN), NS) * BN
        lo = lo + seg * per
        hi = tl.minimum(hi, lo + per)

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    if HAS_SINKS:
        # The sink is one more logit of weight exp(sink) and value 0: the running max and sum
        # start from it (once: in segment 0 when the keys are split).
        if seg == 0:
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BM], 1.0, dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    bt_row = block_tables_ptr + s * stride_bt
    kv_head = h * stride_kh
    if SKIP_MASK:
        # Keys every row of the tile may see: [full_lo, first_q + 1), with full_lo the chunk start
        # of the tile's last query (empty when the tile spans a chunk boundary). Whole key tiles
        # inside it skip the mask; the tiles before and after it (chunk or causal edge) keep it.
        # Pays where the mask's ALU work competes with the MMAs (tiles of many queries); a
        # decode-only step is bound by reading keys and runs faster as one loop (H200).
        first_q = ctx + j * BQ
        if CHUNK > 0:
            full_lo = (last_q // CHUNK) * CHUNK
        elif WINDOW > 0:
            full_lo = tl.maximum(last_q - WINDOW + 1, 0)
        else:
            full_lo = first_q * 0
        mid_lo = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BN) * BN, hi)
        mid_hi = mid_lo + tl.maximum(tl.minimum(first_q + 1, hi) - mid_lo, 0) // BN * BN
        m_i, l_i, acc = _key_range(
            q,
            q_pos,
            row_ok,
            m_i,
            l_i,
            acc,
            lo,
            mid_lo,
            hi,
            bt_row,
            k_ptr,
            v_ptr,
            kv_head,
            stride_kn,
            scale_log2,
            d,
            d_ok,
            B,
            D,
            DP,
            CHUNK,
            WINDOW,
            BN,
            True,
            PRECISION,
            INTERPRET,
        )
        m_i, l_i, acc = _key_range(
            q,
            q_pos,
            row_ok,
            m_i,
            l_i,
            acc,
            mid_lo,
            mid_hi,
            hi,
            bt_row,
            k_ptr,
            v_ptr,
            kv_head,
            stride_kn,
            scale_log2,
            d,
            d_ok,
            B,
            D,
            DP,
            CHUNK,
            WINDOW,
            BN,
            False,
            PRECISION,
            INTERPRET,
        )
        m_i, l_i, acc = _key_range(
            q,
            q_pos,
            row_ok,
            m_i,
            l_i,
            acc,
            mid_hi,
            hi,
            hi,
            bt_row,
            k_ptr,
            v_ptr,
            kv_head,
            stride_kn,
            scale_log2,
            d,
            d_ok,
            B,
            D,
            DP,
            CHUNK,
            WINDOW,
            BN,
            True,
            PRECISION,
            INTERPRET,
        )
    else:
        m_i, l_i, acc = _key_range(
            q,
            q_pos,
            row_ok,
            m_i,
            l_i,
            acc,
            lo,
            hi,
            hi,
            bt_row,
            k_ptr,
            v_ptr,
            kv_head,
            stride_kn,
            scale_log2,
            d,
            d_ok,
            B,
            D,
            DP,
            CHUNK,
            WINDOW,
            BN,
            True,
            PRECISION,
            INTERPRET,
        )

    if NS > 1:
        # Partials of (token, head, segment): the unnormalised acc and (m, l) in base 2.
        pr = (q_row * HQ + head) * NS + seg  # [BM]
        tl.store(part_ptr + pr[:, None] * DP + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stat_ptr + pr * 2, m_i, mask=row_ok)
        tl.store(stat_ptr + pr * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            o_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def paged_attention_reduce_kernel(
    part_ptr,
    stat_ptr,
    o_ptr,
    stride_ot,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    NS: tl.constexpr,
):
    # Program (token, query head): o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
    t = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    sg = tl.arange(0, NS)
    d = tl.arange(0, DP)
    pr = (t * HQ + hq) * NS + sg  # [NS]
    m = tl.load(stat_ptr + pr * 2)
    l = tl.load(stat_ptr + pr * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty segments weigh 0
    acc = tl.sum(tl.load(part_ptr + pr[:, None] * DP + d[None, :]) * w[:, None], 0)  # [DP]
    den = tl.sum(l * w, 0)
    out = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + t * stride_ot + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
