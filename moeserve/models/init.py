"""Write a small random checkpoint in the Hugging Face layout, without transformers.

``init_model(dir, family)`` writes ``config.json`` (the transformers-5 spelling, which
transformers itself loads), ``generation_config.json``, ``model.safetensors`` and a small
byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a small chat
template + ``special_tokens_map.json``), so that a fresh machine has a model to serve and
nothing is downloaded. Weights are deterministic for a seed. Every file is written 0644.

The defaults (each family module's ``TINY``) are small enough for a 2-core CPU and still
exercise every feature:

- llama4: hidden 64, 4 layers, MoE layers 1 and 3 (interleave step 2), layer 3 NoPE, 8
  experts, top-1, chunked attention with chunk 8, temperature tuning from position 3
  (floor_scale 4), llama3 RoPE scaling;
- ernie45: hidden 64, 4 layers with layer 0 dense, 16 experts, top-4, 2 shared experts, a
  non-zero e_score_correction_bias, init std 0.3 (with 0.02 greedy decoding repeats one token);
- qwen3_moe: hidden 64, 4 layers with layer 0 dense (mlp_only_layers), 16 experts top-4 with
  norm_topk_prob, qk-norm weights;
- mixtral: hidden 64, 4 layers, 8 experts top-2;
- gpt_oss: hidden 64, 4 layers alternating a sliding window of 8 and full attention, YaRN
  (factor 8 over 64 positions), sinks, 8 experts top-2 with biases and the clamp at 2;
- deepseek_v3: hidden 64, 3 layers with layer 0 dense, MLA (q and kv LoRA, RoPE dim 8), YaRN
  with the softmax-scale correction, 16 experts in 4 groups with 2 picked, top-4, scaling 2.5,
  one shared expert.

Weights are normal with std ``initializer_range`` (norms 1 + 0.1 N(0, 1), so that they are
tested), in the family's published layout (``moeserve.models.families.checkpoint_shapes``).

``hot_experts=N`` skews routing so that N experts per MoE layer (different ones per layer)
receive most tokens, which gives a load balancer something to fix. Families without a
correction bias: one hidden channel is reserved for the routers: every embedding row holds a
constant there and no other weight reads or writes it, so every MoE input carries a positive
value on it. The hot experts' router rows get a positive weight on that channel, searched layer
by layer on random calibration prompts until the hot experts receive ``HOT_SHARE`` (80%) of the
routed tokens (or 90% of the most they can: N / top_k, every token picking every hot expert). ERNIE: the hot experts' correction bias is +1, so they are selected for every
token (their weights still come from the unbiased scores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moeserve.models import families
from moeserve.models.config import DTYPES, ModelConfig, parse_config
from moeserve.models.families import FAMILIES

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
HOT_SHARE = 0.8  # share of routed tokens the hot experts receive (families without a correction bias)

# Optional fields that may be given although the defaults leave them out.
EXTRA_KEYS = {
    "llama4": {"moe_layers", "no_rope_layers", "layer_types"},
    "ernie45": {"head_dim"},
    "qwen3_moe": set(),
    "mixtral": set(),
    "gpt_oss": {"swiglu_alpha", "layer_types"},
    "deepseek_v3": {"scoring_func", "topk_method"},
}


def defaults(family: str) -> dict[str, Any]:
    """The config.json init_model writes for ``family`` (its module's ``TINY``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    return families.module(family).TINY


def init_model(
    path: str | Path, family: str = "llama4", seed: int = 0, hot_experts: int = 0, **config_overrides
) -> Path:
    """Write a random checkpoint of ``family`` (one of ``families.FAMILIES``) into folder ``path``.

    ``config_overrides`` are config.json fields in the transformers-5 spelling (for example
    ``num_hidden_layers=8``, ``num_local_experts=16``, ``moe_num_experts=32``, ``dtype="bfloat16"``,
    ``initializer_range`` = the init std). Returns the folder.
    """
    tiny = defaults(family)
    allowed = set(tiny) | EXTRA_KEYS[family]
    unknown = sorted(set(config_overrides) - allowed - {"architectures", "model_type"})
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown} for {family}; allowed: {', '.join(sorted(allowed))}")
    raw = json.loads(json.dumps({**tiny, **config_overrides}))
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
    elif family == "ernie45":
        tensors = _ernie45_weights(cfg, gen, std, hot_experts)
    else:
        tensors = _weights(cfg, gen, std, hot_experts)
    dtype = DTYPES[raw["dtype"]]
    tensors = {k: (v if _fp32(cfg, k) else v.to(dtype)).contiguous() for k, v in tensors.items()}

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if not cfg.routing.correction_bias and 0 < hot_experts < cfg.num_experts:
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
    elif cfg.family == "ernie45" and raw.get("moe_layer_end_index", -1) == -1:
        raw["moe_layer_end_index"] = cfg.num_layers - 1
    elif cfg.family == "gpt_oss":
        raw["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.sliding_layers]
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
    experts, lm_head) ignores it, and every weight or bias that writes the residual (o_proj,
    down projections) leaves it alone."""
    # (Mixtral's gate and up: w1, w3)
    reads = (
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "gate_proj.weight",
        "up_proj.weight",
        "lm_head.weight",
        "w1.weight",
        "w3.weight",
    )
    for name, w in t.items():
        if name == "model.embed_tokens.weight":
            w[:, ch] = value
        elif name.endswith(reads):
            w[:, ch] = 0.0  # [out, H]
        elif name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
            w[ch, :] = 0.0  # [H, in]
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            w[ch] = 0.0  # [H]
        elif name.endswith("experts.gate_up_proj"):
            w[:, ch, :] = 0.0  # [E, H, 2I]
        elif name.endswith(("experts.down_proj", "experts.down_proj_bias")):
            w[..., ch] = 0.0  # [E, I, H], [E, H]


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


def _fp32(cfg: ModelConfig, name: str) -> bool:
    """Stored in fp32 whatever the dtype: a correction bias, and an fp32 gate (ERNIE's)."""
    n = families.names(cfg)
    return name.endswith("e_score_correction_bias") or (
        cfg.routing.gate_fp32 and name.endswith(f".{n.ffn}.{n.router}.weight")
    )


def _weights(cfg: ModelConfig, gen: torch.Generator, std: float, hot: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``families.checkpoint_shapes`` (the published layout): norms 1 + 0.1 N,
    the rest N(0, std); with ``hot``, the hot routers' rows marked for calibration."""
    t = {}
    for name, shape in families.checkpoint_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t[name] = _normal(gen, shape, std)
    if hot and cfg.routing.correction_bias:  # as ERNIE: +1 on the hot experts' selection bias
        n = families.names(cfg)
        for layer in cfg.moe_layer_ids:
            t[f"{n.layer(layer)}.{n.correction_bias[0]}"].view(-1)[_hot_ids(gen, cfg.num_experts, hot)] += 1.0
    elif hot:
        n = families.names(cfg)
        for layer in cfg.moe_layer_ids:
            router = t[f"{n.layer(layer)}.{n.router}.weight"]
            router[:, HOT_CHANNEL] = 0.0
            router[_hot_ids(gen, cfg.num_experts, hot), HOT_CHANNEL] = float("nan")  # calibrated later
        _reserve_channel(t, HOT_CHANNEL, std)
    return t


def _calibrate_hot_routers(out: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Set the hot experts' router weight on HOT_CHANNEL, MoE layer by MoE layer (earlier layers'
    routing shapes later layers' inputs), so that they receive about HOT_SHARE of the routed
    (token, k) pairs of random calibration prompts (at most 90% of N / top_k). Updates
    ``tensors`` in place."""
    from moeserve.models.cache import StepBatch
    from moeserve.models.model import load_model
    from moeserve.models.moe import LocalExperts

    fam = families.names(cfg)
    names = [f"{fam.layer(i)}.{fam.router}.weight" for i in cfg.moe_layer_ids]
    hot_rows = [torch.isnan(tensors[n][:, HOT_CHANNEL]) for n in names]  # [E] bool per MoE layer
    target = min(HOT_SHARE, 0.9 * int(hot_rows[0].sum()) / cfg.top_k)  # a token picks a hot expert once
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
        model.moe_blocks[m].gate_weight[hot_rows[m], HOT_CHANNEL] = w
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
        while share(m, hi) < target and hi < 1e3:
            lo, hi = hi, 2 * hi
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share(m, mid) < target else (lo, mid)
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
