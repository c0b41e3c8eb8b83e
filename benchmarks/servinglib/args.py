"""``benchmarks/serving.py``'s command line: the configurations, workloads and APIs it knows, and
``parse``, which checks every flag against them (the script's ``parse`` hands it its docstring)."""

from __future__ import annotations

import argparse
import os

from servinglib.shapes import SHAPES

CONFIGS = ("moeserve-ep2", "moeserve-1rank", "transformers")
# named with --configs only: the same with synchronous steps (--no-async-scheduling), to measure
# what the asynchronous step protocol gains side by side in one run
SYNC_CONFIGS = ("moeserve-ep2-sync", "moeserve-1rank-sync")
# named with --configs only: the same with torch._grouped_mm for every step's experts
# (MOESERVE_EXPERT_KERNEL=grouped_mm), against the Triton decode kernels of the default
GROUPED_MM_CONFIGS = ("moeserve-ep2-grouped-mm", "moeserve-1rank-grouped-mm")
# named with --configs only: the same with FP8 experts and MLPs (--quantization fp8: dummy weights
# made as FP8 codes with per-channel scales), side by side with the bf16 ones
# (W8A8 where it applies, the default); ``-fp8-weight-only``: every FP8 product weight-only
FP8_CONFIGS = (
    "moeserve-ep2-fp8",
    "moeserve-1rank-fp8",
    "moeserve-ep2-fp8-weight-only",
    "moeserve-1rank-fp8-weight-only",
)
# named with --configs only: the same without prefix caching (--no-enable-prefix-caching)
NO_PREFIX_CACHE_CONFIGS = ("moeserve-ep2-no-prefix-cache", "moeserve-1rank-no-prefix-cache")
EXTRA_CONFIGS = SYNC_CONFIGS + GROUPED_MM_CONFIGS + FP8_CONFIGS + NO_PREFIX_CACHE_CONFIGS
# "-no-late-schedule" after moeserve-ep2 / moeserve-1rank: the same without late scheduling
# (docs/dataplane.md, "Late scheduling"), e.g. moeserve-1rank-no-late-schedule-no-prefix-cache
NO_LATE = "-no-late-schedule"


def known_config(name: str) -> bool:
    """Whether ``name`` is a configuration: one of CONFIGS + EXTRA_CONFIGS, or a moeserve one
    with NO_LATE after its rank count."""
    for base in ("moeserve-ep2", "moeserve-1rank"):
        if name.startswith(base + NO_LATE):
            name = base + name[len(base + NO_LATE) :]
    return name in CONFIGS + EXTRA_CONFIGS


PREFIX_WORKLOADS = ("prefix", "multiturn")
APIS = ("grpc", "http")


def parse(argv=None, doc: str = "") -> argparse.Namespace:
    """``benchmarks/serving.py``'s command line (``doc``: the script's docstring, its help)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="scout8, scout48, maverick12, ernie28, qwen3_30b, gptoss20b, dsv3_7 or dsv3_13_fp8 (smoke: tiny)",
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
        "--dummy-routing",
        choices=("default", "spread"),
        default=None,
        help="the dummy weights' routing (moeserve.models.dummy; docs/models.md): spread balances every MoE "
        "layer as a trained model does; default: spread for the shapes whose plain routing collapses "
        "(ernie28, gptoss20b, dsv3_*), else the plain weights; eplb: always the hot experts",
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
    p.add_argument(
        "--late-scheduling-margin-ms",
        type=float,
        default=None,
        help="moeserve up --late-scheduling-margin-ms for the configurations with late scheduling "
        "(default: the cluster's, 1.0)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--exchange", default="auto", choices=("auto", "collective", "nvlink"))
    p.add_argument(
        "--capture-graphs-at-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every decode graph captured before serving (moeserve up's default); "
        "--no-capture-graphs-at-start: on a key's first two uses while serving",
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
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="front-end processes of every moeserve configuration (moeserve up --api-server-count; default 1)",
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
    bad = [c for c in a.configs if not known_config(c)]
    if bad:
        p.error(f"unknown configs {bad}; choose from {CONFIGS + EXTRA_CONFIGS}")
    a.workloads = a.workloads.split(",")
    a.apis = [x.strip() for x in a.apis.split(",") if x.strip()]
    if not a.apis or not set(a.apis) <= set(APIS) or len(set(a.apis)) < len(a.apis):
        p.error(f"--apis is a comma list of {','.join(APIS)} without repeats, got {','.join(a.apis) or 'nothing'}")
    if not 1 <= a.api_server_count <= 64:
        p.error(f"--api-server-count must be 1 .. 64, got {a.api_server_count}")
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.tokenizer == "auto":
        a.tokenizer = "words" if "http" in a.apis else "none"
    if "http" in a.apis and a.tokenizer == "none":
        p.error("--apis http needs --tokenizer words: without a tokenizer the HTTP API streams no chunk per token")
    a.hot_experts_cfg = None
    if eplb and a.dummy_routing == "spread":
        p.error("--workloads eplb skews routing with hot experts: leave out --dummy-routing spread")
    if a.dummy_routing is None:
        a.dummy_routing = "default" if eplb else SHAPES[a.shape].get("dummy_routing", "default")
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
