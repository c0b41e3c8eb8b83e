"""``moeserve generate (--model DIR | --address HOST:PORT) (--prompt-ids 1,2,3 | --prompt TEXT)``.

With ``--model`` it runs the single-process reference model (every expert in this process);
with ``--address`` it asks a running serving front end. Either way it prints the prompt ids
(with --model), the generated ids and, when there is a tokenizer, the generated text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeserve.cli import UsageError

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate tokens with the single-process reference model",
        description="Continue a prompt with a checkpoint folder's model and print the tokens.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", metavar="DIR", help="checkpoint folder (config.json + safetensors)")
    where.add_argument("--address", metavar="HOST:PORT", help="a running serving front end (moeserve up --port)")
    p.add_argument("--ca-file", metavar="PEM", help="with --address: connect with TLS, trusting this CA")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="with --address: deadline (default none)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizer.json in the folder)")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(func=run)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated token ids such as 1,2,3, found {text!r}") from None
    if any(i < 0 for i in ids):
        raise UsageError(f"--prompt-ids must be token ids >= 0, found {text!r}")
    return ids


def run_remote(args: argparse.Namespace) -> int:
    from moeserve.client import Client, MoeserveError

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, found {args.max_tokens}")
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    try:
        with Client(args.address, ca_file=args.ca_file) as c:
            out = c.generate(
                args.prompt,
                prompt_token_ids=ids,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                ignore_eos=args.ignore_eos,
                timeout=args.timeout,
            )
    except ValueError as e:
        raise UsageError(str(e)) from None
    except MoeserveError as e:
        print(f"error: {e.code.name}: {e.message}", file=sys.stderr)
        return 1
    print("generated ids:", ",".join(map(str, out.token_ids)))
    if out.text:
        print("generated text:", repr(out.text))
    print("finish reason:", out.finish_reason)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.address is not None:
        return run_remote(args)
    import torch

    from moeserve.models import CheckpointError, load_config, load_model
    from moeserve.sampling import SamplingParams

    folder = Path(args.model)
    if not folder.is_dir():
        raise UsageError(f"--model {folder}: no such folder")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, found {args.max_tokens}")
    try:
        SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        cfg = load_config(folder)
    except (ValueError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if args.prompt is not None:
        if tokenizer is None:
            raise UsageError(f"--prompt needs {folder / 'tokenizer.json'}, which does not exist; use --prompt-ids")
        ids = tokenizer.encode(args.prompt).ids
        if not ids:
            raise UsageError("--prompt encodes to no tokens")
    else:
        ids = _parse_ids(args.prompt_ids)
    bad = [i for i in ids if i >= cfg.vocab_size]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} out of range 0..{cfg.vocab_size - 1} (vocab_size of {folder})")
    try:
        model = load_model(folder, dtype=getattr(torch, args.dtype), device=args.device)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    new = out[0, len(ids) :].tolist()
    print("prompt ids:", ",".join(map(str, ids)))
    print("generated ids:", ",".join(map(str, new)))
    if tokenizer is not None:
        print("generated text:", repr(tokenizer.decode(new, skip_special_tokens=True)))
    return 0
