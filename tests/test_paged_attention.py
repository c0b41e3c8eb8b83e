"""The paged KV cache and batched attention (moeserve.models.paged, moeserve.models.attention,
moeserve.kernels.triton_attention): the whole model through (PagedBatch, PagedKVCache) equals the eager
(StepBatch, KVCache) oracle; the Triton kernel, run by Triton's interpreter on CPU tensors in
fp32 with IEEE dots, equals the torch path; PagedBatch.build's metadata on a golden example.

Dimension letters as in moeserve/models/attention.py: T new tokens, S sequences, Hq / Hkv
query / key-value heads, D head dim, N flat slots.
"""

import functools
import itertools
import logging
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL
from triton_util import HAVE_TRITON, needs_triton  # noqa: E402

from moeserve.models import PagedBatch, PagedKVCache, StepBatch, init_model, load_model, paged
from moeserve.models import attention as attn
from moeserve.models.layers import Attention

if HAVE_TRITON and not torch.cuda.is_available():
    # conftest.py sets it before Triton is imported; without a GPU the interpreter is the only way.
    assert os.environ.get("TRITON_INTERPRET") == "1"


# -- PagedBatch ----------------------------------------------------------------------------------


def test_paged_batch_build_golden_example():
    # block size 4; a prefill of 3 (blocks 7, 2), a decode at position 6 (blocks 4, 0: block 0 is a
    # real block, not padding), a chunk of 5 at positions 2..6 after 2 cached tokens (blocks 9, 1, 3)
    b = PagedBatch.build([3, 1, 5], [0, 6, 2], [[7, 2], [4, 0], [9, 1, 3]], 4)
    assert (b.num_tokens, b.num_seqs, b.max_query_len, b.max_seq_len, b.block_size) == (9, 3, 5, 7, 4)
    assert b.positions.tolist() == [0, 1, 2, 6, 2, 3, 4, 5, 6]
    assert b.slot_mapping.tolist() == [28, 29, 30, 2, 38, 39, 4, 5, 6]
    assert b.block_tables.tolist() == [[7, 2, 0], [4, 0, 0], [9, 1, 3]]
    assert b.seq_lens.tolist() == [3, 7, 7]
    assert b.query_start.tolist() == [0, 3, 4, 9]
    assert b.last_token_index.tolist() == [2, 3, 8]
    assert b.positions.dtype == b.slot_mapping.dtype == b.last_token_index.dtype == torch.int64
    assert b.block_tables.dtype == b.seq_lens.dtype == b.query_start.dtype == torch.int32


def test_paged_batch_fresh_suffix_is_the_trailing_prompts_that_start_at_zero(monkeypatch):
    assert PagedBatch.build([3, 2], [0, 0], [[1], [2]], 4).fresh is None  # off: nothing built for it
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    # a decode, a continuing chunk, then two fresh prompts (the scheduler admits new ones last)
    b = PagedBatch.build([1, 5, 3, 6], [6, 2, 0, 0], [[4, 0], [9, 1], [7], [2, 3]], 4)
    f = b.fresh
    assert f is not None and (f.first_seq, f.first_token, f.max_len) == (2, 6, 6)
    assert f.cu_seqlens.tolist() == [0, 3, 9] and f.cu_seqlens.dtype == torch.int32
    h = f.head
    assert h is not None and (h.num_tokens, h.num_seqs, h.max_query_len, h.max_seq_len) == (6, 2, 5, 7)
    assert h.fresh is None and h.block_size == 4
    assert h.positions.tolist() == b.positions.tolist()[:6] and h.slot_mapping.tolist() == b.slot_mapping.tolist()[:6]
    assert h.block_tables.tolist() == [[4, 0], [9, 1]] and h.seq_lens.tolist() == [7, 7]
    assert h.query_start.tolist() == [0, 1, 6] and h.last_token_index.tolist() == [0, 5]
    # a fresh prompt before a continuing one is not in the suffix; all fresh: no head
    assert PagedBatch.build([3, 2], [0, 4], [[1], [2, 3]], 4).fresh is None
    whole = PagedBatch.build([3, 2], [0, 0], [[1], [2]], 4).fresh
    assert whole is not None and whole.head is None and (whole.first_seq, whole.first_token) == (0, 0)
    assert whole.cu_seqlens.tolist() == [0, 3, 5]
    assert PagedBatch.build([], [], [], 4).fresh is None


