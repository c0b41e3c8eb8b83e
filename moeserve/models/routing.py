"""The router side of a MoE layer, for every family: its routing function (``route``, the
semantics of a :class:`~moeserve.models.config.RoutingSpec`) and :class:`MoEBlock` (the gate,
its biases and the shared experts, read from a checkpoint by the family's names).

Dimension letters: T tokens, H hidden size, E logical experts, K = top_k, G expert groups.

A family declares its routing as data; the same code routes all of them, so that the router
rank, the exchange and the workers never know which model they serve:

| family | scoring | top-k | correction bias | renormalise | weights on |
|---|---|---|---|---|---|
| Llama 4 | sigmoid of the k logits | first, on the logits | no | no | input |
| ERNIE-4.5 | softmax (fp32 gate) | on scores + bias | yes | yes, floored at moe_norm_min | output |
| Qwen3-MoE | softmax | on the scores | no | norm_topk_prob | output |
| Mixtral | softmax | on the scores | no | yes | output |
| GPT-OSS | softmax over the k logits (gate bias) | first, on the logits | no | (softmax) | output |
| DeepSeek-V3 | sigmoid (fp32 gate) | on scores + bias, in the best groups | yes | norm_topk_prob, x scaling | output |

DeepSeek-V3's groups (``n_group`` / ``topk_group``) and routed scaling factor are the same data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve import kernels
from moeserve.models import families
from moeserve.models.config import ModelConfig, RoutingSpec
from moeserve.models.layers import Linear, SwiGLU, load_swiglu
from moeserve.models.moe import RoutingResult


def _score(spec: RoutingSpec, x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, or an elementwise sigmoid, in fp32: [..., N] -> [..., N]."""
    x = x.float()
    return torch.softmax(x, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(x)


def group_limited(spec: RoutingSpec, choice: torch.Tensor) -> torch.Tensor:
    """The selection scores [T, E] with every expert outside the ``topk_group`` best of
    ``n_group`` groups (a group's score: the sum of its two best) set to -inf."""
    t, e = choice.shape
    g = spec.n_group
    grouped = choice.view(t, g, e // g)  # [T, G, E/G]
    group_scores = grouped.topk(min(2, e // g), dim=-1).values.sum(dim=-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)


def route(
    spec: RoutingSpec,
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    parts: int = 1,
) -> RoutingResult:
    """The routing function of ``spec``: gate logits [T, E] -> ids, weights [T, K] (weights in
    ``dtype``, default the logits' dtype); ``correction_bias`` [E] fp32 selects only. ``parts``
    3: the logits come as the partial logits [T, 3E] of ``kernels.gate_split_logits``, summed
    first (``kernels.sum_gate_parts``; the fused kernel sums them as it loads them).

    On CUDA a routing that takes the top-k on the scores is one Triton launch
    (``kernels.fused_route``: the same fp32 operations, the lowest index first among equal
    choices), DeepSeek-V3's expert groups too (``MOESERVE_FUSED_GROUPED_ROUTING=0`` keeps
    torch's grouped selection); the torch sequence below is the CPU's and the reference
    (``MOESERVE_FUSED_ROUTING=0`` keeps it on CUDA too)."""
    dtype = dtype or logits.dtype
    if kernels.fused_route_takes(logits, spec, top_k, parts):
        ids, weights = kernels.fused_route(
            logits,
            top_k,
            spec.scoring,
            correction_bias,
            spec.renormalize,
            spec.renorm_min,
            spec.scaling_factor,
            dtype,
            parts,
            spec.n_group,
            spec.topk_group,
        )
        return RoutingResult(ids=ids, weights=weights, weights_on_input=spec.weights_on_input)
    if parts != 1:
        logits = kernels.sum_gate_parts(logits)
    if spec.topk_first:
        top, ids = torch.topk(logits, top_k, dim=-1)  # [T, K]
        weights = _score(spec, top)
    else:
        scores = _score(spec, logits)  # [T, E] fp32
        choice = scores if correction_bias is None else scores + correction_bias
        if spec.n_group > 1:
            choice = group_limited(spec, choice)
        ids = torch.topk(choice, top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(-1, ids)
    if spec.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total.clamp(min=spec.renorm_min) if spec.renorm_min else total)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    return RoutingResult(ids=ids, weights=weights.to(dtype), weights_on_input=spec.weights_on_input)


class MoEBlock:
    """The router side of one MoE layer: the gate (weight [E, H], bias [E] or None), the
    correction bias [E] (fp32, indexed by logical expert: it never moves with a placement), the
    shared experts' SwiGLU and their sigmoid gate (each None when the family has none)."""

    def __init__(
        self,
        spec: RoutingSpec,
        top_k: int,
        gate_weight: torch.Tensor,
        gate_bias: torch.Tensor | None = None,
        correction_bias: torch.Tensor | None = None,
        shared_mlp: SwiGLU | None = None,
        shared_gate: Linear | None = None,
    ):
        self.spec, self.top_k = spec, top_k
        self.gate_weight = gate_weight  # [E, H], fp32 when spec.gate_fp32, else the model dtype
        self.gate_bias = gate_bias  # [E] or None
        self.correction_bias = correction_bias  # [E] fp32 or None
        self.shared_mlp = shared_mlp
        self.shared_gate = shared_gate  # weight [1, H] or None
        # an fp32 gate of bf16 rows on tensor cores: the weight's three bf16 parts [3E, H]
        # (kernels.gate_parts), where the device takes them; the fp32 weight stays for fp32 rows
        split = spec.gate_fp32 and gate_bias is None and kernels.gate_split_takes(gate_weight)
        self.gate_parts = kernels.gate_parts(gate_weight) if split else None

    @classmethod
    def load(cls, reader, cfg: ModelConfig, layer: int, dtype: torch.dtype, device) -> MoEBlock:
        """Decoder layer ``layer``'s gate and shared experts, by the family's names."""
        n, spec = families.names(cfg), cfg.routing
        p, e, h = n.layer(layer), cfg.num_experts, cfg.hidden_size
        gate_dtype = torch.float32 if spec.gate_fp32 else dtype
        weight = reader.read(f"{p}.{n.router}.weight", gate_dtype, shape=(e, h)).to(device)
        bias = reader.read(f"{p}.{n.router}.bias", gate_dtype, shape=(e,)).to(device) if spec.gate_bias else None
        correction = None
        if spec.correction_bias:
            found = [f"{p}.{c}" for c in n.correction_bias]
            name = next((c for c in found if reader.has(c)), found[0])  # a missing one is named by its usual name
            if tuple(reader.shape(name)) not in ((1, e), (e,)):
                reader.check_shape(name, (1, e))
            correction = reader.read(name, torch.float32).reshape(e).to(device)
        shared = None
        if cfg.num_shared_experts:
            shared = load_swiglu(
                reader, f"{p}.{n.shared}", h, cfg.shared_intermediate_size, cfg.mlp_bias, dtype, device
            )
        gate = None
        if cfg.shared_expert_gate:
            gate = Linear(reader.read(f"{p}.{n.shared_gate}.weight", dtype, shape=(1, h)).to(device))
        return cls(spec, cfg.top_k, weight, bias, correction, shared, gate)

    def route(self, hidden: torch.Tensor) -> RoutingResult:
        """hidden [T, H] (the post-attention-norm MoE input) -> logical ids and weights [T, K]."""
        if (gate_parts := self._split_parts(hidden)) is not None:
            partial = kernels.gate_split_logits(hidden, gate_parts)  # [T, 3E] fp32
            return route(self.spec, partial, self.top_k, self.correction_bias, hidden.dtype, kernels.GATE_PARTS)
        x = hidden.float() if self.spec.gate_fp32 else hidden
        logits = F.linear(x, self.gate_weight, self.gate_bias)  # [T, E]
        return route(self.spec, logits, self.top_k, self.correction_bias, hidden.dtype)

    def _split_parts(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The gate's bf16 parts (``gate_parts``) where ``hidden`` takes them now (bf16 rows on a
        device of ``kernels.GATE_SPLIT_DEVICES``), else None."""
        if hidden.dtype == torch.bfloat16 and kernels.gate_split_on(hidden):
            return self.gate_parts
        return None

    def warm_up(self, dtype: torch.dtype) -> int:
        """Compile, before serving, what ``route`` launches for hidden states of ``dtype`` (the
        model's): the fused routing kernel of this layer's routing, experts and top-k, whose key
        does not depend on the token count. Returns the launches run: 0 where torch's sequence
        serves (CPU, top-k-first routings, grouped ones with ``MOESERVE_FUSED_GROUPED_ROUTING=0``,
        ``MOESERVE_FUSED_ROUTING=0``)."""
        gate_dtype = torch.float32 if self.spec.gate_fp32 else dtype
        x = torch.zeros(1, self.gate_weight.shape[1], dtype=dtype, device=self.gate_weight.device)
        parts = kernels.GATE_PARTS if self._split_parts(x) is not None else 1
        logits = torch.zeros(1, parts * self.gate_weight.shape[0], dtype=gate_dtype, device=self.gate_weight.device)
        if not kernels.fused_route_takes(logits, self.spec, self.top_k, parts):
            return 0
        self.route(x)
        return 1

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared experts: [T, H] -> [T, H] (times their sigmoid gate), or None."""
        if self.shared_mlp is None:
            return None
        out = self.shared_mlp(hidden)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(hidden)) * out
        return out
