"""Llama 4 (text): what its config.json means, and where its weights sit in a checkpoint.

Dimension letters: T tokens, H hidden size, E logical experts, K = top_k (1 in every published
model), I one expert's intermediate size.

MoE layer (docs/models.md, "Llama 4 (text)"), as data: logits = x @ W_r.T in the model dtype;
the top-k logits pass through a sigmoid (fp32, cast back) and the weight scales the expert's
*input*: y = Shared(x) + sum_k E_k(s_k * x). There is no softmax, no renormalisation and no
bias (``RoutingSpec(scoring="sigmoid", topk_first=True, weights_on_input=True)``). The shared
expert is one SwiGLU of the experts' width, unscaled.

Checkpoint names (``language_model.`` in front for multimodal checkpoints, added by the reader):
``model.layers.{i}.feed_forward.router.weight [E, H]``,
``model.layers.{i}.feed_forward.shared_expert.{gate,up,down}_proj.weight``,
``model.layers.{i}.feed_forward.experts.*`` (fused or per expert: see checkpoint.py), and for
dense layers ``model.layers.{i}.feed_forward.{gate,up,down}_proj.weight``.
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

NAMES = Names(ffn="feed_forward", router="router", shared="shared_expert", fused=True)
ROUTING = RoutingSpec(scoring="sigmoid", topk_first=True, weights_on_input=True)


def parse(f: Fields, model_type: str) -> ModelConfig:
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = read_heads(f)
    num_experts = f.int("num_local_experts")
    top_k = f.int("num_experts_per_tok", 1)
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"({top_k}) exceeds num_local_experts ({num_experts})")

    moe_layers = f.int_list("moe_layers")
    if moe_layers is None:
        step = f.int("interleave_moe_layer_step", 1)
        moe_layers = list(range(step - 1, layers, step))
    if sorted(set(moe_layers)) != moe_layers or any(not 0 <= i < layers for i in moe_layers):
        raise f.error("moe_layers", f"must be ascending distinct layer indices in 0..{layers - 1}, found {moe_layers}")

    no_rope = f.int_list("no_rope_layers")
    if not no_rope:  # absent or empty: a NoPE layer every no_rope_layer_interval layers
        interval = f.int("no_rope_layer_interval", 4)
        no_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(no_rope) < layers:
        raise f.error("no_rope_layers", f"has {len(no_rope)} entries for {layers} layers")
    use_rope = tuple(bool(x) for x in no_rope[:layers])

    chunk = f.raw.get("attention_chunk_size", 8192)
    if chunk is not None:
        chunk = f.int("attention_chunk_size")
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        chunked = tuple(r and chunk is not None for r in use_rope)
    else:
        allowed = ("full_attention", "chunked_attention")
        if not isinstance(layer_types, list) or len(layer_types) < layers or any(t not in allowed for t in layer_types):
            raise f.error("layer_types", f"must list one of {allowed} per layer ({layers}), found {layer_types!r}")
        chunked = tuple(t == "chunked_attention" for t in layer_types[:layers])
        if any(chunked) and chunk is None:
            raise f.error("layer_types", "has chunked_attention layers but attention_chunk_size is null")

    expert_width = f.int("intermediate_size")
    return ModelConfig(
        family="llama4",
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=f.int("intermediate_size_mlp", 16384),
        rms_norm_eps=f.float("rms_norm_eps", 1e-5),
        rope=read_rope(f),
        use_rope=use_rope,
        chunked_attention=chunked,
        attention_chunk_size=chunk,
        use_qk_norm=f.bool("use_qk_norm", True),
        attn_temperature_tuning=f.bool("attn_temperature_tuning", True, allow_int=True),
        floor_scale=f.float("floor_scale", 8192.0),
        attn_scale=f.float("attn_scale", 0.1),
        attention_bias=f.bool("attention_bias", False),
        mlp_bias=False,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        moe_layer_ids=tuple(moe_layers),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=expert_width,
        num_shared_experts=1,
        shared_intermediate_size=expert_width,
        bos_token_id=optional_id(f, "bos_token_id", 1),
        eos_token_ids=token_ids(f.raw.get("eos_token_id", 2), f.source, "eos_token_id"),
        pad_token_id=optional_id(f, "pad_token_id", None),
        dtype=read_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
        routing=ROUTING,
        attention_softmax_fp32=False,  # transformers' Llama 4 eager attention: softmax in the model dtype
    )


# init_model's small checkpoint (moeserve/models/init.py): hidden 64, 4 layers, MoE layers 1 and 3,
# layer 3 NoPE, chunked attention of 8, temperature tuning from position 3, llama3 RoPE scaling.
TINY: dict[str, Any] = {
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 32,
    "intermediate_size_mlp": 96,
    "num_local_experts": 8,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8,
    "use_qk_norm": True,
    "attn_temperature_tuning": True,
    "floor_scale": 4,
    "attn_scale": 0.1,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