def test_paged_batch_empty_and_invalid():
    e = PagedBatch.build([], [], [], 16)
    assert (e.num_tokens, e.num_seqs, e.max_query_len, e.max_seq_len) == (0, 0, 0, 0)
    assert e.block_tables.shape == (0, 0) and e.query_start.tolist() == [0]
    with pytest.raises(ValueError, match="needs 2 blocks of 4, but its block table has 1"):
        PagedBatch.build([3], [2], [[5]], 4)
    with pytest.raises(ValueError, match=">= 1 new token"):
        PagedBatch.build([0], [0], [[0]], 4)
    with pytest.raises(ValueError, match="outside 0..7"):
        PagedBatch.build([1], [0], [[8]], 4, num_blocks=8)
    with pytest.raises(ValueError, match="one entry per sequence"):
        PagedBatch.build([1, 1], [0], [[0]], 4)


def test_bytes_per_block_and_pool_layout():
    assert PagedKVCache.bytes_per_block(4, 2, 16, 8, torch.bfloat16) == 2 * 4 * 8 * 2 * 16 * 2
    c = PagedKVCache(4, 2, 16, num_blocks=5, block_size=8)
    assert c.k.shape == c.v.shape == (4, 40, 2, 16) and c.num_slots == 40


# -- the whole model: paged equals eager -----------------------------------------------------------


class Blocks:
    """The caller's side of the paged cache, as the router runner keeps it: a shuffled free list
    (so block ids are neither contiguous nor ordered) and each sequence's block table."""

    def __init__(self, num_blocks, block_size, seed):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size, self.tables = block_size, {}

    def batch(self, step, device):
        """step: {seq: (start, end)} -> PagedBatch, allocating the blocks the new tokens need."""
        for sid, (_, end) in step.items():
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
        return PagedBatch.build(
            [e - s for s, e in step.values()],
            [s for s, _ in step.values()],
            [self.tables[sid] for sid in step],
            self.block_size,
            device,
        )


# Prefills of different lengths, a long prompt in chunks (3, then 14 crossing two chunk
# boundaries of Llama 4's chunk 8, then 4), a late-starting prefill, decodes, an empty step.
PROMPTS = {"a": 12, "b": 5, "c": 21, "d": 9}
SCHEDULE = [
    {"a": (0, 12), "b": (0, 5), "c": (0, 3)},
    {"a": (12, 13), "b": (5, 6), "c": (3, 17), "d": (0, 9)},
    {},
    {"d": (9, 10), "c": (17, 21), "a": (13, 14), "b": (6, 7)},
    {"b": (7, 8), "a": (14, 15), "c": (21, 22), "d": (10, 11)},
    {"c": (22, 23)},
]


