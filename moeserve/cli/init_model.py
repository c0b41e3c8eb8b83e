"""``moeserve init-model DIR --family llama4|ernie45|qwen3_moe|mixtral|gpt_oss|deepseek_v3``: write a small
random checkpoint.

Nothing is downloaded: the folder gets config.json, model.safetensors and a small tokenizer
(see moeserve/models/init.py), ready for ``moeserve generate --model DIR``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeserve.cli import UsageError
from moeserve.models.families import FAMILIES

FAMILY_FIELDS = {  # CLI option -> config.json field, per family
    "num_layers": dict.fromkeys(FAMILIES, "num_hidden_layers"),
    "num_experts": {
        "llama4": "num_local_experts",
        "ernie45": "moe_num_experts",
        "qwen3_moe": "num_experts",
        "mixtral": "num_local_experts",
        "gpt_oss": "num_local_experts",
        "deepseek_v3": "n_routed_experts",
    },
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "init-model",
        help="write a small random checkpoint (Hugging Face layout, no download)",
        description="Write a small random checkpoint of one family (Llama 4, ERNIE-4.5-MoE, Qwen3-MoE, Mixtral, "
        "GPT-OSS, DeepSeek-V3) with a tokenizer into DIR.",
    )
    p.add_argument("dir", metavar="DIR", help="folder to write (created; an earlier init-model folder is overwritten)")
    p.add_argument("--family", choices=FAMILIES, default="llama4", help="model family (default llama4)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument(
        "--hot-experts",
        type=int,
        default=0,
        metavar="N",
        help="skew routing so that N experts per MoE layer receive most tokens (default 0)",
    )
    p.add_argument("--num-layers", type=int, help="decoder layers (default 4)")
    p.add_argument(
        "--num-experts",
        type=int,
        help="routed experts per MoE layer (default 8 llama4, mixtral, gpt_oss; 16 ernie45, qwen3_moe, deepseek_v3)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="stored dtype (default float32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeserve.models import load_config
    from moeserve.models.init import WRITTEN_FILES, init_model

    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a folder")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in WRITTEN_FILES)
        if foreign:
            raise UsageError(
                f"{out} holds files init-model did not write ({', '.join(foreign[:5])}); choose an empty or new folder"
            )
    overrides = {}
    for opt, fields in FAMILY_FIELDS.items():
        if getattr(args, opt) is not None:
            overrides[fields[args.family]] = getattr(args, opt)
    if args.dtype:
        overrides["dtype"] = args.dtype
    try:
        path = init_model(out, args.family, seed=args.seed, hot_experts=args.hot_experts, **overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cfg = load_config(path)
    size = (path / "model.safetensors").stat().st_size
    print(
        f"wrote a random {args.family} checkpoint to {path}: {cfg.num_layers} layers, "
        f"MoE layers {list(cfg.moe_layer_ids)}, {cfg.num_experts} experts, top-{cfg.top_k}, "
        f"{cfg.num_shared_experts} shared, hot experts {args.hot_experts}, {size / 1e6:.1f} MB"
    )
    return 0
