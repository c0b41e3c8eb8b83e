"""``moeserve serve MODEL``: the whole local cluster and the OpenAI-compatible HTTP API, as a
vLLM user expects from ``vllm serve MODEL``.

MODEL is a folder or a Hugging Face id, resolved through huggingface_hub's cache
(``moeserve.ops.hub``: ``$HF_HOME``, ``$HF_HUB_OFFLINE``, ``--revision``, ``--download-dir``,
``--tokenizer``). It runs ``moeserve up`` with the HTTP API on ``--port`` (default 8000) and the
gRPC serving API on ``--grpc-port`` (default 8003); the admin API and the balancer keep their
ports (8001, 8002). It shows progress while the ranks load the weights and prints every
endpoint once ready. ``--api-key`` guards the serving API, HTTP and gRPC alike.

vLLM's flags, with what they mean here:

- ``--enable-expert-parallel``: accepted (experts are always sharded over expert workers);
  ``--data-parallel-size N --enable-expert-parallel``: N co-located ranks (each a router and an
  expert worker); ``--tensor-parallel-size 1`` / ``--pipeline-parallel-size 1``: accepted, larger
  values refused with what to use instead;
- ``--eplb-config``: moeserve's keys plus vLLM's ``use_async`` (true: weights move live, a
  slice per step, which is what moeserve does; false: each migration's moves all in one step, as
  vLLM's blocking rearrangement), ``log_balancedness_interval`` (honoured when it equals
  ``step_interval``, the interval moeserve logs at; refused otherwise) and ``policy``
  (``default``: the balancer's policy; others refused);
- ``--dtype auto`` (the default: the checkpoint's dtype), ``half``, ``float``; ``--backend auto``
  (the default: nccl when there is a CUDA device per rank, else gloo);
- ``--trust-remote-code``: accepted and unused;
- ``--ssl-certfile`` / ``--ssl-keyfile``: HTTPS on the HTTP port; the same files as ``--tls-cert``
  / ``--tls-key``, which the gRPC services serve too (one certificate for the cluster);
- ``--tokenizer none`` / ``--skip-tokenizer-init``: no tokenizer: prompts are token ids, chat and
  stop strings are refused, completions carry no text (``return_token_ids`` gives the ids).

A port in use, a model that cannot be found, a bad flag: one line saying what and the exit code
(1, or 2 for a usage error), no traceback. Ctrl-C while starting stops everything (exit 130);
once ready it drains in-flight requests as SIGTERM does (exit 0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from moeserve.cli import UsageError, multinode, vllm_flags
from moeserve.cli import flags as F

DEFAULT_GRPC_PORT = 8003
DTYPE_NAMES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model (folder or Hugging Face id): local cluster + OpenAI-compatible HTTP API",
        description="Run a whole local cluster (routers, expert workers, front end, balancer) for MODEL and serve "
        "the OpenAI-compatible HTTP API on --port, until Ctrl-C or SIGTERM.",
    )
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="a checkpoint folder or a Hugging Face model id")
    F.add_model_flags(p)
    F.add_state_flags(p)
    for action in p._actions:  # serve's MODEL is positional; vLLM's dtype and backend names
        if action.dest == "model":
            action.required = False
            action.help = "the same as MODEL (vLLM accepts both spellings)"
            action.metavar = "MODEL"
        elif action.dest == "dtype":
            action.choices = tuple(DTYPE_NAMES)
            action.default = "auto"
            action.help = "auto (the checkpoint's dtype, default), float32 (float), bfloat16, float16 (half)"
        elif action.dest == "backend":
            action.choices = ("auto", "gloo", "nccl")
            action.default = "auto"
            action.help = "auto (nccl when there is a CUDA device per rank, else gloo; default), gloo or nccl"
    g = p.add_argument_group("ports")
    g.add_argument("--port", type=F.port, default=8000, help="the HTTP API (default 8000; 0 = any free)")
    g.add_argument(
        "--grpc-port",
        type=F.port,
        default=DEFAULT_GRPC_PORT,
        help=f"the gRPC serving API (default {DEFAULT_GRPC_PORT})",
    )
    g.add_argument("--admin-port", type=F.port, default=8001, help="admin API of the leader (default 8001)")
    g.add_argument("--balancer-port", type=F.port, default=8002, help="balancer (default 8002)")
    F.add_token_flag(p)
    F.add_http_flags(p, http_port=False, max_model_len=False)
    F.add_hub_flags(p)
    F.add_vllm_flags(p)
    vllm_flags.add_vllm_noop_flags(p)
    F.add_balancer_flags(p)
    F.add_server_flags(p)
    F.add_metrics_flags(p, per_expert=True)
    F.add_api_server_count_flag(p)
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="serve without a tokenizer (vLLM's name; the same as --tokenizer none): prompts are token "
        "ids, completions carry no text (ask for return_token_ids to get the ids)",
    )
    multinode.add_node_flags(p)
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S", help="seconds to become ready")
    p.add_argument("--log-dir", metavar="DIR", help="keep every process's log here")
    p.set_defaults(func=run)


def parallel(args, visible_gpus: int | None = None) -> str | None:
    """vLLM's parallelism flags -> routers, workers, co-located; returns the line that says what
    they became (None when none was given). ``-tp N --enable-expert-parallel`` (times ``-dp M``)
    is N x M co-located ranks, each with its own attention and KV cache (data-parallel
    attention, which is what vLLM's expert parallelism does with its attention data-parallel)
    and a share of the experts; on CUDA it needs a GPU per rank (``visible_gpus``: the count,
    None to ask torch)."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    for flag, value in (("--tensor-parallel-size", tp), ("--pipeline-parallel-size", pp)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if pp > 1:
        raise UsageError(
            f"--pipeline-parallel-size {pp}: moeserve does not split layers over GPUs; it shards the experts "
            f"over ranks: use --tensor-parallel-size N --enable-expert-parallel or --data-parallel-size N "
            f"--enable-expert-parallel (N co-located ranks), or --routers R --workers W"
        )
    if tp > 1 and not args.enable_expert_parallel:
        raise UsageError(
            f"--tensor-parallel-size {tp} without --enable-expert-parallel would split attention and every "
            f"expert over {tp} GPUs, which moeserve does not do: add --enable-expert-parallel ({tp} co-located "
            f"ranks with data-parallel attention and the experts sharded over them)"
        )
    dp = args.data_parallel_size
    if dp is None and tp == 1:
        return None
    if dp is not None and dp < 1:
        raise UsageError(f"--data-parallel-size must be >= 1, got {dp}")
    dp = dp or 1
    if dp > 1 and not args.enable_expert_parallel:
        raise UsageError(
            f"--data-parallel-size {dp} without --enable-expert-parallel would be {dp} independent copies "
            f"of the model; moeserve serves one expert-parallel cluster: add --enable-expert-parallel "
            f"({dp} co-located ranks)"
        )
    n = tp * dp
    what = " x ".join(
        f
        for f in (f"--tensor-parallel-size {tp}" if tp > 1 else "", f"--data-parallel-size {dp}" if dp > 1 else "")
        if f
    )
    if (args.routers, args.workers) not in ((1, 1), (n, n)):
        raise UsageError(
            f"{what} means {n} co-located ranks; it disagrees with --routers {args.routers} --workers {args.workers}"
        )
    if args.backend in ("auto", "nccl"):
        if visible_gpus is None:
            try:
                import torch

                visible_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            except Exception:
                visible_gpus = 0
        if (visible_gpus or args.backend == "nccl") and n > visible_gpus:
            raise UsageError(
                f"{what} needs {n} GPUs (one per rank); {visible_gpus} {'is' if visible_gpus == 1 else 'are'} "
                f"visible (CUDA_VISIBLE_DEVICES)"
            )
    args.routers = args.workers = n
    args.colocated = True
    device = f"{n} GPUs" if visible_gpus else f"{n} CPU ranks"
    return (
        f"{what} --enable-expert-parallel: {n} co-located ranks on {device}, each a router with its own "
        f"attention and KV cache (data-parallel attention; no tensor-parallel attention) and an expert "
        f"worker with 1/{n} of the experts"
    )


def vllm_eplb_config(args) -> list[str]:
    """Take vLLM's --eplb-config keys out of the JSON (moeserve's own keys stay for
    flags.eplb_settings); returns what each became, for the start-up log."""
    if not args.eplb_config:
        return []
    try:
        raw = json.loads(args.eplb_config)
    except json.JSONDecodeError:
        return []  # flags.eplb_settings says what is wrong
    if not isinstance(raw, dict):
        return []
    notes = []
    if "use_async" in raw:
        v = raw.pop("use_async")
        if not isinstance(v, bool):
            raise UsageError(f"--eplb-config key 'use_async' must be true or false, got {v!r}")
        if v:
            notes.append("use_async: weights move live, a slice of --migration-bytes-per-step per step")
        else:
            if args.migration_bytes_per_step != 512 << 20:
                raise UsageError(
                    "--eplb-config use_async false moves each rearrangement in one step; it disagrees "
                    "with --migration-bytes-per-step (a slice per step): give one"
                )
            args.migration_bytes_per_step = 1 << 50
            notes.append("use_async false: each rearrangement moves all its weights in one step")
    if "policy" in raw:
        v = raw.pop("policy")
        if v != "default":
            raise UsageError(
                f"--eplb-config policy {v!r} is not available: moeserve's balancer plans with its own "
                f"policy (moeserve.balancer.policy: starts from the placement in force, moves at most "
                f"--eplb-move-budget of the slots); 'default' selects it"
            )
    if "log_balancedness_interval" in raw:
        v = raw.pop("log_balancedness_interval")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"--eplb-config key 'log_balancedness_interval' must be an integer >= 1, got {v!r}")
        interval = raw.get("step_interval", args.eplb_step_interval or 3000)
        if raw.get("log_balancedness", args.eplb_log_balancedness) and v != interval:
            raise UsageError(
                f"--eplb-config log_balancedness_interval {v}: moeserve logs balancedness every "
                f"step_interval steps ({interval}); set step_interval to {v} or leave the key out "
                f"(per-layer balancedness is always on the leader's /metrics)"
            )
    args.eplb_config = json.dumps(raw)
    return notes