@pytest.fixture(scope="module", params=["llama4", "ernie45"])
def model(request, tmp_path_factory):
    return load_model(init_model(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def _run_schedule(model, block_size, seed=0):
    """Every step of SCHEDULE through both caches: the eager and paged hidden states [T, H]."""
    g = torch.Generator().manual_seed(seed)
    tokens = {k: torch.randint(3, model.config.vocab_size, (n + 8,), generator=g) for k, n in PROMPTS.items()}
    eager, paged = model.new_cache(), model.new_paged_cache(num_blocks=40, block_size=block_size)
    blocks = Blocks(40, block_size, seed)
    out = []
    for step in SCHEDULE:
        ids = torch.cat([tokens[k][s:e] for k, (s, e) in step.items()]) if step else torch.zeros(0, dtype=torch.long)
        sb = StepBatch(tuple(step), tuple(e - s for s, e in step.values()), tuple(s for s, _ in step.values()))
        pb = blocks.batch(step, model.device)
        want = model.step(ids, sb, eager)
        got = model.step(ids, pb, paged)
        assert torch.equal(pb.last_token_index, sb.last_token_index) and torch.equal(pb.positions, sb.positions)
        out.append((want, got, pb))
    return out


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_model_step_equals_the_eager_oracle(model, block_size):
    if model.config.family == "llama4":  # the features the schedule must exercise
        c = model.config
        assert c.attention_chunk_size == 8 and any(c.chunked_attention) and not all(c.use_rope)
        assert c.attn_temperature_tuning and c.use_qk_norm
    for want, got, pb in _run_schedule(model, block_size):
        assert got.shape == want.shape
        if want.numel():
            # The fp32 contract (logits within 1e-4), on the hidden states and on the logits: a
            # different summation order in attention is a few fp32 ulps, ~1e-5 on ERNIE's logits
            # of magnitude ~12 (its tied embedding, std 0.3, as the LM head).
            assert (got - want).abs().max() < FP32_LOGITS_ATOL
            lw = model.logits(want[pb.last_token_index])
            lg = model.logits(got[pb.last_token_index])
            assert (lg - lw).abs().max() < FP32_LOGITS_ATOL


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@needs_triton
def test_paged_model_step_with_the_triton_kernel_equals_the_eager_oracle(model, monkeypatch):
    """The model's Attention routed through the Triton kernel (as on CUDA), under the interpreter."""
    monkeypatch.setattr(
        "moeserve.models.layers.paged_attention", functools.partial(attn.paged_attention, backend="triton")
    )
    for want, got, _ in _run_schedule(model, 4, seed=1):
        if want.numel():
            assert (got - want).abs().max() < FP32_LOGITS_ATOL


def test_paged_and_eager_caches_do_not_mix(model):
    pb = PagedBatch.build([2], [0], [[0]], 4)
    with pytest.raises(TypeError, match="PagedBatch needs a PagedKVCache"):
        model.step(torch.tensor([5, 6]), pb, model.new_cache())
    with pytest.raises(TypeError, match="PagedKVCache needs a PagedBatch"):
        model.step(torch.tensor([5, 6]), StepBatch.prefill([0], [2]), model.new_paged_cache(4, 4))
    with pytest.raises(ValueError, match="built for block_size 4 but the cache's is 8"):
        model.step(torch.tensor([5, 6]), pb, model.new_paged_cache(4, 8))


# -- the attention functions -----------------------------------------------------------------------


def _case(lens, starts, block_size, hq, hkv, d, seed, extra_blocks=3):
    """Random q [T, Hq, D], pools [N, Hkv, D] filled everywhere, shuffled block tables, and the batch."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil((s + n) / block_size) for s, n in zip(starts, lens)]
    num_blocks = sum(need) + extra_blocks
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for k in need:
        tables.append(ids[:k])
        ids = ids[k:]
    batch = PagedBatch.build(lens, starts, tables, block_size, num_blocks=num_blocks)
    q = torch.randn(batch.num_tokens, hq, d, generator=g)
    k_pool = torch.randn(num_blocks * block_size, hkv, d, generator=g)
    v_pool = torch.randn(num_blocks * block_size, hkv, d, generator=g)
    return q, k_pool, v_pool, batch


def _eager(q, k_pool, v_pool, batch, chunk, hq, hkv, d, window=None, sinks=None):
    """Attention._attend sequence by sequence, on keys read back through the block tables."""
    me = SimpleNamespace(
        chunk=chunk,
        window=window,
        sinks=sinks,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        scale=d**-0.5,
        softmax_fp32=True,
    )
    out = torch.empty_like(q)
    qs, lens = batch.query_start.tolist(), batch.seq_lens.tolist()
    for s in range(batch.num_seqs):
        a, b = qs[s], qs[s + 1]
        slots = [
            batch.block_tables[s, p // batch.block_size].item() * batch.block_size + p % batch.block_size
            for p in range(lens[s])
        ]
        out[a:b] = Attention._attend(me, q[a:b], k_pool[slots], v_pool[slots], lens[s] - (b - a))
    return out


def _poisoned(k_pool, v_pool, batch, chunk, window=None):
    """Copies of the pools with NaN in every slot no query of the step may read: slots past a
    sequence's length, blocks no sequence owns, and (chunked) keys before the chunk of a
    sequence's first new token, or (sliding window) before its window. A kernel that reads one
    of them returns NaN there."""
    keep = torch.zeros(k_pool.shape[0], dtype=torch.bool)
    bs, qs = batch.block_size, batch.query_start.tolist()
    for s, n in enumerate(batch.seq_lens.tolist()):
        first = n - (qs[s + 1] - qs[s])
        lo = (first // chunk) * chunk if chunk else max(0, first - window + 1) if window else 0
        for p in range(lo, n):
            keep[batch.block_tables[s, p // bs].item() * bs + p % bs] = True
    k, v = k_pool.clone(), v_pool.clone()
    k[~keep], v[~keep] = float("nan"), float("nan")
    return k, v


CASES = {  # name: (lens, starts)
    "decode": ([1, 1, 1, 1, 1], [0, 3, 17, 40, 70]),
    "prefill": ([7, 20, 1, 33], [0, 0, 0, 0]),
    "mixed": ([1, 9, 1, 30, 4], [50, 0, 7, 13, 21]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (4, 2, 16), (6, 2, 24), (8, 1, 32)])
@pytest.mark.parametrize("chunk", [None, 8])
def test_torch_path_equals_the_eager_attention(case, hq, hkv, d, chunk):
    lens, starts = CASES[case]
    q, k_pool, v_pool, batch = _case(lens, starts, 4, hq, hkv, d, seed=hq * 10 + d)
    want = _eager(q, k_pool, v_pool, batch, chunk, hq, hkv, d)
    # the torch path reads padding slots too, and must not let them leak (0 * NaN)
    kp, vp = _poisoned(k_pool, v_pool, batch, None)
    got = attn.paged_attention_torch(q, kp, vp, batch, scale=d**-0.5, chunk=chunk, softmax_fp32=True)
    assert (got - want).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (4, 2, 16), (6, 2, 24), (8, 1, 32)])
@pytest.mark.parametrize("chunk", [None, 8])
def test_triton_kernel_equals_the_torch_path(case, block_size, hq, hkv, d, chunk):
    lens, starts = CASES[case]
    q, k_pool, v_pool, batch = _case(lens, starts, block_size, hq, hkv, d, seed=block_size + hq + d)
    want = attn.paged_attention_torch(q, k_pool, v_pool, batch, scale=d**-0.5, chunk=chunk, softmax_fp32=True)
    kp, vp = _poisoned(k_pool, v_pool, batch, chunk)
    got = attn.paged_attention_triton(q, kp, vp, batch, scale=d**-0.5, chunk=chunk)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("segments", [2, 8])
@pytest.mark.parametrize("chunk", [None, 16])
def test_triton_split_key_range_equals_the_torch_path(segments, chunk):
    """Long decodes with the key range split into segments (more segments than key tiles for
    the short ones: empty segments must weigh nothing)."""
    lens, starts = [1, 1, 1, 2], [300, 5, 131, 200]
    q, k_pool, v_pool, batch = _case(lens, starts, 16, 8, 2, 16, seed=segments)
    want = attn.paged_attention_torch(q, k_pool, v_pool, batch, scale=0.25, chunk=chunk, softmax_fp32=True)
    kp, vp = _poisoned(k_pool, v_pool, batch, chunk)
    got = attn.paged_attention_triton(q, kp, vp, batch, scale=0.25, chunk=chunk, num_segments=segments)
    assert (got - want).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("skip_mask", [False, True])
@pytest.mark.parametrize("lens,starts", [([1, 40, 1, 70, 3], [90, 0, 33, 20, 64]), ([1, 1, 1], [90, 33, 64])])
def test_triton_mask_free_key_tiles_equal_the_torch_path(monkeypatch, skip_mask, lens, starts):
    """Key tiles of 16 and a chunk of 32: many tiles every row of a query tile sees, which skip
    the mask with SKIP_MASK, next to the chunk's and the causal edges."""
    monkeypatch.setattr(attn, "TUNING", {k: dict(v, BN=16, SKIP_MASK=skip_mask) for k, v in attn.TUNING.items()})
    for chunk in (None, 32):
        q, k_pool, v_pool, batch = _case(lens, starts, 4, 4, 2, 16, seed=7)
        want = attn.paged_attention_torch(q, k_pool, v_pool, batch, scale=0.25, chunk=chunk, softmax_fp32=True)
        kp, vp = _poisoned(k_pool, v_pool, batch, chunk)
        got = attn.paged_attention_triton(q, kp, vp, batch, scale=0.25, chunk=chunk)
        assert (got - want).abs().max() < 1e-5


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0, 0.25])  # [Hq], up to 8 heads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window, sinks", [(6, False), (None, True), (5, True)])
def test_torch_path_with_a_sliding_window_and_sinks_equals_the_eager_attention(case, window, sinks):
    lens, starts = CASES[case]
    hq, hkv, d = 8, 2, 16
    s = SINKS[:hq] if sinks else None
    q, k_pool, v_pool, batch = _case(lens, starts, 4, hq, hkv, d, seed=11)
    want = _eager(q, k_pool, v_pool, batch, None, hq, hkv, d, window, s)
    kp, vp = _poisoned(k_pool, v_pool, batch, None)
    got = attn.paged_attention_torch(
        q, kp, vp, batch, scale=d**-0.5, chunk=None, softmax_fp32=True, window=window, sinks=s
    )
    assert (got - want).abs().max() < 1e-5


