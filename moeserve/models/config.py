"""Model configuration: parse a Hugging Face ``config.json`` into one frozen :class:`ModelConfig`.

Accepted ``model_type`` values (see ``MODEL_TYPES``):

- ``llama4_text``: a text-only Llama 4 checkpoint (``Llama4ForCausalLM``);
- ``llama4``: the published multimodal Llama 4 checkpoints; the text model's settings sit in
  ``text_config`` and its weights under ``language_model.`` (vision weights are ignored);
- ``ernie4_5_moe``: ERNIE-4.5-MoE (``mtp*`` weights are ignored).

Both spellings of the fields that transformers 5 renamed are read: ``rope_theta`` /
``rope_scaling`` / ``torch_dtype`` (published checkpoints) and ``rope_parameters`` / ``dtype``
(what transformers 5 writes); ``attn_temperature_tuning`` may be a bool or an int (Scout's
``config.json`` says ``4``). ``quantization_config`` becomes ``ModelConfig.quantization`` (FP8 formats only; anything else is refused by name: ``moeserve.models.quant``). Which decoder layers are MoE layers, use RoPE, or use chunked local
attention follows docs/models.md to the letter (the same rules as transformers).

The *MoE layer index* is the ordinal of a MoE layer among the model's MoE layers
(``0 .. num_moe_layers-1``); ``moe_layer_ids[m]`` is the decoder-layer index of MoE layer ``m``.
Everything that talks to expert workers (dispatch, placement, load) uses the MoE layer index.
"""

from __future__ import annotations

import builtins
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeserve.models.errors import CheckpointError
from moeserve.models.quant import QuantScheme, parse_quantization, resolve

