"""Llama 4 (text): the router side of a MoE layer, and where its weights sit in a checkpoint.

Dimension letters: T tokens, H hidden size, E logical experts, K = top_k (1 in every published
model), I one expert's intermediate size.

MoE layer (docs/models.md, "Llama 4 (text)"): logits = x @ W_r.T in the model dtype; the top-k
logits pass through a sigmoid (fp32, cast back) and the weight scales the expert's *input*:
y = Shared(x) + sum_k E_k(s_k * x). There is no softmax, no renormalisation and no bias. The
shared expert is one SwiGLU of the experts' width, unscaled.

Checkpoint names (``language_model.`` in front for multimodal checkpoints, added by the reader):
``model.layers.{i}.feed_forward.router.weight [E, H]``,
``model.layers.{i}.feed_forward.shared_expert.{gate,up,down}_proj.weight``,
``model.layers.{i}.feed_forward.experts.*`` (fused or per expert: see checkpoint.py), and for
dense layers ``model.layers.{i}.feed_forward.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.models.config import ModelConfig
from moeserve.models.layers import SwiGLU, load_swiglu
from moeserve.models.moe import RoutingResult

FFN_PREFIX = "model.layers.{}.feed_forward"
# transformers' Llama 4 eager attention takes its softmax in the model dtype.
ATTN_SOFTMAX_FP32 = False


class Llama4MoEBlock:
    """Router-side part of one Llama 4 MoE layer: the router and the shared expert."""

    def __init__(self, router_weight: torch.Tensor, shared_expert: SwiGLU, top_k: int):
        self.router_weight = router_weight  # [E, H], model dtype
        self.shared_expert = shared_expert
        self.top_k = top_k

    @classmethod
    def load(cls, reader, cfg: ModelConfig, layer: int, dtype: torch.dtype, device) -> Llama4MoEBlock:
        p = FFN_PREFIX.format(layer)
        router = reader.read(f"{p}.router.weight", dtype, shape=(cfg.num_experts, cfg.hidden_size)).to(device)
        shared = load_swiglu(
            reader, f"{p}.shared_expert", cfg.hidden_size, cfg.moe_intermediate_size, False, dtype, device
        )
        return cls(router, shared, cfg.top_k)

    @property
    def shared_mlp(self) -> SwiGLU | None:
        """The shared experts' SwiGLU (None when the model has none)."""
        return self.shared_expert

    def route(self, hidden: torch.Tensor) -> RoutingResult:
        """hidden [T, H] -> ids [T, K], weights [T, K] = sigmoid(top-k logits), applied to the input."""
        logits = F.linear(hidden, self.router_weight)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, K]
        weights = torch.sigmoid(top.float()).to(hidden.dtype)  # [T, K]
        return RoutingResult(ids=ids, weights=weights, weights_on_input=True)

    def shared(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared expert: [T, H] -> [T, H]."""
        return self.shared_expert(hidden)


def load_dense_mlp(reader, cfg: ModelConfig, layer: int, dtype: torch.dtype, device) -> SwiGLU:
    """The SwiGLU of a dense (non-MoE) layer, width ``intermediate_size_mlp``."""
    return load_swiglu(reader, FFN_PREFIX.format(layer), cfg.hidden_size, cfg.intermediate_size, False, dtype, device)
