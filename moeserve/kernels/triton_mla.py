"""The Triton kernel of MLA's absorbed attention over the latent paged cache (imported only when
Triton is present; ``moeserve.models.mla`` documents and launches it).

Dimension letters: T tokens of a step, Hq heads (BH of them per program), R kv_lora_rank (RP:
next power of two), Dr the RoPE dim (DRP), C = R + Dr the latent of a token, N flat slots of a
layer's pool, B block size, BN keys per iteration.

One program per (token, tile of BH heads): the token's BH absorbed queries ``[q_c | q_pe]`` meet
every visible latent ``[c | k_pe]`` (keys 0 .. position, read through the block table); scores
``q_c . c + q_pe . k_pe``, an online softmax in fp32 (base 2, scale folded in), and the values
are the latents' first R columns: ``o_c = softmax @ c`` [BH, R]. The latent rows are read once
per tile of heads, which is what makes MLA decode cheap: C values per cached token for all heads.
"""

import triton
import triton.language as tl


@triton.jit
def _latent_tile(
    q_c,
    q_pe,
    m_i,
    l_i,
    acc,
    start,
    pos,
    bt_row,
    pool_ptr,
    stride_pn,
    scale_log2,
    r,
    r_ok,
    e,
    e_ok,
    R: tl.constexpr,
    B: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One step of the online softmax over latents start .. start+BN-1 (those > pos masked).
    k_pos = start + tl.arange(0, BN)  # [BN]
    k_ok = k_pos <= pos
    blk = tl.load(bt_row + k_pos // B, mask=k_ok, other=0)
    slot = blk.to(tl.int64) * B + k_pos % B  # [BN]
    row = pool_ptr + slot * stride_pn  # [BN]
    c = tl.load(row[:, None] + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BN, RP]
    k_pe = tl.load(row[:, None] + R + e[None, :], mask=k_ok[:, None] & e_ok[None, :], other=0.0)  # [BN, DRP]
    s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)  # [BH, BN]
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
    s = tl.where(k_ok[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BH, BN]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
    return m_new, l_i, acc


# The block table's width and the step's packed metadata (block tables, positions, sequence of
# each token) follow the step's shape: left unspecialized, so that one compile per model and
# dtype serves every step (tests/test_triton_specialization.py).
@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "positions_ptr", "seq_ptr"],
)
def mla_decode_kernel(
    qc_ptr,
    qpe_ptr,
    pool_ptr,
    out_ptr,
    block_tables_ptr,
    positions_ptr,
    seq_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_pn,
    stride_ot,
    stride_oh,
    stride_bt,
    HQ: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    DR: tl.constexpr,
    DRP: tl.constexpr,
    B: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tok = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)  # [BH]
    h_ok = heads < HQ
    r = tl.arange(0, RP)
    r_ok = r < R
    e = tl.arange(0, DRP)
    e_ok = e < DR
    seq = tl.load(seq_ptr + tok)
    pos = tl.load(positions_ptr + tok)  # keys 0 .. pos are visible
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    q_c = tl.load(
        qc_ptr + tok * stride_qt + heads[:, None] * stride_qh + r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )  # [BH, RP]
    q_pe = tl.load(
        qpe_ptr + tok * stride_pt + heads[:, None] * stride_ph + e[None, :],
        mask=h_ok[:, None] & e_ok[None, :],
        other=0.0,
    )  # [BH, DRP]
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, RP], tl.float32)
    if INTERPRET:
        # Triton's interpreter cannot range() over a runtime bound; a while loop is the same
        # iteration (compiled, only the for loop is software-pipelined, hence both).
        start = pos * 0
        while start <= pos:
            m_i, l_i, acc = _latent_tile(
                q_c,
                q_pe,
                m_i,
                l_i,
                acc,
                start,
                pos,
                bt_row,
                pool_ptr,
                stride_pn,
                scale_log2,
                r,
                r_ok,
                e,
                e_ok,
                R,
                B,
                BN,
                PRECISION,
            )
            start += BN
    else:
        for start in range(0, pos + 1, BN):
            m_i, l_i, acc = _latent_tile(
                q_c,
                q_pe,
                m_i,
                l_i,
                acc,
                start,
                pos,
                bt_row,
                pool_ptr,
                stride_pn,
                scale_log2,
                r,
                r_ok,
                e,
                e_ok,
                R,
                B,
                BN,
                PRECISION,
            )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok * stride_ot + heads[:, None] * stride_oh + r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & r_ok[None, :],
    )
