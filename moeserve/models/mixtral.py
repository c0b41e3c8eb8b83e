"""Mixtral: what its config.json means, and where its weights sit in a checkpoint.

Dimension letters: H hidden size, E logical experts (num_local_experts), I one expert's width
(``intermediate_size``).

Attention: grouped-query, no bias, RoPE on the two halves of a head (rotate_half), eager
softmax in fp32; ``sliding_window`` (null in the published 8x7B and 8x22B) puts every layer on
that window. Every layer is a MoE layer.

MoE layer (docs/models.md, "Mixtral"), as data: p = softmax(x @ W_g.T) in fp32; the top-k of p,
renormalised (always); the weight scales the expert's *output*; no shared expert. Experts are
SwiGLU: w1 the gate, w3 the up projection, w2 the down projection.

Checkpoint names (as published and as transformers writes them):
``model.layers.{i}.block_sparse_moe.gate.weight [E, H]``,
``model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3}.weight [I, H]``, ``...w2.weight [H, I]``.
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
from moeserve.models.families import Names
from moeserve.models.qwen3_moe import check_silu

NAMES = Names(ffn="block_sparse_moe", router="gate", expert_linears=("w1", "w3", "w2"))


def parse(f: Fields, model_type: str) -> ModelConfig:
    check_silu(f)
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = read_heads(f)
    num_experts = f.int("num_local_experts", 8)
    top_k = f.int("num_experts_per_tok", 2)
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"({top_k}) exceeds num_local_experts ({num_experts})")
    window = f.int("sliding_window") if f.has("sliding_window") else None
    return ModelConfig(
        family="mixtral",
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=0,  # no dense layer
        rms_norm_eps=f.float("rms_norm_eps", 1e-5),
        rope=read_rope(f, ("default", "yarn"), default_theta=1e6, interleaved=False),
        attention_bias=False,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        moe_layer_ids=tuple(range(layers)),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=f.int("intermediate_size", 14336),
        num_shared_experts=0,
        shared_intermediate_size=0,
        bos_token_id=optional_id(f, "bos_token_id", 1),
        eos_token_ids=token_ids(f.raw.get("eos_token_id", 2), f.source, "eos_token_id"),
        pad_token_id=optional_id(f, "pad_token_id", None),
        dtype=read_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 4096 * 32),
        routing=RoutingSpec(scoring="softmax", renormalize=True),
        sliding_window=window,
        sliding_layers=(window is not None,) * layers,
        attention_softmax_fp32=True,
    )


# init_model's small checkpoint (moeserve/models/init.py): hidden 64, 4 layers, 8 experts top-2;
# init std 0.2 (informative greedy output).
TINY: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_window": None,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