def test_a_sink_takes_its_share_of_the_weight_and_adds_nothing():
    """One key: without a sink its value comes through whole; with sink s, times e^x / (e^x + e^s)."""
    q, kp, vp, batch = _case([1], [0], 4, 2, 1, 16, seed=3)
    plain = attn.paged_attention_torch(q, kp, vp, batch, scale=0.25, chunk=None, softmax_fp32=True)
    sinks = torch.tensor([0.0, 1.0])
    got = attn.paged_attention_torch(q, kp, vp, batch, scale=0.25, chunk=None, softmax_fp32=True, sinks=sinks)
    x = (q[0] @ kp[batch.slot_mapping[0], 0]) * 0.25  # [Hq] the one score per head
    share = torch.exp(x) / (torch.exp(x) + torch.exp(sinks))
    assert torch.allclose(got[0], plain[0] * share[:, None], atol=1e-6)


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("window, sinks", [(6, False), (None, True), (9, True)])
def test_triton_kernel_with_a_sliding_window_and_sinks_equals_the_torch_path(case, block_size, window, sinks):
    lens, starts = CASES[case]
    hq, hkv, d = 8, 2, 16
    s = SINKS[:hq] if sinks else None
    q, k_pool, v_pool, batch = _case(lens, starts, block_size, hq, hkv, d, seed=block_size)
    want = attn.paged_attention_torch(
        q, k_pool, v_pool, batch, scale=d**-0.5, chunk=None, softmax_fp32=True, window=window, sinks=s
    )
    kp, vp = _poisoned(k_pool, v_pool, batch, None, window)
    got = attn.paged_attention_triton(q, kp, vp, batch, scale=d**-0.5, chunk=None, window=window, sinks=s)
    assert (got - want).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("segments", [2, 8])
