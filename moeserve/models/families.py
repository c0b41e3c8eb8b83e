"""The families: where each keeps its weights, and the registry of their modules.

Dimension letters: E logical experts, H hidden size, I one expert's intermediate size, V
vocabulary, D head dim, Hq query heads.

A family is a module (``llama4``, ``ernie45``, ``qwen3_moe``, ``mixtral``, ``gpt_oss``,
``deepseek_v3``) holding
what its ``config.json`` means (``parse``: a :class:`~moeserve.models.config.ModelConfig`, whose
MoE layer is data) and where its checkpoints keep each tensor (``NAMES``, a :class:`Names`).
Nothing else is per family: the decoder, the router side of a MoE layer
(``moeserve.models.routing.MoEBlock``), the expert readers and the dummy weights read these two.

Every decoder layer ``i`` holds ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` (MLA: ``mla_shapes``)
(biases with ``attention_bias``; ``q_norm`` / ``k_norm`` [D] with ``qk_rms_norm``; ``sinks``
[Hq] with ``attention_sinks``), ``input_layernorm`` and ``post_attention_layernorm``, and under
``model.layers.{i}.{NAMES.ffn}`` either a dense SwiGLU (``{gate,up,down}_proj``) or a MoE
layer: the gate ``{router}.weight`` [E, H] (``.bias`` [E] with ``routing.gate_bias``), the
correction bias [1, E], the shared experts ``{shared}.{gate,up,down}_proj`` (and
``{shared_gate}.weight`` [1, H]), and the routed experts under ``experts.``: fused
``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H] (x @ W; with ``expert_bias``
``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H]), or per expert
``{e}.{gate,up,down}.weight`` as nn.Linear stores them ([I, H], [I, H], [H, I]).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.models.config import ModelConfig

# The families, each a module moeserve.models.<family> (config.py reads config.json through them)
FAMILIES = ("llama4", "ernie45", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


@dataclass(frozen=True)
class Names:
    """Where a family's checkpoints keep the tensors of a decoder layer's FFN (under
    ``model.layers.{i}.{ffn}``)."""

    ffn: str  # "feed_forward" (Llama 4), "mlp", "block_sparse_moe" (Mixtral)
    router: str = "gate"  # the gate's module: "gate" or "router"
    correction_bias: tuple[str, ...] = ()  # the correction bias's names, the first the one written
    shared: str = ""  # the shared experts' SwiGLU module ("" when the family has none)
    shared_gate: str = ""  # the shared experts' sigmoid gate ("" when none)
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    fused: bool = False  # published with fused expert tensors (what dummy weights are made as)
    interleaved: bool = False  # fused gate_up_proj's columns alternate gate, up (GPT-OSS)
    correction_bias_vector: bool = False  # the correction bias is stored [E] (DeepSeek-V3), not [1, E]

    def layer(self, layer: int) -> str:
        """The FFN prefix of decoder layer ``layer``."""
        return f"model.layers.{layer}.{self.ffn}"

    def experts(self, layer: int) -> str:
        """The routed experts' prefix of decoder layer ``layer`` (with its trailing dot)."""
        return f"{self.layer(layer)}.experts."


