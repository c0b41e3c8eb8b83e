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

from moeserve import kernels
from moeserve.config import env_switch
from moeserve.models.attention import attention_probs, paged_attention
from moeserve.models.cache import KVCache, StepBatch
from moeserve.models.config import ModelConfig, RopeConfig
from moeserve.models.paged import PagedBatch, PagedKVCache
from moeserve.models.quant import QuantLinear, merge_quant, read_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool = False) -> torch.Tensor:
    """x [..., H] -> [..., H]: normalised in fp32, cast back to x's dtype, then scaled by weight;
    ``weight_first``: scaled in fp32, then cast (GPT-OSS, whose norm weights stay fp32).
    On the GPU one Triton launch (``moeserve.kernels.rms_norm``), rounding at the same places."""
    if kernels.fused_norms_take(x, weight, weight_first):
        return kernels.rms_norm(x, weight, eps, weight_first)[0]
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_first:
        return (weight * normed).to(x.dtype)
    return normed.to(x.dtype) * weight


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, weight_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's update and the next norm: (h + delta, rms_norm(h + delta)), both
    [T, H]; ``delta`` None: (h, rms_norm(h)). On the GPU the sum and the norm are one launch."""
    if delta is None:
        return h, rms_norm(h, weight, eps, weight_first)
    if delta.dtype == h.dtype and delta.shape == h.shape and kernels.fused_norms_take(h, weight, weight_first):
        y, total = kernels.rms_norm(h, weight, eps, weight_first, residual=delta)
        assert total is not None  # a residual was given
        return total, y
    h = h + delta
    return h, rms_norm(h, weight, eps, weight_first)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation of the last dim, in fp32 (Llama 4's qk-norm): [..., D]."""
    if kernels.fused_norms_take(x, None):
        return kernels.rms_norm(x, None, eps)[0]
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate's and up's outputs side by side, gu [T, 2F] -> [T, F], each
    rounded to the dtype as torch's ``F.silu(g) * u``; on the GPU one launch
    (``kernels.silu_mul``) instead of two kernels over strided halves."""
    if gu.dim() == 2 and gu.is_contiguous() and kernels.fused_norms_take(gu, None, max_width=False):
        return kernels.silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2j/D) of each rotated pair, after llama3 or YaRN scaling: fp32 [D/2].

    llama3: wavelengths longer than original_max/low_freq_factor are slowed by ``factor``,
    those shorter than original_max/high_freq_factor are kept, and those in between blend the
    two with weight s = (original_max/wavelength - low) / (high - low) on the unscaled one.
    yarn: ``_yarn_inv_freq``.
    """
    if rope.type == "yarn":
        return _yarn_inv_freq(head_dim, rope)
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