MODEL_TYPES = {"llama4_text": "llama4", "llama4": "llama4", "ernie4_5_moe": "ernie45"}
FAMILIES = ("llama4", "ernie45")
ROPE_TYPES = ("default", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (both families rotate adjacent pairs, x[2j] and x[2j+1]).

    type "llama3" scales the inverse frequencies by ``factor`` below the low-frequency
    wavelength ``original_max_position_embeddings / low_freq_factor`` and interpolates between
    the two wavelength bounds (see ``layers.rope_inv_freq``); "default" leaves them as they are.
    """

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs, family-neutral, with family specifics as plain fields.

    Per-decoder-layer tuples have ``num_layers`` entries. For Llama 4, ``intermediate_size`` is
    ``intermediate_size_mlp`` (the dense layers) and ``moe_intermediate_size`` is its
    ``intermediate_size`` (each routed expert and the one shared expert). For ERNIE the shared
    experts form one SwiGLU MLP of width ``moe_intermediate_size * num_shared_experts``.
    """

    family: str  # "llama4" | "ernie45"
    model_type: str  # config.json's model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense SwiGLU layers
    rms_norm_eps: float
    rope: RopeConfig
    use_rope: tuple[bool, ...]  # [num_layers]; False = NoPE layer (no RoPE, no qk-norm)
    chunked_attention: tuple[bool, ...]  # [num_layers]; True = causal within chunks of attention_chunk_size
    attention_chunk_size: int | None
    use_qk_norm: bool  # weightless L2 norm of q and k after RoPE (RoPE layers only)
    attn_temperature_tuning: bool  # scale q on NoPE layers by 1 + attn_scale*log1p(floor((pos+1)/floor_scale))
    floor_scale: float
    attn_scale: float
    attention_bias: bool  # q/k/v/o projections have biases
    mlp_bias: bool  # dense and shared-expert MLPs (and ERNIE's lm_head) have biases
    tie_word_embeddings: bool
    moe_layer_ids: tuple[int, ...]  # decoder-layer index of each MoE layer, ascending
    num_experts: int  # logical routed experts per MoE layer
    top_k: int
    moe_intermediate_size: int  # one routed expert's intermediate size I
    num_shared_experts: int
    shared_intermediate_size: int  # width of the shared-expert MLP (0 when none)
    moe_norm_min: float  # ERNIE: floor of the top-k weight sum before renormalising
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: torch.dtype  # dtype the checkpoint declares (dtype / torch_dtype)
    max_position_embeddings: int
    quantization: QuantScheme | None = None  # quantization_config, or --quantization fp8 (moeserve.models.quant)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def moe_index(self, layer: int) -> int | None:
        """MoE layer index of decoder layer ``layer``, or None when that layer is dense."""
        try:
            return self.moe_layer_ids.index(layer)
        except ValueError:
            return None


def load_config(path: str | Path) -> ModelConfig:
    """Parse ``config.json`` of a checkpoint folder (or the file itself) into a ModelConfig.

    When the folder also has ``generation_config.json`` with ``eos_token_id``, those EOS ids
    win, as in transformers' ``generate``.
    """
    path = Path(path)
    file = path if path.suffix == ".json" else path / "config.json"
    if not file.is_file():
        what = "folder does not exist" if not file.parent.exists() else "no config.json in the folder"
        raise CheckpointError(f"{file}: {what}; a checkpoint folder needs config.json and model.safetensors")
    raw = _read_json(file)
    eos_override = None
    gen = file.parent / "generation_config.json"
    if gen.is_file():
        g = _read_json(gen)
        if g.get("eos_token_id") is not None:
            eos_override = _token_ids(g["eos_token_id"], str(gen), "eos_token_id")
    return parse_config(raw, source=str(file), eos_override=eos_override)


def parse_config(
    raw: dict[str, Any], source: str = "config.json", eos_override: tuple[int, ...] | None = None
) -> ModelConfig:
    """Parse a config dict (as read from ``source``, named in errors) into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: unknown model_type {model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
    if model_type == "llama4":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(
                f"{source}: model_type 'llama4' needs a 'text_config' object (the text model's settings)"
            )
        f = _Fields({**{k: raw[k] for k in ("dtype", "torch_dtype") if k in raw}, **text}, source, "text_config.")
        cfg = _parse_llama4(f, model_type)
    elif model_type == "llama4_text":
        cfg = _parse_llama4(_Fields(raw, source), model_type)
    else:
        cfg = _parse_ernie45(_Fields(raw, source), model_type)
    if eos_override is not None:
        cfg = replace(cfg, eos_token_ids=eos_override)
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is not None:
        cfg = replace(cfg, quantization=parse_quantization(qc, source))
    return cfg


def with_quantization(cfg: ModelConfig, requested: str | None) -> ModelConfig:
    """``cfg`` served with ``--quantization`` (vLLM's name): None keeps the checkpoint's own;
    "fp8" also quantizes a bf16 checkpoint at load. Anything else is a CheckpointError."""
    return replace(cfg, quantization=resolve(cfg.quantization, requested))


# ---------------------------------------------------------------------------------------------
# Field access with errors that name the file and the field.


class _Fields:
    def __init__(self, raw: dict[str, Any], source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    def error(self, name: str, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: field '{self.prefix}{name}' {msg}")

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def int(self, name: str, default: Any = ..., minimum: int | None = 1) -> int:
        v = self.raw.get(name)
        if v is None:
            if default is ...:
                raise self.error(name, "is missing (an integer is required)")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(name, f"must be an integer, found {v!r}")
        if minimum is not None and v < minimum:
            raise self.error(name, f"must be >= {minimum}, found {v}")
        return v

    def float(self, name: str, default: float) -> float:
        v = self.raw.get(name, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(name, f"must be a finite number, found {v!r}")
        return float(v)

    def bool(self, name: str, default: bool, allow_int: bool = False) -> bool:
        v = self.raw.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool):
            return v
        if allow_int and isinstance(v, int):
            return v != 0
        raise self.error(name, f"must be {'a bool or an int' if allow_int else 'a bool'}, found {v!r}")

    # builtins.int below: in the class body "int" is the method above
    def int_list(self, name: str) -> list[builtins.int] | None:
        v = self.raw.get(name)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.error(name, f"must be a list of integers, found {v!r}")
        return v

    def alias_int(self, names: tuple[str, ...], default: Any = ...) -> builtins.int:
        """An int that may be spelled several ways; the spellings present must agree."""
        found = {n: self.int(n) for n in names if self.has(n)}
        if len(set(found.values())) > 1:
            raise self.error(names[0], f"disagrees with its aliases: {found}")
        if found:
            return next(iter(found.values()))
        if default is ...:
            raise self.error(names[0], f"is missing (also accepted as {', '.join(names[1:])})")
        return default


def _read_json(file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not readable as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object at the top level")
    return raw


def _token_ids(v: Any, source: str, name: str) -> tuple[int, ...]:
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise CheckpointError(f"{source}: field '{name}' must be a token id or a list of token ids, found {v!r}")
    return tuple(vals)


def _optional_id(f: _Fields, name: str, default: int | None) -> int | None:
    if name not in f.raw:
        return default
    if f.raw[name] is None:
        return None
    return f.int(name, minimum=0)


def _dtype(f: _Fields) -> torch.dtype:
    name = f.raw.get("dtype") or f.raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise f.error("dtype", f"is {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def _rope(f: _Fields) -> RopeConfig:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = f.raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = f.raw.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        raise f.error(field, f"must be an object, found {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise f.error(field, "holds per-layer-type RoPE settings, which these families do not use")
    theta = params.get("rope_theta", f.raw.get("rope_theta", 500000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise f.error("rope_theta", f"must be a positive number, found {theta!r}")
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise f.error(field, f"has rope_type {rtype!r}; allowed: {', '.join(ROPE_TYPES)}")
    if rtype == "default":
        return RopeConfig(theta=float(theta))
    sub = _Fields(params, f.source, f"{f.prefix}{field}.")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if name not in params:
            raise sub.error(name, "is missing (llama3 RoPE scaling needs factor, low_freq_factor, high_freq_factor)")
    rope = RopeConfig(
        theta=float(theta),
        type="llama3",
        factor=sub.float("factor", 1.0),
        low_freq_factor=sub.float("low_freq_factor", 1.0),
        high_freq_factor=sub.float("high_freq_factor", 4.0),
        original_max_position_embeddings=sub.int(
            "original_max_position_embeddings", f.int("max_position_embeddings", 131072)
        ),
    )
    if rope.high_freq_factor == rope.low_freq_factor:
        raise sub.error("high_freq_factor", "must differ from low_freq_factor")
    return rope


def _heads(f: _Fields) -> tuple[int, int, int]:
    heads = f.int("num_attention_heads")
    kv = f.int("num_key_value_heads", heads)
    if heads % kv:
        raise f.error("num_key_value_heads", f"({kv}) must divide num_attention_heads ({heads})")
    head_dim = f.int("head_dim", 0, minimum=0) or 0
    if not head_dim:
        hidden = f.int("hidden_size")
        if hidden % heads:
            raise f.error(
                "hidden_size", f"({hidden}) is not a multiple of num_attention_heads ({heads}) and head_dim is absent"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise f.error("head_dim", f"must be even (RoPE rotates pairs), found {head_dim}")
    return heads, kv, head_dim


def _parse_llama4(f: _Fields, model_type: str) -> ModelConfig:
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = _heads(f)
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
        rope=_rope(f),
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
        moe_norm_min=0.0,
        bos_token_id=_optional_id(f, "bos_token_id", 1),
        eos_token_ids=_token_ids(f.raw.get("eos_token_id", 2), f.source, "eos_token_id"),
        pad_token_id=_optional_id(f, "pad_token_id", None),
        dtype=_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
    )


def _parse_ernie45(f: _Fields, model_type: str) -> ModelConfig:
    layers = f.int("num_hidden_layers")
    heads, kv, head_dim = _heads(f)
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
        rope=_rope(f),
        use_rope=(True,) * layers,
        chunked_attention=(False,) * layers,
        attention_chunk_size=None,
        use_qk_norm=False,
        attn_temperature_tuning=False,
        floor_scale=1.0,
        attn_scale=0.0,
        attention_bias=use_bias,
        mlp_bias=use_bias,
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        moe_layer_ids=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=width,
        num_shared_experts=shared,
        shared_intermediate_size=width * shared,
        moe_norm_min=f.float("moe_norm_min", 1e-12),
        bos_token_id=_optional_id(f, "bos_token_id", 1),
        eos_token_ids=_token_ids(f.raw.get("eos_token_id", 2), f.source, "eos_token_id"),
        pad_token_id=_optional_id(f, "pad_token_id", 0),
        dtype=_dtype(f),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
    )
