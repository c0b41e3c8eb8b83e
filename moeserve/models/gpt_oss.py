"""GPT-OSS: what its config.json means, and where its weights sit in a checkpoint.

Dimension letters: H hidden size, E logical experts (num_local_experts), I one expert's width
(``intermediate_size``), Hq query heads.

Attention: grouped-query with biases on q, k, v and o; RoPE on the two halves of a head with
YaRN scaling (by default factor 32 over an original context of 4096, beta_fast 32, beta_slow 1,
not truncated; cos and sin times the attention factor 0.1 ln(32) + 1); ``layer_types``
alternates sliding-window layers (``sliding_window``, 128: keys p - 128 < k <= p) and full ones,
sliding first; every head has a learned sink logit (``sinks`` [Hq]) that joins its softmax and
adds nothing to the output. RMSNorm weights stay in fp32 and scale before the cast. Every layer
is a MoE layer.

MoE layer (docs/models.md, "GPT-OSS"), as data: l = x @ W_r.T + b_r (the router has a bias), in
the model dtype; the top-k of l; softmax over those k; the weight scales the expert's *output*.
Experts have biases and a clamped SwiGLU: with [g | u] = x @ gate_up + b,
g' = min(g, limit), u' = clamp(u, -limit, limit), E(x) = ((u' + 1) g' sigmoid(alpha g')) @ down
+ b_down (alpha = ``swiglu_alpha``, 1.702; limit = ``swiglu_limit``, 7).

Checkpoint names (bf16, as transformers writes them): ``model.layers.{i}.mlp.router.{weight [E,
H], bias [E]}``, ``model.layers.{i}.mlp.experts.gate_up_proj [E, H, 2I]`` (x @ W, gate and up
columns *interleaved*: g0, u0, g1, u1, ...), ``gate_up_proj_bias [E, 2I]`` (likewise),
``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, ``model.layers.{i}.self_attn.sinks [Hq]``.
The published checkpoints' MXFP4 experts (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``)
are refused by name.
"""

from __future__ import annotations

from typing import Any

from moeserve.models.config import (
    Fields,
    ModelConfig,
    RoutingSpec,
    optional_id,
    read_dtype,
    read_heads,
    read_rope,
    token_ids,
)
from moeserve.models.errors import CheckpointError
from moeserve.models.families import Names

NAMES = Names(ffn="mlp", router="router", fused=True, interleaved=True)
ROUTING = RoutingSpec(scoring="softmax", topk_first=True, gate_bias=True)
# transformers' GptOssConfig when the config says nothing of RoPE
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def parse(f: Fields, model_type: str) -> ModelConfig:
    qc = f.raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        raise CheckpointError(
            f"{f.source}: quantization_config quant_method 'mxfp4': GPT-OSS's MXFP4 experts are not served yet; "
            f"serve a bf16 checkpoint (transformers loads this one with Mxfp4Config(dequantize=True) and "
            f"save_pretrained writes it in bf16)"
        )
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = read_heads(f)
    num_experts = f.int("num_local_experts", 128)
    top_k = f.alias_int(("num_experts_per_tok", "experts_per_token"), 4)
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"({top_k}) exceeds num_local_experts ({num_experts})")
    types = f.raw.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) < layers or any(t not in LAYER_TYPES for t in types):
        raise f.error("layer_types", f"must list one of {LAYER_TYPES} per layer ({layers}), found {types!r}")
    window = f.int("sliding_window", 128)
    rope_fields = f
    if f.raw.get("rope_parameters") is None and not f.raw.get("rope_scaling"):
        rope_fields = Fields({**f.raw, "rope_parameters": DEFAULT_ROPE}, f.source, f.prefix)
    return ModelConfig(
        family="gpt_oss",
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=0,  # no dense layer
        rms_norm_eps=f.float("rms_norm_eps", 1e-5),
        rope=read_rope(rope_fields, ("default", "yarn"), default_theta=150000.0, interleaved=False),
        attention_bias=f.bool("attention_bias", True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        moe_layer_ids=tuple(range(layers)),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=f.int("intermediate_size", 2880),
        num_shared_experts=0,
        shared_intermediate_size=0,
        bos_token_id=optional_id(f, "bos_token_id", None),
        eos_token_ids=token_ids(f.raw.get("eos_token_id"), f.source, "eos_token_id"),
        pad_token_id=optional_id(f, "pad_token_id", None),
        dtype=read_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
        routing=ROUTING,
        expert_activation="clamped_swiglu",
        swiglu_alpha=f.float("swiglu_alpha", 1.702),
        swiglu_limit=f.float("swiglu_limit", 7.0),
        expert_bias=True,
        sliding_window=window,
        sliding_layers=tuple(t == "sliding_attention" for t in types[:layers]),
        attention_sinks=True,
        attention_softmax_fp32=False,  # transformers' GPT-OSS eager attention: softmax in the model dtype
        norm_weight_fp32=True,
    )


# init_model's small checkpoint (moeserve/models/init.py): hidden 64, 4 layers alternating a sliding
# window of 8 and full attention, YaRN (factor 8 over 64 positions), sinks, 8 experts top-2 with
# biases and the clamp at 2 (it acts on many rows of a model this small); init std 0.2.
TINY: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    "max_position_embeddings": 512,
    "swiglu_limit": 2.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": True,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
