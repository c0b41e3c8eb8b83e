"""ERNIE-4.5-MoE: the router side of a MoE layer, and where its weights sit in a checkpoint.

Dimension letters: T tokens, H hidden size, E logical experts, K = moe_k.

MoE layer (docs/models.md, "ERNIE-4.5-MoE"): the gate runs in fp32 whatever the model dtype,
p = softmax(x_f32 @ W_g.T); the top-k is chosen on p + e_score_correction_bias (the bias only
selects); the weights are the *unbiased* p of the chosen experts, renormalised by
max(sum, moe_norm_min) and cast to the model dtype, and they scale the expert's *output*:
y = Shared(x) + sum_k w_k * E_k(x). The shared experts form one SwiGLU of width
moe_intermediate_size * moe_num_shared_experts (none when that is 0).

Checkpoint names: ``model.layers.{i}.mlp.gate.weight [E, H]``,
``model.layers.{i}.mlp.moe_statics.e_score_correction_bias [1, E]`` (fp32),
``model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, and for dense layers
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``. There is no ``lm_head.weight`` when the
embeddings are tied. ``mtp*`` tensors are ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.models.config import ModelConfig
from moeserve.models.layers import SwiGLU, load_swiglu
from moeserve.models.moe import RoutingResult

FFN_PREFIX = "model.layers.{}.mlp"
# transformers' ERNIE eager attention takes its softmax in fp32.
ATTN_SOFTMAX_FP32 = True
BIAS_NAMES = ("mlp.moe_statics.e_score_correction_bias", "mlp.gate.e_score_correction_bias")


class Ernie45MoEBlock:
    """Router-side part of one ERNIE MoE layer: fp32 gate, correction bias, shared experts."""

    def __init__(
        self,
        gate_weight: torch.Tensor,
        correction_bias: torch.Tensor,
        top_k: int,
        norm_min: float,
        shared_experts: SwiGLU | None,
    ):
        self.gate_weight = gate_weight  # [E, H] fp32
        self.correction_bias = correction_bias  # [E] fp32, indexed by logical expert
        self.top_k = top_k
        self.norm_min = norm_min
        self.shared_experts = shared_experts

    @classmethod
    def load(cls, reader, cfg: ModelConfig, layer: int, dtype: torch.dtype, device) -> Ernie45MoEBlock:
        p = FFN_PREFIX.format(layer)
        e, h = cfg.num_experts, cfg.hidden_size
        gate = reader.read(f"{p}.gate.weight", torch.float32, shape=(e, h)).to(device)
        names = [f"model.layers.{layer}.{n}" for n in BIAS_NAMES]
        name = next((n for n in names if reader.has(n)), names[0])  # a missing bias is reported under its usual name
        shape = reader.shape(name)
        if shape not in ((1, e), (e,)):
            reader.check_shape(name, (1, e))
        bias = reader.read(name, torch.float32).reshape(e).to(device)
        shared = None
        if cfg.num_shared_experts:
            shared = load_swiglu(
                reader, f"{p}.shared_experts", h, cfg.shared_intermediate_size, cfg.mlp_bias, dtype, device
            )
        return cls(gate, bias, cfg.top_k, cfg.moe_norm_min, shared)

    @property
    def shared_mlp(self) -> SwiGLU | None:
        """The shared experts' SwiGLU (None when the model has none)."""
        return self.shared_experts

    def route(self, hidden: torch.Tensor) -> RoutingResult:
        """hidden [T, H] -> ids [T, K], weights [T, K] (renormalised softmax), applied to the output."""
        probs = torch.softmax(F.linear(hidden.float(), self.gate_weight), dim=-1)  # [T, E] fp32
        ids = torch.topk(probs + self.correction_bias, self.top_k, dim=-1).indices  # [T, K]
        weights = probs.gather(-1, ids)  # [T, K]
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return RoutingResult(ids=ids, weights=weights.to(hidden.dtype), weights_on_input=False)

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared experts: [T, H] -> [T, H], or None when the model has none."""
        return None if self.shared_experts is None else self.shared_experts(hidden)


def load_dense_mlp(reader, cfg: ModelConfig, layer: int, dtype: torch.dtype, device) -> SwiGLU:
    """The SwiGLU of a dense layer, width ``intermediate_size``."""
    return load_swiglu(
        reader, FFN_PREFIX.format(layer), cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device
    )