def _yarn_inv_freq(d: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN (transformers' ``_compute_yarn_parameters``, op for op): the pairs that turn fewer
    than ``beta_slow`` times over the original context are interpolated (divided by
    ``factor``), those that turn more than ``beta_fast`` times are kept, and a linear ramp over
    the pair index blends the two in between: fp32 [D/2]."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)

    def dim_of(rotations: float) -> float:
        return (d * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [D/2] weight of the unscaled frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles of every (position, pair): cos and sin, fp32 [T, D/2], times ``scale`` (YaRN's
    attention factor)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate pairs as complex numbers, in fp32: x [T, heads, D]. ``interleaved``: the pairs are
    (x[2j], x[2j+1]); else (x[j], x[j + D/2]) (transformers' rotate_half)."""
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    if not interleaved:
        x0, x1 = x.float().chunk(2, dim=-1)  # [T, heads, D/2] each
        return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).to(x.dtype)
    xf = x.float().unflatten(-1, (-1, 2))  # [T, heads, D/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
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

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``self(x)`` for 2-D ``x``, written into ``out`` [rows, out_features] (contiguous): the
        product ``F.linear`` runs on 2-D inputs (``addmm`` with a bias, ``mm`` without), so the
        values are the same bits."""
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)


def _merge_projections() -> bool:
    """MOESERVE_MERGED_PROJECTIONS: 1 (the default) merges q, k, v and gate, up at load; 0 keeps
    them separate products (a measurement switch); any other value is refused by name."""
    return env_switch("MOESERVE_MERGED_PROJECTIONS", "1", "merged", "separate")


MERGE_PROJECTIONS = _merge_projections()


def merge_linears(parts: list[Linear | QuantLinear]) -> Linear | QuantLinear | None:
    """One linear layer whose outputs are ``parts``' outputs side by side (vLLM's merged column
    linears: q, k, v as one qkv, gate and up as one gate_up), so that a step runs one product
    (and, W8A8, quantizes its rows once) where it ran ``len(parts)``; each part's outputs are
    the same values, only computed in one call. None when the parts cannot be joined: mixed
    kinds (one kept in bf16 by an ignore list, one FP8), biases on some only, or FP8 scale
    blocks that do not line up (``moeserve.models.quant.merge_quant``)."""
    if len(parts) < 2 or not MERGE_PROJECTIONS:
        return None
    linears = [p for p in parts if isinstance(p, Linear)]
    if len(linears) == len(parts):
        ws = [p.weight for p in linears]
        if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
            return None
        biases = [p.bias for p in linears if p.bias is not None]
        if biases and len(biases) != len(parts):
            return None
        return Linear(torch.cat(ws).contiguous(), torch.cat(biases) if biases else None)
    quants = [p for p in parts if isinstance(p, QuantLinear)]
    return merge_quant(quants) if len(quants) == len(parts) else None


def split_outputs(y: torch.Tensor, widths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """A merged linear's output y [T, sum(widths)] -> each part's [T, width] (views)."""
    return tuple(y.split(widths, dim=-1))


@dataclass
class SwiGLU:
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts. x [T, H] -> [T, H].
    ``gate_up`` (``merged``): gate's and up's outputs from one product, gate and up then None."""

    gate: Linear | QuantLinear | None
    up: Linear | QuantLinear | None
    down: Linear | QuantLinear
    gate_up: Linear | QuantLinear | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gu = self.gate_up(x)  # [T, 2F]
            if self.quantizes_activation(gu):
                return self.down.call_codes(*kernels.silu_mul_quant(gu), gu.dtype)  # type: ignore[union-attr]
            return self.down(silu_mul(gu))
        else:
            assert self.gate is not None and self.up is not None  # unmerged: both held
            g, u = self.gate(x), self.up(x)
        return self.down(F.silu(g) * u)

    def quantizes_activation(self, gu: torch.Tensor) -> bool:
        """Whether a call whose merged product is gu [T, 2F] hands its W8A8 down projection (on
        cuBLAS's FP8 GEMM, ``QuantLinear.takes_codes``) silu * up already quantized per row, from
        the activation's own launch (``kernels.silu_mul_quant``, bitwise ``silu_mul`` then
        ``quant_rows``); otherwise ``silu_mul`` and the down projection as it is."""
        return (
            isinstance(self.down, QuantLinear)
            and gu.dim() == 2
            and gu.is_contiguous()
            and kernels.fused_norms_take(gu, None, max_width=False)
            and self.down.takes_codes(gu)  # (reads gu's device, dtype and rows, not its width)
        )

    def merged(self) -> SwiGLU:
        """The same MLP with gate and up as one ``gate_up`` product where they can be joined
        (``merge_linears``), else itself."""
        if self.gate_up is not None or self.gate is None or self.up is None:
            return self
        gate_up = merge_linears([self.gate, self.up])
        return self if gate_up is None else SwiGLU(None, None, self.down, gate_up)

    @property
    def merged_width(self) -> int | None:
        """2F, the width of the merged ``gate_up`` output ``silu_mul`` takes; None unmerged."""
        gu = self.gate_up
        if gu is None:
            return None
        return (gu.weight if isinstance(gu, Linear) else gu.codes).shape[0]

    def linears(self) -> tuple[Linear | QuantLinear, ...]:
        """The linear layers it holds (merged or not)."""
        return tuple(m for m in (self.gate, self.up, self.gate_up, self.down) if m is not None)


class Attention:
    """Grouped-query self-attention of one decoder layer over the KV cache.

    Per layer: optionally Qwen3's RMSNorm of q and k (weights [D]) before RoPE; RoPE (adjacent
    pairs or halves, ``RopeConfig.interleaved``) followed by Llama 4's weightless qk L2 norm, or
    a NoPE layer with optional temperature tuning of the queries. The mask is causal; with a
    chunk size C also restricted to keys in the query's chunk, floor(q_pos/C) == floor(k_pos/C)
    (non-overlapping chunks); with a sliding window W to the keys with q_pos - W < k_pos. With
    sinks (GPT-OSS) each query head's softmax has one more logit, ``sinks[h]``, which takes its
    share of the weight and adds nothing to the output.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        q: Linear | QuantLinear,
        k: Linear | QuantLinear,
        v: Linear | QuantLinear,
        o: Linear | QuantLinear,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ):
        self.layer = layer
        # q, k and v as one product where they can be joined (``merge_linears``): each step's
        # x is read (and, W8A8, quantized) once and one GEMM launched; the three then None
        self.qkv = merge_linears([q, k, v])
        self.qkv_widths = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        )
        unmerged: tuple[Linear | QuantLinear | None, ...] = (None,) * 3 if self.qkv is not None else (q, k, v)
        self.q_proj, self.k_proj, self.v_proj = unmerged
        self.o_proj = o
        self.q_norm, self.k_norm = q_norm, k_norm  # [D] each, or None
        self.sinks = sinks  # [Hq] or None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.use_rope = cfg.use_rope[layer]
        self.interleaved = cfg.rope.interleaved
        self.qk_norm = cfg.use_qk_norm and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.chunk = cfg.attention_chunk_size if cfg.chunked_attention[layer] else None
        self.window = cfg.window(layer)
        self.temperature_tuning = cfg.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
        self.softmax_fp32 = cfg.attention_softmax_fp32
        # Whether q and k go through anything before attention, and whether one fused launch
        # (``kernels.head_rope``, power-of-two heads) may do it: fixed at load, read every call.
        self.transforms_heads = q_norm is not None or self.use_rope or self.qk_norm
        self.fusable_heads = self.transforms_heads and self.head_dim & (self.head_dim - 1) == 0

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
        if self.qkv is not None:
            q, k, v = split_outputs(self.qkv(x), self.qkv_widths)  # views of one [T, (Hq + 2 Hkv) D]
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self._heads(q, self.q_norm, rope), self._heads(k, self.k_norm, rope)
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
                window=self.window,
                sinks=self.sinks,
                k_new=k,
                v_new=v,
            )  # [T, Hq, D]
            return self.o_proj(out.view(t, self.num_heads * self.head_dim))
        assert isinstance(batch, StepBatch)  # DecoderModel.step pairs the batch with its cache
        out = torch.empty_like(q)  # [T, Hq, D]
        for s, (sid, start) in enumerate(zip(batch.seq_ids, batch.starts)):
            a, b = batch.offsets[s], batch.offsets[s + 1]
            keys, values = cache.write(self.layer, sid, start, k[a:b], v[a:b])  # [start+n, Hkv, D]
            out[a:b] = self._attend(q[a:b], keys, values, start)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))

    def linears(self) -> tuple[Linear | QuantLinear, ...]:
        """The projections it holds (q, k, v merged or not, then o)."""
        parts = (self.qkv, self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        return tuple(m for m in parts if m is not None)

    def warm_up_norms(self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, device) -> int:
        """Run q's and k's transforms on one token (rope: cos, sin [1, D/2]), so that their fused
        kernel is compiled before serving; returns the calls run."""
        if not self.transforms_heads:
            return 0
        for heads, norm in ((self.num_heads, self.q_norm), (self.num_kv_heads, self.k_norm)):
            self._heads(torch.zeros(1, heads, self.head_dim, dtype=dtype, device=device), norm, rope)
        return 2

    def _heads(
        self, x: torch.Tensor, norm: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """What q or k [T, heads, D] go through before attention: the weighted RMS norm (Qwen3's
        q_norm / k_norm), the rotary embedding, the weightless qk-norm (Llama 4's), in that order,
        each rounded to the dtype; on the GPU all of it one launch (``kernels.head_rope``)."""
        if self.fusable_heads and kernels.fused_norms_take(x, norm):
            cos, sin = rope if self.use_rope else (None, None)
            return kernels.head_rope(x, cos, sin, self.interleaved, self.eps, pre_weight=norm, post_norm=self.qk_norm)
        if norm is not None:
            x = rms_norm(x, norm, self.eps)
        if self.use_rope:
            x = apply_rope(x, *rope, self.interleaved)
        if self.qk_norm:
            x = l2_norm(x, self.eps)
        return x

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """One sequence: q [n, Hq, D] at positions start.., keys/values [start+n, Hkv, D] -> [n, Hq, D]."""
        n, end = q.shape[0], keys.shape[0]
        first = (start // self.chunk) * self.chunk if self.chunk else 0  # keys before the chunk are never visible
        if self.window:
            first = max(first, start - self.window + 1)  # nor those out of the first query's window
        keys, values = keys[first:], values[first:]  # [L, Hkv, D]
        g = self.num_heads // self.num_kv_heads
        qh = q.view(n, self.num_kv_heads, g, self.head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        kh = keys.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
        vh = values.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * self.scale  # [Hkv, G, n, L]
        if n > 1 or self.chunk or self.window:
            q_pos = torch.arange(start, end, device=q.device)[:, None]  # [n, 1]
            k_pos = torch.arange(first, end, device=q.device)[None, :]  # [1, L]
            visible = k_pos <= q_pos
            if self.chunk:
                visible = visible & (k_pos // self.chunk == q_pos // self.chunk)
            if self.window:
                visible = visible & (k_pos > q_pos - self.window)
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = attention_probs(scores, self.sinks, self.softmax_fp32, q.dtype)
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
    """Read a SwiGLU MLP stored as ``{prefix}.{gate,up,down}_proj``, gate and up merged into one
    product where they can be (``SwiGLU.merged``)."""
    return SwiGLU(
        gate=load_linear(reader, f"{prefix}.gate_proj", width, hidden, bias, dtype, device),
        up=load_linear(reader, f"{prefix}.up_proj", width, hidden, bias, dtype, device),
        down=load_linear(reader, f"{prefix}.down_proj", hidden, width, bias, dtype, device),
    ).merged()
