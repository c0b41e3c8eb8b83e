"""DeepSeek-V3 (and Kimi K2): what its config.json means, and where its weights sit in a checkpoint.

Dimension letters: H hidden size, E logical experts (``n_routed_experts``), K =
num_experts_per_tok, G expert groups (``n_group``), Hq query heads, R kv_lora_rank, Dn / Dr /
Dv the no-RoPE, RoPE and value head dims.

Attention: multi-head latent attention (``moeserve.models.mla``, ``config.MLAConfig``): q and kv
LoRA projections, a RoPE key shared by all heads, YaRN RoPE on Dr dims (adjacent pairs with
``rope_interleave``, the default) and YaRN's softmax-scale correction mscale(factor,
mscale_all_dim)^2. ``num_key_value_heads`` is not used: every head has its own keys and values,
expanded from one latent per token.

MoE layer (docs/models.md, "DeepSeek-V3"), as data: s = sigmoid(x_f32 @ W_g.T) (the gate in
fp32); the top-k of s + ``e_score_correction_bias`` (selection only) within the ``topk_group``
best of ``n_group`` groups (a group's score: the sum of its two best); the unbiased s of the k,
renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``; on the expert's output;
``n_shared_experts`` shared experts as one SwiGLU of ``n_shared_experts * moe_intermediate_size``.
Decoder layers ``0 .. first_k_dense_replace - 1`` are dense SwiGLUs of ``intermediate_size``.

Checkpoint names: ``model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, ``model.layers.{i}.mlp.gate.weight [E,
H]``, ``mlp.gate.e_score_correction_bias [E]`` (fp32), ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_experts.{gate,up,down}_proj``; the multi-token-prediction layers beyond
``num_hidden_layers`` (``model.layers.61.*`` in V3) are not read.
"""

from __future__ import annotations

import math
from typing import Any

from moeserve.models.config import (
    Fields,
    MLAConfig,
    ModelConfig,
    RoutingSpec,
    optional_id,
    read_dtype,
    read_rope,
    token_ids,
)
from moeserve.models.families import Names
from moeserve.models.qwen3_moe import check_silu

NAMES = Names(
    ffn="mlp",
    router="gate",
    correction_bias=("gate.e_score_correction_bias",),
    shared="shared_experts",
    correction_bias_vector=True,
)


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_scale(f: Fields, qk_head_dim: int) -> float:
    """(Dn + Dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers'
    ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    params = f.raw.get("rope_parameters") or f.raw.get("rope_scaling") or {}
    rtype = params.get("rope_type", params.get("type", "default"))
    all_dim = params.get("mscale_all_dim") or 0
    if rtype != "default" and all_dim:
        m = _mscale(float(params.get("factor", 1.0)), float(all_dim))
        scale *= m * m
    return scale


def parse(f: Fields, model_type: str) -> ModelConfig:
    check_silu(f)
    layers = f.int("num_hidden_layers")
    heads = f.int("num_attention_heads")
    num_experts = f.int("n_routed_experts")
    top_k = f.int("num_experts_per_tok", 8)
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"({top_k}) exceeds n_routed_experts ({num_experts})")
    n_group, topk_group = f.int("n_group", 1), f.int("topk_group", 1)
    if num_experts % n_group:
        raise f.error("n_group", f"({n_group}) must divide n_routed_experts ({num_experts})")
    if topk_group > n_group or topk_group * (num_experts // n_group) < top_k:
        raise f.error(
            "topk_group", f"({topk_group}) must be <= n_group ({n_group}) and its groups hold >= {top_k} experts"
        )
    for name, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if f.raw.get(name, allowed) != allowed:
            raise f.error(name, f"is {f.raw[name]!r}; DeepSeek-V3 routing: allowed: {allowed}")
    if f.int("moe_layer_freq", 1) != 1:
        raise f.error("moe_layer_freq", "must be 1 (every layer from first_k_dense_replace on is MoE)")
    first_dense = f.int("first_k_dense_replace", 3, minimum=0)
    rope_dim, nope_dim = f.int("qk_rope_head_dim", 64), f.int("qk_nope_head_dim", 128)
    if rope_dim % 2:
        raise f.error("qk_rope_head_dim", f"must be even (RoPE rotates pairs), found {rope_dim}")
    q_lora = f.int("q_lora_rank", 0, minimum=0) or None
    mla = MLAConfig(
        q_lora_rank=q_lora,
        kv_lora_rank=f.int("kv_lora_rank", 512),
        qk_nope_head_dim=nope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.int("v_head_dim", 128),
        softmax_scale=softmax_scale(f, nope_dim + rope_dim),
    )
    shared = f.int("n_shared_experts", 1, minimum=0)
    moe_width = f.int("moe_intermediate_size", 2048)
    return ModelConfig(
        family="deepseek_v3",
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,  # every head its own keys and values (expanded from the latent)
        head_dim=rope_dim,  # the RoPE part: what the rotary embedding rotates
        intermediate_size=f.int("intermediate_size", 18432),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope=read_rope(f, ("default", "yarn"), default_theta=10000.0, interleaved=f.bool("rope_interleave", True)),
        attention_bias=f.bool("attention_bias", False),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        moe_layer_ids=tuple(range(min(first_dense, layers), layers)),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_width,
        num_shared_experts=shared,
        shared_intermediate_size=shared * moe_width,
        bos_token_id=optional_id(f, "bos_token_id", None),
        eos_token_ids=token_ids(f.raw.get("eos_token_id"), f.source, "eos_token_id"),
        pad_token_id=optional_id(f, "pad_token_id", None),
        dtype=read_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 4096),
        routing=RoutingSpec(
            scoring="sigmoid",
            gate_fp32=True,
            correction_bias=True,
            n_group=n_group,
            topk_group=topk_group,
            renormalize=f.bool("norm_topk_prob", True),
            renorm_min=1e-20,
            scaling_factor=f.float("routed_scaling_factor", 1.0),
        ),
        attention_softmax_fp32=True,
        mla=mla,
    )


# init_model's small checkpoint (moeserve/models/init.py): hidden 64, 3 layers with layer 0 dense,
# MLA (q LoRA 48, kv LoRA 32, RoPE dim 8, no-RoPE 16, value 16), YaRN (factor 8 over 64 positions,
# mscale_all_dim 1: the softmax scale is corrected), 16 experts in 4 groups with 2 picked, top-4,
# scaling 2.5, one shared expert; init std 0.2 (informative greedy output).
TINY: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
