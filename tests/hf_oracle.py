"""Tiny random checkpoints built with transformers (the oracle), and ways to rewrite them.

Tests import this module; non-test code never imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

V = 160  # vocabulary of the tiny models; prompts avoid ids 0..2 (pad / bos / eos)

# The correctness contract in fp32 (CONTRIBUTING.md): logits within 1e-4 of the reference.
# Tests of whole models hold logits (and hidden states) to it; tests of one kernel against its
# torch path may ask for less.
FP32_LOGITS_ATOL = 1e-4

LLAMA4_BASE = dict(
    vocab_size=V,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_local_experts=8,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.1,
    initializer_range=0.1,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
)
ERNIE_BASE = dict(
    vocab_size=V,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    moe_intermediate_size=32,
    moe_num_experts=16,
    moe_k=4,
    moe_num_shared_experts=2,
    moe_layer_start_index=1,
    moe_layer_end_index=-1,
    moe_layer_interval=1,
    initializer_range=0.3,
    max_position_embeddings=4096,
)


def build_llama4(seed: int = 0, **overrides):
    """A random transformers Llama4ForCausalLM (fp32, eval) with non-trivial norm weights."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    model = Llama4ForCausalLM(Llama4TextConfig(**{**LLAMA4_BASE, **overrides})).eval()
    _perturb(model, seed)
    return model


def build_ernie(seed: int = 0, bias_std: float = 0.1, **overrides):
    """A random transformers Ernie4_5_MoeForCausalLM with a non-zero e_score_correction_bias."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    torch.manual_seed(seed)
    model = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**{**ERNIE_BASE, **overrides})).eval()
    _perturb(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(bias_std * torch.randn(p.shape, generator=g))
    return model


QWEN3_BASE = dict(
    vocab_size=V,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    initializer_range=0.2,
    max_position_embeddings=4096,
)
MIXTRAL_BASE = dict(
    vocab_size=V,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    initializer_range=0.2,
    max_position_embeddings=4096,
)
GPT_OSS_BASE = dict(
    vocab_size=V,
    hidden_size=64,
    num_hidden_layers=4,  # sliding, full, sliding, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=2.0,  # low enough that the clamp acts on many rows of the tiny model
    initializer_range=0.2,
    max_position_embeddings=512,  # YaRN's factor 8 over 64 positions
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
)


def build_qwen3_moe(seed: int = 0, **overrides):
    """A random transformers Qwen3MoeForCausalLM (fp32, eval), norms (q_norm, k_norm too) random."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**QWEN3_BASE, **overrides})).eval()
    _perturb(model, seed)
    return model


def build_mixtral(seed: int = 0, **overrides):
    """A random transformers MixtralForCausalLM (fp32, eval)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**MIXTRAL_BASE, **overrides})).eval()
    _perturb(model, seed)
    return model


def build_gpt_oss(seed: int = 0, **overrides):
    """A random transformers GptOssForCausalLM (fp32, eval) whose sinks, router bias and expert
    biases are random too (transformers initialises the biases to 0)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**GPT_OSS_BASE, **overrides})).eval()
    _perturb(model, seed)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_proj_bias", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _perturb(model, seed: int) -> None:
    """transformers initialises norms to 1 and biases to 0; make them random so they are tested."""
    g = torch.Generator().manual_seed(seed + 500)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias") and "e_score" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return Path(path)


def load_oracle(path: Path, dtype=torch.float32):
    """The checkpoint as transformers loads it, with eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()


def hf_greedy(model, ids: torch.Tensor, n: int, eos=None, pad=None) -> torch.Tensor:
    """transformers' greedy generate; eos=None ignores EOS entirely."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )


def prompts(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """Copy a checkpoint folder with new tensors (one model.safetensors) and optionally a new config."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else json.loads((Path(src) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    return dst


def llama4_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused Llama 4 experts ([E, H, 2I] / [E, I, H]) -> per-expert nn.Linear tensors."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("experts.gate_up_proj"):
            base, i = k[: -len("gate_up_proj")], v.shape[-1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :, :i].t().contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, :, i:].t().contiguous()
        elif k.endswith("experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].t().contiguous()
        else:
            out[k] = v
    return out
