"""The model shapes the serving benchmark serves (config.json of each, bf16 on the GPU), the
model folder written from one, and the bytes its tensors take (for the roofline)."""

from __future__ import annotations

import json
import os

SCOUT8 = {  # Llama-4-Scout-17B-16E's text_config (docs/models.md), 8 decoder layers
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "vocab_size": 202048,
    "hidden_size": 5120,
    "num_hidden_layers": 8,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "no_rope_layers": [1, 1, 1, 0] * 2,
    "attention_chunk_size": 8192,
    "use_qk_norm": True,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 10485760,
    "initializer_range": 0.02,
    "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008],
    "pad_token_id": 200018,
    "torch_dtype": "bfloat16",
}
ERNIE28 = {  # baidu/ERNIE-4.5-21B-A3B-PT config.json, as published
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "rms_norm_eps": 1e-05,
    "use_cache": False,
    "vocab_size": 103424,
    "rope_theta": 500000,
    "use_rmsnorm": True,
    "tie_word_embeddings": True,
    "use_bias": False,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 27,
    "moe_intermediate_size": 1536,
    "moe_capacity": [64, 64, 64],
    "moe_gate": "topk",
    "moe_k": 6,
    "moe_layer_interval": 1,
    "moe_use_aux_free": True,
    "weight_share_add_bias": True,
    "num_nextn_predict_layers": 1,
    "multi_token_pred_lambda": 0.3,
    "torch_dtype": "bfloat16",
}
TINY = {  # the smoke shape: moeserve init-model's small Llama 4
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
    "no_rope_layers": [1, 1, 1, 0],
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
# Llama 4 Scout's whole text model: 48 decoder layers (109 B parameters; ~218 GB in bf16, so on
# one H200 only with FP8 experts and MLPs: --configs moeserve-1rank-fp8).
SCOUT48 = {**SCOUT8, "num_hidden_layers": 48, "no_rope_layers": [1, 1, 1, 0] * 12}
# Llama 4 Maverick's text model (128 experts of width 8192, MoE every other layer, no qk-norm)
# cut to 12 of its 48 decoder layers: 6 MoE layers of ~16 GB each in FP8, what one H200 holds.
MAVERICK12 = {
    **SCOUT8,
    "num_hidden_layers": 12,
    "num_local_experts": 128,
    "interleave_moe_layer_step": 2,
    "no_rope_layers": [1, 1, 1, 0] * 3,
    "use_qk_norm": False,
}
QWEN3_30B = {  # Qwen/Qwen3-30B-A3B config.json, as published (transformers 4.51)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
GPTOSS_20B = {  # openai/gpt-oss-20b config.json, as published (its MXFP4 quantization_config left out:
    # the dummy weights are bf16 experts, what moeserve serves of GPT-OSS)
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json, as published (its weights block-wise FP8)
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# 1 x H200: the 3 dense layers and 4 MoE layers in bf16 (each MoE layer's experts ~22.5 GB), or
# 3 + 10 in the published block-wise FP8
DSV3_7 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"} | {"num_hidden_layers": 7}
DSV3_13_FP8 = {**DEEPSEEK_V3, "num_hidden_layers": 13}
SHAPES = {
    "scout8": dict(config=SCOUT8, redundant=2),
    "qwen3_30b": dict(config=QWEN3_30B, redundant=16),
    "gptoss20b": dict(config=GPTOSS_20B, redundant=4, dummy_routing="spread"),
    "dsv3_7": dict(config=DSV3_7, redundant=0, dummy_routing="spread"),
    "dsv3_13_fp8": dict(config=DSV3_13_FP8, redundant=0, dummy_routing="spread"),
    "scout48": dict(config=SCOUT48, redundant=2),
    "maverick12": dict(config=MAVERICK12, redundant=2),
    "ernie28": dict(config=ERNIE28, redundant=2, dummy_routing="spread"),
    "tiny": dict(config=TINY, redundant=2),
}


def write_model(folder: str, config: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    eos = config["eos_token_id"]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(
            {
                "bos_token_id": config.get("bos_token_id"),
                "eos_token_id": eos,
                "pad_token_id": config.get("pad_token_id"),
            },
            f,
            indent=2,
        )
    return folder


def write_tokenizer(folder: str, vocab_size: int) -> str:
    """A word-level ``tokenizer.json`` for the model folder: id i is the word ``t<i>``, no special
    tokens, so every generated id adds text (``t5 t7``) and a streamed HTTP completion sends one
    chunk per token. Written with the ``tokenizers`` library (a moeserve dependency)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def model_sizes(model_dir: str, dtype_bytes: int, quantization: str | None = None) -> dict:
    """Bytes of the router side (everything but the routed experts) and of one routed expert,
    from config.json alone (the tensors a checkpoint of it holds; ERNIE's gate and correction
    bias in float32, as the model keeps them). ``quantization="fp8"``: as the dummy FP8 weights
    are held (FP8 codes and float32 scales for the experts and MLPs)."""
    from moeserve.models.config import load_config

    cfg = load_config(model_dir)
    if quantization:
        return _quantized_sizes(model_dir, dtype_bytes, quantization, _plain_sizes(cfg, dtype_bytes))
    return _plain_sizes(cfg, dtype_bytes)


def _quantized_sizes(model_dir: str, dtype_bytes: int, quantization: str, plain: dict) -> dict:
    """``model_sizes`` of a model served with ``--quantization``: every tensor's bytes as the
    dummy reader makes it (1 byte per FP8 code, 4 per scale), the experts' from ExpertSpec."""
    import torch

    from moeserve.models.checkpoint import expert_spec
    from moeserve.models.dummy import DummyReader

    r = DummyReader(model_dir, quantization=quantization)
    cfg = r.config
    experts = {n for n in r.names() if ".experts." in n}
    router = 0
    for name in r.names():
        if name in experts:
            continue
        dt = r.stored_dtype(name)
        size = 1 if dt == torch.float8_e4m3fn else 4 if dt == torch.float32 else dtype_bytes
        n = 1
        for d in r.shape(name):
            n *= d
        router += n * size
    expert = expert_spec(cfg, torch.bfloat16 if dtype_bytes == 2 else torch.float32).nbytes
    return dict(
        plain,
        router_bytes=router,
        lookup_bytes=_lookup_bytes(cfg, r.names(), r.shape, r.stored_dtype, dtype_bytes),
        expert_bytes=expert,
        all_experts_bytes=expert * cfg.num_experts * cfg.num_moe_layers,
        quantization=quantization,
    )


def _plain_sizes(cfg, dtype_bytes: int) -> dict:
    """Bytes from the tensors a checkpoint of ``cfg`` holds (``families.checkpoint_shapes``),
    an fp32 gate and the correction bias at 4 bytes, the routed experts counted apart (their
    ``ExpertSpec``: biases included)."""
    import torch

    from moeserve.models.checkpoint import expert_spec
    from moeserve.models.families import checkpoint_shapes

    router = 0
    # per token, for the FLOP-aware roofline: the dense products' weights (attention projections,
    # dense MLPs, shared experts, gates, LM head: every matrix beside the experts'), one
    # expert's, and attention's per key and layer (the embedding is a lookup: with tied
    # embeddings its one table is the LM head's product)
    dense_params = 0
    for name, shape in checkpoint_shapes(cfg).items():
        if ".experts." in name:
            continue
        n = 1
        for d in shape:
            n *= d
        if len(shape) == 2 and min(shape) > 1 and (name != "model.embed_tokens.weight" or cfg.tie_word_embeddings):
            dense_params += n
        fp32 = name.endswith("e_score_correction_bias") or (
            cfg.routing.gate_fp32 and ".experts" not in name and name.endswith((".gate.weight", ".router.weight"))
        )
        router += n * (4 if fp32 else dtype_bytes)
    expert = expert_spec(cfg, torch.bfloat16 if dtype_bytes == 2 else torch.float32).nbytes
    shapes = checkpoint_shapes(cfg)
    lookup = _lookup_bytes(cfg, shapes, shapes.__getitem__, lambda name: None, dtype_bytes)
    # MLA caches one latent per token and layer (moeserve.models.mla); other families K and V
    kv_layer_token = (1 if cfg.mla is not None else 2) * cfg.cache_heads * cfg.cache_dim * dtype_bytes
    return dict(
        family=cfg.family,
        num_layers=cfg.num_layers,
        num_moe_layers=cfg.num_moe_layers,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        router_bytes=router,
        lookup_bytes=lookup,
        expert_bytes=expert,
        all_experts_bytes=expert * cfg.num_experts * cfg.num_moe_layers,
        kv_bytes_per_token=kv_layer_token * cfg.num_layers,
        chunked=[bool(c) for c in cfg.chunked_attention],
        chunk=cfg.attention_chunk_size,
        windows=[cfg.window(i) for i in range(cfg.num_layers)],
        kv_layer_token=kv_layer_token,
        eos=list(cfg.eos_token_ids),
        dense_params=dense_params,
        expert_params=3 * cfg.hidden_size * cfg.moe_intermediate_size,
        attn_flops_per_key=4 * cfg.num_heads * cfg.head_dim,  # QK and PV: 2 FLOPs each per query head dim and key
    )


EMBEDDING = "model.embed_tokens.weight"


def _lookup_bytes(cfg, names, shape_of, dtype_of, dtype_bytes: int) -> int:
    """Bytes of the router side that a decode step does not read whole: an untied embedding
    table, of which a step gathers one row per token (a tied one is the LM head's product,
    read whole every step). Held in memory (``router_bytes`` counts it), left out of the
    roofline's bytes read."""
    import torch

    if cfg.tie_word_embeddings or EMBEDDING not in names:
        return 0
    n = 1
    for d in shape_of(EMBEDDING):
        n *= d
    dt = dtype_of(EMBEDDING)
    return n * (1 if dt == torch.float8_e4m3fn else 4 if dt == torch.float32 else dtype_bytes)


def expert_bytes_per_gpu(sizes: dict, redundant: int, ranks: int) -> int:
    """Bytes of the routed experts one rank holds: its (E + R) / ranks slots of every MoE layer."""
    return (sizes["num_experts"] + redundant) // max(1, ranks) * sizes["num_moe_layers"] * sizes["expert_bytes"]


def weights_per_gpu(sizes: dict, redundant: int, ranks: int) -> int:
    """Bytes of every weight one rank holds: the router side and its expert slots."""
    return sizes["router_bytes"] + expert_bytes_per_gpu(sizes, redundant, ranks)


def weights_read_per_gpu(sizes: dict, redundant: int, ranks: int) -> int:
    """Bytes of weights one rank reads in a decode step: every weight it holds but an untied
    embedding table, of which the step gathers a row per token (``lookup_bytes``)."""
    return weights_per_gpu(sizes, redundant, ranks) - sizes.get("lookup_bytes", 0)
