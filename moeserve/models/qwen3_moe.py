"""Qwen3-MoE: what its config.json means, and where its weights sit in a checkpoint.

Dimension letters: T tokens, H hidden size, E logical experts, K = num_experts_per_tok, D head dim.

Attention: grouped-query, no bias (``attention_bias``), q and k each RMS-normalised over the
head dim with weights ``q_norm`` / ``k_norm`` [D] *before* RoPE, which rotates the two halves
of a head (rotate_half); the eager softmax runs in fp32. ``use_sliding_window`` puts every
layer on ``sliding_window`` (off in every published model).

MoE layer (docs/models.md, "Qwen3-MoE"), as data: p = softmax(x @ W_g.T) in fp32; the top-k of
p; with ``norm_topk_prob`` renormalised; cast to the model dtype; the weight scales the
expert's *output*. No shared expert. Layer i is MoE iff i is not in ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0; the others are a dense SwiGLU of ``intermediate_size``.

Checkpoint names: ``model.layers.{i}.mlp.gate.weight [E, H]``,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
``model.layers.{i}.self_attn.{q,k}_norm.weight [D]``, dense layers
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``. The published configs spell the expert
count ``num_experts``; transformers 5 writes ``num_local_experts``: both are read.
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

NAMES = Names(ffn="mlp", router="gate")


def check_silu(f: Fields) -> None:
    """The families here compute SwiGLU MLPs: any other ``hidden_act`` is refused by name."""
    act = f.raw.get("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"is {act!r}; these MLPs are SwiGLU: allowed: silu")


def parse(f: Fields, model_type: str) -> ModelConfig:
    check_silu(f)
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = read_heads(f)
    num_experts = f.alias_int(("num_experts", "num_local_experts"))
    top_k = f.int("num_experts_per_tok", 8)
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"({top_k}) exceeds num_experts ({num_experts})")
    dense = f.int_list("mlp_only_layers") or []
    if any(not 0 <= i < layers for i in dense):
        raise f.error("mlp_only_layers", f"must hold layer indices in 0..{layers - 1}, found {dense}")
    step = f.int("decoder_sparse_step", 1)
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    window = f.int("sliding_window") if f.bool("use_sliding_window", False) else None
    return ModelConfig(
        family="qwen3_moe",
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=f.int("intermediate_size", 6144),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope=read_rope(f, ("default", "yarn"), default_theta=10000.0, interleaved=False),
        attention_bias=f.bool("attention_bias", False),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        moe_layer_ids=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=f.int("moe_intermediate_size", 768),
        num_shared_experts=0,
        shared_intermediate_size=0,
        bos_token_id=optional_id(f, "bos_token_id", None),
        eos_token_ids=token_ids(f.raw.get("eos_token_id"), f.source, "eos_token_id"),
        pad_token_id=optional_id(f, "pad_token_id", None),
        dtype=read_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        routing=RoutingSpec(scoring="softmax", renormalize=f.bool("norm_topk_prob", False)),
        qk_rms_norm=True,
        sliding_window=window,
        sliding_layers=(window is not None,) * layers,
        attention_softmax_fp32=True,
    )


# init_model's small checkpoint (moeserve/models/init.py): hidden 64, 4 layers with layer 0 dense,
# 16 experts top-4 with norm_topk_prob, qk-norm; init std 0.2 (informative greedy output).
TINY: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}
