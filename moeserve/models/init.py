"""Write a small random checkpoint in the Hugging Face layout, without transformers.

``init_model(dir, family)`` writes ``config.json`` (the transformers-5 spelling, which
transformers itself loads), ``generation_config.json``, ``model.safetensors`` and a small
byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a small chat
template + ``special_tokens_map.json``), so that a fresh machine has a model to serve and
nothing is downloaded. Weights are deterministic for a seed. Every file is written 0644.

The defaults are small enough for a 2-core CPU and still exercise every feature:

- llama4: hidden 64, 4 layers, MoE layers 1 and 3 (interleave step 2), layer 3 NoPE, 8
  experts, top-1, chunked attention with chunk 8, temperature tuning from position 3
  (floor_scale 4), llama3 RoPE scaling;
- ernie45: hidden 64, 4 layers with layer 0 dense, 16 experts, top-4, 2 shared experts, a
  non-zero e_score_correction_bias, init std 0.3 (with 0.02 greedy decoding repeats one token).

``hot_experts=N`` skews routing so that N experts per MoE layer (different ones per layer)
receive most tokens, which gives a load balancer something to fix. Llama 4: one hidden channel
is reserved for the routers: every embedding row holds a constant there and no other weight
reads or writes it, so every MoE input carries a positive value on it. The hot experts' router
rows get a positive weight on that channel, searched layer by layer on random calibration
prompts until the hot experts receive ``HOT_SHARE`` (80%) of the routed tokens.
ERNIE: the hot experts' correction bias is +1, so they are selected for every token (their
weights still come from the unbiased scores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moeserve.models.config import DTYPES, ModelConfig, parse_config

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos
WRITTEN_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# A small chat template (the tokenizer has no chat tokens of its own: roles are spelled as text),
# so that /v1/chat/completions serves these checkpoints; rendered as transformers renders it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
FILE_MODE = 0o644  # readable by every user (a container's non-root user too)
HOT_CHANNEL = 0  # the hidden channel the Llama 4 hot-expert skew rides on
HOT_SHARE = 0.8  # Llama 4: share of routed tokens the hot experts receive

LLAMA4_DEFAULTS: dict[str, Any] = {
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
ERNIE45_DEFAULTS: dict[str, Any] = {
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
DEFAULTS = {"llama4": LLAMA4_DEFAULTS, "ernie45": ERNIE45_DEFAULTS}
# Optional fields that may be given although the defaults leave them out.
EXTRA_KEYS = {"llama4": {"moe_layers", "no_rope_layers", "layer_types"}, "ernie45": {"head_dim"}}


def init_model(
    path: str | Path, family: str = "llama4", seed: int = 0, hot_experts: int = 0, **config_overrides
) -> Path:
    """Write a random checkpoint of ``family`` ("llama4" | "ernie45") into folder ``path``.

    ``config_overrides`` are config.json fields in the transformers-5 spelling (for example
    ``num_hidden_layers=8``, ``num_local_experts=16``, ``moe_num_experts=32``, ``dtype="bfloat16"``,
    ``initializer_range`` = the init std). Returns the folder.
    """
    if family not in DEFAULTS:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(DEFAULTS)}")
    allowed = set(DEFAULTS[family]) | EXTRA_KEYS[family]
    unknown = sorted(set(config_overrides) - allowed - {"architectures", "model_type"})
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown} for {family}; allowed: {', '.join(sorted(allowed))}")
    raw = json.loads(json.dumps({**DEFAULTS[family], **config_overrides}))
    cfg = parse_config(raw, source=f"init_model({family!r}) config")
    if isinstance(hot_experts, bool) or not isinstance(hot_experts, int) or not 0 <= hot_experts <= cfg.num_experts:
        raise ValueError(f"hot_experts must be an integer in 0..{cfg.num_experts}, found {hot_experts!r}")
    if cfg.vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(
            f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (special tokens + 256 bytes), found {cfg.vocab_size}"
        )
    raw = _spell_out(raw, cfg)

    gen = torch.Generator().manual_seed(seed)
    std = float(raw["initializer_range"])
    if family == "llama4":
        tensors = _llama4_weights(cfg, gen, std, hot_experts)
    else:
        tensors = _ernie45_weights(cfg, gen, std, hot_experts)
    dtype = DTYPES[raw["dtype"]]
    tensors = {
        k: (v if k.endswith(("mlp.gate.weight", "e_score_correction_bias")) else v.to(dtype)).contiguous()
        for k, v in tensors.items()
    }

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if family == "llama4" and 0 < hot_experts < cfg.num_experts:
        _calibrate_hot_routers(out, cfg, tensors, seed)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    _write_tokenizer(out, cfg.vocab_size)
    _make_readable(out)
    return out


def _make_readable(out: Path) -> None:
    """Every written file 0644 and the folder readable and searchable by all (safetensors 0.8
    writes its files 0600, which a container's other users cannot read)."""
    for name in WRITTEN_FILES:
        if (out / name).is_file():
            (out / name).chmod(FILE_MODE)
    out.chmod(out.stat().st_mode | 0o555)


def _spell_out(raw: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Write derived fields explicitly, as transformers 5 does when it saves a config."""
    raw = dict(raw)
    if cfg.family == "llama4":
        raw["moe_layers"] = list(cfg.moe_layer_ids)
        raw["no_rope_layers"] = [int(r) for r in cfg.use_rope]
        raw["layer_types"] = ["chunked_attention" if c else "full_attention" for c in cfg.chunked_attention]
    elif raw.get("moe_layer_end_index", -1) == -1:
        raw["moe_layer_end_index"] = cfg.num_layers - 1
    return raw


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _norm_weight(gen: torch.Generator, h: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(h, generator=gen)


def _attention(cfg: ModelConfig, i: int, gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    p = f"model.layers.{i}"
    out = {
        f"{p}.self_attn.q_proj.weight": _normal(gen, (q, h), std),
        f"{p}.self_attn.k_proj.weight": _normal(gen, (kv, h), std),
        f"{p}.self_attn.v_proj.weight": _normal(gen, (kv, h), std),
        f"{p}.self_attn.o_proj.weight": _normal(gen, (h, q), std),
    }
    if cfg.attention_bias:
        for n, d in (("q", q), ("k", kv), ("v", kv), ("o", h)):
            out[f"{p}.self_attn.{n}_proj.bias"] = _normal(gen, (d,), std)
    out[f"{p}.input_layernorm.weight"] = _norm_weight(gen, h)
    out[f"{p}.post_attention_layernorm.weight"] = _norm_weight(gen, h)
    return out


def _swiglu(prefix: str, h: int, width: int, bias: bool, gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    out = {
        f"{prefix}.gate_proj.weight": _normal(gen, (width, h), std),
        f"{prefix}.up_proj.weight": _normal(gen, (width, h), std),
        f"{prefix}.down_proj.weight": _normal(gen, (h, width), std),
    }
    if bias:
        for n, d in (("gate", width), ("up", width), ("down", h)):
            out[f"{prefix}.{n}_proj.bias"] = _normal(gen, (d,), std)
    return out


def _hot_ids(gen: torch.Generator, n_experts: int, hot: int) -> torch.Tensor:
    return torch.randperm(n_experts, generator=gen)[:hot]


def _llama4_weights(cfg: ModelConfig, gen: torch.Generator, std: float, hot: int) -> dict[str, torch.Tensor]:
    h, v, e, i = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    t = {"model.embed_tokens.weight": _normal(gen, (v, h), std)}
    for layer in range(cfg.num_layers):
        t.update(_attention(cfg, layer, gen, std))
        p = f"model.layers.{layer}.feed_forward"
        if cfg.moe_index(layer) is None:
            t.update(_swiglu(p, h, cfg.intermediate_size, False, gen, std))
            continue
        router = _normal(gen, (e, h), std)
        if hot:
            router[:, HOT_CHANNEL] = 0.0
            router[_hot_ids(gen, e, hot), HOT_CHANNEL] = float("nan")  # marks the hot rows; calibrated later
        t[f"{p}.router.weight"] = router
        t[f"{p}.experts.gate_up_proj"] = _normal(gen, (e, h, 2 * i), std)  # [E, H, 2I], gate first
        t[f"{p}.experts.down_proj"] = _normal(gen, (e, i, h), std)  # [E, I, H]
        t.update(_swiglu(f"{p}.shared_expert", h, i, False, gen, std))
    t["model.norm.weight"] = _norm_weight(gen, h)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _normal(gen, (v, h), std)
    if hot:
        _reserve_channel(t, HOT_CHANNEL, std)
    return t


def _reserve_channel(t: dict[str, torch.Tensor], ch: int, value: float) -> None:
    """Make hidden channel ``ch`` a constant that only the routers see: every embedding holds
    ``value`` there, and every weight that reads the normalised hidden state (q/k/v, MLPs,
    experts, lm_head) ignores it, and every weight that writes the residual (o_proj, down
    projections) leaves it alone."""
    for name, w in t.items():
        if name == "model.embed_tokens.weight":
            w[:, ch] = value
        elif name.endswith(
            ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight", "lm_head.weight")
        ):
            w[:, ch] = 0.0  # [out, H]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w[ch, :] = 0.0  # [H, in]
        elif name.endswith("experts.gate_up_proj"):
            w[:, ch, :] = 0.0  # [E, H, 2I]
        elif name.endswith("experts.down_proj"):
            w[:, :, ch] = 0.0  # [E, I, H]


def _ernie45_weights(cfg: ModelConfig, gen: torch.Generator, std: float, hot: int) -> dict[str, torch.Tensor]:
    h, v, e, i = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    t = {"model.embed_tokens.weight": _normal(gen, (v, h), std)}
    for layer in range(cfg.num_layers):
        t.update(_attention(cfg, layer, gen, std))
        p = f"model.layers.{layer}.mlp"
        if cfg.moe_index(layer) is None:
            t.update(_swiglu(p, h, cfg.intermediate_size, cfg.mlp_bias, gen, std))
            continue
        t[f"{p}.gate.weight"] = _normal(gen, (e, h), std)
        bias = 0.05 * torch.randn((1, e), generator=gen)  # selection only
        if hot:
            bias[0, _hot_ids(gen, e, hot)] += 1.0
        t[f"{p}.moe_statics.e_score_correction_bias"] = bias
        for x in range(e):
            t.update(_swiglu(f"{p}.experts.{x}", h, i, False, gen, std))
        if cfg.num_shared_experts:
            t.update(_swiglu(f"{p}.shared_experts", h, cfg.shared_intermediate_size, cfg.mlp_bias, gen, std))
    t["model.norm.weight"] = _norm_weight(gen, h)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _normal(gen, (v, h), std)
    if cfg.mlp_bias:
        t["lm_head.bias"] = _normal(gen, (v,), std)
    return t


def _calibrate_hot_routers(out: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Set the hot experts' router weight on HOT_CHANNEL, MoE layer by MoE layer (earlier layers'
    routing shapes later layers' inputs), so that they receive about HOT_SHARE of the routed
    (token, k) pairs of random calibration prompts. Updates ``tensors`` in place."""
    from moeserve.models.cache import StepBatch
    from moeserve.models.model import load_model
    from moeserve.models.moe import LocalExperts

    names = [f"model.layers.{i}.feed_forward.router.weight" for i in cfg.moe_layer_ids]
    hot_rows = [torch.isnan(tensors[n][:, HOT_CHANNEL]) for n in names]  # [E] bool per MoE layer
    for n in names:
        tensors[n][:, HOT_CHANNEL] = torch.nan_to_num(tensors[n][:, HOT_CHANNEL], nan=0.0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(out)
    assert model.experts is not None  # load_model loads the experts
    experts: LocalExperts = model.experts  # (declared: the Spy below reads it)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = 4
    ids = torch.randint(len(SPECIAL_TOKENS), cfg.vocab_size, (prompts * 64,), generator=gen)
    batch = StepBatch.prefill(range(prompts), [64] * prompts)

    def share(m: int, w: float) -> float:
        model.moe_blocks[m].router_weight[hot_rows[m], HOT_CHANNEL] = w
        seen = {}

        class Spy:
            def dispatch(self, layer, hidden, routing):
                if layer == m:
                    seen["ids"] = routing.ids
                return experts.dispatch(layer, hidden, routing)

            def combine(self, handle):
                return experts.combine(handle)

        model.step(ids, batch, model.new_cache(), experts=Spy())
        return float(hot_rows[m][seen["ids"]].float().mean())

    for m, name in enumerate(names):
        lo, hi = 0.0, 0.25
        while share(m, hi) < HOT_SHARE and hi < 1e3:
            lo, hi = hi, 2 * hi
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share(m, mid) < HOT_SHARE else (lo, mid)
        share(m, hi)  # keep it for later layers
        tensors[name][hot_rows[m], HOT_CHANNEL] = hi


# A little English for the tokenizer's merges: the model is random, the tokenizer need not be.
_CORPUS = """\
A mixture of experts model sends every token to a few of its experts. The router picks them,
the experts run, and the results are added back together. Serving such a model on many
machines means placing the experts, counting how many tokens each of them receives, and
moving the busy ones so that no worker waits for another. The balancer reads the load,
computes a new placement and applies it while requests keep flowing. Tokens are the same
before and after a move: only the place where an expert runs has changed.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
One, two, three, four, five, six, seven, eight, nine, ten. Hello world! How are you today?
In the beginning was the word, and the word was a number, and the number was a token.
"""


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE with exactly ``vocab_size`` entries; encode() prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # the corpus ran out of merges: fill the rest with unused special tokens
        tok.add_special_tokens([f"<unused_{n}>" for n in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(out / "tokenizer.json"))
    specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                **specials,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
