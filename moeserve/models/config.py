"""Model configuration: parse a Hugging Face ``config.json`` into one frozen :class:`ModelConfig`.

Accepted ``model_type`` values (``MODEL_TYPES``, each mapped to its family's module, which
parses it):

- ``llama4_text``: a text-only Llama 4 checkpoint (``Llama4ForCausalLM``);
- ``llama4``: the published multimodal Llama 4 checkpoints; the text model's settings sit in
  ``text_config`` and its weights under ``language_model.`` (vision weights are ignored);
- ``ernie4_5_moe``: ERNIE-4.5-MoE (``mtp*`` weights are ignored);
- ``qwen3_moe``: Qwen3-MoE; ``mixtral``: Mixtral; ``gpt_oss``: GPT-OSS (bf16 experts; its
  published MXFP4 checkpoints are refused by name);
- ``deepseek_v3`` and ``kimi_k2`` (Kimi K2's spelling of the same architecture): DeepSeek-V3,
  multi-head latent attention (``ModelConfig.mla``) and grouped sigmoid routing.

Both spellings of the fields that transformers 5 renamed are read: ``rope_theta`` /
``rope_scaling`` / ``torch_dtype`` (published checkpoints) and ``rope_parameters`` / ``dtype``
(what transformers 5 writes); ``attn_temperature_tuning`` may be a bool or an int (Scout's
``config.json`` says ``4``). ``quantization_config`` becomes ``ModelConfig.quantization`` (FP8
formats only; anything else is refused by name: ``moeserve.models.quant``). Which decoder
layers are MoE layers and which attention each uses follows docs/models.md to the letter (the
same rules as transformers).

A family is a config mapping: everything downstream (the decoder, the MoE layer, the expert
workers, the balancer) reads ModelConfig, whose MoE layer is data: :class:`RoutingSpec` (the
routing function), the shared experts (count, width, sigmoid gate) and the expert MLP
(activation, biases). The *MoE layer index* is the ordinal of a MoE layer among the model's MoE
layers (``0 .. num_moe_layers-1``); ``moe_layer_ids[m]`` is the decoder-layer index of MoE
layer ``m``. Everything that talks to expert workers (dispatch, placement, load) uses it.
"""

from __future__ import annotations

import builtins
import importlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeserve.models.errors import CheckpointError
from moeserve.models.quant import QuantScheme, parse_quantization, resolve

