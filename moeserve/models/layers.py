"""Building blocks shared by the families: norms, RoPE, attention over a KV cache, SwiGLU MLP.

Dimension letters: T tokens in a step (flattened over sequences), H hidden size, Hq query
heads, Hkv key/value heads, G = Hq / Hkv, D head dim, n new tokens of one sequence, L keys of
one sequence, F an MLP's intermediate size.

``Attention`` runs over either cache: the eager ``KVCache`` sequence by sequence (the oracle,
which ``generate`` uses), or the ``PagedKVCache`` with one batched call per layer for the whole
mixed step (``moeserve.models.attention``).

Weights are plain tensors (no nn.Module, no autograd): the model is inference only, and the
router and expert sides load different subsets of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.models.attention import paged_attention
from moeserve.models.cache import KVCache, StepBatch
from moeserve.models.config import ModelConfig, RopeConfig
from moeserve.models.paged import PagedBatch, PagedKVCache
from moeserve.models.quant import QuantLinear, read_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> [..., H]: normalised in fp32, cast back to x's dtype, then scaled by weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation of the last dim, in fp32 (Llama 4's qk-norm): [..., D]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2j/D) of each rotated pair, after llama3 scaling: fp32 [D/2].

    llama3: wavelengths longer than original_max/low_freq_factor are slowed by ``factor``,
    those shorter than original_max/high_freq_factor are kept, and those in between blend the
    two with weight s = (original_max/wavelength - low) / (high - low) on the unscaled one.
    """
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
    if rope.type == "default":
        return inv
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    s = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - s) * scaled / rope.factor + s * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles of every (position, pair): cos and sin, fp32 [T, D/2]."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2j], x[2j+1]) as a complex number, in fp32: x [T, heads, D]."""
    xf = x.float().unflatten(-1, (-1, 2))  # [T, heads, D/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query scale on NoPE layers: 1 + attn_scale * log1p(floor((pos+1)/floor_scale)), fp32 [T]."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


@dataclass
class Linear:
    """y = x @ weight.T (+ bias); weight [out, in] as nn.Linear stores it, bias [out] or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class SwiGLU:
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts. x [T, H] -> [T, H]."""

    gate: Linear | QuantLinear
    up: Linear | QuantLinear
    down: Linear | QuantLinear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention:
    """Grouped-query self-attention of one decoder layer over the KV cache.

    Per layer it may use RoPE (interleaved pairs) followed by a weightless qk L2 norm, or be a
    NoPE layer with optional temperature tuning of the queries; its mask is causal, and with a
    chunk size C also restricted to keys in the query's chunk: floor(q_pos/C) == floor(k_pos/C),
    with absolute positions (non-overlapping chunks, not a sliding window).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        q: Linear | QuantLinear,
        k: Linear | QuantLinear,
        v: Linear | QuantLinear,
        o: Linear | QuantLinear,
        softmax_fp32: bool,
    ):
        self.layer = layer
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.use_rope = cfg.use_rope[layer]
        self.qk_norm = cfg.use_qk_norm and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.chunk = cfg.attention_chunk_size if cfg.chunked_attention[layer] else None
        self.temperature_tuning = cfg.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
        self.softmax_fp32 = softmax_fp32

    def __call__(
        self,
        x: torch.Tensor,
        batch: StepBatch | PagedBatch,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | PagedKVCache,
    ) -> torch.Tensor:
        """x [T, H] (normalised), positions [T], rope = (cos, sin) [T, D/2] -> [T, H].

        With a ``PagedKVCache`` (and a ``PagedBatch``) the step's k/v are written at
        ``batch.slot_mapping`` and every sequence is attended in one batched call
        (``moeserve.models.attention``); with a ``KVCache`` (the eager oracle) sequence by sequence.
        """
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.use_rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature_tuning:
            q = (q * temperature_scales(positions, self.floor_scale, self.attn_scale)[:, None, None]).to(q.dtype)
        if isinstance(cache, PagedKVCache):
            assert isinstance(batch, PagedBatch)  # DecoderModel.step pairs the batch with its cache
            cache.write(self.layer, batch.slot_mapping, k, v)
            out = paged_attention(
                q,
                cache.k[self.layer],
                cache.v[self.layer],
                batch,
                scale=self.scale,
                chunk=self.chunk,
                softmax_fp32=self.softmax_fp32,
            )  # [T, Hq, D]
            return self.o_proj(out.view(t, self.num_heads * self.head_dim))
        assert isinstance(batch, StepBatch)  # DecoderModel.step pairs the batch with its cache
        out = torch.empty_like(q)  # [T, Hq, D]
        for s, (sid, start) in enumerate(zip(batch.seq_ids, batch.starts)):
            a, b = batch.offsets[s], batch.offsets[s + 1]
            keys, values = cache.write(self.layer, sid, start, k[a:b], v[a:b])  # [start+n, Hkv, D]
            out[a:b] = self._attend(q[a:b], keys, values, start)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """One sequence: q [n, Hq, D] at positions start.., keys/values [start+n, Hkv, D] -> [n, Hq, D]."""
        n, end = q.shape[0], keys.shape[0]
        first = (start // self.chunk) * self.chunk if self.chunk else 0  # keys before the chunk are never visible
        keys, values = keys[first:], values[first:]  # [L, Hkv, D]
        g = self.num_heads // self.num_kv_heads
        qh = q.view(n, self.num_kv_heads, g, self.head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        kh = keys.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
        vh = values.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * self.scale  # [Hkv, G, n, L]
        if n > 1 or self.chunk:
            q_pos = torch.arange(start, end, device=q.device)[:, None]  # [n, 1]
            k_pos = torch.arange(first, end, device=q.device)[None, :]  # [1, L]
            visible = k_pos <= q_pos
            if self.chunk:
                visible = visible & (k_pos // self.chunk == q_pos // self.chunk)
            scores = scores.masked_fill(~visible, float("-inf"))
        if self.softmax_fp32:
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, vh)  # [Hkv, G, n, D]
        return out.permute(2, 0, 1, 3).reshape(n, self.num_heads, self.head_dim)


def load_linear(
    reader, name: str, out_features: int, in_features: int, bias: bool, dtype: torch.dtype, device
) -> Linear | QuantLinear:
    """Read ``{name}.weight`` [out, in] (and ``{name}.bias`` [out] when ``bias``) from a checkpoint:
    a :class:`QuantLinear` when the checkpoint holds the weight in FP8 with its scale, or when
    ``--quantization fp8`` quantizes it at load (``moeserve.models.quant.read_weight``)."""
    w = read_weight(reader, name, (out_features, in_features), dtype, device)
    b = reader.read(f"{name}.bias", dtype, shape=(out_features,)).to(device) if bias else None
    if isinstance(w, QuantLinear):
        w.bias = b
        return w
    return Linear(w, b)


def load_swiglu(reader, prefix: str, hidden: int, width: int, bias: bool, dtype: torch.dtype, device) -> SwiGLU:
    """Read a SwiGLU MLP stored as ``{prefix}.{gate,up,down}_proj``."""
    return SwiGLU(
        gate=load_linear(reader, f"{prefix}.gate_proj", width, hidden, bias, dtype, device),
        up=load_linear(reader, f"{prefix}.up_proj", width, hidden, bias, dtype, device),
        down=load_linear(reader, f"{prefix}.down_proj", hidden, width, bias, dtype, device),
    )