def module(family: str) -> ModuleType:
    """The family's module (``moeserve.models.<family>``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    return importlib.import_module(f"moeserve.models.{family}")


def names(cfg: ModelConfig) -> Names:
    """Where ``cfg``'s family keeps its FFN tensors."""
    return module(cfg.family).NAMES


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor a checkpoint of ``cfg`` holds, and its shape, in the layout the
    family publishes (FP8 scales included when ``cfg.quantization`` declares them: added by
    ``moeserve.models.dummy``)."""
    n = names(cfg)
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}

    def linear(name: str, o: int, k: int, bias: bool) -> None:
        out[f"{name}.weight"] = (o, k)
        if bias:
            out[f"{name}.bias"] = (o,)

    def swiglu(prefix: str, width: int, bias: bool) -> None:
        linear(f"{prefix}.gate_proj", width, h, bias)
        linear(f"{prefix}.up_proj", width, h, bias)
        linear(f"{prefix}.down_proj", h, width, bias)

    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        if cfg.mla is not None:
            out.update(mla_shapes(cfg, f"{p}.self_attn"))
        else:
            for name, o, k in (("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q)):
                linear(f"{p}.self_attn.{name}_proj", o, k, cfg.attention_bias)
        if cfg.qk_rms_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (d,)
            out[f"{p}.self_attn.k_norm.weight"] = (d,)
        if cfg.attention_sinks:
            out[f"{p}.self_attn.sinks"] = (cfg.num_heads,)
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        ffn = n.layer(layer)
        if cfg.moe_index(layer) is None:
            swiglu(ffn, cfg.intermediate_size, cfg.mlp_bias)
            continue
        linear(f"{ffn}.{n.router}", e, h, cfg.routing.gate_bias)
        if cfg.routing.correction_bias:
            out[f"{ffn}.{n.correction_bias[0]}"] = (e,) if n.correction_bias_vector else (1, e)
        experts = n.experts(layer)
        if n.fused and not fused_fp8(cfg):
            out[experts + "gate_up_proj"] = (e, h, 2 * i)
            out[experts + "down_proj"] = (e, i, h)
            if cfg.expert_bias:
                out[experts + "gate_up_proj_bias"] = (e, 2 * i)
                out[experts + "down_proj_bias"] = (e, h)
        else:
            g, u, dn = n.expert_linears
            for x in range(e):
                linear(f"{experts}{x}.{g}", i, h, cfg.expert_bias)
                linear(f"{experts}{x}.{u}", i, h, cfg.expert_bias)
                linear(f"{experts}{x}.{dn}", h, i, cfg.expert_bias)
        if cfg.num_shared_experts:
            swiglu(f"{ffn}.{n.shared}", cfg.shared_intermediate_size, cfg.mlp_bias)
        if cfg.shared_expert_gate:
            linear(f"{ffn}.{n.shared_gate}", 1, h, False)
    if not cfg.tie_word_embeddings:
        linear("lm_head", v, h, cfg.mlp_bias)
    elif cfg.mlp_bias:
        out["lm_head.bias"] = (v,)
    return out


def mla_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's tensors under ``prefix`` (``config.MLAConfig``): q_a_proj
    [Lq, H], q_a_layernorm [Lq], q_b_proj [Hq (Dn + Dr), Lq] (or q_proj [Hq (Dn + Dr), H]),
    kv_a_proj_with_mqa [R + Dr, H], kv_a_layernorm [R], kv_b_proj [Hq (Dn + Dv), R], o_proj
    [H, Hq Dv]; q_a, kv_a and o have biases with ``attention_bias``."""
    m = cfg.mla
    assert m is not None
    h, hq, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
    qk = hq * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    out: dict[str, tuple[int, ...]] = {}

    def linear(name: str, o: int, k: int, b: bool) -> None:
        out[f"{prefix}.{name}.weight"] = (o, k)
        if b:
            out[f"{prefix}.{name}.bias"] = (o,)

    if m.q_lora_rank is None:
        linear("q_proj", qk, h, False)
    else:
        linear("q_a_proj", m.q_lora_rank, h, bias)
        out[f"{prefix}.q_a_layernorm.weight"] = (m.q_lora_rank,)
        linear("q_b_proj", qk, m.q_lora_rank, False)
    linear("kv_a_proj_with_mqa", m.latent_dim, h, bias)
    out[f"{prefix}.kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    linear("kv_b_proj", hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False)
    linear("o_proj", h, hq * m.v_head_dim, bias)
    return out


def fused_fp8(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s FP8 experts must be stored one Linear per expert although the family
    publishes fused tensors (the published FP8 Llama 4 checkpoints do: fused FP8 is no layout)."""
    return cfg.quantization is not None and names(cfg).fused and experts_quantized(cfg)


def experts_quantized(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s routed experts are FP8 (its quantization keeps none of them in the
    checkpoint's dtype; checked against the tensors when they are read)."""
    scheme = cfg.quantization
    if scheme is None or not cfg.num_moe_layers:
        return False
    n = names(cfg)
    module = f"{n.experts(cfg.moe_layer_ids[0])}0.{n.expert_linears[0]}"
    return scheme.online_quantizes(module) if scheme.format == "online" else not scheme.ignores(module)