MODEL_TYPES = {
    "llama4_text": "llama4",
    "llama4": "llama4",
    "ernie4_5_moe": "ernie45",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCORINGS = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings.

    type "llama3" scales the inverse frequencies by ``factor`` below the low-frequency
    wavelength ``original_max_position_embeddings / low_freq_factor`` and interpolates between
    the two wavelength bounds; "yarn" blends interpolated and extrapolated frequencies over the
    dimensions between the ``beta_fast`` and ``beta_slow`` rotation counts and scales cos and
    sin by ``attention_factor`` (``layers.rope_inv_freq``); "default" leaves them as they are.
    ``interleaved``: rotate adjacent pairs (x[2j], x[2j+1]) (Llama 4, ERNIE), else the two
    halves (x[j], x[j + D/2]) (Qwen3, Mixtral, GPT-OSS: transformers' rotate_half).
    """

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    interleaved: bool = True


@dataclass(frozen=True)
class RoutingSpec:
    """A MoE layer's routing function, as data (``moeserve.models.routing.route``).

    l = x @ W_g.T (+ b_g with ``gate_bias``), in fp32 with ``gate_fp32`` (the gate's weight
    held in fp32), else in the model dtype. Then either

    - ``topk_first``: the top-k of l, scored over the k chosen: softmax over the k (GPT-OSS) or
      a sigmoid of each (Llama 4); or
    - s = softmax(l) or sigmoid(l) over every expert (fp32); the top-k of s + the correction
      bias (``correction_bias``: ERNIE's e_score_correction_bias, which selects and never
      weighs), within the ``topk_group`` best of ``n_group`` groups when ``n_group`` > 1
      (a group's score: the sum of its two best, DeepSeek-V3's); weights s of the chosen.

    ``renormalize`` divides the k weights by their sum, floored at ``renorm_min`` (ERNIE's
    moe_norm_min); ``scaling_factor`` multiplies them (routed_scaling_factor); they are cast to
    the model dtype and scale the expert's input (``weights_on_input``, Llama 4) or its output.
    """

    scoring: str = "softmax"
    topk_first: bool = False
    gate_fp32: bool = False
    gate_bias: bool = False
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    renorm_min: float = 0.0
    scaling_factor: float = 1.0
    weights_on_input: bool = False

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring {self.scoring!r}; allowed: {', '.join(SCORINGS)}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"routing groups: need 1 <= topk_group <= n_group, found {self.topk_group}, {self.n_group}"
            )
        if self.topk_first and (self.correction_bias or self.n_group > 1):
            raise ValueError("routing: a correction bias or expert groups need the top-k taken on the scores")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; ``moeserve.models.mla``).

    q = q_b(norm(q_a(x))) (or q_proj(x) when ``q_lora_rank`` is None): per head a no-RoPE part
    [Dn] and a RoPE part [Dr]. The keys and values of every head come from one latent per token:
    kv_a(x) = [c | k_pe], c [R] normalised (``kv_a_layernorm``), k_pe [Dr] the RoPE key shared by
    all heads; kv_b(c) = per head [k_nope (Dn) | v (Dv)]. The cache holds [c | k_pe], R + Dr per
    token and layer. ``softmax_scale``: (Dn + Dr)^-0.5 times YaRN's mscale(factor,
    mscale_all_dim)^2 when RoPE is YaRN-scaled.
    """

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # Dr
    v_head_dim: int  # Dv
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        """R + Dr: what the cache holds per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs, family-neutral, with family specifics as plain fields.

    Per-decoder-layer tuples have ``num_layers`` entries. For Llama 4, ``intermediate_size`` is
    ``intermediate_size_mlp`` (the dense layers) and ``moe_intermediate_size`` is its
    ``intermediate_size`` (each routed expert and the one shared expert). For ERNIE the shared
    experts form one SwiGLU MLP of width ``moe_intermediate_size * num_shared_experts``.
    """

    family: str  # one of FAMILIES
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
    attention_bias: bool  # q/k/v/o projections have biases
    tie_word_embeddings: bool
    moe_layer_ids: tuple[int, ...]  # decoder-layer index of each MoE layer, ascending
    num_experts: int  # logical routed experts per MoE layer
    top_k: int
    moe_intermediate_size: int  # one routed expert's intermediate size I
    num_shared_experts: int
    shared_intermediate_size: int  # width of the shared-expert MLP (0 when none)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: torch.dtype  # dtype the checkpoint declares (dtype / torch_dtype)
    max_position_embeddings: int
    # Llama 4's attention (every other family keeps the defaults: RoPE on every layer, no chunks,
    # no q/k L2 norm, no temperature tuning). Empty per-layer tuples mean the default on every
    # layer; __post_init__ writes them out to num_layers entries.
    use_rope: tuple[bool, ...] = ()  # [num_layers]; False = NoPE layer (no RoPE, no qk-norm)
    chunked_attention: tuple[bool, ...] = ()  # [num_layers]; True = causal within chunks of attention_chunk_size
    attention_chunk_size: int | None = None
    use_qk_norm: bool = False  # Llama 4: weightless L2 norm of q and k after RoPE (RoPE layers only)
    attn_temperature_tuning: bool = False  # scale q on NoPE layers by 1 + attn_scale*log1p(floor((pos+1)/floor_scale))
    floor_scale: float = 1.0
    attn_scale: float = 0.0
    mlp_bias: bool = False  # dense and shared-expert MLPs (and ERNIE's lm_head) have biases
    quantization: QuantScheme | None = None  # quantization_config, or --quantization fp8 (moeserve.models.quant)
    routing: RoutingSpec = RoutingSpec()  # the MoE layers' routing function
    shared_expert_gate: bool = False  # the shared experts' output times sigmoid(x @ w.T), w [1, H] (Qwen2-MoE)
    expert_activation: str = "silu"  # "silu" (SwiGLU) | "clamped_swiglu" (GPT-OSS, swiglu_alpha / swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # routed experts' gate_up and down have biases (GPT-OSS)
    qk_rms_norm: bool = False  # Qwen3: RMSNorm with weights (q_norm, k_norm [D]) on q and k before RoPE
    sliding_window: int | None = None  # keys visible to a query at p: p - W < k <= p, on sliding layers
    sliding_layers: tuple[bool, ...] = ()  # [num_layers] (empty: none)
    attention_sinks: bool = False  # GPT-OSS: a learned logit per query head in every softmax (sinks [Hq])
    attention_softmax_fp32: bool = False  # the eager attention's softmax in fp32 (else the model dtype)
    norm_weight_fp32: bool = False  # GPT-OSS: RMSNorm weights held in fp32 and applied before the cast
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3); head_dim is then its RoPE dim

    def __post_init__(self):
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.expert_activation!r}; allowed: {', '.join(EXPERT_ACTIVATIONS)}")
        for name, default in (("use_rope", True), ("chunked_attention", False)):
            value = getattr(self, name)
            if not value:
                object.__setattr__(self, name, (default,) * self.num_layers)
            elif len(value) != self.num_layers:
                raise ValueError(f"{name} has {len(value)} entries; allowed: one per layer ({self.num_layers}) or none")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def cache_heads(self) -> int:
        """Heads of a cached token: the KV heads, or 1 (the latent) with MLA."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def cache_dim(self) -> int:
        """Width of one cached head: head_dim, or kv_lora_rank + RoPE dim (the latent) with MLA."""
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def moe_norm_min(self) -> float:
        """ERNIE's floor of the top-k weight sum before renormalising (``routing.renorm_min``)."""
        return self.routing.renorm_min

    def moe_index(self, layer: int) -> int | None:
        """MoE layer index of decoder layer ``layer``, or None when that layer is dense."""
        try:
            return self.moe_layer_ids.index(layer)
        except ValueError:
            return None

    @property
    def attention_window(self) -> int:
        """The sliding window of the model's sliding-window layers, 0 when none has one."""
        return max((self.window(i) or 0 for i in range(self.num_layers)), default=0)

    def window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer``, None when it attends to every key."""
        if self.sliding_window is None or not self.sliding_layers or not self.sliding_layers[layer]:
            return None
        return self.sliding_window


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
            eos_override = token_ids(g["eos_token_id"], str(gen), "eos_token_id")
    return parse_config(raw, source=str(file), eos_override=eos_override)


def parse_config(
    raw: dict[str, Any], source: str = "config.json", eos_override: tuple[int, ...] | None = None
) -> ModelConfig:
    """Parse a config dict (as read from ``source``, named in errors) into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: unknown model_type {model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
    f = Fields(raw, source)
    if model_type == "llama4":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(
                f"{source}: model_type 'llama4' needs a 'text_config' object (the text model's settings)"
            )
        f = Fields({**{k: raw[k] for k in ("dtype", "torch_dtype") if k in raw}, **text}, source, "text_config.")
    # the family's module (moeserve.models.<family>, which imports this one; families.module)
    cfg = importlib.import_module(f"moeserve.models.{MODEL_TYPES[model_type]}").parse(f, model_type)
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


class Fields:
    """A config dict's fields, read with errors that name the file and the field."""

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


def token_ids(v: Any, source: str, name: str) -> tuple[int, ...]:
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise CheckpointError(f"{source}: field '{name}' must be a token id or a list of token ids, found {v!r}")
    return tuple(vals)


def optional_id(f: Fields, name: str, default: int | None) -> int | None:
    if name not in f.raw:
        return default
    if f.raw[name] is None:
        return None
    return f.int(name, minimum=0)


def read_dtype(f: Fields) -> torch.dtype:
    name = f.raw.get("dtype") or f.raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise f.error("dtype", f"is {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def read_rope(
    f: Fields,
    allowed: tuple[str, ...] = ("default", "llama3"),
    default_theta: float = 500000.0,
    interleaved: bool = True,
) -> RopeConfig:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``;
    ``allowed``: the family's rope types; ``interleaved``: its rotation (``RopeConfig``)."""
    params = f.raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = f.raw.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        raise f.error(field, f"must be an object, found {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise f.error(field, "holds per-layer-type RoPE settings, which these families do not use")
    theta = params.get("rope_theta", f.raw.get("rope_theta", default_theta))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise f.error("rope_theta", f"must be a positive number, found {theta!r}")
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in allowed:
        raise f.error(field, f"has rope_type {rtype!r}; allowed: {', '.join(allowed)}")
    if rtype == "default":
        return RopeConfig(theta=float(theta), interleaved=interleaved)
    sub = Fields(params, f.source, f"{f.prefix}{field}.")
    original = sub.int("original_max_position_embeddings", f.int("max_position_embeddings", 131072))
    if rtype == "yarn":
        return _yarn(f, sub, params, float(theta), original, interleaved)
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if name not in params:
            raise sub.error(name, "is missing (llama3 RoPE scaling needs factor, low_freq_factor, high_freq_factor)")
    rope = RopeConfig(
        theta=float(theta),
        type="llama3",
        factor=sub.float("factor", 1.0),
        low_freq_factor=sub.float("low_freq_factor", 1.0),
        high_freq_factor=sub.float("high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        interleaved=interleaved,
    )
    if rope.high_freq_factor == rope.low_freq_factor:
        raise sub.error("high_freq_factor", "must differ from low_freq_factor")
    return rope


def _yarn(f: Fields, sub: Fields, params: dict, theta: float, original: int, interleaved: bool) -> RopeConfig:
    """YaRN as transformers computes it (``_compute_yarn_parameters``): ``factor`` defaults to
    max_position_embeddings / original_max_position_embeddings, ``attention_factor`` to
    0.1 ln(factor) + 1 (or the ratio of the two with ``mscale`` and ``mscale_all_dim``), the
    betas to 32 and 1 (also when null), ``truncate`` to true."""
    factor = sub.float("factor", f.int("max_position_embeddings", 131072) / original)
    if factor <= 0:
        raise sub.error("factor", f"must be positive, found {factor}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    af = params.get("attention_factor")
    if af is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        af = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    else:
        af = sub.float("attention_factor", 1.0)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise sub.error("truncate", f"must be a bool, found {truncate!r}")
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=truncate,
        attention_factor=float(af),
        interleaved=interleaved,
    )


def read_heads(f: Fields) -> tuple[int, int, int]:
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
