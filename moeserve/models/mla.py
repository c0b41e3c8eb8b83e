"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) and its latent paged cache.

Dimension letters: T tokens of a step (flattened over sequences), H hidden size, Hq heads, R
kv_lora_rank, Dn / Dr / Dv the no-RoPE, RoPE and value head dims, C = R + Dr the latent of one
token, S sequences, Q max new tokens of a sequence, L max keys of a sequence, N flat slots of a
pool, n new tokens and Lk keys of one sequence.

Each token's keys and values, for every head, are a function of one latent ``[c | k_pe]`` [C]:
``kv_b(c)`` = per head ``[k_nope (Dn) | v (Dv)]``, and ``k_pe`` [Dr] (after RoPE) is the RoPE
half of every head's key. So the cache holds the latent only (``LatentKVCache``: C values per
token and layer, where a KV cache of the same attention holds 2 Hq (Dn + Dr) ... per token; for
DeepSeek-V3 576 against 32,768 values), and attention is computed two ways, equal in exact
arithmetic:

- **expanded** (prefill, and the eager oracle, as transformers computes it): the cached latents
  are expanded through kv_b into per-head keys [Lk, Hq, Dn + Dr] and values [Lk, Hq, Dv];
- **absorbed** (decode): kv_b's key half is folded into the query, ``q_c = q_nope @ W_uk``
  [Hq, R], so that ``q . k = q_c . c + q_pe . k_pe``: one key head of width C shared by all
  query heads (MQA over the latent), whose values are the latent's first R columns; the output
  ``o_c`` [Hq, R] goes through kv_b's value half, ``o = o_c @ W_uv^T`` [Hq, Dv], before o_proj.
  A decode step reads C values per cached token instead of expanding Hq (Dn + Dv).

The absorbed attention runs on ``moeserve.models.attention.paged_attention_torch`` (the latent
as both the key and the value pool; the Dr RoPE columns of its output are dropped) on the CPU,
and on ``moeserve.kernels.triton_mla`` on CUDA.
"""

from __future__ import annotations

import functools
import os

import torch

from moeserve.kernels import available as triton_available
from moeserve.kernels import fresh_module
from moeserve.models import attention as attn
from moeserve.models.attention import paged_attention_torch
from moeserve.models.cache import KVCache, StepBatch
from moeserve.models.config import MLAConfig, ModelConfig
from moeserve.models.layers import apply_rope, load_linear, rms_norm
from moeserve.models.paged import FreshSuffix, PagedBatch, PagedKVCache
from moeserve.models.quant import QuantLinear


class LatentKVCache(PagedKVCache):
    """The paged cache of MLA: one pool ``k`` [Lyr, N, 1, C] of latents ``[c | k_pe]`` (k_pe
    after RoPE); ``v`` is the same tensor (the values are its first R columns), so a block costs
    C values per token and layer, not 2 Hkv D. Zeroed, as ``PagedKVCache``."""

    def __init__(
        self,
        num_layers: int,
        latent_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, val in (
            ("num_layers", num_layers),
            ("latent_dim", latent_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"LatentKVCache: {name} must be an integer >= 1, found {val!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, 1, latent_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.k = torch.zeros((num_layers, num_blocks * block_size, 1, latent_dim), dtype=dtype, device=self.device)
        self.v = self.k  # [Lyr, N, 1, C]: one pool

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers: one latent of ``head_dim`` (= C) per token."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Store a step's latents k [T, 1, C] at flat slots ``slot_mapping`` [T] (``v`` unused)."""
        self.k[layer].index_copy_(0, slot_mapping, k)


def cache_class(cfg: ModelConfig) -> type[PagedKVCache]:
    """The paged cache a model of ``cfg`` needs (its ``bytes_per_block`` sizes the pool)."""
    return LatentKVCache if cfg.mla is not None else PagedKVCache


