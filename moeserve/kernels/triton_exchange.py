"""The Triton kernels behind ``moeserve.kernels`` (imported only when Triton is present).

They live at module level so that Triton's interpreter (``TRITON_INTERPRET=1``) can patch the
``triton.language`` helpers they call; ``moeserve.kernels`` documents and launches them.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Inputs that a step or a layer hands over as views at offsets that follow it (a whole-step
# graph's row of arguments per MoE layer, a layer's rows of the placement tables and of the
# load counters, a slot table's last entry) are not specialized on their alignment: each kernel
# then compiles once per model whatever the layer and the step, and the warm-ups before ready
# (NvlinkExchange.warm_up_kernels, ExpertStore.warm_up_kernels) find every key a step launches.


@triton.jit(do_not_specialize_on_alignment=["args_ptr"])
def expert_count_kernel(args_ptr, ecnt_ptr, B: tl.constexpr, EB: tl.constexpr):
    # Block b of B pairs of the N in args: its pairs per logical expert, added to ecnt [EB] (int32,
    # zeroed before the launch). Blocks past N (the grid covers the capacity) do nothing.
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(args_ptr + 3)
    if b * B < n:
        ids_ptr = tl.load(args_ptr + 1).to(tl.pointer_type(tl.int64))
        i = b * B + tl.arange(0, B)
        m = i < n
        e = tl.load(ids_ptr + i, mask=m, other=0).to(tl.int32)
        h = tl.histogram(e, EB, mask=m)
        bins = tl.arange(0, EB)
        tl.atomic_add(ecnt_ptr + bins, h, mask=h > 0)


@triton.jit(do_not_specialize_on_alignment=["args_ptr", "log2phy_ptr", "logcnt_ptr", "ecnt_ptr", "b_ptr"])
def route_kernel(
    args_ptr,
    log2phy_ptr,
    logcnt_ptr,
    slots_ptr,
    hist_ptr,
    ecnt_ptr,
    b_ptr,
    router,
    K: tl.constexpr,
    X: tl.constexpr,
    SINGLE: tl.constexpr,
    BREAKEVEN: tl.constexpr,
    NR: tl.constexpr,
    B: tl.constexpr,
    PB: tl.constexpr,
):
    # args = (x address, ids address, weights address, N, offset). Block b of B pairs (flat (token, k)
    # order): the slot of each pair by the replica rule (token + offset) mod logcnt[e] (replica 0
    # when every expert has one), and the block's histogram over the slots [PB]. Blocks past N
    # (the grid covers the capacity) do nothing. BREAKEVEN: the rule with break-even counts b [E]
    # and this router's pairs per expert ecnt [E] (from expert_count_kernel): with n = ecnt[e] * NR,
    # b[e] > 0 and n <= b[e], replica (offset - router + e) mod logcnt[e] (the step's, staggered by
    # expert, the same on every router); else (token + offset) mod u, u = min(logcnt[e], ceil(n / b[e])) (logcnt[e] when b[e] = 0).
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(args_ptr + 3)
    if b * B < n:
        ids_ptr = tl.load(args_ptr + 1).to(tl.pointer_type(tl.int64))
        i = b * B + tl.arange(0, B)
        m = i < n
        e = tl.load(ids_ptr + i, mask=m, other=0)
        if SINGLE:
            rep = tl.zeros((B,), dtype=tl.int64)
        else:
            offset = tl.load(args_ptr + 4)
            cnt = tl.load(logcnt_ptr + e, mask=m, other=1)
            if BREAKEVEN:
                est = tl.load(ecnt_ptr + e, mask=m, other=0).to(tl.int64) * NR
                be = tl.load(b_ptr + e, mask=m, other=0).to(tl.int64)
                on = be > 0
                used = tl.where(on, tl.minimum(cnt, (est + be - 1) // tl.maximum(be, 1)), cnt)
                used = tl.maximum(used, 1)
                step = offset - router
                alone = (((step + e) % cnt) + cnt) % cnt
                rep = tl.where(on & (est <= be), alone, (i // K + offset) % used)
            else:
                rep = (i // K + offset) % cnt
        slot = tl.load(log2phy_ptr + e * X + rep, mask=m, other=0).to(tl.int32)
        tl.store(slots_ptr + i, slot, mask=m)
        tl.store(hist_ptr + b * PB + tl.arange(0, PB), tl.histogram(slot, PB, mask=m))


@triton.jit(do_not_specialize_on_alignment=["args_ptr", "sent_ptr"])
def publish_kernel(
    args_ptr,
    hist_ptr,
    prefix_ptr,
    counts_table,
    sent_ptr,
    rank,
    R: tl.constexpr,
    P: tl.constexpr,
    PB: tl.constexpr,
    B: tl.constexpr,
    CH: tl.constexpr,
):
    # One program: prefix[b, p] = pairs of slot p in blocks before b; c[p] = this router's pairs
    # per slot, into row `rank` of every rank's counts [R, P], and added to sent [P].
    n = tl.load(args_ptr + 3)
    nb = (n + B - 1) // B
    p = tl.arange(0, PB)
    running = tl.zeros((PB,), dtype=tl.int32)
    b0 = nb * 0  # a while loop: Triton's interpreter cannot range() over a runtime bound
    while b0 < nb:
        rows = b0 + tl.arange(0, CH)
        m = (rows < nb)[:, None]
        h = tl.load(hist_ptr + rows[:, None] * PB + p[None, :], mask=m, other=0)  # [CH, PB]
        tl.store(prefix_ptr + rows[:, None] * PB + p[None, :], tl.cumsum(h, axis=0) - h + running[None, :], mask=m)
        running += tl.sum(h, axis=0)
        b0 += CH
    c = running.to(tl.int64)
    mp = p < P
    tl.store(sent_ptr + p, tl.load(sent_ptr + p, mask=mp, other=0) + c, mask=mp)
    for d in range(R):
        dst = tl.load(counts_table + d).to(tl.pointer_type(tl.int64))
        tl.store(dst + rank * P + p, c, mask=mp)


@triton.jit
def prep_kernel(
    counts_ptr,
    shift_ptr,
    offs_ptr,
    rank,
    worker,
    R: tl.constexpr,
    W: tl.constexpr,
    S: tl.constexpr,
    RB: tl.constexpr,
    WB: tl.constexpr,
    SB: tl.constexpr,
):
    # counts [R, P] seen as [R, W, S]. shift[p] = (rows of the slots before p on p's worker)
    # + (rows earlier ranks send to p); offs [S] = cumulative rows per slot of `worker`
    # (skipped when worker < 0).
    r = tl.arange(0, RB)[:, None, None]
    w = tl.arange(0, WB)[None, :, None]
    s = tl.arange(0, SB)[None, None, :]
    m = (r < R) & (w < W) & (s < S)
    c = tl.load(counts_ptr + r * (W * S) + w * S + s, mask=m, other=0)  # [RB, WB, SB]
    total = tl.sum(c, axis=0)  # [WB, SB]
    before = tl.sum(tl.where(r < rank, c, 0), axis=0)  # [WB, SB]
    within = tl.cumsum(total, axis=1)  # [WB, SB] inclusive
    w2 = tl.arange(0, WB)[:, None]
    s2 = tl.arange(0, SB)[None, :]
    m2 = (w2 < W) & (s2 < S)
    tl.store(shift_ptr + w2 * S + s2, within - total + before, mask=m2)
    if worker >= 0:
        offs = tl.sum(tl.where(w2 == worker, within, 0), axis=0)  # [SB]
        s1 = tl.arange(0, SB)
        tl.store(offs_ptr + s1, offs.to(tl.int32), mask=s1 < S)


@triton.jit(do_not_specialize_on_alignment=["args_ptr"])
def scatter_pairs_kernel(
    args_ptr,
    slots_ptr,
    prefix_ptr,
    shift_ptr,
    rows_table,
    meta_table,
    meta_base,
    worker_base,
    H: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    PB: tl.constexpr,
    DTYPE: tl.constexpr,
    SCALE: tl.constexpr,
    B: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Program (b, q): pairs i = b*B + q*ROWS ... + ROWS-1 (flat (token, k) order) of the N in
    # args. A pair's row on its worker: shift[slot] + prefix[b, slot] + (pairs of the same slot
    # before it in block b), which is its rank in a stable sort of this router's pairs by slot.
    b = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)
    n = tl.load(args_ptr + 3)
    if b * B + q * ROWS < n:
        # Addresses loaded from tables carry no alignment: say they are 16-byte aligned (torch's
        # allocations are), or Triton falls back to 2-byte accesses.
        x_ptr = tl.multiple_of(tl.load(args_ptr), 16).to(tl.pointer_type(DTYPE))
        jb = tl.arange(0, B)
        sb = tl.load(slots_ptr + b * B + jb, mask=b * B + jb < n, other=-1)  # [B]
        li = q * ROWS + tl.arange(0, ROWS)  # in block
        i = b * B + li
        m = i < n
        s = tl.load(slots_ptr + i, mask=m, other=0)  # [ROWS]
        same = (sb[None, :] == s[:, None]) & (jb[None, :] < li[:, None])
        rank_in_block = tl.sum(same.to(tl.int64), axis=1)
        s64 = s.to(tl.int64)
        row = (
            tl.load(shift_ptr + s64, mask=m, other=0)
            + tl.load(prefix_ptr + b * PB + s64, mask=m, other=0)
            + rank_in_block
        )
        d = worker_base + s64 // S
        dst = tl.multiple_of(tl.load(rows_table + d, mask=m, other=0), 16).to(tl.pointer_type(DTYPE))
        meta = tl.load(meta_table + d, mask=m, other=0).to(tl.pointer_type(tl.int64))
        tl.store(meta + row, meta_base + i, mask=m)
        tok = i // K
        if SCALE:
            w_ptr = tl.load(args_ptr + 2).to(tl.pointer_type(DTYPE))
            f = tl.load(w_ptr + i, mask=m, other=0).to(tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mm = m[:, None] & (cols < H)[None, :]
            v = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=mm)
            if SCALE:
                v = (v.to(tl.float32) * f[:, None]).to(DTYPE)
            tl.store(dst[:, None] + row[:, None] * H + cols[None, :], v, mask=mm)


@triton.jit(do_not_specialize_on_alignment=["total_ptr"])
def return_rows_kernel(
    y_ptr, meta_ptr, total_ptr, out_table, capacity, H: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr
):
    # Rows j < total, ROWS per program: back to rank meta // capacity, row meta % capacity there.
    j0 = tl.program_id(0).to(tl.int64) * ROWS
    total = tl.load(total_ptr).to(tl.int64)
    if j0 < total:
        j = j0 + tl.arange(0, ROWS)
        m = j < total
        meta = tl.load(meta_ptr + j, mask=m, other=0)
        src = meta // capacity
        row = meta % capacity
        dst = tl.multiple_of(tl.load(out_table + src, mask=m, other=0), 16).to(tl.pointer_type(y_ptr.dtype.element_ty))
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mm = m[:, None] & (cols < H)[None, :]
            v = tl.load(y_ptr + j[:, None] * H + cols[None, :], mask=mm)
            tl.store(dst[:, None] + row[:, None] * H + cols[None, :], v, mask=mm)


@triton.jit(do_not_specialize=["rows"], do_not_specialize_on_alignment=["total_ptr"])
def silu_mul_kernel(
    gu_ptr,
    out_ptr,
    total_ptr,
    rows,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISE: tl.constexpr,
    HAS_TOTAL: tl.constexpr,
):
    # out[j] = silu(gu[j, :I]) * gu[j, I:] for rows j < total (the device total with HAS_TOTAL,
    # else ``rows``): rows pid, pid + P, .. for P programs, whatever the buffer's capacity.
    j = tl.program_id(0).to(tl.int64)
    total = rows.to(tl.int64)
    if HAS_TOTAL:
        total = tl.load(total_ptr).to(tl.int64)
    while j < total:
        for c0 in range(0, I, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < I
            a = tl.load(gu_ptr + j * 2 * I + cols, mask=m).to(tl.float32)
            u = tl.load(gu_ptr + j * 2 * I + I + cols, mask=m)
            if PRECISE:  # libdevice's expf, as ATen's silu (GPU)
                e = libdevice.exp(-a)
            else:  # the interpreter has no libdevice
                e = tl.exp(-a)
            sl = tl.math.div_rn(a, 1.0 + e).to(u.dtype)
            tl.store(out_ptr + j * I + cols, (sl.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=m)
        j += tl.num_programs(0)


@triton.jit(do_not_specialize_on_alignment=["w_ptr"])
def weighted_sum_kernel(x_ptr, w_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = sum_k w[t, k] * x[t*K + k], fp32 accumulation in k order, one rounding.
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(K):
            wk = tl.load(w_ptr + t * K + k).to(tl.float32)
            acc += wk * tl.load(x_ptr + (t * K + k) * H + cols, mask=m).to(tl.float32)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=m)