def _dtype(args, folder) -> str:
    name = DTYPE_NAMES[args.dtype]
    if name != "auto":
        return name
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    text = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype") or "float32"
    return text if text in ("float32", "bfloat16", "float16") else "float32"


def _backend(args, world: int) -> str:
    if args.backend != "auto":
        return args.backend
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= world:
            return "nccl"
    except Exception:
        pass
    return "gloo"


def run(args: argparse.Namespace) -> int:
    from moeserve.ops import hub

    if args.model_tag and args.model and args.model_tag != args.model:
        raise UsageError(f"MODEL {args.model_tag} and --model {args.model} disagree: give one")
    model = args.model_tag or args.model
    if not model:
        raise UsageError("give the model: moeserve serve MODEL (a checkpoint folder or a Hugging Face id)")
    layout = parallel(args)
    accepted = vllm_flags.check_vllm_noops(args)
    notes = vllm_eplb_config(args)
    if layout:
        notes.insert(0, layout)
    prog = "moeserve serve"
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("HTTPS needs both --ssl-certfile and --ssl-keyfile (the same as --tls-cert and --tls-key)")
    no_tokenizer = args.skip_tokenizer_init or (args.tokenizer or "").lower() == "none"
    try:
        folder = hub.resolve(model, args.revision, args.download_dir)
        tokenizer = folder
        if args.tokenizer and not no_tokenizer:
            tokenizer = hub.resolve_tokenizer(args.tokenizer, args.tokenizer_revision, args.download_dir)
    except hub.ModelNotFound as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    if no_tokenizer:  # the front end reads its tokenizer from a folder with none
        tokenizer = Path(tempfile.mkdtemp(prefix="moeserve-no-tokenizer-"))
    world = args.routers if args.colocated else args.routers + args.workers
    args.dtype = _dtype(args, folder)
    args.backend = _backend(args, world // max(1, args.nnodes))  # the GPUs of this node
    args.model, args.model_name, args.tokenizer_dir = str(folder), model, str(tokenizer)
    args.http_port, args.port = args.port, args.grpc_port
    args.startup_progress = True
    for note in notes:
        print(f"{'ranks' if note is layout else 'eplb':<8} {note}", flush=True)
    for note in accepted:
        print(f"vllm     {note}", flush=True)
    if folder != Path(model):
        print(f"model    {model} -> {folder}", flush=True)
    from moeserve.cli import up

    try:
        return up.run(args)
    finally:
        if no_tokenizer:
            shutil.rmtree(tokenizer, ignore_errors=True)