class MLAttention:
    """Multi-head latent attention of one decoder layer (the module docstring), called as
    ``layers.Attention``: over the eager ``KVCache`` (expanded, sequence by sequence: the
    oracle) or the ``LatentKVCache`` (absorbed when every sequence of the step brings one token,
    else expanded; on CUDA absorbed always, on the Triton kernel)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        q_a,
        q_a_norm: torch.Tensor | None,
        q_b,
        kv_a,
        kv_a_norm: torch.Tensor,
        kv_b,
        o,
    ):
        m = cfg.mla
        assert m is not None  # built for MLA configs only
        self.mla: MLAConfig = m
        self.layer = layer
        self.q_a, self.q_a_norm, self.q_b = q_a, q_a_norm, q_b  # q_a None: q_b is q_proj [Hq (Dn+Dr), H]
        self.kv_a, self.kv_a_norm, self.kv_b, self.o_proj = kv_a, kv_a_norm, kv_b, o
        self.num_heads, self.eps, self.interleaved = cfg.num_heads, cfg.rms_norm_eps, cfg.rope.interleaved
        self.scale = m.softmax_scale
        w = kv_b.weight(kv_a_norm.dtype) if isinstance(kv_b, QuantLinear) else kv_b.weight
        w = w.view(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = w[:, : m.qk_nope_head_dim].contiguous()  # [Hq, Dn, R]
        self.w_uv = w[:, m.qk_nope_head_dim :].contiguous()  # [Hq, Dv, R]

    def linears(self):
        yield from (x for x in (self.q_a, self.q_b, self.kv_a, self.kv_b, self.o_proj) if x is not None)

    def warm_up_norms(self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, device) -> int:
        """Run the latent norms on one token, so that their fused kernel is compiled before
        serving (the RoPE of the MLA's rotary part stays torch's); returns the calls run."""
        norms = [n for n in (self.q_a_norm, self.kv_a_norm) if n is not None]
        for n in norms:
            rms_norm(torch.zeros(1, n.shape[0], dtype=dtype, device=device), n, self.eps)
        return len(norms)

    def __call__(
        self,
        x: torch.Tensor,
        batch: StepBatch | PagedBatch,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | PagedKVCache,
    ) -> torch.Tensor:
        """x [T, H] (normalised), rope = (cos, sin) [T, Dr/2] -> [T, H]."""
        t, m, hq = x.shape[0], self.mla, self.num_heads
        if self.q_a is None or self.q_a_norm is None:
            q = self.q_b(x)
        else:
            q = self.q_b(rms_norm(self.q_a(x), self.q_a_norm, self.eps))
        q = q.view(t, hq, m.qk_nope_head_dim + m.qk_rope_head_dim)  # [T, Hq, Dn+Dr]
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a(x)  # [T, C]
        c, k_pe = ckv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = rms_norm(c, self.kv_a_norm, self.eps)  # [T, R]
        q_pe = apply_rope(q_pe, *rope, self.interleaved)  # [T, Hq, Dr]
        k_pe = apply_rope(k_pe[:, None], *rope, self.interleaved)  # [T, 1, Dr]
        latent = torch.cat([c[:, None], k_pe], dim=-1)  # [T, 1, C]
        if isinstance(cache, PagedKVCache):
            assert isinstance(batch, PagedBatch)  # DecoderModel.step pairs the batch with its cache
            cache.write(self.layer, batch.slot_mapping, latent, latent)  # (one pool: v is k)
            pool = cache.k[self.layer]
            f = fresh_prompts(batch, q_nope)
            if f is None:
                out = self._paged(q_nope, q_pe, pool, batch)
            else:  # the step's fresh prompts expanded from their own latents, through SDPA
                t0 = f.first_token
                out = q_nope.new_empty(t, hq, m.v_head_dim)
                out[t0:] = self._expanded_sdpa(q_nope[t0:], q_pe[t0:], latent[t0:, 0], f.lens)
                if f.head is not None:
                    out[:t0] = self._paged(q_nope[:t0], q_pe[:t0], pool, f.head)
            return self.o_proj(out.reshape(t, hq * m.v_head_dim))
        assert isinstance(batch, StepBatch)  # DecoderModel.step pairs the batch with its cache
        out = q.new_empty(t, hq, m.v_head_dim)  # [T, Hq, Dv]
        for s, (sid, start) in enumerate(zip(batch.seq_ids, batch.starts)):
            a, b = batch.offsets[s], batch.offsets[s + 1]
            keys, _ = cache.write(self.layer, sid, start, latent[a:b], latent[a:b])  # [start+n, 1, C]
            out[a:b] = self._expanded(q_nope[a:b], q_pe[a:b], keys[:, 0], start)
        return self.o_proj(out.view(t, hq * m.v_head_dim))

    def _paged(self, q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """A paged step's attention -> [T, Hq, Dv]: absorbed for a decode step and on CUDA (the
        torch expansion's padded scores [S, Hq, Q, L] would not fit a long prompt's chunks, 64 x
        8,000 tokens), else expanded."""
        if batch.max_query_len <= 1 or (q_nope.is_cuda and triton_available()):
            return self.absorbed(q_nope, q_pe, pool, batch)
        return self._expanded_paged(q_nope, q_pe, pool, batch)

    def _expanded_sdpa(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, lens: tuple[int, ...]
    ) -> torch.Tensor:
        """Fresh prompts (no cached key): each attends to its own latents [Tf, C] expanded through
        kv_b, on torch's SDPA (``attention.sdpa_prompts``, causal): q [Tf, Hq, Dn] and [Tf, Hq, Dr]
        -> [Tf, Hq, Dv]. The expanded form's FLOPs per (query, key) pair are Hq (Dn + Dr + Dv)
        against the absorbed form's Hq (C + R): 320 against 1,088 per head at DeepSeek-V3's
        shapes. The head dims are padded to one width with zeros (q and k with zeros leave
        every dot product; v's pad columns are dropped), as torch's fused kernels want."""
        keys, values = self.expand(latent)  # [Tf, Hq, Dn+Dr], [Tf, Hq, Dv]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [Tf, Hq, Dn+Dr]
        dqk, dv = q.shape[-1], values.shape[-1]
        width = max(dqk, dv)
        if dqk < width:
            q, keys = (torch.nn.functional.pad(x, (0, width - dqk)) for x in (q, keys))
        if dv < width:
            values = torch.nn.functional.pad(values, (0, width - dv))
        return attn.sdpa_prompts(q, keys, values, lens, scale=self.scale)[..., :dv]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [..., C] -> keys [..., Hq, Dn + Dr] and values [..., Hq, Dv] (kv_b, as transformers)."""
        m = self.mla
        c, k_pe = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b(c).unflatten(-1, (self.num_heads, m.qk_nope_head_dim + m.v_head_dim))
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], m.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, start: int) -> torch.Tensor:
        """One sequence: q [n, Hq, Dn] and [n, Hq, Dr] at positions start.., latents [start+n, C]
        -> [n, Hq, Dv]; the softmax in fp32, as transformers' eager attention."""
        n, end = q_nope.shape[0], latent.shape[0]
        keys, values = self.expand(latent)  # [Lk, Hq, Dn+Dr], [Lk, Hq, Dv]
        qh = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [Hq, n, Dn+Dr]
        scores = torch.matmul(qh, keys.permute(1, 2, 0)) * self.scale  # [Hq, n, Lk]
        if n > 1:
            q_pos = torch.arange(start, end, device=q_nope.device)[:, None]
            k_pos = torch.arange(end, device=q_nope.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
        return torch.matmul(probs, values.transpose(0, 1)).transpose(0, 1)  # [n, Hq, Dv]

    def _expanded_paged(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, batch: PagedBatch
    ) -> torch.Tensor:
        """A mixed step, expanded: every sequence's latents gathered through its block table
        [S, L, C], expanded, and attended in one padded, masked batch: -> [T, Hq, Dv]."""
        t, hq, dn = q_nope.shape
        s, qmax, lmax, bs = batch.num_seqs, batch.max_query_len, batch.max_seq_len, batch.block_size
        dev = q_nope.device
        qs = batch.query_start.long()  # [S + 1]
        q_len = qs[1:] - qs[:-1]  # [S]
        ctx = batch.seq_lens.long() - q_len  # [S]
        qi = torch.arange(qmax, device=dev)
        q_idx = torch.where(qi[None, :] < q_len[:, None], qs[:-1, None] + qi[None, :], 0)  # [S, Q]
        q_pos = ctx[:, None] + qi[None, :]  # [S, Q]
        ki = torch.arange(lmax, device=dev)
        k_ok = ki[None, :] < batch.seq_lens.long()[:, None]  # [S, L]
        slots = batch.block_tables.long()[:, ki // bs] * bs + ki % bs  # [S, L]
        latent = pool[slots][:, :, 0].masked_fill(~k_ok[:, :, None], 0)  # [S, L, C]
        keys, values = self.expand(latent)  # [S, L, Hq, Dn+Dr], [S, L, Hq, Dv]
        qh = torch.cat([q_nope, q_pe], dim=-1)[q_idx].permute(0, 2, 1, 3)  # [S, Hq, Q, Dn+Dr]
        scores = torch.matmul(qh, keys.permute(0, 2, 3, 1)) * self.scale  # [S, Hq, Q, L]
        visible = (ki[None, None, :] <= q_pos[:, :, None]) & k_ok[:, None, :]  # [S, Q, L]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [S, Hq, Q, Dv]
        out = out.permute(0, 2, 1, 3).reshape(s * qmax, hq, -1)
        tok = torch.arange(t, device=dev)
        seq = torch.searchsorted(qs[1:], tok, right=True)  # [T]
        return out[seq * qmax + tok - qs[seq]]

    def absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        pool: torch.Tensor,
        batch: PagedBatch,
        backend: str | None = None,
    ) -> torch.Tensor:
        """The absorbed attention of a step (any step: every query sees its causal keys):
        q [T, Hq, Dn] and [T, Hq, Dr], one layer's latent pool [N, 1, C] -> [T, Hq, Dv].
        backend: "torch", "triton", or None (Triton on CUDA when installed)."""
        m = self.mla
        q_c = torch.einsum("thd,hdr->thr", q_nope, self.w_uk)  # [T, Hq, R]
        if backend is None:
            backend = "triton" if q_nope.is_cuda and triton_available() else "torch"
        if backend == "triton":
            o_c = mla_decode_triton(q_c, q_pe, pool, batch, scale=self.scale, kv_lora_rank=m.kv_lora_rank)
        elif backend == "torch":
            qq = torch.cat([q_c, q_pe], dim=-1)  # [T, Hq, C]
            o = paged_attention_torch(qq, pool, pool, batch, scale=self.scale, chunk=None, softmax_fp32=True)
            o_c = o[..., : m.kv_lora_rank]  # [T, Hq, R] (the RoPE columns are no value)
        else:
            raise ValueError(f"unknown attention backend {backend!r}; allowed: 'torch', 'triton'")
        return torch.einsum("thr,hvr->thv", o_c, self.w_uv)  # [T, Hq, Dv]


def fresh_prompts(batch: PagedBatch, q: torch.Tensor) -> FreshSuffix | None:
    """The step's trailing fresh prompts when MLA expands them through SDPA: with
    ``MOESERVE_ATTENTION_PREFILL=sdpa`` (the measurement switch of ``moeserve.models.attention``;
    ``auto``: for 16-bit queries ``q`` on CUDA) and at most ``SDPA_MAX_PROMPTS`` of them (one launch per prompt and layer). A fresh prompt's
    keys are its own latents, in hand before the pool is read; the sequences before it keep the
    paged path. Sinks, windows, chunks and the pool's dtype do not arise here: the latent pool
    holds what was written, in the step's dtype."""
    return batch.fresh if attn.sdpa_takes(batch.fresh, q) else None


def load_mla(reader, cfg: ModelConfig, i: int, dtype: torch.dtype, device) -> MLAttention:
    """Decoder layer ``i``'s MLA weights (``families.mla_shapes``)."""
    m = cfg.mla
    assert m is not None
    p, h, hq, ab = f"model.layers.{i}.self_attn", cfg.hidden_size, cfg.num_heads, cfg.attention_bias
    qk = hq * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_a = q_a_norm = None
    if m.q_lora_rank is None:
        q_b = load_linear(reader, f"{p}.q_proj", qk, h, False, dtype, device)
    else:
        q_a = load_linear(reader, f"{p}.q_a_proj", m.q_lora_rank, h, ab, dtype, device)
        q_a_norm = reader.read(f"{p}.q_a_layernorm.weight", dtype, shape=(m.q_lora_rank,)).to(device)
        q_b = load_linear(reader, f"{p}.q_b_proj", qk, m.q_lora_rank, False, dtype, device)
    return MLAttention(
        cfg,
        i,
        q_a=q_a,
        q_a_norm=q_a_norm,
        q_b=q_b,
        kv_a=load_linear(reader, f"{p}.kv_a_proj_with_mqa", m.latent_dim, h, ab, dtype, device),
        kv_a_norm=reader.read(f"{p}.kv_a_layernorm.weight", dtype, shape=(m.kv_lora_rank,)).to(device),
        kv_b=load_linear(
            reader, f"{p}.kv_b_proj", hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False, dtype, device
        ),
        o=load_linear(reader, f"{p}.o_proj", h, hq * m.v_head_dim, ab, dtype, device),
    )


# -- Triton --------------------------------------------------------------------------------------


@functools.cache
def _kernels():
    return fresh_module("moeserve.kernels.triton_mla")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def warm_up_mla(
    pool: torch.Tensor, num_heads: int, mla: MLAConfig, block_size: int, scale: float, max_fresh: int = 0
) -> int:
    """Compile ``mla_decode_triton`` before serving, on one layer's latent pool [N, 1, C] (every
    layer's view has the same strides): its launch configuration depends on the model and the
    dtype alone, so one decode launch covers every step, decode, prefill or mixed. With
    ``MOESERVE_ATTENTION_PREFILL=sdpa`` also the expanded fresh prompts' SDPA at every bucket up
    to ``max_fresh`` tokens (``attention.warm_up_sdpa``, at ``_expanded_sdpa``'s padded head
    width). Reads block 0 of the pool, writes nothing of it. Returns the launches."""
    device, dtype = pool.device, pool.dtype
    batch = PagedBatch.build([1], [0], [[0]], block_size, device)
    q_c = torch.zeros(1, num_heads, mla.kv_lora_rank, dtype=dtype, device=device)
    q_pe = torch.zeros(1, num_heads, mla.qk_rope_head_dim, dtype=dtype, device=device)
    mla_decode_triton(q_c, q_pe, pool, batch, scale=scale, kv_lora_rank=mla.kv_lora_rank)
    n = 1
    if attn.sdpa_serves(pool) and max_fresh > 0:
        width = max(mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
        n += attn.warm_up_sdpa(num_heads, num_heads, width, width, max_fresh, dtype, device, scale)
    return n


def mla_decode_triton(
    q_c: torch.Tensor,
    q_pe: torch.Tensor,
    pool: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    kv_lora_rank: int,
    block_heads: int = 16,
    block_keys: int = 32,
) -> torch.Tensor:
    """The absorbed attention on the Triton kernel: q_c [T, Hq, R], q_pe [T, Hq, Dr], latent
    pool [N, 1, C] -> o_c [T, Hq, R] in q's dtype. One program per (token, tile of
    ``block_heads`` heads): every head of a token reads the same latent rows, once per tile."""
    t, hq, r = q_c.shape
    dr = q_pe.shape[-1]
    if r != kv_lora_rank or pool.shape[-1] != r + dr or pool.stride(-1) != 1:
        raise ValueError(
            f"mla_decode_triton: q_c [T, Hq, {r}] and q_pe [T, Hq, {dr}] need a contiguous latent pool of "
            f"{kv_lora_rank} + {dr} columns, found {list(pool.shape)}"
        )
    out = q_c.new_empty(t, hq, r)
    if t == 0:
        return out
    q_c, q_pe = q_c.contiguous(), q_pe.contiguous()
    qs = batch.query_start.long()
    seq = torch.searchsorted(qs[1:], torch.arange(t, device=q_c.device), right=True).to(torch.int32)  # [T]
    bh = block_heads  # >= 16: the smallest MMA height (heads past Hq are masked)
    extra = {} if _interpreted() else dict(num_warps=4, num_stages=2)
    _kernels().mla_decode_kernel[(t, triton_cdiv(hq, bh))](
        q_c,
        q_pe,
        pool,
        out,
        batch.block_tables,
        batch.positions,
        seq,
        scale * 1.4426950408889634,  # log2(e): the softmax runs in base 2
        q_c.stride(0),
        q_c.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        pool.stride(0),
        out.stride(0),
        out.stride(1),
        batch.block_tables.stride(0),
        HQ=hq,
        R=r,
        RP=max(16, _pow2(r)),
        DR=dr,
        DRP=max(16, _pow2(dr)),
        B=batch.block_size,
        BH=bh,
        BN=block_keys,
        PRECISION="ieee" if q_c.dtype == torch.float32 else "tf32",
        INTERPRET=_interpreted(),
        **extra,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
