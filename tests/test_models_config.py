"""config.json parsing: both spellings, the layer rules of docs/models.md, errors that name the field."""

import json

import pytest
import torch

from moeserve.models import CheckpointError, RopeConfig, load_config
from moeserve.models.config import parse_config

SCOUT_TEXT = {  # the published Llama-4-Scout-17B-16E text_config, as far as parsing is concerned
    "model_type": "llama4_text",
    "vocab_size": 202048,
    "hidden_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "no_rope_layers": [],
    "attention_chunk_size": 8192,
    "use_qk_norm": True,
    "attn_temperature_tuning": 4,
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
    "torch_dtype": "bfloat16",
    "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008],
    "pad_token_id": 200018,
    "max_position_embeddings": 10485760,
}
ERNIE_21B = {  # the published ERNIE-4.5-21B-A3B config.json, extra keys included
    "model_type": "ernie4_5_moe",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "vocab_size": 103424,
    "rope_theta": 500000,
    "moe_num_experts": 64,
    "moe_k": 6,
    "moe_num_shared_experts": 2,
    "moe_intermediate_size": 1536,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 27,
    "moe_layer_interval": 1,
    "moe_capacity": [64, 64, 64],
    "moe_gate": "topk",
    "moe_use_aux_free": True,
    "use_rmsnorm": True,
    "weight_share_add_bias": True,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": True,
    "use_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "max_position_embeddings": 131072,
}


def test_published_scout_config_follows_the_llama4_layer_rules():
    cfg = parse_config({"model_type": "llama4", "text_config": SCOUT_TEXT})
    assert cfg.family == "llama4" and cfg.model_type == "llama4"
    assert cfg.moe_layer_ids == tuple(range(48)) and cfg.num_shared_experts == 1
    assert cfg.use_rope == (True, True, True, False) * 12
    assert cfg.chunked_attention == cfg.use_rope, "RoPE layers are chunked, NoPE layers are full"
    assert cfg.attn_temperature_tuning is True, "the int 4 means on"
    assert cfg.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.dtype == torch.bfloat16
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (200000, (200001, 200007, 200008), 200018)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size) == (16384, 8192)


def test_published_and_transformers5_spellings_parse_to_the_same_config():
    t5 = dict(
        SCOUT_TEXT,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        dtype="bfloat16",
        attn_temperature_tuning=True,
    )
    for k in ("rope_theta", "rope_scaling", "torch_dtype"):
        del t5[k]
    assert parse_config(t5) == parse_config(SCOUT_TEXT)


def test_interleave_step_2_makes_the_odd_layers_moe_and_explicit_moe_layers_win():
    cfg = parse_config(dict(SCOUT_TEXT, interleave_moe_layer_step=2))
    assert cfg.moe_layer_ids == tuple(range(1, 48, 2))
    assert cfg.moe_index(1) == 0 and cfg.moe_index(3) == 1 and cfg.moe_index(2) is None
    cfg = parse_config(dict(SCOUT_TEXT, interleave_moe_layer_step=2, moe_layers=[0, 5]))
    assert cfg.moe_layer_ids == (0, 5)


def test_explicit_layer_types_and_a_null_chunk_size():
    cfg = parse_config(dict(SCOUT_TEXT, num_hidden_layers=4, attention_chunk_size=None))
    assert cfg.chunked_attention == (False,) * 4
    cfg = parse_config(dict(SCOUT_TEXT, num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"]))
    assert cfg.chunked_attention == (False, True)
    with pytest.raises(CheckpointError, match="field 'layer_types' must list one of"):
        parse_config(dict(SCOUT_TEXT, num_hidden_layers=2, layer_types=["sliding_attention"] * 2))


def test_published_ernie_21b_config():
    cfg = parse_config(ERNIE_21B)
    assert cfg.family == "ernie45"
    assert cfg.moe_layer_ids == tuple(range(1, 28)), "layer 0 dense, layers 1-27 MoE"
    assert (cfg.num_experts, cfg.top_k, cfg.num_shared_experts, cfg.shared_intermediate_size) == (64, 6, 2, 3072)
    assert cfg.head_dim == 128 and cfg.tie_word_embeddings and cfg.rope == RopeConfig(500000.0)
    assert cfg.moe_norm_min == 1e-12 and cfg.pad_token_id == 0


def test_ernie_end_index_minus_1_interval_and_aliases():
    raw = dict(ERNIE_21B, num_hidden_layers=8, moe_layer_start_index=2, moe_layer_end_index=-1, moe_layer_interval=2)
    assert parse_config(raw).moe_layer_ids == (3, 5, 7)
    aliased = {k: v for k, v in raw.items() if k not in ("moe_num_experts", "moe_k")}
    aliased.update(num_experts=64, num_experts_per_tok=6)
    assert parse_config(aliased) == parse_config(raw)
    with pytest.raises(CheckpointError, match="field 'moe_num_experts' disagrees with its aliases"):
        parse_config(dict(raw, num_experts=32))


def test_generation_config_eos_ids_win(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ERNIE_21B))
    assert load_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(tmp_path).eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": None}, "field 'hidden_size' is missing"),
        ({"num_hidden_layers": "4"}, "field 'num_hidden_layers' must be an integer, found '4'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'; allowed: default, llama3"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "field 'rope_scaling.low_freq_factor' is missing"),
        ({"num_key_value_heads": 7}, "field 'num_key_value_heads' \\(7\\) must divide num_attention_heads \\(40\\)"),
        ({"moe_layers": [3, 1]}, "field 'moe_layers' must be ascending distinct layer indices"),
        ({"torch_dtype": "float8"}, "field 'dtype' is 'float8'; allowed: float32, bfloat16, float16"),
    ],
)
def test_bad_fields_are_named_with_what_is_allowed(tmp_path, change, message):
    raw = {k: v for k, v in SCOUT_TEXT.items()}
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/config.json: .*{message}"):
        load_config(tmp_path)


def test_multimodal_config_errors_name_the_text_config_field():
    with pytest.raises(CheckpointError, match="field 'text_config.vocab_size' is missing"):
        parse_config(
            {"model_type": "llama4", "text_config": {k: v for k, v in SCOUT_TEXT.items() if k != "vocab_size"}}
        )
    with pytest.raises(CheckpointError, match="needs a 'text_config' object"):
        parse_config({"model_type": "llama4"})


def test_families_without_llama4_attention_get_rope_everywhere_and_no_chunks_and_a_wrong_length_is_refused():
    import dataclasses

    from moeserve.models.mixtral import TINY

    cfg = parse_config(dict(TINY))
    assert cfg.use_rope == (True,) * cfg.num_layers and cfg.chunked_attention == (False,) * cfg.num_layers
    assert (cfg.use_qk_norm, cfg.attn_temperature_tuning, cfg.attention_chunk_size, cfg.mlp_bias) == (
        False,
        False,
        None,
        False,
    )
    with pytest.raises(ValueError, match=r"use_rope has 3 entries; allowed: one per layer \(4\) or none"):
        dataclasses.replace(cfg, use_rope=(True, True, False))
