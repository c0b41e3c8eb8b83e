#!/usr/bin/env python3
"""Serving end to end, as users feel it: moeserve behind its gRPC front end, against transformers.

    python benchmarks/serving.py --shape scout8       # 2 GPUs, about 8 minutes
    python benchmarks/serving.py --shape ernie28
    python benchmarks/serving.py --smoke              # CPU: tiny shape, gloo, 1 rank, a few requests

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
- ``transformers``: ``AutoModelForCausalLM.from_config`` (random init, bf16) and ``generate``
  (greedy, ``min_new_tokens`` = ``max_new_tokens``) on 1 GPU at the burst's batch; reported,
  not a target.

Workloads (``--workloads burst,online``):

- burst: ``--burst-requests`` (256) sequences of ``--burst-prompt`` (128) random ids and
  ``--burst-output`` (256) tokens, ignore_eos, all submitted at once. Output tok/s, and the
  steady decode step time: with every sequence decoding in lockstep, the gaps between a
  stream's consecutive tokens are the step times; taken in the window where all sequences
  are running (after the last first token, before the first last token: no prefill in the
  step), the first and last ``--trim`` (10) gaps of each stream left out; the median.
- online: Poisson arrivals at ``--load`` (70 %) of the maximum rate measured by the burst
  (burst output tok/s / the online requests' mean output length), prompts of 64-1,024 and
  outputs of 64-512 tokens (uniform, seeded), ignore_eos; ``--duration`` seconds of arrivals
  (at most ``--requests``). Output tok/s, TTFT p50/p99, inter-token latency p50/p99 and the
  ratio ITL p99 / p50. Requests still running ``--drain`` seconds after the last arrival are
  cancelled and counted.

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
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATASHEET_HBM_BPS = 4.8e12               # H200 SXM: 4.8 TB/s
TOKEN = "serving-bench"

SCOUT8 = {  # Llama-4-Scout-17B-16E's text_config (docs: MODELS.md), 8 decoder layers
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
    "vocab_size": 202048, "hidden_size": 5120, "num_hidden_layers": 8, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "no_rope_layers": [1, 1, 1, 0] * 2, "attention_chunk_size": 8192, "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "max_position_embeddings": 10485760, "initializer_range": 0.02,
    "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "pad_token_id": 200018,
    "torch_dtype": "bfloat16",
}
ERNIE28 = {  # baidu/ERNIE-4.5-21B-A3B-PT config.json, as published
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
    "hidden_size": 2560, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28, "rms_norm_eps": 1e-05,
    "use_cache": False, "vocab_size": 103424, "rope_theta": 500000, "use_rmsnorm": True,
    "tie_word_embeddings": True, "use_bias": False, "moe_num_experts": 64, "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_intermediate_size": 1536,
    "moe_capacity": [64, 64, 64], "moe_gate": "topk", "moe_k": 6, "moe_layer_interval": 1,
    "moe_use_aux_free": True, "weight_share_add_bias": True, "num_nextn_predict_layers": 1,
    "multi_token_pred_lambda": 0.3, "torch_dtype": "bfloat16",
}
TINY = {  # the smoke shape: moeserve init-model's small Llama 4
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96,
    "num_local_experts": 8, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
    "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 8, "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.1,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "initializer_range": 0.05,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32",
}
SHAPES = {"scout8": dict(config=SCOUT8, redundant=2), "ernie28": dict(config=ERNIE28, redundant=2),
          "tiny": dict(config=TINY, redundant=2)}
CONFIGS = ("moeserve-ep2", "moeserve-1rank", "transformers")

BURST_KEYS = ("requests", "prompt_tokens", "output_tokens_per_request", "completed", "errors", "wall_s",
              "output_tokens", "output_tok_s", "max_request_rate", "ttft_p50_s", "ttft_p99_s",
              "steady_step_s", "steady_step_mean_s", "steady_step_p10_s", "steady_step_p90_s", "steady_gaps",
              "steady_all_running", "steady_window_s", "steady_mean_context")
ONLINE_KEYS = ("requests", "load", "arrival_rate_req_s", "arrival_span_s", "prompt_tokens_range",
               "output_tokens_range", "completed", "cancelled", "errors", "wall_s", "output_tokens",
               "output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_p99_over_p50",
               "e2e_p50_s", "e2e_p99_s")
ROOFLINE_KEYS = ("gpus", "weight_bytes_per_gpu", "kv_bytes_per_step_per_gpu", "bytes_per_step_per_gpu",
                 "sequences_per_gpu", "mean_context", "datasheet", "measured_copy")


# ------------------------------------------------------------------------------------------
# small helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when this process dies (Linux), so nothing is left behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
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
        except Exception:                                        # queue.Empty
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
    except BaseException as e:                                   # noqa: BLE001 - reported to the parent
        q.put(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


# ------------------------------------------------------------------------------------------
# the model folder and its sizes


def write_model(folder: str, config: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    eos = config["eos_token_id"]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos,
                   "pad_token_id": config.get("pad_token_id")}, f, indent=2)
    return folder


def model_sizes(model_dir: str, dtype_bytes: int) -> dict:
    """Bytes of the router side (everything but the routed experts) and of one routed expert,
    from config.json alone (the tensors a checkpoint of it holds; ERNIE's gate and correction
    bias in float32, as the model keeps them)."""
    from moeserve.models.config import load_config
    cfg = load_config(model_dir)
    h, v = cfg.hidden_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    router = v * h * (1 if cfg.tie_word_embeddings else 2) + h            # embed (+ lm_head), final norm
    router_fp32 = 0
    for layer in range(cfg.num_layers):
        router += 2 * q * h + 2 * kv * h + 2 * h                            # q, k, v, o, two norms
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
    return dict(family=cfg.family, num_layers=cfg.num_layers, num_moe_layers=cfg.num_moe_layers,
                num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=h, vocab_size=v,
                router_bytes=router * dtype_bytes + router_fp32 * 4, expert_bytes=expert,
                all_experts_bytes=expert * cfg.num_experts * cfg.num_moe_layers,
                kv_bytes_per_token=kv_layer_token * cfg.num_layers,
                chunked=[bool(c) for c in cfg.chunked_attention], chunk=cfg.attention_chunk_size,
                kv_layer_token=kv_layer_token, eos=list(cfg.eos_token_ids))


def kv_bytes_read(sizes: dict, contexts) -> float:
    """KV bytes one decode step reads for sequences at these context lengths (a chunked-attention
    layer reads only the current chunk)."""
    total = 0.0
    for ctx in contexts:
        for chunked in sizes["chunked"]:
            n = (ctx - 1) % sizes["chunk"] + 1 if chunked and sizes["chunk"] else ctx
            total += n * sizes["kv_layer_token"]
    return total


def roofline(weight_bytes: float, kv_bytes: float, step_s: float | None, rates: dict, gpus: int,
             seqs_per_gpu: float, mean_ctx: float | None) -> dict:
    total = weight_bytes + kv_bytes
    out = dict(gpus=gpus, weight_bytes_per_gpu=int(weight_bytes), kv_bytes_per_step_per_gpu=int(kv_bytes),
               bytes_per_step_per_gpu=int(total), sequences_per_gpu=seqs_per_gpu, mean_context=mean_ctx)
    for name, rate in rates.items():
        t = total / rate if rate else None
        out[name] = dict(rate_Bps=rate, step_s=t,
                         step_over_roofline=(step_s / t) if (t and step_s) else None,
                         roofline_share=(t / step_s) if (t and step_s) else None)
    return out


# ------------------------------------------------------------------------------------------
# the HBM copy rate, in its own process per device


def measure_copy(device: str, nbytes: int, iters: int) -> dict:
    import torch
    dev = torch.device(device)
    info = {"device": device}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        info.update(name=torch.cuda.get_device_name(dev),
                    memory_bytes=torch.cuda.get_device_properties(dev).total_memory)
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
# clients: processes with an asyncio loop each, streaming through the SDK


def client_main(address: str, plan: list, t0_value, go, results, warm: bool, deadline_s: float) -> None:
    """Run ``plan`` [(index, offset_s, prompt_ids, max_tokens)]; every time is relative to t0
    (``time.monotonic()``, one clock for every process of the host), set by the parent."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_client(address, plan, t0_value, go, results, warm, deadline_s))


