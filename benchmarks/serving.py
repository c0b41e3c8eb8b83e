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
  published checkpoint's MXFP4 is not served; 42 GB in bf16).

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
  per-channel scales), the roofline counted on the quantized bytes; ``--shape scout48`` (Scout's
  whole text model) and ``maverick12`` fit one H200 only so;
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

from servinglib.baseline import run_transformers  # noqa: E402
from servinglib.common import git_commit  # noqa: E402
from servinglib.figures import burst_plan  # noqa: E402
from servinglib.prefix import conversation_plan, prefix_plan, prefix_table, side_by_side  # noqa: E402
from servinglib.report import table  # noqa: E402
from servinglib.roofline import DATASHEET_HBM_BPS, PEAK_GEMM, gpu_facts  # noqa: E402
from servinglib.shapes import SHAPES, model_sizes, weights_per_gpu, write_model, write_tokenizer  # noqa: E402
from servinglib.workloads import run_moeserve  # noqa: E402

CONFIGS = ("moeserve-ep2", "moeserve-1rank", "transformers")
# named with --configs only: the same with synchronous steps (--no-async-scheduling), to measure
# what the asynchronous step protocol gains side by side in one run
SYNC_CONFIGS = ("moeserve-ep2-sync", "moeserve-1rank-sync")
# named with --configs only: the same with torch._grouped_mm for every step's experts
# (MOESERVE_EXPERT_KERNEL=grouped_mm), against the Triton decode kernels of the default
GROUPED_MM_CONFIGS = ("moeserve-ep2-grouped-mm", "moeserve-1rank-grouped-mm")
# named with --configs only: the same with FP8 experts and MLPs (--quantization fp8: dummy weights
# made as FP8 codes with per-channel scales), side by side with the bf16 ones
FP8_CONFIGS = ("moeserve-ep2-fp8", "moeserve-1rank-fp8")
# named with --configs only: the same without prefix caching (--no-enable-prefix-caching)
NO_PREFIX_CACHE_CONFIGS = ("moeserve-ep2-no-prefix-cache", "moeserve-1rank-no-prefix-cache")
EXTRA_CONFIGS = SYNC_CONFIGS + GROUPED_MM_CONFIGS + FP8_CONFIGS + NO_PREFIX_CACHE_CONFIGS
PREFIX_WORKLOADS = ("prefix", "multiturn")
APIS = ("grpc", "http")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="scout8, scout48, maverick12, ernie28, qwen3_30b or gptoss20b (smoke: tiny)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shape, gloo, 1 rank, a few requests")
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma list of {','.join(CONFIGS)} (default: all; smoke: moeserve-1rank,transformers; "
        "prefix,multiturn alone: moeserve-1rank,moeserve-1rank-no-prefix-cache)",
    )
    p.add_argument(
        "--workloads",
        default="burst,online",
        help="burst,online (online needs burst), prefix,multiturn (prefix caching; alone or after "
        "burst,online), or eplb alone (moeserve-ep2: the EPLB measurement)",
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
    p.add_argument("--prefix-requests", type=int, default=None, help="prefix: requests (256; smoke 12)")
    p.add_argument("--prefix-system", type=int, default=None, help="prefix: shared system prompt ids (2048; smoke 64)")
    p.add_argument("--prefix-unique", type=int, default=None, help="prefix: ids of each request's own (64; smoke 8)")
    p.add_argument("--prefix-output", type=int, default=None, help="prefix: output tokens (128; smoke 8)")
    p.add_argument("--prefix-rate", type=float, default=None, help="prefix: Poisson arrivals per second (32; smoke 6)")
    p.add_argument("--multiturn-conversations", type=int, default=None, help="multiturn: conversations (64; smoke 4)")
    p.add_argument("--multiturn-turns", type=int, default=None, help="multiturn: turns per conversation (8; smoke 3)")
    p.add_argument("--multiturn-new", type=int, default=None, help="multiturn: new ids per turn (64; smoke 32)")
    p.add_argument("--multiturn-output", type=int, default=None, help="multiturn: tokens per answer (128; smoke 32)")
    p.add_argument(
        "--multiturn-rate", type=float, default=None, help="multiturn: conversations started per second (4; smoke 4)"
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
        p.error("--shape scout8|ernie28|qwen3_30b|gptoss20b|... (or --smoke)")
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
    defaults.update(
        prefix_requests=(12, 256),
        prefix_system=(64, 2048),
        prefix_unique=(8, 64),
        prefix_output=(8, 128),
        prefix_rate=(6.0, 32.0),
        multiturn_conversations=(4, 64),
        multiturn_turns=(3, 8),
        multiturn_new=(32, 64),
        multiturn_output=(32, 128),
        multiturn_rate=(4.0, 4.0),
    )
    for k, (small, big) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, small if smoke else big)
    if a.redundant_experts is None:
        a.redundant_experts = SHAPES[a.shape]["redundant"]
    eplb = "eplb" in a.workloads.split(",")
    prefix_only = not {"burst", "eplb"} & set(a.workloads.split(","))
    a.configs = (
        a.configs
        or (
            "moeserve-ep2"
            if eplb
            else "moeserve-1rank,moeserve-1rank-no-prefix-cache"
            if prefix_only
            else "moeserve-1rank,transformers"
            if smoke
            else ",".join(CONFIGS)
        )
    ).split(",")
    bad = [c for c in a.configs if c not in CONFIGS + EXTRA_CONFIGS]
    if bad:
        p.error(f"unknown configs {bad}; choose from {CONFIGS + EXTRA_CONFIGS}")
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
    elif not set(a.workloads) <= {"burst", "online", *PREFIX_WORKLOADS} or (
        "online" in a.workloads and "burst" not in a.workloads
    ):
        p.error(
            "--workloads is burst or burst,online (the online rate comes from the burst), with or without "
            "prefix,multiturn, or eplb"
        )
    elif not set(a.workloads) & {"burst", *PREFIX_WORKLOADS}:
        p.error("--workloads names no workload")
    if "burst" not in a.workloads and "eplb" not in a.workloads and "transformers" in a.configs:
        p.error("the transformers baseline runs the burst: add burst to --workloads or leave transformers out")
    a.backend = "gloo" if smoke else "nccl"
    a.dtype = "float32" if smoke else "bfloat16"
    need = max(
        a.burst_prompt + a.burst_output,
        a.online_prompt[1] + a.online_output[1],
        a.eplb_prompt + a.eplb_output if eplb else 0,
        a.prefix_system + a.prefix_unique + a.prefix_output if "prefix" in a.workloads else 0,
        a.multiturn_turns * (a.multiturn_new + a.multiturn_output) if "multiturn" in a.workloads else 0,
    )
    if not given_max_model_len and a.max_model_len < need:  # room for the longest request of the workloads
        a.max_model_len = -(-need // 256) * 256
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
    sizes_fp8 = model_sizes(model_dir, dtype_bytes, "fp8") if any(c.endswith("-fp8") for c in a.configs) else None

    facts = gpu_facts(2 if any(c.startswith("moeserve-ep2") for c in a.configs) else 1, a.smoke)
    measured = float(min(f["rate_Bps"] for f in facts))
    rates = {"datasheet": DATASHEET_HBM_BPS, "measured_copy": measured}
    peaks = [f["peak_flops"] for f in facts if f.get("peak_flops")]
    a.peak_flops = min(peaks) if peaks else None  # the FLOP-aware roofline's matmul peak (GPUs only)
    print(
        f"{facts[0].get('name', 'cpu')}: device-to-device copy {measured / 1e12:.2f} TB/s "
        f"(datasheet {DATASHEET_HBM_BPS / 1e12:.1f})",
        flush=True,
    )

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
        hbm=dict(datasheet_Bps=DATASHEET_HBM_BPS, measured_copy_Bps=measured, per_device=facts),
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
            held = sizes_fp8 if name.endswith("-fp8") and sizes_fp8 is not None else sizes
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