@pytest.mark.parametrize("skip_mask", [False, True])
def test_triton_split_keys_and_mask_free_tiles_with_a_window_and_sinks(monkeypatch, segments, skip_mask):
    """The sink counted once over split key segments; a window of 40 over tiles of 16 keys."""
    monkeypatch.setattr(attn, "TUNING", {k: dict(v, BN=16, SKIP_MASK=skip_mask) for k, v in attn.TUNING.items()})
    lens, starts = [1, 1, 30, 2], [300, 5, 70, 200]
    q, k_pool, v_pool, batch = _case(lens, starts, 16, 8, 2, 16, seed=segments)
    for window in (None, 40):
        want = attn.paged_attention_torch(
            q, k_pool, v_pool, batch, scale=0.25, chunk=None, softmax_fp32=True, window=window, sinks=SINKS
        )
        kp, vp = _poisoned(k_pool, v_pool, batch, None, window)
        got = attn.paged_attention_triton(
            q, kp, vp, batch, scale=0.25, chunk=None, window=window, sinks=SINKS, num_segments=segments
        )
        assert (got - want).abs().max() < 1e-5


def test_empty_step_attention():
    batch = PagedBatch.build([], [], [], 4)
    q, pool = torch.zeros(0, 4, 16), torch.zeros(8, 2, 16)
    assert attn.paged_attention_torch(q, pool, pool, batch, scale=0.25, chunk=None, softmax_fp32=True).shape == (
        0,
        4,
        16,
    )
    if HAVE_TRITON:
        assert attn.paged_attention_triton(q, pool, pool, batch, scale=0.25, chunk=None).shape == (0, 4, 16)


