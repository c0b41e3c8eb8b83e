#!/usr/bin/env python3
"""Serving end to end, as users feel it: moeserve behind its gRPC front end, against transformers.

    python benchmarks/serving.py --shape scout8       # 2 GPUs, about 8 minutes
    python benchmarks/serving.py --shape ernie28
    python3 benchmarks/serving.py --shape qwen3_30b --configs moeserve-1rank --workloads burst   # 1 GPU
    python3 benchmarks/serving.py --shape gptoss20b --configs moeserve-1rank --workloads burst   # 1 GPU
    python benchmarks/serving.py --smoke              # CPU: tiny shape, gloo, 1 rank, a few requests
    python benchmarks/serving.py --shape scout8 --apis grpc,http     # also through the HTTP API
    python3 benchmarks/serving.py --shape scout8 --configs moeserve-ep2 --workloads eplb   # EPLB end to end, 2 GPUs
    python benchmarks/serving.py --smoke --workloads eplb                 # the same on the CPU (gloo, 2 ranks)
    python3 benchmarks/serving.py --shape scout8 --configs moeserve-1rank,moeserve-1rank-no-prefix-cache \
        --workloads prefix,multiturn                                     # prefix caching, 1 GPU
    python benchmarks/serving.py --smoke --workloads prefix,multiturn    # the same on the CPU

Weights are seeded random numbers made on the device (``--load-format dummy``): the model
folder is a ``config.json`` written here, nothing is downloaded. Shapes (bf16):

- ``scout8``: Llama 4 Scout's text config (hidden 5120, 40 heads / 8 KV heads of 128, 16
  experts of width 8192 top-1, one shared expert, every layer MoE, chunked attention 8192,
  NoPE every 4th layer, llama3 RoPE scaling, vocab 202,048) cut to 8 decoder layers;
- ``ernie28``: ERNIE-4.5-21B-A3B's published config.json (28 layers, hidden 2560, 64 experts
  top-6 of width 1536, 2 shared experts, layer 0 dense, vocab 103,424);
- ``qwen3_30b``: Qwen3-30B-A3B's published config.json (48 layers, hidden 2048, 32 / 4 heads of
  128 with qk-norm, 128 experts top-8 of width 768 renormalised, vocab 151,936; 61 GB in bf16);
- ``gptoss20b``: GPT-OSS-20B's published config.json (24 layers alternating a window of 128 and
  full attention with sinks, hidden 2880, 64 / 8 heads of 64 with biases, YaRN, 32 experts top-4
  of width 2880 with biases and the clamped SwiGLU, vocab 201,088), its experts in bf16 (the
  published checkpoint's MXFP4 is not served; 42 GB in bf16);
- ``dsv3_7``: DeepSeek-V3's published config.json (MLA with a latent cache of 576 values per
  token and layer, 256 experts top-8 in 8 groups of which 4 are picked, one shared expert) cut to
  its 3 dense and 4 MoE layers in bf16 (~22.5 GB of experts per MoE layer); ``dsv3_13_fp8``:
  3 + 10 layers in its published block-wise FP8.

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
- ``moeserve-ep2-fp8``, ``moeserve-1rank-fp8`` (only when named): the same with
  ``--quantization fp8``: FP8 experts, shared experts and dense MLPs (dummy codes made as FP8,
  per-channel scales; W8A8 where it applies, the default), the roofline counted on the quantized
  bytes; ``--shape scout48`` (Scout's whole text model) and ``maverick12`` fit one H200 only so;
  ``moeserve-ep2-fp8-weight-only``, ``moeserve-1rank-fp8-weight-only``: the same with every FP8
  product weight-only (``MOESERVE_FP8_ACTIVATIONS=weight-only``);
- ``-no-late-schedule`` after ``moeserve-ep2`` or ``moeserve-1rank`` in any of these names (e.g.
  ``moeserve-1rank-no-late-schedule-no-prefix-cache``): the same without late scheduling
  (``--no-late-scheduling``; docs/dataplane.md, "Late scheduling"), for side-by-side runs;
- ``moeserve-ep2-no-prefix-cache``, ``moeserve-1rank-no-prefix-cache`` (only when named): the same
  with ``--no-enable-prefix-caching``, side by side with the default's prefix caching;
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

- prefix and multiturn (``--workloads prefix,multiturn``, alone or after burst,online; the
  moeserve configurations only): prefix caching (``servinglib.prefix``). prefix:
  ``--prefix-requests`` (256) requests sharing a system prompt of ``--prefix-system`` (2,048)
  ids, each with ``--prefix-unique`` (64) of its own and ``--prefix-output`` (128) tokens out,
  Poisson arrivals at ``--prefix-rate`` (32) requests/s (an uncached server then needs 68k
  prompt tokens/s of prefill, about one H200's Scout-8L prefill rate); multiturn:
  ``--multiturn-conversations`` (64) conversations of ``--multiturn-turns`` (8) turns starting at
  ``--multiturn-rate`` (4) per second, each turn resending the conversation so far with
  ``--multiturn-new`` (64) new ids, answered with ``--multiturn-output`` (128) tokens, the next
  turn sent when the answer came back (through gRPC). Each reports TTFT p50/p99, output tok/s and
  the share of prompt tokens read from the cache (``usage.cached_tokens``; multiturn: of the
  turns after the first), and ``prefix_caching`` puts each configuration beside its
  ``-no-prefix-cache`` twin: uncached / cached TTFT p50 and p99, cached / uncached output tok/s,
  and the share of requests whose generated ids are the same in both (greedy, the same dummy
  weights; in bf16 a hit changes the attention's shape).
  Every run of every workload sends a ``cache_salt`` of its own, so no run (the burst's rounds,
  the APIs, the warm-ups) reads what another left in the cache.

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
slots included, + the KV bytes the step reads) / HBM rate, for the device's datasheet rate
(``servinglib.roofline.datasheet_hbm_bps``: 4.8 TB/s on an H200, 3.35 on an H100 SXM; on a device
not in its table, the CPU included, the measured copy rate stands in for it, said so, and the
JSON's ``hbm.datasheet_Bps`` is null) and for the rate of a large device-to-device copy measured
in the same run; the measured step time
is reported as a multiple of the roofline step time (``step_over_roofline``: 1.0 = at the
roofline) and its inverse (``roofline_share``).

Prints a table and writes JSON (``--json``, default benchmarks/results/serving-<shape>.json)
with every figure, the command, the git commit and the GPU's name. Only stable public
interfaces are used: ``moeserve up`` and its flags, the front end, the SDK, ``load_config``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # moeserve, from a bare copy of the repository too
sys.path.insert(0, HERE)  # servinglib

from servinglib.args import APIS, CONFIGS, EXTRA_CONFIGS, PREFIX_WORKLOADS  # noqa: E402, F401
from servinglib.args import parse as parse_args  # noqa: E402
from servinglib.baseline import run_transformers  # noqa: E402
from servinglib.cluster import is_fp8  # noqa: E402
from servinglib.common import git_commit, switches  # noqa: E402
from servinglib.figures import burst_plan  # noqa: E402
from servinglib.prefix import conversation_plan, prefix_plan, prefix_table, side_by_side  # noqa: E402
from servinglib.report import table  # noqa: E402
from servinglib.roofline import PEAK_GEMM, gpu_facts, hbm_rates, rate_line  # noqa: E402
from servinglib.shapes import SHAPES, model_sizes, weights_per_gpu, write_model, write_tokenizer  # noqa: E402
from servinglib.workloads import run_moeserve  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    return parse_args(argv, __doc__ or "")


def main(argv=None) -> int:
    a = parse(argv)
    started = time.monotonic()
    out_path = a.json or os.path.join(ROOT, "benchmarks", "results", f"serving-{'smoke' if a.smoke else a.shape}.json")
    work = tempfile.mkdtemp(prefix="moeserve-serving-")
    config = dict(SHAPES[a.shape]["config"])
    if a.hot_experts_cfg:  # --workloads eplb: skewed routing (moeserve.models.dummy)
        from moeserve.models.dummy import HOT_CONFIG_KEY

        config[HOT_CONFIG_KEY] = a.hot_experts_cfg
    if a.dummy_routing == "spread":  # every MoE layer about evenly loaded (moeserve.models.dummy)
        from moeserve.models.dummy import ROUTING_CONFIG_KEY

        config[ROUTING_CONFIG_KEY] = "spread"
    model_dir = write_model(os.path.join(work, "model"), config)
    if a.tokenizer == "words":
        write_tokenizer(model_dir, SHAPES[a.shape]["config"]["vocab_size"])
    dtype_bytes = 4 if a.dtype == "float32" else 2
    sizes = model_sizes(model_dir, dtype_bytes)
    sizes_fp8 = model_sizes(model_dir, dtype_bytes, "fp8") if any(is_fp8(c) for c in a.configs) else None

    facts = gpu_facts(2 if any(c.startswith("moeserve-ep2") for c in a.configs) else 1, a.smoke)
    measured = float(min(f["rate_Bps"] for f in facts))
    rates, hbm = hbm_rates([f.get("name", "cpu") for f in facts], measured)
    peaks = [f["peak_flops"] for f in facts if f.get("peak_flops")]
    a.peak_flops = min(peaks) if peaks else None  # the FLOP-aware roofline's matmul peak (GPUs only)
    print(rate_line(hbm), flush=True)

    rng = np.random.default_rng(a.seed)
    plans: dict = {}
    if "burst" in a.workloads or "eplb" in a.workloads:
        plans["burst"] = burst_plan(rng, a.burst_requests, a.burst_prompt, a.burst_output, sizes["vocab_size"])
    if "online" in a.workloads:
        plans["online"] = True
    if "eplb" in a.workloads:
        plans["eplb"] = True
    if "prefix" in a.workloads:
        plans["prefix"] = prefix_plan(a, sizes["vocab_size"])
    if "multiturn" in a.workloads:
        plans["multiturn"] = conversation_plan(a, sizes["vocab_size"])
    result = dict(
        shape=a.shape,
        smoke=a.smoke,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        git=git_commit(),
        switches=switches(),
        gpu=facts[0].get("name", "cpu"),
        device="cpu" if a.smoke else "cuda",
        gpus=len(facts) if not a.smoke else 0,
        dtype=a.dtype,
        load_format="dummy",
        apis=a.apis,
        tokenizer=a.tokenizer,
        model={k: v for k, v in sizes.items() if k not in ("chunked", "windows", "kv_layer_token", "eos")},
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
            prefix=dict(
                requests=a.prefix_requests,
                system=a.prefix_system,
                unique=a.prefix_unique,
                output=a.prefix_output,
                rate_req_s=a.prefix_rate,
            )
            if "prefix" in a.workloads
            else None,
            multiturn=dict(
                conversations=a.multiturn_conversations,
                turns=a.multiturn_turns,
                new=a.multiturn_new,
                output=a.multiturn_output,
                rate_s=a.multiturn_rate,
            )
            if "multiturn" in a.workloads
            else None,
            client_procs=a.client_procs,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_model_len=a.max_model_len,
        ),
        hbm=dict(hbm, per_device=facts),
        matmul_peak=dict(flops=a.peak_flops, gemm_mkn=list(PEAK_GEMM), dtype="bfloat16", best_of=10),
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
            held = sizes_fp8 if is_fp8(name) and sizes_fp8 is not None else sizes
            weights = weights_per_gpu(held, redundant, ranks)
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
                name, ranks, redundant, model_dir, held, a, rates, {k: v for k, v in plans.items()}, log_root
            )
        result["configs"][name]["elapsed_s"] = time.monotonic() - t
    ratios = {
        n: c["http_over_grpc_output_tok_s"] for n, c in result["configs"].items() if "http_over_grpc_output_tok_s" in c
    }
    if ratios:
        result["http_over_grpc_output_tok_s"] = ratios
    compared = side_by_side(result["configs"])
    if compared:
        result["prefix_caching"] = compared
    result["elapsed_s"] = time.monotonic() - started

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(table(result))
    for line in prefix_table(result):
        print(line)
    print(f"wrote {out_path} in {result['elapsed_s']:.0f} s", flush=True)
    failed = [n for n, c in result["configs"].items() if c.get("error") and c.get("kind") == "moeserve"]
    if failed:
        print(f"logs of {', '.join(failed)} kept in {log_root}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
