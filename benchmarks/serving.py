#!/usr/bin/env python3
"""Serving end to end, as users feel it: moeserve behind its gRPC front end, against transformers.

    python benchmarks/serving.py --shape scout8       # 2 GPUs, about 8 minutes
    python benchmarks/serving.py --shape ernie28
    python benchmarks/serving.py --smoke              # CPU: tiny shape, gloo, 1 rank, a few requests
    python benchmarks/serving.py --shape scout8 --apis grpc,http     # also through the HTTP API
    python3 benchmarks/serving.py --shape scout8 --configs moeserve-ep2 --workloads eplb   # EPLB end to end, 2 GPUs
    python benchmarks/serving.py --smoke --workloads eplb                 # the same on the CPU (gloo, 2 ranks)

Weights are seeded random numbers made on the device (``--load-format dummy``): the model
folder is a ``config.json`` written here, nothing is downloaded. Shapes (bf16):

- ``scout8``: Llama 4 Scout's text config (hidden 5120, 40 heads / 8 KV heads of 128, 16
  experts of width 8192 top-1, one shared expert, every layer MoE, chunked attention 8192,
  NoPE every 4th layer, llama3 RoPE scaling, vocab 202,048) cut to 8 decoder layers;
- ``ernie28``: ERNIE-4.5-21B-A3B's published config.json (28 layers, hidden 2560, 64 experts
  top-6 of width 1536, 2 shared experts, layer 0 dense, vocab 103,424).

Configurations, side by side in one run, each in its own processes, freed before the next:

- ``moeserve-ep2``: ``moeserve up`` with 2 co-located ranks over 2 GPUs (NCCL, exchange auto,
  EPLB on with ``--redundant-experts`` redundant slots), the serving front end and the
  balancer (which never rebalances here), driven by clients in ``--client-procs`` processes
  through the SDK's streaming call (``AsyncClient.generate_stream``), each recording per
  request the submit time, the first token's time and every token's time;
- ``moeserve-1rank``: the same on 1 GPU (1 co-located rank), when the model fits;
- ``moeserve-ep2-sync``, ``moeserve-1rank-sync`` (only when named in ``--configs``): the same
  with ``--no-async-scheduling``, every step's tokens back in its own gather;
- ``moeserve-ep2-grouped-mm``, ``moeserve-1rank-grouped-mm`` (only when named): the same with
  ``torch._grouped_mm`` for the experts of every step (``MOESERVE_EXPERT_KERNEL=grouped_mm``),
  against the default's Triton decode kernels (``moeserve.kernels.expert_mlp``);
- ``transformers``: ``AutoModelForCausalLM.from_config`` (random init, bf16) and ``generate``
  (greedy, ``min_new_tokens`` = ``max_new_tokens``) on 1 GPU at the burst's batch; reported,
  not a target.

Workloads (``--workloads burst,online``):

- burst: ``--burst-requests`` (256) sequences of ``--burst-prompt`` (128) random ids and
  ``--burst-output`` (256) tokens, ignore_eos, all submitted at once. Output tok/s, and the
  steady decode step time: with every sequence decoding in lockstep, the gaps between a
  stream's consecutive tokens are the step times; taken in the window where all sequences
  are running (after the last first token, before the first last token: no prefill in the
  step), the first and last ``--trim`` (10) gaps of each stream left out; step time = a
  stream's window / its steps, the median stream ("wall time / steps"; the gaps'
  median, ``steady_gap_p50_s``, reads low when asynchronous steps hand a stream two tokens at
  once).
- online: Poisson arrivals at ``--load`` (70 %) of the maximum rate of the online mix (first,
  ``--burst-requests`` requests of that mix all at once: their output tok/s / the mean output
  length; ``--online-capacity burst`` takes the fixed burst's tok/s instead), prompts of 64-1,024 and
  outputs of 64-512 tokens (uniform, seeded), ignore_eos; ``--duration`` seconds of arrivals
  (at most ``--requests``). Output tok/s, TTFT p50/p99, inter-token latency p50/p99 and the
  ratio ITL p99 / p50. Requests still running ``--drain`` seconds after the last arrival are
  cancelled and counted.

- eplb (``--workloads eplb``, alone, ``moeserve-ep2`` only): the EPLB measurement on one cluster
  (docs/eplb.md, "The end-to-end measurement"). The dummy weights get hot experts
  (``--hot-experts 2:0.8``: experts R .. R+1 take about 80 % of every MoE layer's routed tokens,
  config.json's ``moeserve_dummy_hot_experts``), both on worker 0 in the start placement; the
  balancer may move every slot in one plan (``--eplb-move-budget 1.0``). Phases: a decode burst
  (the burst's flags) and the prefill-heavy burst (``--eplb-requests`` 256 x ``--eplb-prompt``
  2,048 tokens, ``--eplb-output`` 32, ``--max-num-batched-tokens`` 8192) on the start placement
  ("EPLB off"): prefill and output tok/s, step times, the routers' measured balancedness over
  the burst's steps; a rebalance now through the balancer (slots and bytes moved, seconds,
  bytes/s); the same two bursts on the new placement; the ideal MoE time (measured x
  balancedness); then, back on the start placement, a live rebalance at ``--eplb-rebalance-at``
  seconds into a Poisson online load (``--load`` of the online mix's capacity, ``--duration``):
  its wall time (target <= 30 s), inter-token p99 of the gaps that overlap it against the steady
  ones (target <= 1.1x) and failed requests (target 0). Written under the configuration's
  ``eplb`` key and printed as a table of its own. ``--eplb-step-model FILE`` (e.g.
  benchmarks/results/step_model_h200.json, with ``--eplb-step-model-shape NAME``) makes the
  balancer plan by predicted step time and send break-even counts (the cost-aware EPLB of docs/eplb.md).

APIs (``--apis grpc,http``, default ``grpc``): each moeserve configuration's workloads run
through each API in turn, back to back against the same running cluster (``moeserve up`` then
also serves the HTTP API, ``--http-port``), workload by workload (burst through gRPC, burst
through HTTP, then online through each at the same arrival plan and rate, the rate taken from
the first API's burst), each API with its own warm-up first:

- ``grpc``: the SDK's streaming call, as above;
- ``http``: ``POST /v1/completions`` with ``stream: true`` (prompt as token ids, ``max_tokens``,
  ``ignore_eos``, ``temperature: 0``, ``stream_options.include_usage``) through httpx (or its
  successor httpx2, which this checkout's environment carries with openai), one connection per
  stream in flight (opened by the warm-up, kept alive), every token's arrival time taken from
  the server-sent events as they come in. A chunk's tokens are counted from its ``token_ids``
  when the server sends them (the warm-up asks for ``return_token_ids`` and drops it when it is
  refused), else one token per chunk with text (or its ``logprobs.tokens``); the count is
  checked against the final ``usage.completion_tokens``, and tokens a chunk did not show are
  added at the time of the last chunk (``tokens_from_usage`` says how many). httpx is imported
  only by the HTTP clients: the gRPC command lines need nothing new; on a GPU machine without
  it, the HTTP mode needs httpx and its dependencies brought as wheels (``pip download httpx``
  beside the others of the offline install).

  The model folder then also gets a word-level ``tokenizer.json`` (id i is the word ``t<i>``;
  ``--tokenizer``, default ``auto``: only when the HTTP API is measured): the HTTP API streams a
  chunk per token only when the token adds text, and without a tokenizer no token does. With a
  tokenizer both APIs detokenize, on the same cluster, so the comparison stays even.

  Reported per API (``by_api``) with the front end's CPU time during each run
  (``frontend_cpu_s``, ``frontend_cpu_us_per_token``, from /proc) and the clients' own
  (``client_cpu_s``), and per configuration and workload ``http_over_grpc_output_tok_s``.
  The configuration's top-level ``burst`` / ``online`` / ``roofline`` / ``engine`` are the first
  API's. ``--rounds N`` (for a noisy machine) runs the burst N times through each API, every
  other round in the reverse order: each API's burst figures are those of its median round
  (``rounds`` lists every round), the ratio is the median of the rounds' ratios
  (``http_over_grpc_output_tok_s_rounds`` lists them); rounds where a request failed through
  either API (``rounds_with_failed_requests``) are left out of both medians unless every round
  has one.

Roofline per GPU beside each measured step: (bytes of every weight the GPU holds, redundant
slots included, + the KV bytes the step reads) / HBM rate, for the datasheet's 4.8 TB/s and
for the rate of a large device-to-device copy measured in the same run; the measured step time
is reported as a multiple of the roofline step time (``step_over_roofline``: 1.0 = at the
roofline) and its inverse (``roofline_share``).

Prints a table and writes JSON (``--json``, default benchmarks/results/serving-<shape>.json)
with every figure, the command, the git commit and the GPU's name. Only stable public
interfaces are used: ``moeserve up`` and its flags, the front end, the SDK, ``load_config``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATASHEET_HBM_BPS = 4.8e12  # H200 SXM: 4.8 TB/s
TOKEN = "serving-bench"

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
SHAPES = {
    "scout8": dict(config=SCOUT8, redundant=2),
    "ernie28": dict(config=ERNIE28, redundant=2),
    "tiny": dict(config=TINY, redundant=2),
}
CONFIGS = ("moeserve-ep2", "moeserve-1rank", "transformers")
# named with --configs only: the same with synchronous steps (--no-async-scheduling), to measure
# what the asynchronous step protocol gains side by side in one run
SYNC_CONFIGS = ("moeserve-ep2-sync", "moeserve-1rank-sync")
# named with --configs only: the same with torch._grouped_mm for every step's experts
# (MOESERVE_EXPERT_KERNEL=grouped_mm), against the Triton decode kernels of the default
GROUPED_MM_CONFIGS = ("moeserve-ep2-grouped-mm", "moeserve-1rank-grouped-mm")
APIS = ("grpc", "http")

BURST_KEYS = (
    "requests",
    "prompt_tokens",
    "output_tokens_per_request",
    "completed",
    "errors",
    "wall_s",
    "output_tokens",
    "output_tok_s",
    "max_request_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "steady_step_s",
    "steady_step_mean_s",
    "steady_gap_p50_s",
    "steady_step_p10_s",
    "steady_step_p90_s",
    "steady_gaps",
    "steady_all_running",
    "steady_window_s",
    "steady_mean_context",
)
ONLINE_KEYS = (
    "requests",
    "load",
    "arrival_rate_req_s",
    "arrival_span_s",
    "prompt_tokens_range",
    "output_tokens_range",
    "completed",
    "cancelled",
    "errors",
    "wall_s",
    "output_tokens",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "itl_p99_over_p50",
    "e2e_p50_s",
    "e2e_p99_s",
)
ROUND_KEYS = (
    "api",
    "requests",
    "completed",
    "errors",
    "output_tok_s",
    "wall_s",
    "ttft_p50_s",
    "steady_step_s",
    "frontend_cpu_us_per_token",
    "client_cpu_s",
)
ROOFLINE_KEYS = (
    "gpus",
    "weight_bytes_per_gpu",
    "kv_bytes_per_step_per_gpu",
    "bytes_per_step_per_gpu",
    "sequences_per_gpu",
    "mean_context",
    "datasheet",
    "measured_copy",
)


# ------------------------------------------------------------------------------------------
# small helpers


def free_port() -> int:
    from moeserve.ops.ports import free_port as pick  # outside the ephemeral range: see moeserve/ops/ports.py

    return pick()


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when this process dies (Linux), so nothing is left behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_env() -> dict:
    """Every child finds this checkout (ranks start as ``python -m moeserve.cluster.rank``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def pct(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def git_commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            raise OSError(head.stderr)
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": os.environ.get("MOESERVE_GIT_COMMIT", "unknown"), "dirty": None}


def run_in_process(fn, args: tuple, timeout_s: float):
    """``fn(*args)`` in a fresh (spawned) process, its memory and devices freed when it ends:
    (result, None) or (None, error text)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_entry, args=(q, fn, args), daemon=True)
    p.start()
    deadline = time.monotonic() + timeout_s
    out = None
    while out is None:
        try:
            out = q.get(timeout=1.0)
        except Exception:  # queue.Empty
            if not p.is_alive():
                out = ("err", f"the process exited with code {p.exitcode} before answering")
            elif time.monotonic() > deadline:
                p.kill()
                out = ("err", f"timed out after {timeout_s:.0f} s")
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join()
    return (out[1], None) if out[0] == "ok" else (None, out[1])


def _child_entry(q, fn, args) -> None:
    try:
        q.put(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


# ------------------------------------------------------------------------------------------
# the model folder and its sizes


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


def model_sizes(model_dir: str, dtype_bytes: int) -> dict:
    """Bytes of the router side (everything but the routed experts) and of one routed expert,
    from config.json alone (the tensors a checkpoint of it holds; ERNIE's gate and correction
    bias in float32, as the model keeps them)."""
    from moeserve.models.config import load_config

    cfg = load_config(model_dir)
    h, v = cfg.hidden_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    router = v * h * (1 if cfg.tie_word_embeddings else 2) + h  # embed (+ lm_head), final norm
    router_fp32 = 0
    for layer in range(cfg.num_layers):
        router += 2 * q * h + 2 * kv * h + 2 * h  # q, k, v, o, two norms
        if cfg.moe_index(layer) is None:
            router += 3 * h * cfg.intermediate_size
            continue
        router += 3 * h * cfg.shared_intermediate_size if cfg.num_shared_experts else 0
        if cfg.family == "ernie45":
            router_fp32 += cfg.num_experts * h + cfg.num_experts
        else:
            router += cfg.num_experts * h
    expert = 3 * h * cfg.moe_intermediate_size * dtype_bytes
    kv_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return dict(
        family=cfg.family,
        num_layers=cfg.num_layers,
        num_moe_layers=cfg.num_moe_layers,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        hidden_size=h,
        vocab_size=v,
        router_bytes=router * dtype_bytes + router_fp32 * 4,
        expert_bytes=expert,
        all_experts_bytes=expert * cfg.num_experts * cfg.num_moe_layers,
        kv_bytes_per_token=kv_layer_token * cfg.num_layers,
        chunked=[bool(c) for c in cfg.chunked_attention],
        chunk=cfg.attention_chunk_size,
        kv_layer_token=kv_layer_token,
        eos=list(cfg.eos_token_ids),
    )


def kv_bytes_read(sizes: dict, contexts) -> float:
    """KV bytes one decode step reads for sequences at these context lengths (a chunked-attention
    layer reads only the current chunk)."""
    total = 0.0
    for ctx in contexts:
        for chunked in sizes["chunked"]:
            n = (ctx - 1) % sizes["chunk"] + 1 if chunked and sizes["chunk"] else ctx
            total += n * sizes["kv_layer_token"]
    return total


def roofline(
    weight_bytes: float,
    kv_bytes: float,
    step_s: float | None,
    rates: dict,
    gpus: int,
    seqs_per_gpu: float,
    mean_ctx: float | None,
) -> dict:
    total = weight_bytes + kv_bytes
    out = dict(
        gpus=gpus,
        weight_bytes_per_gpu=int(weight_bytes),
        kv_bytes_per_step_per_gpu=int(kv_bytes),
        bytes_per_step_per_gpu=int(total),
        sequences_per_gpu=seqs_per_gpu,
        mean_context=mean_ctx,
    )
    for name, rate in rates.items():
        t = total / rate if rate else None
        out[name] = dict(
            rate_Bps=rate,
            step_s=t,
            step_over_roofline=(step_s / t) if (t and step_s) else None,
            roofline_share=(t / step_s) if (t and step_s) else None,
        )
    return out


# ------------------------------------------------------------------------------------------
# the HBM copy rate, in its own process per device


def measure_copy(device: str, nbytes: int, iters: int) -> dict:
    import torch

    dev = torch.device(device)
    info = {"device": device}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        info.update(
            name=torch.cuda.get_device_name(dev), memory_bytes=torch.cuda.get_device_properties(dev).total_memory
        )
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(dev)
        sec = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sec = time.perf_counter() - t0
    # a copy reads and writes every byte
    info.update(copy_bytes=nbytes, iters=iters, rate_Bps=2 * nbytes * iters / sec)
    return info


def gpu_facts(gpus: int, smoke: bool) -> list[dict]:
    devices = ["cpu"] if smoke else [f"cuda:{i}" for i in range(gpus)]
    out = []
    for d in devices:
        res, err = run_in_process(measure_copy, (d, (64 << 20) if smoke else (4 << 30), 5 if smoke else 20), 180)
        if err:
            raise RuntimeError(f"measuring the copy rate on {d} failed: {err}")
        out.append(res)
    return out


# ------------------------------------------------------------------------------------------
# clients: processes with an asyncio loop each, streaming through the SDK or the HTTP API


def client_main(
    address: str, plan: list, t0_value, go, results, warm: bool, deadline_s: float, api: str = "grpc"
) -> None:
    """Run ``plan`` [(index, offset_s, prompt_ids, max_tokens)] through ``api`` (``grpc``: the
    SDK at ``address`` HOST:PORT; ``http``: /v1/completions at ``address`` http://HOST:PORT);
    every time is relative to t0 (``time.monotonic()``, one clock for every process of the
    host), set by the parent."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    run = _client_http if api == "http" else _client
    asyncio.run(run(address, plan, t0_value, go, results, warm, deadline_s))


async def _start(go, t0_value) -> float:
    while not go.wait(0.05):
        await asyncio.sleep(0)
    return t0_value.value


def _record(i, offset, prompt, n, t0) -> dict:
    return {
        "i": i,
        "submit": time.monotonic() - t0,
        "tokens": [],
        "prompt_len": len(prompt),
        "max_tokens": n,
        "finish": None,
        "error": None,
    }


async def _client(address, plan, t0_value, go, results, warm, deadline_s) -> None:
    from moeserve.client import AsyncClient

    client = AsyncClient(address, timeout=deadline_s)
    if warm:  # connect, and one token through every layer
        async for _ in client.generate_stream(prompt_token_ids=[5, 6, 7], max_tokens=1, ignore_eos=True):
            pass
    results.put(("ready", None))
    t0 = await _start(go, t0_value)
    cpu0 = time.process_time()
    deadline = t0 + deadline_s

    async def one(i, offset, prompt, n):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        rec = _record(i, offset, prompt, n, t0)

        async def stream():
            async for chunk in client.generate_stream(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True):
                now = time.monotonic() - t0
                rec["tokens"].extend([now] * len(chunk.token_ids))
                if chunk.finish_reason:
                    rec["finish"] = chunk.finish_reason

        try:
            await asyncio.wait_for(stream(), timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            rec["finish"] = "timeout"
        except Exception as e:  # noqa: BLE001 - recorded per request
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec

    recs = await asyncio.gather(*(one(*p) for p in plan))
    cpu = time.process_time() - cpu0
    await client.close()
    results.put(("done", {"recs": recs, "cpu_s": cpu}))


def http_module():
    """The async HTTP client's module, imported here only (the HTTP clients' processes): httpx,
    or httpx2 (its successor, with the same API), whichever is installed."""
    try:
        import httpx
    except ImportError:
        try:
            import httpx2 as httpx
        except ImportError:
            raise ImportError(
                "--apis http needs httpx (pip install httpx; on a machine without a package "
                "registry, bring its wheels: pip download httpx)"
            ) from None
    return httpx


class HttpStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body = status, body


class SseTokens:
    """The server-sent events of one streamed completion, fed as bytes arrive: :meth:`feed`
    answers how many new tokens they carry. A chunk's tokens: its ``token_ids`` when the server
    sends them, else its ``logprobs.tokens``, else one for a chunk with text and no
    finish_reason (the last chunk may carry text a finished detokenizer flushed, or a stop
    string's token: :meth:`missing` gets those from ``usage.completion_tokens``)."""

    def __init__(self):
        self.buf = b""
        self.counted = 0
        self.usage_tokens: int | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.done = False
        self.chunks = 0
        self.token_ids = False

    def feed(self, data: bytes) -> int:
        self.buf += data
        new = 0
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                break
            event, self.buf = self.buf[:end], self.buf[end + 2 :]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                else:
                    new += self._chunk(json.loads(payload))
        self.counted += new
        return new

    def _chunk(self, obj: dict) -> int:
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return 0
        self.chunks += 1
        usage = obj.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")
        n = 0
        for ch in obj.get("choices") or ():
            ids = ch.get("token_ids")
            if ids is not None:
                self.token_ids = True
                n += len(ids)
            elif ch.get("finish_reason") is None:
                lp = ch.get("logprobs")
                n += len(lp.get("tokens") or ()) if lp else (1 if ch.get("text") else 0)
            if ch.get("finish_reason") is not None:
                self.finish = ch["finish_reason"]
        return n

    def missing(self) -> int:
        """Tokens the usage counts that no chunk showed (0 when every chunk showed its tokens)."""
        return max(0, (self.usage_tokens or 0) - self.counted)


async def _client_http(base, plan, t0_value, go, results, warm, deadline_s) -> None:
    httpx = http_module()
    client = httpx.AsyncClient(
        base_url=base,
        trust_env=False,
        timeout=httpx.Timeout(deadline_s, connect=60.0, pool=deadline_s),
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=max(60.0, deadline_s)
        ),
    )
    extra = {"return_token_ids": True}

    async def stream(prompt, n, on_tokens) -> SseTokens:
        body = {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        sse = SseTokens()
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise HttpStatusError(resp.status_code, (await resp.aread()).decode(errors="replace"))
            async for data in resp.aiter_raw():
                now = time.monotonic()
                k = sse.feed(data)
                if k:
                    on_tokens(now, k)
        if sse.error:
            raise RuntimeError(f"the stream ended with an error: {sse.error}")
        if not sse.done:
            raise RuntimeError("the stream ended without data: [DONE]")
        return sse

    if warm:
        try:  # does the server send each chunk's token ids?
            await stream([5, 6, 7], 1, lambda *_: None)
        except HttpStatusError as e:
            if e.status != 400 or "return_token_ids" not in e.body:
                raise
            extra = {}
        # one connection per stream this process will have in flight (at most 256), kept alive
        await asyncio.gather(*(stream([5, 6, 7], 1, lambda *_: None) for _ in range(min(len(plan), 256))))
    results.put(("ready", None))
    t0 = await _start(go, t0_value)
    cpu0 = time.process_time()
    deadline = t0 + deadline_s

    async def one(i, offset, prompt, n):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        rec = _record(i, offset, prompt, n, t0)
        rec["from_usage"] = 0

        def on_tokens(now, k):
            rec["tokens"].extend([now - t0] * k)

        try:
            sse = await asyncio.wait_for(stream(prompt, n, on_tokens), timeout=max(0.1, deadline - time.monotonic()))
            rec["finish"] = sse.finish
            k = sse.missing()
            if k:
                rec["tokens"].extend([rec["tokens"][-1] if rec["tokens"] else time.monotonic() - t0] * k)
                rec["from_usage"] = k
        except TimeoutError:
            rec["finish"] = "timeout"
        except Exception as e:  # noqa: BLE001 - recorded per request
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec

    recs = await asyncio.gather(*(one(*p) for p in plan))
    cpu = time.process_time() - cpu0
    await client.aclose()
    results.put(("done", {"recs": recs, "cpu_s": cpu, "token_ids": bool(extra)}))


def drive(
    address: str, plan: list, procs: int, deadline_s: float, api: str = "grpc", stats: dict | None = None, on_start=None
) -> list[dict]:
    """Split ``plan`` round-robin over ``procs`` client processes of ``api``, start them
    together, and return every request's record (times relative to the common start);
    ``stats`` (when given) gets the clients' CPU seconds during the run (``client_cpu_s``) and,
    for HTTP, whether the server sent each chunk's token ids (``http_token_ids``)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    t0 = ctx.Value("d", 0.0)
    go = ctx.Event()
    shares = [plan[k::procs] for k in range(procs)]
    shares = [s for s in shares if s]
    ps = [
        ctx.Process(target=_client_entry, args=(address, s, t0, go, results, True, deadline_s, api), daemon=True)
        for s in shares
    ]
    for p in ps:
        p.start()

    def fail(what: str):
        for p in ps:
            p.kill()
        raise RuntimeError(what)

    ready = 0
    limit = time.monotonic() + 120
    while ready < len(ps):
        try:
            kind, payload = results.get(timeout=1.0)
            if kind == "error":
                fail(f"a {api} client process failed: {payload}")
            ready += kind == "ready"
        except RuntimeError:
            raise
        except Exception:  # queue.Empty
            if any(not p.is_alive() for p in ps) or time.monotonic() > limit:
                fail(f"a {api} client process did not start")
    t0.value = time.monotonic() + 0.2
    go.set()
    if on_start is not None:  # the common start (time.monotonic())
        on_start(t0.value)
    recs, cpu, token_ids = [], 0.0, []
    done = 0
    limit = time.monotonic() + deadline_s + 60
    while done < len(ps):
        try:
            kind, payload = results.get(timeout=1.0)
        except Exception:  # queue.Empty
            if time.monotonic() > limit or all(not p.is_alive() for p in ps):
                fail(f"a {api} client process did not finish")
            continue
        if kind == "error":
            fail(f"a {api} client process failed: {payload}")
        if kind == "done":
            recs.extend(payload["recs"])
            cpu += payload["cpu_s"]
            if "token_ids" in payload:
                token_ids.append(payload["token_ids"])
            done += 1
    for p in ps:
        p.join(10)
    if stats is not None:
        stats["client_cpu_s"] = cpu
        if token_ids:
            stats["http_token_ids"] = all(token_ids)
    return sorted(recs, key=lambda r: r["i"])


def _client_entry(*args) -> None:
    results = args[4]
    try:
        client_main(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
        raise


# ------------------------------------------------------------------------------------------
# workloads and their figures


def burst_plan(rng: np.random.Generator, n: int, prompt: int, output: int, vocab: int) -> list:
    return [(i, 0.0, rng.integers(3, vocab, prompt).tolist(), output) for i in range(n)]


def online_plan(
    rng: np.random.Generator, rate: float, count: int, prompts: tuple, outputs: tuple, vocab: int, first: int = 0
) -> list:
    gaps = rng.exponential(1.0 / rate, count)
    offsets = np.cumsum(gaps) - gaps[0]
    plen = rng.integers(prompts[0], prompts[1] + 1, count)
    olen = rng.integers(outputs[0], outputs[1] + 1, count)
    return [
        (first + i, float(offsets[i]), rng.integers(3, vocab, int(plen[i])).tolist(), int(olen[i]))
        for i in range(count)
    ]


def steady_steps(recs: list[dict], trim: int) -> dict:
    """The step times of the window where every sequence is decoding: after the last first token
    (no prompt is being prefilled any more) and before the first last token (none finished)."""
    ok = [r for r in recs if r["tokens"]]
    out = dict(
        steady_step_s=None,
        steady_step_mean_s=None,
        steady_gap_p50_s=None,
        steady_step_p10_s=None,
        steady_step_p90_s=None,
        steady_gaps=0,
        steady_all_running=False,
        steady_window_s=None,
        steady_mean_context=None,
    )
    if not ok:
        return out
    lo = max(r["tokens"][0] for r in ok)
    hi = min(r["tokens"][-1] for r in ok)
    all_running = len(ok) == len(recs) and hi > lo
    gaps, ctxs, means = [], [], []
    for r in ok:
        ts = r["tokens"]
        idx = (
            [j for j in range(1, len(ts)) if ts[j - 1] >= lo and ts[j] <= hi]
            if all_running
            else list(range(1, len(ts)))
        )
        idx = idx[trim : len(idx) - trim] if len(idx) > 2 * trim else []
        if not idx:
            continue
        gaps.extend(ts[j] - ts[j - 1] for j in idx)
        ctxs.extend(r["prompt_len"] + j for j in idx)
        if len(idx) > 1:
            means.append((ts[idx[-1]] - ts[idx[0] - 1]) / len(idx))
    if not gaps:
        return out
    # the step time is wall time / steps (per stream over its window, the median stream): with
    # asynchronous steps a stream's tokens can reach the client in twos, which leaves the gaps'
    # median below the step time; the gaps' median is kept as steady_gap_p50_s
    mean = float(np.median(means)) if means else float(np.mean(gaps))
    out.update(
        steady_step_s=mean,
        steady_step_mean_s=mean,
        steady_gap_p50_s=pct(gaps, 50),
        steady_step_p10_s=pct(gaps, 10),
        steady_step_p90_s=pct(gaps, 90),
        steady_gaps=len(gaps),
        steady_all_running=all_running,
        steady_window_s=[lo, hi] if all_running else None,
        steady_mean_context=float(np.mean(ctxs)),
    )
    return out


def burst_figures(recs: list[dict], prompt: int, output: int, trim: int) -> dict:
    done = [r for r in recs if r["error"] is None and r["finish"] not in (None, "timeout")]
    toks = sum(len(r["tokens"]) for r in recs)
    last = max((r["tokens"][-1] for r in recs if r["tokens"]), default=0.0)
    first_submit = min(r["submit"] for r in recs)
    wall = last - first_submit
    ttft = [r["tokens"][0] - r["submit"] for r in recs if r["tokens"]]
    out = dict(
        requests=len(recs),
        prompt_tokens=prompt,
        output_tokens_per_request=output,
        completed=len(done),
        errors=sorted({r["error"] for r in recs if r["error"]})[:5],
        wall_s=wall,
        output_tokens=toks,
        output_tok_s=toks / wall if wall > 0 else None,
        max_request_rate=len(done) / wall if wall > 0 else None,
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
    )
    out.update(steady_steps(recs, trim))
    return out


def online_figures(recs: list[dict], load: float, rate: float, prompts: tuple, outputs: tuple) -> dict:
    done = [r for r in recs if r["error"] is None and r["finish"] not in (None, "timeout")]
    toks = sum(len(r["tokens"]) for r in recs)
    first_submit = min(r["submit"] for r in recs)
    last = max((r["tokens"][-1] for r in recs if r["tokens"]), default=first_submit)
    wall = last - first_submit
    ttft = [r["tokens"][0] - r["submit"] for r in recs if r["tokens"]]
    itl = [b - a for r in recs for a, b in zip(r["tokens"], r["tokens"][1:])]
    e2e = [r["tokens"][-1] - r["submit"] for r in done]
    p50, p99 = pct(itl, 50), pct(itl, 99)
    return dict(
        requests=len(recs),
        load=load,
        arrival_rate_req_s=rate,
        arrival_span_s=max(r["submit"] for r in recs) - first_submit,
        prompt_tokens_range=list(prompts),
        output_tokens_range=list(outputs),
        completed=len(done),
        cancelled=sum(r["finish"] == "timeout" for r in recs),
        errors=sorted({r["error"] for r in recs if r["error"]})[:5],
        wall_s=wall,
        output_tokens=toks,
        output_tok_s=toks / wall if wall > 0 else None,
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
        itl_p50_s=p50,
        itl_p99_s=p99,
        itl_p99_over_p50=(p99 / p50) if p50 else None,
        e2e_p50_s=pct(e2e, 50),
        e2e_p99_s=pct(e2e, 99),
    )


def api_figures(api: str, recs: list[dict], stats: dict, frontend_cpu_s: float | None, tokens: int) -> dict:
    """What one API's run cost outside the engine: the front end's CPU seconds (all its threads)
    and per output token, the clients' CPU seconds; for HTTP, tokens no chunk showed."""
    out = dict(
        api=api,
        frontend_cpu_s=frontend_cpu_s,
        frontend_cpu_us_per_token=(1e6 * frontend_cpu_s / tokens) if frontend_cpu_s is not None and tokens else None,
        client_cpu_s=stats.get("client_cpu_s"),
    )
    if api == "http":
        out.update(
            tokens_from_usage=sum(r.get("from_usage", 0) for r in recs), http_token_ids=stats.get("http_token_ids")
        )
    return out


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


# ------------------------------------------------------------------------------------------
# moeserve: ``moeserve up`` with the clients in front


def read_profiles(folder: str) -> dict:
    """The ranks' step profiles (``moeserve.ops.profiling``) with the breakdown of a step's device
    time: attention, expert matmuls (and their weight-read rate when known), exchange (dispatch
    and combine less the matmuls inside them), LM head + sampling, the rest; and host times."""
    out: dict = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name)) as f:
            p = json.load(f)
        sp = {k: v for k, v in p["spans"].items()}

        def dev(k):
            return sp.get(k, {}).get("device_s", 0.0)

        def host(k):
            return sp.get(k, {}).get("host_s", 0.0)

        busy = p["device_busy_per_step_s"]
        parts = {
            "attention": dev("attention"),
            "expert_matmul": dev("expert_matmul"),
            "exchange": max(0.0, dev("moe_dispatch") + dev("moe_combine") - dev("expert_matmul")),
            "gate_shared_dense": dev("gate") + dev("shared_expert") + dev("dense_mlp"),
            "lm_head_sampling": dev("lm_head") + dev("sampling"),
        }
        parts["rest"] = max(0.0, busy - sum(parts.values()))
        p["breakdown_device_s"] = parts
        p["breakdown_by_kernel_s"] = kernel_breakdown(p["kernels"])
        p["host_s"] = {
            k: host(k)
            for k in ("schedule", "header_broadcast", "batch_build", "result_gather", "load_read", "sampling")
        }
        out[name[:-5]] = p
    return out


KERNEL_CLASSES = (  # (class, substrings of kernel names), first match wins
    (
        "exchange",
        (
            "barrier_kernel",
            "route_kernel",
            "expert_count_kernel",
            "publish_kernel",
            "prep_kernel",
            "scatter_pairs_kernel",
            "return_rows_kernel",
            "nccl",
            "all_to_all",
            "AllToAll",
        ),
    ),
    ("expert_matmul", ("GroupProblem", "grouped", "silu_mul_kernel", "weighted_sum_kernel")),
    ("attention", ("paged_attention",)),
    ("sampling", ("sample", "philox", "race", "argmax", "ArgMax")),
)


def kernel_breakdown(kernels: list[dict]) -> dict:
    """Device seconds per step by kernel class (``KERNEL_CLASSES``; the rest: dense matmuls of
    attention projections, shared experts, LM head, norms, elementwise)."""
    out = {name: 0.0 for name, _ in KERNEL_CLASSES}
    out["rest"] = 0.0
    for k in kernels:
        cls = next((name for name, keys in KERNEL_CLASSES if any(s in k["name"] for s in keys)), "rest")
        out[cls] += k["device_s"]
    return out


def profile_table(profiles: dict, expert_bytes_per_step: float | None = None) -> list[str]:
    lines = []
    for rank, p in profiles.items():
        kb = p.get("breakdown_by_kernel_s") or {}
        if kb:
            rate = ""
            if expert_bytes_per_step and kb.get("expert_matmul"):
                rate = f" ({expert_bytes_per_step / kb['expert_matmul'] / 1e9:.0f} GB/s of expert weights)"
            lines.append(
                f"profile {rank}: kernels ms/step: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in kb.items()) + rate
            )
        b = p["breakdown_device_s"]
        lines.append(
            f"profile {rank}: wall {1e3 * p['wall_per_step_s']:.2f} ms/step, device busy "
            f"{1e3 * p['device_busy_per_step_s']:.2f} ms: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in b.items())
        )
        lines.append(
            f"profile {rank}: host ms/step: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in p["host_s"].items())
        )
        for k in p["kernels"][:8]:
            lines.append(f"    {1e3 * k['device_s']:7.3f} ms x{k['calls_per_step']:.0f}  {k['name'][:90]}")
    return lines


class Up:
    """``python -m moeserve up ...`` as a child process, until ``stop``."""

    def __init__(
        self,
        model_dir: str,
        ranks: int,
        redundant: int,
        a,
        log_dir: str,
        http: bool = False,
        extra: list | None = None,
        expert_kernel: str | None = None,
    ):
        self.ports = {"port": free_port(), "admin": free_port(), "balancer": free_port()}
        if http:
            self.ports["http"] = free_port()
        while len(set(self.ports.values())) < len(self.ports):
            for k in list(self.ports)[2:]:
                self.ports[k] = free_port()
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "moeserve",
            "up",
            "--model",
            model_dir,
            "--load-format",
            "dummy",
            "--routers",
            str(ranks),
            "--workers",
            str(ranks),
            "--colocated",
            "--backend",
            a.backend,
            "--dtype",
            a.dtype,
            "--exchange",
            a.exchange,
            "--max-model-len",
            str(a.max_model_len),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--max-num-batched-tokens",
            str(a.max_num_batched_tokens),
            "--max-waiting",
            "100000",
            "--port",
            str(self.ports["port"]),
            "--admin-port",
            str(self.ports["admin"]),
            "--balancer-port",
            str(self.ports["balancer"]),
            "--admin-token",
            TOKEN,
            "--grace-period",
            "5",
            "--startup-timeout",
            str(a.startup_timeout),
            "--log-dir",
            log_dir,
            "--eplb-step-interval",
            "1000000000",
        ]  # the balancer never rebalances here
        if redundant:
            cmd += ["--enable-eplb", "--num-redundant-experts", str(redundant)]
        if http:
            cmd += ["--http-port", str(self.ports["http"])]
        cmd += list(extra or ())
        self.cmd = cmd
        self.out_path = os.path.join(log_dir, "up.out")
        self.t0 = time.monotonic()
        env = child_env()
        self.profile_dir = None
        if getattr(a, "profile", None):  # ranks profile forward steps START .. START+COUNT-1
            self.profile_dir = os.path.join(log_dir, "profile")
            env["MOESERVE_PROFILE"] = f"{self.profile_dir}:{a.profile}"
        if expert_kernel:
            env["MOESERVE_EXPERT_KERNEL"] = expert_kernel
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + a.startup_timeout + 30
        while "ready" not in self._out().split():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moeserve up did not become ready (logs in {log_dir}):\n{self.tail()}")
            time.sleep(0.2)
        self.startup_s = time.monotonic() - self.t0
        self.serving = f"127.0.0.1:{self.ports['port']}"
        self.admin = f"127.0.0.1:{self.ports['admin']}"
        self.http = f"http://127.0.0.1:{self.ports['http']}" if http else None
        self.balancer = f"127.0.0.1:{self.ports['balancer']}"
        self._frontend_pid: int | None = None

    def address(self, api: str) -> str:
        return self.http if api == "http" else self.serving

    def frontend_cpu_s(self) -> float | None:
        """CPU seconds (user + system, every thread) the front end process has used so far, from
        /proc (None where there is none); the front end is ``moeserve up``'s child."""
        try:
            if self._frontend_pid is None:
                for name in os.listdir("/proc"):
                    if not name.isdigit():
                        continue
                    try:
                        with open(f"/proc/{name}/stat") as f:
                            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                        if ppid != self.proc.pid:
                            continue
                        with open(f"/proc/{name}/cmdline", "rb") as f:
                            if b"frontend" in f.read().split(b"\0"):
                                self._frontend_pid = int(name)
                                break
                    except (OSError, ValueError, IndexError):
                        continue
            if self._frontend_pid is None:
                return None
            with open(f"/proc/{self._frontend_pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def _out(self) -> str:
        try:
            with open(self.out_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        parts = []
        for name in sorted(os.listdir(self.log_dir)):
            try:
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    text = f.readlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {name} ---\n{''.join(text)}")
        return "\n".join(parts)[-12000:]

    def status(self) -> dict:
        from moeserve.client import Client

        with Client(self.admin, TOKEN, timeout=10) as c:
            s = c.status()
        return dict(
            forward_steps=s.forward_steps,
            step=s.step,
            running=s.running,
            waiting=s.waiting,
            kv_blocks_total=getattr(s, "kv_blocks_total", 0),
            kv_blocks_used=getattr(s, "kv_blocks_used", 0),
            preemptions=getattr(s, "preemptions", 0),
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def warnings(self) -> list[str]:
        """Lines of the cluster's logs that say a step ran eagerly or a graph failed, a step or a
        schedule was slow (> 0.5 s), or a request waited over 1 s for admission."""
        found = []
        for root, _, files in os.walk(self.log_dir):
            for f in files:
                try:
                    with open(os.path.join(root, f), errors="replace") as fh:
                        found += [
                            f"{f}: {ln.strip()}"[:300]
                            for ln in fh
                            if "CUDA graph" in ln
                            or "run eagerly" in ln
                            or "Traceback" in ln
                            or "slow step" in ln
                            or "slow schedule" in ln
                            or "for admission" in ln
                            or "slow garbage collection" in ln
                            or "compiled" in ln
                            and "while serving" in ln
                        ]
                except OSError:
                    continue
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_moeserve(
    name: str, ranks: int, redundant: int, model_dir: str, sizes: dict, a, rates: dict, plans: dict, log_root: str
) -> dict:
    apis = list(getattr(a, "apis", None) or ["grpc"])
    res: dict = dict(
        kind="moeserve",
        ranks=ranks,
        gpus=ranks if a.backend == "nccl" else 0,
        redundant_experts=redundant,
        backend=a.backend,
        exchange=a.exchange,
        error=None,
        burst=None,
        online=None,
        roofline=None,
        engine=None,
        apis=apis,
        by_api={api: dict(burst=None, online=None, roofline=None, engine=None) for api in apis},
    )
    if "grpc" in apis and "http" in apis:
        res["http_over_grpc_output_tok_s"] = {}
    first = apis[0]
    up = None

    def record(api: str, key: str, value) -> None:
        res["by_api"][api][key] = value
        if api == first:  # the configuration's own figures: the first API's
            res[key] = value

    def compare(workload: str) -> None:
        if "http_over_grpc_output_tok_s" in res:
            g, h = (res["by_api"][api][workload] or {} for api in ("grpc", "http"))
            res["http_over_grpc_output_tok_s"][workload] = ratio(h.get("output_tok_s"), g.get("output_tok_s"))

    def run(api: str, plan: list, deadline_s: float):
        """(records, the API's cost figures less the token count) of one workload through ``api``."""
        stats: dict = {}
        cpu0 = up.frontend_cpu_s()
        recs = drive(up.address(api), plan, a.client_procs, deadline_s, api=api, stats=stats)
        cpu1 = up.frontend_cpu_s()
        fe = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
        return recs, lambda tokens: api_figures(api, recs, stats, fe, tokens)

    try:
        eplb = "eplb" in plans
        up = Up(
            model_dir,
            ranks,
            redundant,
            a,
            os.path.join(log_root, name),
            http="http" in apis,
            extra=(
                (
                    ["--eplb-move-budget", "1.0"]  # one rebalance may move every layer
                    + (
                        ["--eplb-step-model", os.path.abspath(a.eplb_step_model)]
                        if getattr(a, "eplb_step_model", None)
                        else []
                    )
                    + (
                        ["--eplb-step-model-shape", a.eplb_step_model_shape]
                        if getattr(a, "eplb_step_model_shape", None)
                        else []
                    )
                )
                if eplb
                else []
            )
            + (["--no-async-scheduling"] if name.endswith("-sync") else [])
            + (["--capture-graphs-at-start"] if a.capture_graphs_at_start else []),
            expert_kernel="grouped_mm" if name.endswith("-grouped-mm") else None,
        )
        res["startup_s"] = up.startup_s
        print(f"[{name}] ready in {up.startup_s:.0f} s", flush=True)
        if eplb:
            res["eplb"] = run_eplb(name, up, a, sizes, plans)
            plans = {}
        # warm-up, through each API: the burst's batch through prefill and a few decode steps
        for api in apis if "burst" in plans else ():
            drive(
                up.address(api),
                [(i, 0.0, p, min(16, n)) for i, _, p, n in plans["burst"]],
                a.client_procs,
                300,
                api=api,
            )
        weights = (
            sizes["router_bytes"]
            + (sizes["num_experts"] + redundant) // ranks * sizes["num_moe_layers"] * sizes["expert_bytes"]
        )
        if "burst" in plans:
            rounds: dict = {api: [] for api in apis}
            for r in range(a.rounds):  # odd rounds in the reverse order of the APIs
                for api in apis if r % 2 == 0 else apis[::-1]:
                    s0 = up.status()
                    recs, cost = run(api, plans["burst"], a.burst_timeout)
                    s1 = up.status()
                    b = burst_figures(recs, a.burst_prompt, a.burst_output, a.trim)
                    b.update(cost(b["output_tokens"]))
                    steps = s1["forward_steps"] - s0["forward_steps"]
                    engine = dict(
                        burst_forward_steps=steps,
                        burst_wall_per_step_s=(b["wall_s"] / steps) if steps else None,
                        preemptions=s1["preemptions"] - s0["preemptions"],
                        kv_blocks_total=s1["kv_blocks_total"],
                    )
                    rounds[api].append((b, engine))
                    fe = b.get("frontend_cpu_us_per_token")
                    print(
                        f"[{name}] burst via {api}{f' (round {r + 1})' if a.rounds > 1 else ''}: "
                        f"{b['output_tok_s'] or 0:.0f} tok/s, step {1e3 * (b['steady_step_s'] or 0):.2f} ms"
                        + (f", front end {fe:.0f} us CPU/token" if fe is not None else ""),
                        flush=True,
                    )

            def clean(b: dict) -> bool:  # every request of the round completed
                return b["completed"] == b["requests"] and not b["errors"]

            for api in apis:
                runs = rounds[api]
                pool = [j for j in range(len(runs)) if clean(runs[j][0])] or list(range(len(runs)))
                k = sorted(pool, key=lambda j: runs[j][0]["output_tok_s"] or 0)[len(pool) // 2]
                b, engine = runs[k]
                if len(runs) > 1:  # the round with the median output tok/s, and every round
                    b = dict(b, round=k, rounds=[{key: x[0].get(key) for key in ROUND_KEYS} for x in runs])
                record(api, "engine", engine)
                record(api, "burst", b)
                per_gpu = a.burst_requests / ranks
                ctx = b["steady_mean_context"] or (a.burst_prompt + a.burst_output / 2)
                kv = kv_bytes_read(sizes, [int(round(ctx))]) * per_gpu
                record(api, "roofline", roofline(weights, kv, b["steady_step_s"], rates, max(1, ranks), per_gpu, ctx))
            if "http_over_grpc_output_tok_s" in res:
                pairs = list(zip(rounds["grpc"], rounds["http"]))
                per_round = [ratio(h[0]["output_tok_s"], g[0]["output_tok_s"]) for g, h in pairs]
                failed = [r for r, (g, h) in enumerate(pairs) if not (clean(g[0]) and clean(h[0]))]
                known = [x for r, x in enumerate(per_round) if x is not None and r not in failed] or [
                    x for x in per_round if x is not None
                ]
                res["http_over_grpc_output_tok_s"]["burst"] = float(np.median(known)) if known else None
                if a.rounds > 1:
                    res.setdefault("http_over_grpc_output_tok_s_rounds", {})["burst"] = per_round
                    res.setdefault("rounds_with_failed_requests", {})["burst"] = failed
                print(
                    f"[{name}] burst http/grpc output tok/s: "
                    + ", ".join(
                        (f"{x:.3f}" if x is not None else "-") + ("*" if r in failed else "")
                        for r, x in enumerate(per_round)
                    )
                    + (
                        f" (median {res['http_over_grpc_output_tok_s']['burst'] or 0:.3f}"
                        + ("; * a request failed, left out" if failed and len(failed) < len(per_round) else "")
                        + ")"
                        if a.rounds > 1
                        else ""
                    ),
                    flush=True,
                )
        if "online" in plans:
            base = (res["by_api"][first]["burst"] or {}).get("output_tok_s")
            if not base:
                raise RuntimeError("the online workload needs the burst's throughput")
            mean_out = (a.online_output[0] + a.online_output[1]) / 2
            if a.online_capacity == "probe":
                # The maximum rate of the online mix itself: its requests all at once (closed
                # loop, as many as the burst), output tok/s over the run / mean output length.
                probe = online_plan(
                    np.random.default_rng(a.seed + 2),
                    1e9,
                    a.burst_requests,
                    tuple(a.online_prompt),
                    tuple(a.online_output),
                    sizes["vocab_size"],
                    first=2 * 10**6,
                )
                recs, _ = run(first, [(i, 0.0, p, n) for i, _, p, n in probe], a.burst_timeout)
                cap = burst_figures(recs, 0, 0, a.trim)
                res["online_capacity"] = {
                    k: cap[k]
                    for k in (
                        "requests",
                        "completed",
                        "wall_s",
                        "output_tokens",
                        "output_tok_s",
                        "ttft_p50_s",
                        "ttft_p99_s",
                    )
                }
                base = cap["output_tok_s"] or base
                print(
                    f"[{name}] online mix all at once: {base:.0f} tok/s, max rate {base / mean_out:.1f} req/s",
                    flush=True,
                )
            rate = a.load * base / mean_out
            count = max(1, min(a.requests, int(math.ceil(rate * a.duration))))
            plan = online_plan(
                np.random.default_rng(a.seed + 1),
                rate,
                count,
                tuple(a.online_prompt),
                tuple(a.online_output),
                sizes["vocab_size"],
                first=10**6,
            )
            for api in apis:
                recs, cost = run(api, plan, plan[-1][1] + a.drain)
                o = online_figures(recs, a.load, rate, tuple(a.online_prompt), tuple(a.online_output))
                o.update(cost(o["output_tokens"]))
                record(api, "online", o)
                print(
                    f"[{name}] online via {api}: {o['requests']} requests at {rate:.1f}/s, "
                    f"{o['output_tok_s'] or 0:.0f} tok/s, ITL p50 {1e3 * (o['itl_p50_s'] or 0):.1f} ms "
                    f"p99 {1e3 * (o['itl_p99_s'] or 0):.1f} ms",
                    flush=True,
                )
            compare("online")
        res["log_warnings"] = up.warnings()
        for line in res["log_warnings"][:5]:
            print(f"[{name}] log: {line}", flush=True)
        if up.profile_dir:
            res["profile"] = read_profiles(up.profile_dir)
            ebytes = (
                (sizes["num_experts"] + redundant) // max(1, ranks) * sizes["num_moe_layers"] * sizes["expert_bytes"]
            )
            res["profile_expert_bytes_per_step"] = ebytes
            for line in profile_table(res["profile"], ebytes):
                print(f"[{name}] {line}", flush=True)
        if not up.alive():
            raise RuntimeError(f"moeserve up exited during the run:\n{up.tail()}")
    except Exception as e:  # noqa: BLE001 - one configuration's failure
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] failed: {res['error']}", flush=True)
        if up is not None:
            print(up.tail(), flush=True)
    finally:
        if up is not None:
            up.stop()
    return res


# ------------------------------------------------------------------------------------------
# eplb: the EPLB measurement end to end, on one running cluster (``--workloads eplb``)


class StepPoller:
    """Samples the leader's forward-step count (admin status) every ``period`` seconds in a thread,
    so that the steps of a time window (a burst's prefill) can be counted afterwards."""

    def __init__(self, admin: str, period: float = 0.1):
        from moeserve.client import Client

        self.samples: list[tuple[float, int]] = []
        self._client = Client(admin, TOKEN, timeout=10)
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                steps = self._client.status().forward_steps
                self.samples.append((time.monotonic(), steps))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
            self._stop.wait(self._period)

    def steps_at(self, t: float) -> float | None:
        """Forward steps at monotonic time t, interpolated between samples."""
        xs = self.samples
        if not xs or t < xs[0][0] or t > xs[-1][0]:
            return None
        return float(np.interp(t, [x[0] for x in xs], [x[1] for x in xs]))

    def steps_between(self, t0: float, t1: float) -> float | None:
        a, b = self.steps_at(t0), self.steps_at(t1)
        return (b - a) if a is not None and b is not None else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()


def _balancedness(load) -> dict:
    return dict(
        measured=float(load.measured.mean),
        measured_per_layer=[float(x) for x in load.measured.per_layer],
        predicted=float(load.predicted.mean),
        steps=int(load.steps),
        placement_version=int(load.placement_version),
    )


def eplb_burst(up, admin, poller: StepPoller, a, plan: list, prompt: int, output: int, window: int) -> dict:
    """One burst (all at once) with its prefill and decode figures, the engine's step count and
    the balancedness the routers measured over the burst's steps."""
    started: dict = {}
    s0 = admin.status().forward_steps
    recs = drive(up.serving, plan, a.client_procs, a.burst_timeout, on_start=lambda t: started.update(t0=t))
    s1 = admin.status().forward_steps
    time.sleep(2 * poller._period)
    b = burst_figures(recs, prompt, output, a.trim)
    steps = s1 - s0
    firsts = [r["tokens"][0] for r in recs if r["tokens"]]
    prompt_tokens = sum(r["prompt_len"] for r in recs)
    prefill_s = max(firsts) if firsts else None  # from the common start to the last first token
    prefill_steps = poller.steps_between(started["t0"], started["t0"] + prefill_s) if prefill_s else None
    b.update(
        forward_steps=steps,
        wall_per_step_s=(b["wall_s"] / steps) if steps else None,
        prompt_tokens_total=prompt_tokens,
        prefill_s=prefill_s,
        prefill_tok_s=(prompt_tokens / prefill_s) if prefill_s else None,
        prefill_steps=prefill_steps,
        prefill_step_s=(prefill_s / prefill_steps) if prefill_s and prefill_steps else None,
        failed=sum(1 for r in recs if r["error"] or r["finish"] in (None, "timeout")),
    )
    b["balancedness"] = _balancedness(admin.expert_load(window_steps=max(1, min(steps, window))))
    return b


def rebalance_now(balancer, label: str) -> dict:
    """The balancer plans on its load window and applies the plan; the call returns when the
    migration ended."""
    t = time.monotonic()
    rb = balancer.rebalance(wait=True, timeout=600)
    wall = time.monotonic() - t
    mig = rb.migration
    out = dict(
        applied=bool(rb.applied),
        note=rb.note,
        wall_s=wall,
        slots_moved=int(rb.slots_moved),
        slots_moved_across_workers=int(rb.slots_moved_across_workers),
        bytes_moved=int(rb.bytes_moved),
        bytes_per_s=rb.bytes_moved / wall if wall > 0 else None,
        predicted_balancedness_before=float(rb.balancedness_before.mean),
        predicted_balancedness_after=float(rb.balancedness_after.mean),
        predicted_step_s_before=float(rb.predicted_step_s_before) or None,
        predicted_step_s_after=float(rb.predicted_step_s_after) or None,
        breakeven_sent=rb.breakeven is not None and bool(np.asarray(rb.breakeven).size),
        migration_state=str(mig.state) if mig is not None else None,
        migration_layers_committed=int(mig.layers_committed) if mig is not None else None,
        migration_layers_total=int(mig.layers_total) if mig is not None else None,
    )
    print(
        f"[eplb] {label}: {'applied' if rb.applied else 'NOT applied'}, {rb.slots_moved} slots "
        f"({rb.bytes_moved / 2**20:.1f} MiB) in {wall:.2f} s"
        + (f" = {out['bytes_per_s'] / 1e9:.2f} GB/s" if out["bytes_per_s"] else "")
        + f", predicted balancedness {out['predicted_balancedness_before']:.3f} -> "
        f"{out['predicted_balancedness_after']:.3f}" + (f" ({rb.note})" if rb.note else ""),
        flush=True,
    )
    return out


def _gaps(recs: list[dict], keep) -> list[float]:
    return [b - a for r in recs for a, b in zip(r["tokens"], r["tokens"][1:]) if keep(a, b)]


def run_eplb(name: str, up, a, sizes: dict, plans: dict) -> dict:
    """The phases of ``--workloads eplb`` on one running cluster; see the module docstring."""
    from moeserve.client import Client

    admin = Client(up.admin, TOKEN, timeout=60)
    balancer = Client(up.balancer, TOKEN, timeout=60)
    poller = StepPoller(up.admin)
    out: dict = dict(
        hot_experts=a.hot_experts_cfg,
        prompt=a.eplb_prompt,
        output=a.eplb_output,
        requests=a.eplb_requests,
        max_num_batched_tokens=a.max_num_batched_tokens,
        decode=dict(requests=a.burst_requests, prompt=a.burst_prompt, output=a.burst_output),
    )
    try:
        st = admin.status()
        window = int(st.eplb.window_size) or 1000
        initial = admin.placement()
        out["initial_phy2log"] = initial.phy2log.tolist()
        vocab = sizes["vocab_size"]
        rng = np.random.default_rng(a.seed + 7)
        prefill_plan = burst_plan(rng, a.eplb_requests, a.eplb_prompt, a.eplb_output, vocab)
        decode_plan = plans["burst"]
        # warm-up: a few long prompts, then the decode burst's batch through a few steps
        drive(
            up.serving, [(i, 0.0, p, 2) for i, _, p, _ in prefill_plan[: max(2, a.client_procs)]], a.client_procs, 300
        )
        drive(up.serving, [(i, 0.0, p, min(16, n)) for i, _, p, n in decode_plan], a.client_procs, 300)

        def decode(label: str) -> dict:
            d = eplb_burst(up, admin, poller, a, decode_plan, a.burst_prompt, a.burst_output, window)
            print(
                f"[eplb] decode burst {label}: {d['output_tok_s'] or 0:.0f} tok/s, steady step "
                f"{1e3 * (d['steady_step_s'] or 0):.2f} ms, balancedness {d['balancedness']['measured']:.3f}",
                flush=True,
            )
            return d

        def prefill(label: str) -> dict:
            b = eplb_burst(up, admin, poller, a, prefill_plan, a.eplb_prompt, a.eplb_output, window)
            print(
                f"[eplb] prefill burst {label}: prefill {b['prefill_tok_s'] or 0:.0f} tok/s "
                f"({1e3 * (b['prefill_step_s'] or 0):.1f} ms/step), output {b['output_tok_s'] or 0:.0f} tok/s, "
                f"balancedness {b['balancedness']['measured']:.3f}",
                flush=True,
            )
            return b

        # (e) decode at the initial placement; (a) the skewed prefill-heavy burst, EPLB off
        out["decode_before"] = decode("before")
        out["before"] = prefill("before (initial placement)")
        # (b) rebalance now, every layer (--eplb-move-budget 1.0), idle cluster
        out["rebalance"] = rebalance_now(balancer, "rebalance")
        out["rebalance"]["phy2log"] = admin.placement().phy2log.tolist()
        # (c) the same burst on the new placement; (e) decode on it
        out["after"] = prefill("after")
        out["decode_after"] = decode("after")
        # (d) the ideal: MoE time scales with the slowest worker's load, so a perfectly balanced
        # placement would take (measured MoE time) x balancedness
        bb, ba = out["before"]["balancedness"]["measured"], out["after"]["balancedness"]["measured"]
        sb, sa = out["before"].get("prefill_step_s"), out["after"].get("prefill_step_s")
        out["ideal"] = dict(
            moe_time_ideal_over_measured_before=bb,
            moe_time_ideal_over_measured_after=ba,
            moe_speedup_predicted=ratio(ba, bb) if bb else None,
            prefill_step_speedup_measured=ratio(sb, sa),
            prefill_tok_s_speedup_measured=ratio(out["after"].get("prefill_tok_s"), out["before"].get("prefill_tok_s")),
            output_tok_s_speedup_measured=ratio(out["after"].get("output_tok_s"), out["before"].get("output_tok_s")),
            prefill_step_if_all_moe_balanced_s=(sb * bb) if sb else None,
            note="balancedness = mean / max worker load; the MoE part of a step scales with the max, so "
            "ideal MoE time = measured MoE time x balancedness; the step also holds attention, the "
            "shared expert and the LM head, which balance does not change (their share: --profile)",
        )
        out["decode_cost"] = dict(
            step_before_s=out["decode_before"].get("steady_step_s"),
            step_after_s=out["decode_after"].get("steady_step_s"),
            step_after_over_before=ratio(
                out["decode_after"].get("steady_step_s"), out["decode_before"].get("steady_step_s")
            ),
        )
        # (f) back to the initial placement, then a live rebalance during the online load
        t = time.monotonic()
        restore = admin.apply_placement(np.asarray(initial.phy2log), wait=True, timeout=600)
        out["restore"] = dict(wall_s=time.monotonic() - t, moves=int(restore.moves), bytes=int(restore.bytes))
        mean_out = (a.online_output[0] + a.online_output[1]) / 2
        probe = online_plan(
            np.random.default_rng(a.seed + 2),
            1e9,
            a.burst_requests,
            tuple(a.online_prompt),
            tuple(a.online_output),
            vocab,
            first=2 * 10**6,
        )
        cap = burst_figures(
            drive(up.serving, [(i, 0.0, p, n) for i, _, p, n in probe], a.client_procs, a.burst_timeout), 0, 0, a.trim
        )
        rate = a.load * (cap["output_tok_s"] or 1.0) / mean_out
        count = max(1, min(a.requests, int(math.ceil(rate * a.duration))))
        plan = online_plan(
            np.random.default_rng(a.seed + 1),
            rate,
            count,
            tuple(a.online_prompt),
            tuple(a.online_output),
            vocab,
            first=10**6,
        )
        span = plan[-1][1]
        at = a.eplb_rebalance_at if a.eplb_rebalance_at is not None else 0.4 * span
        go, live = threading.Event(), {}

        def live_rebalance():
            go.wait()
            time.sleep(max(0.0, live["t0"] + at - time.monotonic()))
            live["start"] = time.monotonic() - live["t0"]
            try:
                live["result"] = rebalance_now(balancer, "live rebalance during the online load")
            except Exception as e:  # noqa: BLE001 - reported
                live["error"] = f"{type(e).__name__}: {e}"
            live["end"] = time.monotonic() - live["t0"]

        th = threading.Thread(target=live_rebalance, daemon=True)
        th.start()
        recs = drive(
            up.serving, plan, a.client_procs, span + a.drain, on_start=lambda t0: (live.update(t0=t0), go.set())
        )
        th.join(600)
        o = online_figures(recs, a.load, rate, tuple(a.online_prompt), tuple(a.online_output))
        ts, te = live.get("start"), live.get("end")
        lv = dict(
            live.get("result") or {},
            error=live.get("error"),
            start_s=ts,
            end_s=te,
            rebalance_at_s=at,
            arrival_span_s=span,
            requests=len(recs),
            completed=o["completed"],
            cancelled=o["cancelled"],
            errors=o["errors"],
            failed=sum(1 for r in recs if r["error"] or r["finish"] in (None, "timeout")),
            output_tok_s=o["output_tok_s"],
            capacity_output_tok_s=cap["output_tok_s"],
            arrival_rate_req_s=rate,
            itl_p50_s=o["itl_p50_s"],
            itl_p99_s=o["itl_p99_s"],
        )
        if ts is not None and te is not None:
            during = _gaps(recs, lambda x, y: x < te and y > ts)  # gaps that overlap the migration
            steady = _gaps(recs, lambda x, y: (0.25 * ts <= y < ts) or (te < x and y <= span))
            lv.update(
                itl_during_n=len(during),
                itl_steady_n=len(steady),
                itl_p50_during_s=pct(during, 50),
                itl_p99_during_s=pct(during, 99),
                itl_p50_steady_s=pct(steady, 50),
                itl_p99_steady_s=pct(steady, 99),
                itl_p99_during_over_steady=ratio(pct(during, 99), pct(steady, 99)),
            )
        lv["targets"] = dict(
            rebalance_within_30s=bool(lv.get("wall_s") is not None and lv["wall_s"] <= 30.0),
            itl_p99_during_within_1_1x_steady=bool(
                lv.get("itl_p99_during_over_steady") is not None and lv["itl_p99_during_over_steady"] <= 1.1
            ),
            no_request_failed=lv["failed"] == 0 and not lv["errors"],
        )
        out["live"] = lv
        print(
            f"[eplb] live: {lv.get('slots_moved')} slots in {lv.get('wall_s') or 0:.2f} s during the online load "
            f"({count} requests at {rate:.2f}/s), ITL p99 during {1e3 * (lv.get('itl_p99_during_s') or 0):.1f} ms vs "
            f"steady {1e3 * (lv.get('itl_p99_steady_s') or 0):.1f} ms, {lv['failed']} failed",
            flush=True,
        )
        out["failed_requests"] = (
            sum(out[k]["failed"] for k in ("decode_before", "before", "after", "decode_after")) + lv["failed"]
        )
    finally:
        poller.close()
        admin.close()
        balancer.close()
    return out


def eplb_table(result: dict) -> list[str]:
    lines = []
    for name, c in result["configs"].items():
        e = c.get("eplb")
        if not e:
            continue
        hot = e.get("hot_experts") or {}
        lines.append(
            f"EPLB end to end ({name}): {e['requests']} x {e['prompt']}-token prompts, {e['output']} out, "
            f"max-num-batched-tokens {e['max_num_batched_tokens']}, hot experts {hot.get('ids')} taking "
            f"~{hot.get('share')} of the tokens in every MoE layer"
        )
        lines.append(
            f"  {'phase':<26}{'balanced':>9}{'prefill tok/s':>14}{'pf ms/step':>11}{'out tok/s':>10}"
            f"{'ms/step':>9}{'TTFT99 ms':>10}{'failed':>7}"
        )
        for key, label in (
            ("before", "(a) EPLB off (initial)"),
            ("after", "(c) after rebalance"),
            ("decode_before", "(e) decode, initial"),
            ("decode_after", "(e) decode, rebalanced"),
        ):
            b = e.get(key)
            if not b:
                continue
            step = b.get("steady_step_s") if key.startswith("decode") else b.get("prefill_step_s")
            lines.append(
                f"  {label:<26}{_num(b['balancedness']['measured'], '9.3f')}"
                f"{_num(b.get('prefill_tok_s'), '14.0f')}{_ms(b.get('prefill_step_s'))[-11:]:>11}"
                f"{_num(b.get('output_tok_s'), '10.0f')}{_ms(step)}{_ms(b.get('ttft_p99_s'))[-10:]:>10}"
                f"{b.get('failed', 0):>7}"
            )
        r = e.get("rebalance") or {}
        if r:
            lines.append(
                f"  (b) rebalance: {'applied' if r.get('applied') else 'NOT applied'}, {r.get('slots_moved')} "
                f"slots ({r.get('slots_moved_across_workers')} across workers), "
                f"{(r.get('bytes_moved') or 0) / 2**20:.1f} MiB in {r.get('wall_s') or 0:.2f} s = "
                f"{(r.get('bytes_per_s') or 0) / 1e9:.2f} GB/s; predicted balancedness "
                f"{r.get('predicted_balancedness_before', 0):.3f} -> {r.get('predicted_balancedness_after', 0):.3f}"
            )
        i = e.get("ideal") or {}
        if i:
            lines.append(
                f"  (d) ideal MoE time = measured x balancedness: {_f(i.get('moe_time_ideal_over_measured_before'))}"
                f" x before, {_f(i.get('moe_time_ideal_over_measured_after'))} x after; MoE "
                f"speed-up predicted {_f(i.get('moe_speedup_predicted'))}, prefill step "
                f"speed-up measured {_f(i.get('prefill_step_speedup_measured'))}, prefill tok/s "
                f"{_f(i.get('prefill_tok_s_speedup_measured'))}"
            )
        d = e.get("decode_cost") or {}
        if d:
            lines.append(f"  (e) decode step rebalanced / initial: {_f(d.get('step_after_over_before'))}")
        lv = e.get("live") or {}
        if lv:
            t = lv.get("targets") or {}
            lines.append(
                f"  (f) live rebalance during the online load ({lv.get('requests')} requests at "
                f"{lv.get('arrival_rate_req_s') or 0:.2f}/s): {lv.get('slots_moved')} slots, "
                f"{(lv.get('bytes_moved') or 0) / 2**20:.1f} MiB in {lv.get('wall_s') or 0:.2f} s "
                f"({'ok' if t.get('rebalance_within_30s') else 'over'} 30 s); ITL p99 during "
                f"{_ms(lv.get('itl_p99_during_s')).strip()} ms vs steady {_ms(lv.get('itl_p99_steady_s')).strip()} ms = "
                f"{_f(lv.get('itl_p99_during_over_steady'), '.2f')}x "
                f"({'ok' if t.get('itl_p99_during_within_1_1x_steady') else 'over'} 1.1x); "
                f"{lv.get('failed')} failed"
            )
    return lines


# ------------------------------------------------------------------------------------------
# transformers, in its own process


def hf_generate(model_dir: str, device: str, dtype_name: str, prompts: list, new_tokens: int, pad: int) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cfg = AutoConfig.from_pretrained(model_dir)
    t = time.perf_counter()
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    init_s = time.perf_counter() - t
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def gen(n, rows=None):
        x, m = (ids, mask) if rows is None else (ids[:rows], mask[:rows])
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=x,
                attention_mask=m,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                use_cache=True,
            )
        sync()
        return time.perf_counter() - t0, out.shape[1] - x.shape[1]

    gen(2, rows=min(8, len(prompts)))  # warm-up
    prefill_s, _ = gen(1)
    total_s, made = gen(new_tokens)
    step = (total_s - prefill_s) / (made - 1) if made > 1 else None
    return dict(
        transformers=transformers.__version__,
        init_s=init_s,
        weight_bytes=weight_bytes,
        prefill_s=prefill_s,
        total_s=total_s,
        new_tokens=made,
        step_s=step,
        peak_memory_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    )


def run_transformers(model_dir: str, sizes: dict, a, rates: dict, plans: dict) -> dict:
    res: dict = dict(kind="transformers", gpus=0 if a.smoke else 1, error=None, burst=None, online=None, roofline=None)
    prompts = [p for _, _, p, _ in plans["burst"]]
    device = "cpu" if a.smoke else "cuda:0"
    out, err = run_in_process(
        hf_generate,
        (model_dir, device, a.dtype, prompts, a.burst_output, int(TINY["pad_token_id"] if a.smoke else 0)),
        a.hf_timeout,
    )
    if err:
        res["error"] = err.splitlines()[0] if err else err
        res["error_detail"] = err
        print(f"[transformers] failed: {res['error']}", flush=True)
        return res
    n, new = len(prompts), out["new_tokens"]
    res["run"] = out
    res["burst"] = dict(
        requests=n,
        prompt_tokens=a.burst_prompt,
        output_tokens_per_request=new,
        output_tokens=n * new,
        wall_s=out["total_s"],
        output_tok_s=n * new / out["total_s"],
        prefill_s=out["prefill_s"],
        steady_step_s=out["step_s"],
    )
    ctx = a.burst_prompt + new / 2
    kv = kv_bytes_read(sizes, [int(round(ctx))]) * n
    res["roofline"] = roofline(out["weight_bytes"], kv, out["step_s"], rates, 1, n, ctx)
    print(
        f"[transformers] {res['burst']['output_tok_s']:.0f} tok/s, step {1e3 * (out['step_s'] or 0):.2f} ms", flush=True
    )
    return res


# ------------------------------------------------------------------------------------------
# table and main


def _ms(x) -> str:
    return f"{1e3 * x:>9.3g}" if isinstance(x, (int, float)) else f"{'-':>9}"


def _num(x, fmt="8.0f") -> str:
    width = int(fmt.split(".")[0])
    if not isinstance(x, (int, float)):
        return f"{'-':>{width}}"
    text = format(x, fmt).strip()
    return text.rjust(width) if len(text) < width else (" " + format(x, ".3g")).rjust(width)


def _f(x, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def table(result: dict) -> str:
    lines = [
        f"serving benchmark: {result['shape']} on {result['gpu']} ({result['device']})",
        f"{'config':<16}{'burst tok/s':>12}{'step ms':>9}{'roof ms':>9}{'x roof':>8}{'roofc ms':>9}{'x roofc':>8}"
        f"{'onl tok/s':>10}{'TTFT50 ms':>10}{'TTFT99 ms':>10}{'ITL50 ms':>9}{'ITL99 ms':>9}{'99/50':>7}",
    ]
    for name, c in result["configs"].items():
        if c.get("skipped"):
            lines.append(f"{name:<16} skipped: {c['skipped']}")
            continue
        if c.get("error") and not c.get("burst"):
            lines.append(f"{name:<16} failed: {c['error'][:100]}")
            continue
        b, o, r = c.get("burst") or {}, c.get("online") or {}, c.get("roofline") or {}
        ds, mc = r.get("datasheet") or {}, r.get("measured_copy") or {}
        lines.append(
            f"{name:<16}{_num(b.get('output_tok_s'), '12.0f')}{_ms(b.get('steady_step_s'))}"
            f"{_ms(ds.get('step_s'))}{_num(ds.get('step_over_roofline'), '8.2f')}"
            f"{_ms(mc.get('step_s'))}{_num(mc.get('step_over_roofline'), '8.2f')}"
            f"{_num(o.get('output_tok_s'), '10.0f')} {_ms(o.get('ttft_p50_s'))} {_ms(o.get('ttft_p99_s'))}"
            f"{_ms(o.get('itl_p50_s'))}{_ms(o.get('itl_p99_s'))}{_num(o.get('itl_p99_over_p50'), '7.2f')}"
        )
    if len(result.get("apis") or ()) > 1 or (result.get("apis") or ["grpc"]) != ["grpc"]:
        lines.append(
            f"by API (same cluster, back to back; the rows above are {result['apis'][0]}'s): output tok/s, "
            f"front end CPU us per output token, clients' CPU s"
        )
        lines.append(
            f"{'config':<16}{'workload':<9}{'api':<6}{'tok/s':>9}{'TTFT50 ms':>10}{'ITL50 ms':>9}"
            f"{'ITL99 ms':>9}{'FE us/tok':>10}{'client s':>9}{'http/grpc':>10}"
        )
        for name, c in result["configs"].items():
            for w in ("burst", "online"):
                for api, r in (c.get("by_api") or {}).items():
                    f = r.get(w)
                    if not f:
                        continue
                    cmp = (c.get("http_over_grpc_output_tok_s") or {}).get(w) if api == "http" else None
                    lines.append(
                        f"{name:<16}{w:<9}{api:<6}{_num(f.get('output_tok_s'), '9.0f')}"
                        f" {_ms(f.get('ttft_p50_s'))}{_ms(f.get('itl_p50_s'))}{_ms(f.get('itl_p99_s'))}"
                        f"{_num(f.get('frontend_cpu_us_per_token'), '10.0f')}"
                        f"{_num(f.get('client_cpu_s'), '9.1f')}{_num(cmp, '10.3f')}"
                    )
                per_round = (c.get("http_over_grpc_output_tok_s_rounds") or {}).get(w)
                if per_round:
                    failed = (c.get("rounds_with_failed_requests") or {}).get(w) or []
                    lines.append(
                        f"{'':<16}{w:<9}http/grpc by round: "
                        + ", ".join(
                            (f"{x:.3f}" if x is not None else "-") + ("*" if r in failed else "")
                            for r, x in enumerate(per_round)
                        )
                        + " (median above"
                        + ("; * a request failed, left out" if 0 < len(failed) < len(per_round) else "")
                        + ")"
                    )
    lines += eplb_table(result)
    hb = result["hbm"]
    lines.append(
        f"roofline: (weights on a GPU + KV read per step) / HBM rate; roof = datasheet "
        f"{hb['datasheet_Bps'] / 1e12:.1f} TB/s, roofc = measured copy {hb['measured_copy_Bps'] / 1e12:.2f} TB/s; "
        f"x roof = measured step / roofline step"
    )
    for name, c in result["configs"].items():
        r = c.get("roofline")
        if r:
            lines.append(
                f"  {name:<14} weights {r['weight_bytes_per_gpu'] / 2**30:7.2f} GiB/GPU, KV read "
                f"{r['kv_bytes_per_step_per_gpu'] / 2**30:6.3f} GiB/step/GPU, {r['sequences_per_gpu']:.0f} "
                f"sequences/GPU at mean context {r['mean_context'] or 0:.0f}"
            )
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="scout8 or ernie28 (smoke: tiny)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shape, gloo, 1 rank, a few requests")
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma list of {','.join(CONFIGS)} (default: all; smoke: moeserve-1rank,transformers)",
    )
    p.add_argument(
        "--workloads",
        default="burst,online",
        help="burst,online (online needs burst), or eplb alone (moeserve-ep2: the EPLB measurement)",
    )
    p.add_argument(
        "--apis",
        default="grpc",
        help="comma list of grpc,http: each moeserve configuration's "
        "workloads through each API in turn, on the same cluster (grpc)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="burst runs per API, round by round, every other round in the reverse API order; each "
        "API's burst figures are its median round's, the ratio the median of the rounds' (1)",
    )
    p.add_argument(
        "--tokenizer",
        choices=("auto", "words", "none"),
        default="auto",
        help="a word-level tokenizer.json in the model folder (auto: when the HTTP API is measured)",
    )
    p.add_argument("--burst-requests", type=int, default=None)
    p.add_argument("--burst-prompt", type=int, default=None)
    p.add_argument("--burst-output", type=int, default=None)
    p.add_argument("--trim", type=int, default=None, help="steps left out at each end of the steady window (10)")
    p.add_argument("--load", type=float, default=0.7, help="online arrival rate as a share of the maximum rate (0.7)")
    p.add_argument(
        "--online-capacity",
        choices=("probe", "burst"),
        default="probe",
        help="the maximum rate: probe = the online mix's own throughput, its requests all at once "
        "(default); burst = the fixed burst's output tok/s / the mean online output",
    )
    p.add_argument("--duration", type=float, default=None, help="seconds of online arrivals (30; smoke 2)")
    p.add_argument("--requests", type=int, default=None, help="at most this many online requests (2000; smoke 6)")
    p.add_argument("--online-prompt", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--online-output", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--drain", type=float, default=None, help="seconds after the last arrival before cancelling (45)")
    p.add_argument("--client-procs", type=int, default=None, help="client processes (8; smoke 2)")
    p.add_argument("--redundant-experts", type=int, default=None, help="redundant slots per MoE layer of the EP run")
    p.add_argument(
        "--eplb-requests", type=int, default=None, help="eplb: prompts of the prefill-heavy burst (256; smoke 8)"
    )
    p.add_argument("--eplb-prompt", type=int, default=None, help="eplb: tokens per prompt (2048; smoke 64)")
    p.add_argument("--eplb-output", type=int, default=None, help="eplb: output tokens per request (32; smoke 8)")
    p.add_argument(
        "--hot-experts",
        default="2:0.8",
        metavar="K:SHARE",
        help="eplb: K experts per MoE layer take about SHARE of the routed tokens (dummy weights; 2:0.8)",
    )
    p.add_argument(
        "--eplb-step-model",
        default=None,
        metavar="FILE",
        help="eplb: the balancer plans and judges by this step-model table (moeserve up --eplb-step-model; "
        "made by benchmarks/calibrate.py); default: token balance",
    )
    p.add_argument(
        "--eplb-step-model-shape",
        default=None,
        metavar="NAME",
        help="eplb: the table's entry to use (moeserve up --eplb-step-model-shape; default: the one "
        "matching the model)",
    )
    p.add_argument(
        "--eplb-rebalance-at",
        type=float,
        default=None,
        metavar="S",
        help="eplb: seconds into the online load when the live rebalance starts (0.4 x the arrival span)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--exchange", default="auto", choices=("auto", "collective", "nvlink"))
    p.add_argument(
        "--capture-graphs-at-start",
        action="store_true",
        help="moeserve up --capture-graphs-at-start: every decode graph captured before serving",
    )
    p.add_argument("--startup-timeout", type=float, default=None)
    p.add_argument("--burst-timeout", type=float, default=None)
    p.add_argument("--hf-timeout", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        default=None,
        metavar="START:COUNT",
        help="profile forward steps START .. START+COUNT-1 on every rank (moeserve.ops.profiling); "
        "e.g. 80:20 lands in the burst's steady decode",
    )
    p.add_argument("--json", default=None, help="output file (default benchmarks/results/serving-<shape>.json)")
    a = p.parse_args(argv)
    smoke = a.smoke
    if a.shape is None:
        a.shape = "tiny" if smoke else None
    if a.shape is None:
        p.error("--shape scout8|ernie28 (or --smoke)")
    defaults = dict(
        burst_requests=(8, 256),
        burst_prompt=(16, 128),
        burst_output=(32, 256),
        trim=(2, 10),
        duration=(2.0, 30.0),
        requests=(6, 2000),
        online_prompt=([8, 48], [64, 1024]),
        online_output=([8, 32], [64, 512]),
        drain=(30.0, 45.0),
        client_procs=(2, 8),
        max_num_seqs=(64, 256),
        max_num_batched_tokens=(512, 8192),
        max_model_len=(256, 2048),
        startup_timeout=(120.0, 420.0),
        burst_timeout=(120.0, 300.0),
        hf_timeout=(180.0, 300.0),
    )
    given_max_model_len = a.max_model_len is not None
    defaults.update(eplb_requests=(8, 256), eplb_prompt=(64, 2048), eplb_output=(8, 32))
    for k, (small, big) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, small if smoke else big)
    if a.redundant_experts is None:
        a.redundant_experts = SHAPES[a.shape]["redundant"]
    eplb = "eplb" in a.workloads.split(",")
    a.configs = (
        a.configs or ("moeserve-ep2" if eplb else "moeserve-1rank,transformers" if smoke else ",".join(CONFIGS))
    ).split(",")
    bad = [c for c in a.configs if c not in CONFIGS + SYNC_CONFIGS + GROUPED_MM_CONFIGS]
    if bad:
        p.error(f"unknown configs {bad}; choose from {CONFIGS + SYNC_CONFIGS + GROUPED_MM_CONFIGS}")
    a.workloads = a.workloads.split(",")
    a.apis = [x.strip() for x in a.apis.split(",") if x.strip()]
    if not a.apis or not set(a.apis) <= set(APIS) or len(set(a.apis)) < len(a.apis):
        p.error(f"--apis is a comma list of {','.join(APIS)} without repeats, got {','.join(a.apis) or 'nothing'}")
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.tokenizer == "auto":
        a.tokenizer = "words" if "http" in a.apis else "none"
    if "http" in a.apis and a.tokenizer == "none":
        p.error("--apis http needs --tokenizer words: without a tokenizer the HTTP API streams no chunk per token")
    a.hot_experts_cfg = None
    if eplb:
        if a.workloads != ["eplb"]:
            p.error("--workloads eplb runs alone (its model has hot experts, which would skew the other workloads)")
        if a.configs != ["moeserve-ep2"]:
            p.error("--workloads eplb measures the EP configuration with redundant experts: --configs moeserve-ep2")
        if a.apis != ["grpc"]:
            p.error("--workloads eplb runs through the gRPC API only (--apis grpc)")
        if a.redundant_experts < 1:
            p.error("--workloads eplb needs --redundant-experts >= 1")
        from moeserve.models.dummy import parse_hot

        try:
            hot = parse_hot(a.hot_experts)
        except ValueError as e:
            p.error(f"--hot-experts: {e}")
        if hot is None:
            p.error("--hot-experts must name at least one hot expert")
        conf = SHAPES[a.shape]["config"]
        experts = conf.get("num_local_experts") or conf.get("moe_num_experts")
        r = a.redundant_experts
        # the start placement puts expert p mod E on slot p (workers take consecutive slots), so
        # experts R .. R+K-1 have one copy each, all on worker 0 when they fit: the skew EPLB is for
        first = r if r + hot[0] <= min(experts, (experts + r) // 2) else 0
        a.hot_experts_cfg = dict(experts=hot[0], share=hot[1], ids=list(range(first, first + hot[0])))
        if a.eplb_step_model and not os.path.isfile(a.eplb_step_model):
            p.error(f"--eplb-step-model {a.eplb_step_model}: no such file")
        if not given_max_model_len:
            a.max_model_len = max(a.max_model_len, -(-(a.eplb_prompt + a.eplb_output) // 256) * 256)
    elif not set(a.workloads) <= {"burst", "online"} or "burst" not in a.workloads:
        p.error("--workloads is burst or burst,online (the online rate comes from the burst), or eplb")
    a.backend = "gloo" if smoke else "nccl"
    a.dtype = "float32" if smoke else "bfloat16"
    need = max(
        a.burst_prompt + a.burst_output,
        a.online_prompt[1] + a.online_output[1],
        a.eplb_prompt + a.eplb_output if eplb else 0,
    )
    if a.max_model_len < need:
        p.error(f"--max-model-len {a.max_model_len} < {need} tokens the workloads need")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    started = time.monotonic()
    out_path = a.json or os.path.join(ROOT, "benchmarks", "results", f"serving-{'smoke' if a.smoke else a.shape}.json")
    work = tempfile.mkdtemp(prefix="moeserve-serving-")
    config = dict(SHAPES[a.shape]["config"])
    if a.hot_experts_cfg:  # --workloads eplb: skewed routing (moeserve.models.dummy)
        from moeserve.models.dummy import HOT_CONFIG_KEY

        config[HOT_CONFIG_KEY] = a.hot_experts_cfg
    model_dir = write_model(os.path.join(work, "model"), config)
    if a.tokenizer == "words":
        write_tokenizer(model_dir, SHAPES[a.shape]["config"]["vocab_size"])
    dtype_bytes = 4 if a.dtype == "float32" else 2
    sizes = model_sizes(model_dir, dtype_bytes)

    facts = gpu_facts(2 if any(c.startswith("moeserve-ep2") for c in a.configs) else 1, a.smoke)
    measured = float(min(f["rate_Bps"] for f in facts))
    rates = {"datasheet": DATASHEET_HBM_BPS, "measured_copy": measured}
    print(
        f"{facts[0].get('name', 'cpu')}: device-to-device copy {measured / 1e12:.2f} TB/s "
        f"(datasheet {DATASHEET_HBM_BPS / 1e12:.1f})",
        flush=True,
    )

    rng = np.random.default_rng(a.seed)
    plans = {"burst": burst_plan(rng, a.burst_requests, a.burst_prompt, a.burst_output, sizes["vocab_size"])}
    if "online" in a.workloads:
        plans["online"] = True
    if "eplb" in a.workloads:
        plans["eplb"] = True
    result = dict(
        shape=a.shape,
        smoke=a.smoke,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        git=git_commit(),
        gpu=facts[0].get("name", "cpu"),
        device="cpu" if a.smoke else "cuda",
        gpus=len(facts) if not a.smoke else 0,
        dtype=a.dtype,
        load_format="dummy",
        apis=a.apis,
        tokenizer=a.tokenizer,
        model={k: v for k, v in sizes.items() if k not in ("chunked", "kv_layer_token", "eos")},
        config_json=config,
        workload=dict(
            burst=dict(
                requests=a.burst_requests, prompt=a.burst_prompt, output=a.burst_output, trim=a.trim, rounds=a.rounds
            ),
            online=dict(
                load=a.load,
                duration_s=a.duration,
                max_requests=a.requests,
                prompt=a.online_prompt,
                output=a.online_output,
                drain_s=a.drain,
            )
            if "online" in a.workloads
            else None,
            eplb=dict(
                requests=a.eplb_requests,
                prompt=a.eplb_prompt,
                output=a.eplb_output,
                hot_experts=a.hot_experts_cfg,
                rebalance_at_s=a.eplb_rebalance_at,
                move_budget=1.0,
                step_model=a.eplb_step_model,
                step_model_shape=a.eplb_step_model_shape,
            )
            if "eplb" in a.workloads
            else None,
            client_procs=a.client_procs,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_model_len=a.max_model_len,
        ),
        hbm=dict(datasheet_Bps=DATASHEET_HBM_BPS, measured_copy_Bps=measured, per_device=facts),
        configs={},
    )
    try:
        import torch

        result["torch"] = torch.__version__
    except ImportError:
        pass

    log_root = os.path.join(work, "logs")
    gpu_mem = min(f.get("memory_bytes", 0) for f in facts)
    for name in a.configs:
        t = time.monotonic()
        if name == "transformers":
            result["configs"][name] = run_transformers(model_dir, sizes, a, rates, plans)
        else:
            ranks = 2 if name.startswith("moeserve-ep2") else 1
            redundant = a.redundant_experts if ranks > 1 else 0
            weights = (
                sizes["router_bytes"]
                + (sizes["num_experts"] + redundant) // ranks * sizes["num_moe_layers"] * sizes["expert_bytes"]
            )
            if gpu_mem and weights > 0.85 * gpu_mem:
                result["configs"][name] = dict(
                    kind="moeserve",
                    ranks=ranks,
                    skipped=f"{weights / 2**30:.1f} GiB of weights do not fit {gpu_mem / 2**30:.0f} GiB",
                )
                continue
            if (sizes["num_experts"] + redundant) % ranks:
                raise SystemExit(f"(E + R) = {sizes['num_experts'] + redundant} is not a multiple of {ranks}")
            result["configs"][name] = run_moeserve(
                name, ranks, redundant, model_dir, sizes, a, rates, {k: v for k, v in plans.items()}, log_root
            )
        result["configs"][name]["elapsed_s"] = time.monotonic() - t
    ratios = {
        n: c["http_over_grpc_output_tok_s"] for n, c in result["configs"].items() if "http_over_grpc_output_tok_s" in c
    }
    if ratios:
        result["http_over_grpc_output_tok_s"] = ratios
    result["elapsed_s"] = time.monotonic() - started

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(table(result))
    print(f"wrote {out_path} in {result['elapsed_s']:.0f} s", flush=True)
    failed = [n for n, c in result["configs"].items() if c.get("error") and c.get("kind") == "moeserve"]
    if failed:
        print(f"logs of {', '.join(failed)} kept in {log_root}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