def test_launch_config_shapes():
    decode = PagedBatch.build([1] * 4, [4000] * 4, [list(range(i * 300, i * 300 + 251)) for i in range(4)], 16)
    cfg = attn.attention_config(decode, 40, 8, 128, num_sms=132)  # Llama 4 Scout's heads: G = 5
    assert (cfg["BM"], cfg["BQ"], cfg["tiles"]) == (16, 3, 4 // 3 + 4)
    assert cfg["NS"] > 1  # 32 programs for 132 SMs: split
    prefill = PagedBatch.build([100, 1], [0, 50], [list(range(7)), [9, 10, 11, 12]], 16)
    cfg = attn.attention_config(prefill, 40, 8, 128, num_sms=132)
    assert (cfg["BM"], cfg["BQ"], cfg["NS"], cfg["tiles"]) == (64, 12, 1, 101 // 12 + 2)


# -- the flash prefill backend (MOESERVE_ATTENTION_PREFILL=flash) -------------------------------------


def _dense_causal(calls):
    """A stand-in for ``attn.flash_varlen`` on CPU (FlashAttention runs on CUDA only): causal
    attention of each sequence over its own rows, grouped heads, fp32; records its calls."""

    def run(q, k, v, cu_seqlens, max_len, *, scale, window):
        cu = cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == q.shape[0] == k.shape[0] == v.shape[0]
        assert max_len == max(b - a for a, b in zip(cu, cu[1:]))
        calls.append((q.shape[0], len(cu) - 1, window))
        g = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for a, b in zip(cu, cu[1:]):
            qq = q[a:b].transpose(0, 1)  # [Hq, n, D]
            kk, vv = (x[a:b].repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
            i = torch.arange(b - a)
            vis = i[None, :] <= i[:, None]
            if window:
                vis = vis & (i[None, :] > i[:, None] - window)
            p = torch.softmax((qq @ kk.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf")), dim=-1)
            out[a:b] = (p @ vv).transpose(0, 1)
        return out

    return run


@pytest.fixture
def flash_on(monkeypatch):
    """The flash prefill backend switched on, its kernel replaced by ``_dense_causal``."""
    calls: list = []
    monkeypatch.setitem(attn.PREFILL, "backend", "flash")
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    monkeypatch.setattr(attn, "flash_supported", lambda q: True)
    monkeypatch.setattr(attn, "flash_varlen", _dense_causal(calls))
    return calls


FLASH_CASES = {  # name: (lens, starts, rows the dense kernel gets, sequences it gets)
    "decodes, a chunk, two prompts": ([1, 9, 1, 30, 4], [50, 7, 13, 0, 0], 34, 2),
    "prompts only": ([7, 20, 1, 33], [0, 0, 0, 0], 61, 4),
    "a prompt before a chunk": ([12, 5], [0, 3], 0, 0),
}


def _split_equals_the_torch_path(lens, starts, chunk, window) -> PagedBatch:
    """The step of ``lens`` new tokens after ``starts`` through the paged Triton path with the
    step's own keys passed (a prefill backend's split may take its fresh prompts), keys outside
    what each layer may see poisoned: equal to the torch path. Returns the step's batch."""
    q, k_pool, v_pool, batch = _case(lens, starts, 4, 6, 2, 16, seed=len(lens))
    k_new, v_new = k_pool[batch.slot_mapping], v_pool[batch.slot_mapping]  # what the step wrote
    want = attn.paged_attention_torch(
        q, k_pool, v_pool, batch, scale=0.25, chunk=chunk, softmax_fp32=True, window=window
    )
    kp, vp = _poisoned(k_pool, v_pool, batch, chunk, window)
    got = attn.paged_attention(
        q,
        kp,
        vp,
        batch,
        scale=0.25,
        chunk=chunk,
        softmax_fp32=True,
        window=window,
        backend="triton",
        k_new=k_new,
        v_new=v_new,
    )
    assert (got - want).abs().max() < 1e-5
    return batch


@needs_triton
@pytest.mark.parametrize("case", list(FLASH_CASES))
@pytest.mark.parametrize("chunk,window", [(None, None), (None, 6), (40, None), (16, None)])
def test_flash_prefill_takes_the_trailing_prompts_and_equals_the_torch_path(flash_on, case, chunk, window):
    lens, starts, rows, seqs = FLASH_CASES[case]
    batch = _split_equals_the_torch_path(lens, starts, chunk, window)
    if chunk is not None and batch.fresh is not None and batch.fresh.max_len > chunk:
        rows = seqs = 0  # a prompt past its first chunk: the chunked mask is the paged kernel's
    assert flash_on == ([(rows, seqs, window)] if rows else [])


def test_flash_prefill_off_by_default_and_refused_by_name():
    assert attn.prefill_backend_from_env({}) == "triton"
    assert attn.prefill_backend_from_env({"MOESERVE_ATTENTION_PREFILL": "flash"}) == "flash"
    assert attn.prefill_backend_from_env({"MOESERVE_ATTENTION_PREFILL": "sdpa"}) == "sdpa"
    with pytest.raises(ValueError, match=r"MOESERVE_ATTENTION_PREFILL='cudnn': allowed 'triton'.*'flash'.*'sdpa'"):
        attn.prefill_backend_from_env({"MOESERVE_ATTENTION_PREFILL": "cudnn"})
    q = torch.zeros(3, 4, 16)
    assert not attn.flash_supported(q) and not attn.flash_supported(q.bfloat16())  # CPU tensors: never


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@needs_triton
def test_paged_model_step_with_flash_prefill_equals_the_eager_oracle(model, monkeypatch, flash_on):
    """The model's Attention passes the step's own (RoPE'd, normed) keys: with the flash backend
    the schedule's fresh prompts go through them, and the model still equals the oracle."""
    monkeypatch.setattr(
        "moeserve.models.layers.paged_attention", functools.partial(attn.paged_attention, backend="triton")
    )
    for want, got, _ in _run_schedule(model, 4, seed=1):
        if want.numel():
            assert (got - want).abs().max() < FP32_LOGITS_ATOL
    assert flash_on, "no step went through the flash backend"


# -- the sdpa prefill backend (MOESERVE_ATTENTION_PREFILL=sdpa): torch's own kernel, on the CPU too --


@pytest.fixture
def sdpa_on(monkeypatch):
    """The sdpa prefill backend switched on; ``attn.sdpa_prompts`` runs as it is, its calls
    recorded as (rows, lens)."""
    calls: list = []
    real = attn.sdpa_prompts

    def spy(q, k, v, lens, **kw):
        calls.append((q.shape[0], tuple(lens)))
        return real(q, k, v, lens, **kw)

    monkeypatch.setitem(attn.PREFILL, "backend", "sdpa")
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    monkeypatch.setattr(attn, "sdpa_prompts", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_prompts_equal_a_dense_causal_attention_per_sequence(dtype):
    lens = (7, 1, 20, 3)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens), 6, 16, generator=g).to(dtype)
    k, v = (torch.randn(sum(lens), 2, 16, generator=g).to(dtype) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    want = _dense_causal([])(q.float(), k.float(), v.float(), cu, max(lens), scale=0.3, window=None)
    got = attn.sdpa_prompts(q, k, v, lens, scale=0.3)
    assert got.dtype == dtype
    assert (got.float() - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    out = torch.full_like(q, float("nan"))
    assert attn.sdpa_prompts(q, k, v, lens, scale=0.3, out=out) is out and not out.isnan().any()


def test_sdpa_prompts_take_a_fused_kernel_not_the_math_fallback():
    """torch's fused SDPA kernels take 4-D inputs only (a 3-D call falls back to the math kernel,
    which materializes every score): forced to FlashAttention, which the CPU build has too, the
    call runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lens = (5, 9)
    q, k, v = torch.randn(14, 4, 16), torch.randn(14, 2, 16), torch.randn(14, 2, 16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = attn.sdpa_prompts(q, k, v, lens, scale=0.25)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    assert (got - _dense_causal([])(q, k, v, cu, 9, scale=0.25, window=None)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "backend,cuda,dtype,serves",
    [
        ("auto", True, torch.bfloat16, True),
        ("auto", True, torch.float16, True),
        ("auto", True, torch.float32, False),  # the exactness mode keeps the paged kernel
        ("auto", False, torch.bfloat16, False),
        ("sdpa", False, torch.float32, True),
        ("triton", True, torch.bfloat16, False),
        ("flash", True, torch.bfloat16, False),
    ],
)
def test_the_auto_prefill_backend_is_sdpa_for_16_bit_steps_on_cuda_only(monkeypatch, backend, cuda, dtype, serves):
    monkeypatch.setitem(attn.PREFILL, "backend", backend)
    q = SimpleNamespace(is_cuda=cuda, dtype=dtype)
    assert attn.sdpa_serves(q) is serves
    assert attn.prefill_backend_from_env({attn.PREFILL_ENV: "auto"}) == "auto"


def test_sdpa_buckets_cover_every_length_with_bounded_padding():
    """Each prompt length pads to a bucket at or above it: 64-token steps up to 1,024, then at
    most 1/8 of the prompt; the buckets up to a length are the ones its shorter prompts reach."""
    buckets = attn.sdpa_buckets(8192)
    assert buckets == sorted(set(buckets)) and buckets[0] == 64 and buckets[-1] == 8192 and len(buckets) == 40
    for n in range(1, 8193):
        b = attn.sdpa_bucket(n)
        assert b >= n and b in buckets and b % 64 == 0
        assert b - n < 64 if n <= 1024 else (b - n) * 8 <= n
    assert attn.sdpa_buckets(100) == [64, 128] and attn.sdpa_bucket(8193) == 9216


def test_sdpa_prompts_pad_to_their_bucket_and_the_result_does_not_change():
    """A prompt goes to SDPA padded with zero rows to its bucket (the pad after the last token:
    causal, no real row sees it): the real rows equal the unpadded call's, and the kernel sees
    only bucket lengths."""
    lens = (70, 1, 130, 64)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(sum(lens), 4, 16, generator=g)
    k, v = (torch.randn(sum(lens), 2, 16, generator=g) for _ in range(2))
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(qs, ks, vs, **kw):
        seen.append(qs.shape[2])
        assert (ks.shape[2], vs.shape[2]) == (qs.shape[2],) * 2
        return real(qs, ks, vs, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        got = attn.sdpa_prompts(q, k, v, lens, scale=0.3)
    assert seen == [128, 64, 192, 64]
    at = 0
    for n in lens:
        qs, ks, vs = (x[at : at + n].transpose(0, 1)[None] for x in (q, k, v))
        want = real(qs, ks, vs, is_causal=True, scale=0.3, enable_gqa=True)[0].transpose(0, 1)
        assert (got[at : at + n] - want).abs().max() < 1e-6
        at += n


def test_the_sdpa_warm_up_launches_every_shape_a_step_can_reach(monkeypatch, caplog):
    """``warm_up_sdpa`` launches every bucket up to the longest fresh prompt before serving: after
    it, prompts of any length up to that add no shape; a longer one (a shape the warm-up missed)
    is logged as a compile while serving once the compile log watches, and counted."""
    from moeserve.kernels import compilelog

    monkeypatch.setattr(attn, "SDPA_SHAPES", set())
    assert attn.warm_up_sdpa(4, 2, 16, 16, 1500, torch.float32, "cpu", 0.25) == len(attn.sdpa_buckets(1500)) == 20
    warm = set(attn.SDPA_SHAPES)
    assert {s[0] for s in warm} == set(attn.sdpa_buckets(1500))
    monkeypatch.setattr(compilelog, "_installed", True)  # serving from here on
    monkeypatch.setattr(compilelog, "counts", compilelog.Counter())
    rng = random.Random(4)
    with caplog.at_level(logging.INFO, logger=compilelog.__name__):
        for _ in range(6):
            lens = tuple(rng.randint(1, 1500) for _ in range(rng.randint(1, 3)))
            q = torch.zeros(sum(lens), 4, 16)
            attn.sdpa_prompts(q, torch.zeros(sum(lens), 2, 16), torch.zeros(sum(lens), 2, 16), lens, scale=0.25)
        assert attn.SDPA_SHAPES == warm and not compilelog.counts and not caplog.records
        attn.sdpa_prompts(
            torch.zeros(1537, 4, 16), torch.zeros(1537, 2, 16), torch.zeros(1537, 2, 16), (1537,), scale=0.25
        )
    assert compilelog.counts["sdpa"] == 1
    msg = [r.getMessage() for r in caplog.records if "while serving" in r.getMessage()]
    assert len(msg) == 1 and "length=1664" in msg[0]


@needs_triton
@pytest.mark.parametrize("case", list(FLASH_CASES))
@pytest.mark.parametrize("chunk,window", [(None, None), (None, 6), (None, 64), (40, None), (16, None)])
def test_sdpa_prefill_takes_the_trailing_prompts_and_equals_the_torch_path(sdpa_on, case, chunk, window):
    lens, starts, rows, _ = FLASH_CASES[case]
    batch = _split_equals_the_torch_path(lens, starts, chunk, window)
    f = batch.fresh
    if f is None or (chunk is not None and f.max_len > chunk) or (window is not None and f.max_len > window):
        rows = 0  # a prompt past its first chunk or its window: the paged kernel's masks
    assert sdpa_on == ([(rows, tuple(lens[f.first_seq :]))] if rows else [])


@needs_triton
@pytest.mark.parametrize("backend", ["flash_on", "sdpa_on"])
def test_a_prefill_backend_declines_sinks_other_dtypes_and_a_missing_key(request, backend):
    calls = request.getfixturevalue(backend)
    lens, starts = [1, 9], [20, 0]
    q, k_pool, v_pool, batch = _case(lens, starts, 4, 4, 2, 16, seed=3)
    k_new, v_new = k_pool[batch.slot_mapping], v_pool[batch.slot_mapping]
    sinks = SINKS[:4]
    want = attn.paged_attention_torch(q, k_pool, v_pool, batch, scale=0.25, chunk=None, softmax_fp32=True, sinks=sinks)
    got = attn.paged_attention_triton(
        q, k_pool, v_pool, batch, scale=0.25, chunk=None, sinks=sinks, k_new=k_new, v_new=v_new
    )
    assert (got - want).abs().max() < 1e-5
    attn.paged_attention_triton(q, k_pool, v_pool, batch, scale=0.25, chunk=None)  # no step keys given
    assert attn.fresh_suffix(q, k_pool.half(), batch, None, None, k_new) is None  # the pools hold another dtype
    assert attn.fresh_suffix(q, k_pool, batch, None, None, k_new) is batch.fresh
    if backend == "sdpa_on":  # SDPA's causal mask has no window: the 9-token prompt must fit in it
        assert attn.fresh_suffix(q, k_pool, batch, None, None, k_new, window=8) is None
        assert attn.fresh_suffix(q, k_pool, batch, None, None, k_new, window=9) is batch.fresh
    assert calls == []


@needs_triton
def test_sdpa_prefill_leaves_a_step_of_many_short_prompts_to_the_paged_kernel(sdpa_on):
    """One SDPA launch per prompt and layer: past ``SDPA_MAX_PROMPTS`` fresh prompts the step
    keeps the paged kernel; at the limit it takes them all."""
    for n, taken in ((attn.SDPA_MAX_PROMPTS, True), (attn.SDPA_MAX_PROMPTS + 1, False)):
        lens, starts = [1] + [3] * n, [20] + [0] * n
        q, k_pool, v_pool, batch = _case(lens, starts, 4, 4, 2, 16, seed=n)
        k_new, v_new = k_pool[batch.slot_mapping], v_pool[batch.slot_mapping]
        want = attn.paged_attention_torch(q, k_pool, v_pool, batch, scale=0.25, chunk=None, softmax_fp32=True)
        got = attn.paged_attention_triton(q, k_pool, v_pool, batch, scale=0.25, chunk=None, k_new=k_new, v_new=v_new)
        assert (got - want).abs().max() < 1e-5
        assert sdpa_on == ([(3 * n, tuple(lens[1:]))] if taken else [])
        sdpa_on.clear()


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@needs_triton
def test_paged_model_step_with_sdpa_prefill_equals_the_eager_oracle(model, monkeypatch, sdpa_on):
    """The model's fresh prompts through torch's SDPA (the real function, on the CPU), the rest
    through the paged kernel: the model still equals the oracle."""
    monkeypatch.setattr(
        "moeserve.models.layers.paged_attention", functools.partial(attn.paged_attention, backend="triton")
    )
    for want, got, _ in _run_schedule(model, 4, seed=1):
        if want.numel():
            assert (got - want).abs().max() < FP32_LOGITS_ATOL
    assert sdpa_on, "no step went through the sdpa backend"
