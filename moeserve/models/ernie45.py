"""ERNIE-4.5-MoE: what its config.json means, and where its weights sit in a checkpoint.

Dimension letters: T tokens, H hidden size, E logical experts, K = moe_k.

MoE layer (docs/models.md, "ERNIE-4.5-MoE"), as data: the gate runs in fp32 whatever the model
dtype, p = softmax(x_f32 @ W_g.T); the top-k is chosen on p + e_score_correction_bias (the bias
only selects); the weights are the *unbiased* p of the chosen experts, renormalised by
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

NAMES = Names(
    ffn="mlp",
    router="gate",
    correction_bias=("moe_statics.e_score_correction_bias", "gate.e_score_correction_bias"),
    shared="shared_experts",
)


def parse(f: Fields, model_type: str) -> ModelConfig:
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = read_heads(f)
    num_experts = f.alias_int(("moe_num_experts", "num_experts"))
    top_k = f.alias_int(("moe_k", "num_experts_per_tok"))
    if top_k > num_experts:
        raise f.error("moe_k", f"({top_k}) exceeds moe_num_experts ({num_experts})")
    start = f.int("moe_layer_start_index", 1, minimum=0)
    end = f.int("moe_layer_end_index", -1, minimum=-1)
    end = layers - 1 if end == -1 else end
    interval = f.int("moe_layer_interval", 1)
    moe_layers = tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)
    width = f.int("moe_intermediate_size")
    shared = f.int("moe_num_shared_experts", 2, minimum=0)
    use_bias = f.bool("use_bias", False)
    routing = RoutingSpec(
        scoring="softmax",
        gate_fp32=True,
        correction_bias=True,
        renormalize=True,
        renorm_min=f.float("moe_norm_min", 1e-12),
    )
    return ModelConfig(
        family="ernie45",
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=f.int("intermediate_size"),
        rms_norm_eps=f.float("rms_norm_eps", 1e-5),
        rope=read_rope(f),
        attention_bias=use_bias,
        mlp_bias=use_bias,
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        moe_layer_ids=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=width,
        num_shared_experts=shared,
        shared_intermediate_size=width * shared,
        bos_token_id=optional_id(f, "bos_token_id", 1),
        eos_token_ids=token_ids(f.raw.get("eos_token_id", 2), f.source, "eos_token_id"),
        pad_token_id=optional_id(f, "pad_token_id", 0),
        dtype=read_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
        routing=routing,
        attention_softmax_fp32=True,  # transformers' ERNIE eager attention: softmax in fp32
    )


# init_model's small checkpoint (moeserve/models/init.py): hidden 64, 4 layers (layer 0 dense), 16
# experts top-4, 2 shared; init std 0.3 (with 0.02 greedy decoding repeats one token).
TINY: dict[str, Any] = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "moe_num_experts": 16,
    "moe_k": 4,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
    "moe_norm_min": 1e-12,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "use_bias": False,
    "tie_word_embeddings": True,
    "initializer_range": 0.3,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