async def _client(address, plan, t0_value, go, results, warm, deadline_s) -> None:
    from moeserve.client import AsyncClient
    client = AsyncClient(address, timeout=deadline_s)
    if warm:                                              # connect, and one token through every layer
        async for _ in client.generate_stream(prompt_token_ids=[5, 6, 7], max_tokens=1, ignore_eos=True):
            pass
    results.put(("ready", None))
    while not go.wait(0.05):
        await asyncio.sleep(0)
    t0 = t0_value.value
    deadline = t0 + deadline_s

    async def one(i, offset, prompt, n):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        rec = {"i": i, "submit": time.monotonic() - t0, "tokens": [], "prompt_len": len(prompt), "max_tokens": n,
               "finish": None, "error": None}

        async def stream():
            async for chunk in client.generate_stream(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True):
                now = time.monotonic() - t0
                rec["tokens"].extend([now] * len(chunk.token_ids))
                if chunk.finish_reason:
                    rec["finish"] = chunk.finish_reason
        try:
            await asyncio.wait_for(stream(), timeout=max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            rec["finish"] = "timeout"
        except Exception as e:                                # noqa: BLE001 - recorded per request
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec

    recs = await asyncio.gather(*(one(*p) for p in plan))
    await client.close()
    results.put(("done", recs))


def drive(address: str, plan: list, procs: int, deadline_s: float) -> list[dict]:
    """Split ``plan`` round-robin over ``procs`` client processes, start them together, and
    return every request's record (times relative to the common start)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    t0 = ctx.Value("d", 0.0)
    go = ctx.Event()
    shares = [plan[k::procs] for k in range(procs)]
    shares = [s for s in shares if s]
    ps = [ctx.Process(target=client_main, args=(address, s, t0, go, results, True, deadline_s), daemon=True)
          for s in shares]
    for p in ps:
        p.start()
    ready = 0
    limit = time.monotonic() + 120
    while ready < len(ps):
        try:
            kind, _ = results.get(timeout=1.0)
            ready += kind == "ready"
        except Exception:                                        # queue.Empty
            if any(not p.is_alive() for p in ps) or time.monotonic() > limit:
                for p in ps:
                    p.kill()
                raise RuntimeError("a client process did not start")
    t0.value = time.monotonic() + 0.2
    go.set()
    recs = []
    done = 0
    limit = time.monotonic() + deadline_s + 60
    while done < len(ps):
        try:
            kind, payload = results.get(timeout=1.0)
        except Exception:                                        # queue.Empty
            if time.monotonic() > limit or all(not p.is_alive() for p in ps):
                for p in ps:
                    p.kill()
                raise RuntimeError("a client process did not finish")
            continue
        if kind == "done":
            recs.extend(payload)
            done += 1
    for p in ps:
        p.join(10)
    return sorted(recs, key=lambda r: r["i"])


# ------------------------------------------------------------------------------------------
# workloads and their figures


def burst_plan(rng: np.random.Generator, n: int, prompt: int, output: int, vocab: int) -> list:
    return [(i, 0.0, rng.integers(3, vocab, prompt).tolist(), output) for i in range(n)]


def online_plan(rng: np.random.Generator, rate: float, count: int, prompts: tuple, outputs: tuple, vocab: int,
                first: int = 0) -> list:
    gaps = rng.exponential(1.0 / rate, count)
    offsets = np.cumsum(gaps) - gaps[0]
    plen = rng.integers(prompts[0], prompts[1] + 1, count)
    olen = rng.integers(outputs[0], outputs[1] + 1, count)
    return [(first + i, float(offsets[i]), rng.integers(3, vocab, int(plen[i])).tolist(), int(olen[i]))
            for i in range(count)]


def steady_steps(recs: list[dict], trim: int) -> dict:
    """The step times of the window where every sequence is decoding: after the last first token
    (no prompt is being prefilled any more) and before the first last token (none finished)."""
    ok = [r for r in recs if r["tokens"]]
    out = dict(steady_step_s=None, steady_step_mean_s=None, steady_step_p10_s=None, steady_step_p90_s=None,
               steady_gaps=0, steady_all_running=False, steady_window_s=None, steady_mean_context=None)
    if not ok:
        return out
    lo = max(r["tokens"][0] for r in ok)
    hi = min(r["tokens"][-1] for r in ok)
    all_running = len(ok) == len(recs) and hi > lo
    gaps, ctxs, means = [], [], []
    for r in ok:
        ts = r["tokens"]
        idx = [j for j in range(1, len(ts)) if ts[j - 1] >= lo and ts[j] <= hi] if all_running else \
            list(range(1, len(ts)))
        idx = idx[trim:len(idx) - trim] if len(idx) > 2 * trim else []
        if not idx:
            continue
        gaps.extend(ts[j] - ts[j - 1] for j in idx)
        ctxs.extend(r["prompt_len"] + j for j in idx)
        if len(idx) > 1:
            means.append((ts[idx[-1]] - ts[idx[0] - 1]) / len(idx))
    if not gaps:
        return out
    out.update(steady_step_s=pct(gaps, 50), steady_step_mean_s=float(np.median(means)) if means else float(np.mean(gaps)),
               steady_step_p10_s=pct(gaps, 10), steady_step_p90_s=pct(gaps, 90), steady_gaps=len(gaps),
               steady_all_running=all_running, steady_window_s=[lo, hi] if all_running else None,
               steady_mean_context=float(np.mean(ctxs)))
    return out


def burst_figures(recs: list[dict], prompt: int, output: int, trim: int) -> dict:
    done = [r for r in recs if r["error"] is None and r["finish"] not in (None, "timeout")]
    toks = sum(len(r["tokens"]) for r in recs)
    last = max((r["tokens"][-1] for r in recs if r["tokens"]), default=0.0)
    first_submit = min(r["submit"] for r in recs)
    wall = last - first_submit
    ttft = [r["tokens"][0] - r["submit"] for r in recs if r["tokens"]]
    out = dict(requests=len(recs), prompt_tokens=prompt, output_tokens_per_request=output, completed=len(done),
               errors=sorted({r["error"] for r in recs if r["error"]})[:5], wall_s=wall, output_tokens=toks,
               output_tok_s=toks / wall if wall > 0 else None, max_request_rate=len(done) / wall if wall > 0 else None,
               ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99))
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
    return dict(requests=len(recs), load=load, arrival_rate_req_s=rate,
                arrival_span_s=max(r["submit"] for r in recs) - first_submit,
                prompt_tokens_range=list(prompts), output_tokens_range=list(outputs), completed=len(done),
                cancelled=sum(r["finish"] == "timeout" for r in recs),
                errors=sorted({r["error"] for r in recs if r["error"]})[:5], wall_s=wall, output_tokens=toks,
                output_tok_s=toks / wall if wall > 0 else None, ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
                itl_p50_s=p50, itl_p99_s=p99, itl_p99_over_p50=(p99 / p50) if p50 else None,
                e2e_p50_s=pct(e2e, 50), e2e_p99_s=pct(e2e, 99))


# ------------------------------------------------------------------------------------------
# moeserve: ``moeserve up`` with the clients in front


class Up:
    """``python -m moeserve up ...`` as a child process, until ``stop``."""

    def __init__(self, model_dir: str, ranks: int, redundant: int, a, log_dir: str):
        self.ports = {"port": free_port(), "admin": free_port(), "balancer": free_port()}
        while len(set(self.ports.values())) < 3:
            self.ports["balancer"] = free_port()
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "moeserve", "up", "--model", model_dir, "--load-format", "dummy",
               "--routers", str(ranks), "--workers", str(ranks), "--colocated", "--backend", a.backend,
               "--dtype", a.dtype, "--exchange", a.exchange,
               "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
               "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-waiting", "100000",
               "--port", str(self.ports["port"]), "--admin-port", str(self.ports["admin"]),
               "--balancer-port", str(self.ports["balancer"]), "--admin-token", TOKEN,
               "--grace-period", "5", "--startup-timeout", str(a.startup_timeout), "--log-dir", log_dir,
               "--eplb-step-interval", "1000000000"]                # the balancer never rebalances here
        if redundant:
            cmd += ["--enable-eplb", "--num-redundant-experts", str(redundant)]
        self.cmd = cmd
        self.out_path = os.path.join(log_dir, "up.out")
        self.t0 = time.monotonic()
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + a.startup_timeout + 30
        while "ready" not in self._out().split():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moeserve up did not become ready (logs in {log_dir}):\n{self.tail()}")
            time.sleep(0.2)
        self.startup_s = time.monotonic() - self.t0
        self.serving = f"127.0.0.1:{self.ports['port']}"
        self.admin = f"127.0.0.1:{self.ports['admin']}"

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
        return dict(forward_steps=s.forward_steps, step=s.step, running=s.running, waiting=s.waiting,
                    kv_blocks_total=getattr(s, "kv_blocks_total", 0), kv_blocks_used=getattr(s, "kv_blocks_used", 0),
                    preemptions=getattr(s, "preemptions", 0))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_moeserve(name: str, ranks: int, redundant: int, model_dir: str, sizes: dict, a, rates: dict,
                 plans: dict, log_root: str) -> dict:
    res: dict = dict(kind="moeserve", ranks=ranks, gpus=ranks if a.backend == "nccl" else 0,
                     redundant_experts=redundant, backend=a.backend, exchange=a.exchange, error=None,
                     burst=None, online=None, roofline=None, engine=None)
    up = None
    try:
        up = Up(model_dir, ranks, redundant, a, os.path.join(log_root, name))
        res["startup_s"] = up.startup_s
        print(f"[{name}] ready in {up.startup_s:.0f} s", flush=True)
        # warm-up: the burst's batch through prefill and a few decode steps
        drive(up.serving, [(i, 0.0, p, min(16, n)) for i, _, p, n in plans["burst"]], a.client_procs, 300)
        if "burst" in plans:
            s0 = up.status()
            recs = drive(up.serving, plans["burst"], a.client_procs, a.burst_timeout)
            s1 = up.status()
            b = burst_figures(recs, a.burst_prompt, a.burst_output, a.trim)
            steps = s1["forward_steps"] - s0["forward_steps"]
            res["engine"] = dict(burst_forward_steps=steps,
                                 burst_wall_per_step_s=(b["wall_s"] / steps) if steps else None,
                                 preemptions=s1["preemptions"] - s0["preemptions"],
                                 kv_blocks_total=s1["kv_blocks_total"])
            res["burst"] = b
            weights = sizes["router_bytes"] + (sizes["num_experts"] + redundant) // ranks * \
                sizes["num_moe_layers"] * sizes["expert_bytes"]
            per_gpu = a.burst_requests / ranks
            ctx = b["steady_mean_context"] or (a.burst_prompt + a.burst_output / 2)
            kv = kv_bytes_read(sizes, [int(round(ctx))]) * per_gpu
            res["roofline"] = roofline(weights, kv, b["steady_step_s"], rates, max(1, ranks), per_gpu, ctx)
            print(f"[{name}] burst: {b['output_tok_s'] or 0:.0f} tok/s, step {1e3 * (b['steady_step_s'] or 0):.2f} ms",
                  flush=True)
        if "online" in plans:
            base = res["burst"]["output_tok_s"] if res["burst"] else None
            if not base:
                raise RuntimeError("the online workload needs the burst's throughput")
            mean_out = (a.online_output[0] + a.online_output[1]) / 2
            rate = a.load * base / mean_out
            count = max(1, min(a.requests, int(math.ceil(rate * a.duration))))
            plan = online_plan(np.random.default_rng(a.seed + 1), rate, count, tuple(a.online_prompt),
                               tuple(a.online_output), sizes["vocab_size"], first=10 ** 6)
            recs = drive(up.serving, plan, a.client_procs, plan[-1][1] + a.drain)
            res["online"] = online_figures(recs, a.load, rate, tuple(a.online_prompt), tuple(a.online_output))
            o = res["online"]
            print(f"[{name}] online: {o['requests']} requests at {rate:.1f}/s, {o['output_tok_s'] or 0:.0f} tok/s, "
                  f"ITL p50 {1e3 * (o['itl_p50_s'] or 0):.1f} ms p99 {1e3 * (o['itl_p99_s'] or 0):.1f} ms", flush=True)
        if not up.alive():
            raise RuntimeError(f"moeserve up exited during the run:\n{up.tail()}")
    except Exception as e:                                       # noqa: BLE001 - one configuration's failure
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] failed: {res['error']}", flush=True)
        if up is not None:
            print(up.tail(), flush=True)
    finally:
        if up is not None:
            up.stop()
    return res


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
            out = model.generate(input_ids=x, attention_mask=m, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad, use_cache=True)
        sync()
        return time.perf_counter() - t0, out.shape[1] - x.shape[1]

    gen(2, rows=min(8, len(prompts)))                            # warm-up
    prefill_s, _ = gen(1)
    total_s, made = gen(new_tokens)
    step = (total_s - prefill_s) / (made - 1) if made > 1 else None
    return dict(transformers=transformers.__version__, init_s=init_s, weight_bytes=weight_bytes,
                prefill_s=prefill_s, total_s=total_s, new_tokens=made, step_s=step,
                peak_memory_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None)


def run_transformers(model_dir: str, sizes: dict, a, rates: dict, plans: dict) -> dict:
    res: dict = dict(kind="transformers", gpus=0 if a.smoke else 1, error=None, burst=None, online=None,
                     roofline=None)
    prompts = [p for _, _, p, _ in plans["burst"]]
    device = "cpu" if a.smoke else "cuda:0"
    out, err = run_in_process(hf_generate, (model_dir, device, a.dtype, prompts, a.burst_output,
                                            int(TINY["pad_token_id"] if a.smoke else 0)), a.hf_timeout)
    if err:
        res["error"] = err.splitlines()[0] if err else err
        res["error_detail"] = err
        print(f"[transformers] failed: {res['error']}", flush=True)
        return res
    n, new = len(prompts), out["new_tokens"]
    res["run"] = out
    res["burst"] = dict(requests=n, prompt_tokens=a.burst_prompt, output_tokens_per_request=new,
                        output_tokens=n * new, wall_s=out["total_s"], output_tok_s=n * new / out["total_s"],
                        prefill_s=out["prefill_s"], steady_step_s=out["step_s"])
    ctx = a.burst_prompt + new / 2
    kv = kv_bytes_read(sizes, [int(round(ctx))]) * n
    res["roofline"] = roofline(out["weight_bytes"], kv, out["step_s"], rates, 1, n, ctx)
    print(f"[transformers] {res['burst']['output_tok_s']:.0f} tok/s, step {1e3 * (out['step_s'] or 0):.2f} ms",
          flush=True)
    return res


# ------------------------------------------------------------------------------------------
# table and main


def _ms(x) -> str:
    return f"{1e3 * x:>9.3g}" if isinstance(x, (int, float)) else f"{'-':>9}"


def _num(x, fmt="8.0f") -> str:
    width = int(fmt.split('.')[0])
    if not isinstance(x, (int, float)):
        return f"{'-':>{width}}"
    text = format(x, fmt).strip()
    return text.rjust(width) if len(text) < width else (" " + format(x, ".3g")).rjust(width)


def table(result: dict) -> str:
    lines = [f"serving benchmark: {result['shape']} on {result['gpu']} ({result['device']})",
             f"{'config':<16}{'burst tok/s':>12}{'step ms':>9}{'roof ms':>9}{'x roof':>8}{'roofc ms':>9}{'x roofc':>8}"
             f"{'onl tok/s':>10}{'TTFT50 ms':>10}{'TTFT99 ms':>10}{'ITL50 ms':>9}{'ITL99 ms':>9}{'99/50':>7}"]
    for name, c in result["configs"].items():
        if c.get("skipped"):
            lines.append(f"{name:<16} skipped: {c['skipped']}")
            continue
        if c.get("error") and not c.get("burst"):
            lines.append(f"{name:<16} failed: {c['error'][:100]}")
            continue
        b, o, r = c.get("burst") or {}, c.get("online") or {}, c.get("roofline") or {}
        ds, mc = r.get("datasheet") or {}, r.get("measured_copy") or {}
        lines.append(f"{name:<16}{_num(b.get('output_tok_s'), '12.0f')}{_ms(b.get('steady_step_s'))}"
                     f"{_ms(ds.get('step_s'))}{_num(ds.get('step_over_roofline'), '8.2f')}"
                     f"{_ms(mc.get('step_s'))}{_num(mc.get('step_over_roofline'), '8.2f')}"
                     f"{_num(o.get('output_tok_s'), '10.0f')} {_ms(o.get('ttft_p50_s'))} {_ms(o.get('ttft_p99_s'))}"
                     f"{_ms(o.get('itl_p50_s'))}{_ms(o.get('itl_p99_s'))}{_num(o.get('itl_p99_over_p50'), '7.2f')}")
    hb = result["hbm"]
    lines.append(f"roofline: (weights on a GPU + KV read per step) / HBM rate; roof = datasheet "
                 f"{hb['datasheet_Bps'] / 1e12:.1f} TB/s, roofc = measured copy {hb['measured_copy_Bps'] / 1e12:.2f} TB/s; "
                 f"x roof = measured step / roofline step")
    for name, c in result["configs"].items():
        r = c.get("roofline")
        if r:
            lines.append(f"  {name:<14} weights {r['weight_bytes_per_gpu'] / 2**30:7.2f} GiB/GPU, KV read "
                         f"{r['kv_bytes_per_step_per_gpu'] / 2**30:6.3f} GiB/step/GPU, {r['sequences_per_gpu']:.0f} "
                         f"sequences/GPU at mean context {r['mean_context'] or 0:.0f}")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="scout8 or ernie28 (smoke: tiny)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shape, gloo, 1 rank, a few requests")
    p.add_argument("--configs", default=None, help=f"comma list of {','.join(CONFIGS)} (default: all; smoke: "
                                                   "moeserve-1rank,transformers)")
    p.add_argument("--workloads", default="burst,online", help="burst,online (online needs burst)")
    p.add_argument("--burst-requests", type=int, default=None)
    p.add_argument("--burst-prompt", type=int, default=None)
    p.add_argument("--burst-output", type=int, default=None)
    p.add_argument("--trim", type=int, default=None, help="steps left out at each end of the steady window (10)")
    p.add_argument("--load", type=float, default=0.7, help="online arrival rate as a share of the burst's (0.7)")
    p.add_argument("--duration", type=float, default=None, help="seconds of online arrivals (30; smoke 2)")
    p.add_argument("--requests", type=int, default=None, help="at most this many online requests (2000; smoke 6)")
    p.add_argument("--online-prompt", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--online-output", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--drain", type=float, default=None, help="seconds after the last arrival before cancelling (45)")
    p.add_argument("--client-procs", type=int, default=None, help="client processes (8; smoke 2)")
    p.add_argument("--redundant-experts", type=int, default=None, help="redundant slots per MoE layer of the EP run")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--exchange", default="auto", choices=("auto", "collective", "nvlink"))
    p.add_argument("--startup-timeout", type=float, default=None)
    p.add_argument("--burst-timeout", type=float, default=None)
    p.add_argument("--hf-timeout", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="output file (default benchmarks/results/serving-<shape>.json)")
    a = p.parse_args(argv)
    smoke = a.smoke
    if a.shape is None:
        a.shape = "tiny" if smoke else None
    if a.shape is None:
        p.error("--shape scout8|ernie28 (or --smoke)")
    defaults = dict(burst_requests=(8, 256), burst_prompt=(16, 128), burst_output=(32, 256), trim=(2, 10),
                    duration=(2.0, 30.0), requests=(6, 2000), online_prompt=([8, 48], [64, 1024]),
                    online_output=([8, 32], [64, 512]), drain=(30.0, 45.0), client_procs=(2, 8),
                    max_num_seqs=(64, 256), max_num_batched_tokens=(512, 8192), max_model_len=(256, 2048),
                    startup_timeout=(120.0, 420.0), burst_timeout=(120.0, 300.0), hf_timeout=(180.0, 300.0))
    for k, (small, big) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, small if smoke else big)
    if a.redundant_experts is None:
        a.redundant_experts = SHAPES[a.shape]["redundant"]
    a.configs = (a.configs or ("moeserve-1rank,transformers" if smoke else ",".join(CONFIGS))).split(",")
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configs {bad}; choose from {CONFIGS}")
    a.workloads = a.workloads.split(",")
    if not set(a.workloads) <= {"burst", "online"} or "burst" not in a.workloads:
        p.error("--workloads is burst or burst,online (the online rate comes from the burst)")
    a.backend = "gloo" if smoke else "nccl"
    a.dtype = "float32" if smoke else "bfloat16"
    need = max(a.burst_prompt + a.burst_output, a.online_prompt[1] + a.online_output[1])
    if a.max_model_len < need:
        p.error(f"--max-model-len {a.max_model_len} < {need} tokens the workloads need")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    started = time.monotonic()
    out_path = a.json or os.path.join(ROOT, "benchmarks", "results", f"serving-{'smoke' if a.smoke else a.shape}.json")
    work = tempfile.mkdtemp(prefix="moeserve-serving-")
    model_dir = write_model(os.path.join(work, "model"), SHAPES[a.shape]["config"])
    dtype_bytes = 4 if a.dtype == "float32" else 2
    sizes = model_sizes(model_dir, dtype_bytes)

    facts = gpu_facts(2 if "moeserve-ep2" in a.configs else 1, a.smoke)
    measured = float(min(f["rate_Bps"] for f in facts))
    rates = {"datasheet": DATASHEET_HBM_BPS, "measured_copy": measured}
    print(f"{facts[0].get('name', 'cpu')}: device-to-device copy {measured / 1e12:.2f} TB/s "
          f"(datasheet {DATASHEET_HBM_BPS / 1e12:.1f})", flush=True)

    rng = np.random.default_rng(a.seed)
    plans = {"burst": burst_plan(rng, a.burst_requests, a.burst_prompt, a.burst_output, sizes["vocab_size"])}
    if "online" in a.workloads:
        plans["online"] = True
    result = dict(shape=a.shape, smoke=a.smoke, command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                  git=git_commit(), gpu=facts[0].get("name", "cpu"), device="cpu" if a.smoke else "cuda",
                  gpus=len(facts) if not a.smoke else 0, dtype=a.dtype, load_format="dummy",
                  model={k: v for k, v in sizes.items() if k not in ("chunked", "kv_layer_token", "eos")},
                  config_json=SHAPES[a.shape]["config"],
                  workload=dict(burst=dict(requests=a.burst_requests, prompt=a.burst_prompt, output=a.burst_output,
                                           trim=a.trim),
                                online=dict(load=a.load, duration_s=a.duration, max_requests=a.requests,
                                            prompt=a.online_prompt, output=a.online_output, drain_s=a.drain)
                                if "online" in a.workloads else None,
                                client_procs=a.client_procs, max_num_seqs=a.max_num_seqs,
                                max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len),
                  hbm=dict(datasheet_Bps=DATASHEET_HBM_BPS, measured_copy_Bps=measured, per_device=facts),
                  configs={})
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
            ranks = 2 if name == "moeserve-ep2" else 1
            redundant = a.redundant_experts if ranks > 1 else 0
            weights = sizes["router_bytes"] + (sizes["num_experts"] + redundant) // ranks * \
                sizes["num_moe_layers"] * sizes["expert_bytes"]
            if gpu_mem and weights > 0.85 * gpu_mem:
                result["configs"][name] = dict(kind="moeserve", ranks=ranks, skipped=f"{weights / 2**30:.1f} GiB "
                                               f"of weights do not fit {gpu_mem / 2**30:.0f} GiB")
                continue
            if (sizes["num_experts"] + redundant) % ranks:
                raise SystemExit(f"(E + R) = {sizes['num_experts'] + redundant} is not a multiple of {ranks}")
            result["configs"][name] = run_moeserve(name, ranks, redundant, model_dir, sizes, a, rates,
                                                   {k: v for k, v in plans.items()}, log_root)
        result["configs"][name]["elapsed_s"] = time.monotonic() - t
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
