"""Flags shared by the service subcommands, spelled as vLLM users know them.

EPLB: ``--enable-eplb`` and ``--eplb-config '{"window_size": .., "step_interval": ..,
"num_redundant_experts": .., "log_balancedness": ..}'``, with the older single flags
``--num-redundant-experts``, ``--eplb-window-size``, ``--eplb-step-interval`` and
``--eplb-log-balancedness`` as aliases (giving both spellings with different values is an
error). Serving limits: ``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from moeserve.cli import UsageError

EPLB_KEYS = {"window_size": int, "step_interval": int, "num_redundant_experts": int, "log_balancedness": bool}
ALIASES = {
    "num_redundant_experts": "num_redundant_experts",
    "window_size": "eplb_window_size",
    "step_interval": "eplb_step_interval",
    "log_balancedness": "eplb_log_balancedness",
}
TOKEN_ENV = "MOESERVE_ADMIN_TOKEN"
CONTROL_KEY_ENV = "MOESERVE_CONTROL_KEY"


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cluster (the same on every rank)")
    g.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (config.json + safetensors)")
    g.add_argument("--routers", type=int, default=1, metavar="R", help="router ranks (default 1)")
    g.add_argument("--workers", type=int, default=1, metavar="W", help="expert-worker ranks (default 1)")
    g.add_argument("--colocated", action="store_true", help="each rank is a router and a worker (R = W)")
    g.add_argument(
        "--workers-per-node", type=int, default=0, metavar="N", help="workers per node (default: all on one)"
    )
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    g.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU, default) or nccl (GPU)")
    g.add_argument(
        "--exchange",
        choices=("auto", "collective", "nvlink"),
        default="auto",
        help="how rows travel per MoE layer: nvlink (direct stores into peers' memory, one host, "
        "CUDA + Triton), collective (all-to-all), auto (nvlink where every rank can, default)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (vLLM's name; graphs need CUDA "
        "and the direct exchange)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule step N+1 while the GPUs run step N; the leader learns sampled tokens one step "
        "late, so a sequence that stops may run one extra step (default on; vLLM's name)",
    )
    g.add_argument(
        "--late-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --async-scheduling, schedule step N+1 just before the GPUs are expected to finish "
        "step N, so that a request arriving meanwhile joins N+1, one step earlier (default on)",
    )
    g.add_argument(
        "--late-scheduling-margin-ms",
        type=float,
        default=1.0,
        metavar="MS",
        help="how long before the running step's expected end the next step is enqueued (default 1.0, 0-100)",
    )
    g.add_argument(
        "--capture-graphs-at-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before serving, compile and capture the decode CUDA graph of every batch bucket and "
        "attention split, as vLLM does (default on; --no-capture-graphs-at-start: on a key's first "
        "two uses while serving, which costs those steps' latency)",
    )
    g.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="auto: read the checkpoint's safetensors files (default); dummy: seeded random weights "
        "made on each rank's device from config.json alone (vLLM's name; for benchmarks)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        choices=("fp8",),
        default=None,
        help="fp8: serve a bf16 checkpoint with FP8 routed experts and MLPs, quantized at load per output "
        "channel (vLLM's name); FP8 checkpoints (compressed-tensors, block-wise fp8) need no flag: their "
        "config.json's quantization_config is read, and any other is refused",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="requests that give no seed draw theirs from a stream seeded with S, so that the same "
        "requests in the same order sample the same tokens on every run (vLLM's flag; default: random)",
    )
    g.add_argument(
        "--migration-bytes-per-step",
        type=int,
        default=512 << 20,
        metavar="B",
        help="weight bytes moved per destination worker per step during a migration (default 512 MiB)",
    )
    e = p.add_argument_group("EPLB")
    e.add_argument("--enable-eplb", action="store_true", help="allow placement changes and redundant experts")
    e.add_argument(
        "--eplb-config",
        metavar="JSON",
        help='e.g. \'{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 8, '
        '"log_balancedness": true}\'',
    )
    e.add_argument("--num-redundant-experts", type=int, default=None, metavar="N", help="alias of eplb_config's key")
    e.add_argument("--eplb-window-size", type=int, default=None, metavar="N", help="alias of eplb_config's key")
    e.add_argument("--eplb-step-interval", type=int, default=None, metavar="N", help="alias of eplb_config's key")
    e.add_argument(
        "--eplb-log-balancedness", action="store_const", const=True, default=None, help="alias of eplb_config's key"
    )
    s = p.add_argument_group("serving limits")
    s.add_argument("--max-model-len", type=int, default=4096, help="prompt + generated tokens (default 4096)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per router (default 64)")
    s.add_argument(
        "--max-num-batched-tokens", type=int, default=4096, help="new tokens per router per step (default 4096)"
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests waiting for admission; more answer RESOURCE_EXHAUSTED (default 1024)",
    )
    k = p.add_argument_group("KV cache")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    k.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of each GPU's memory a rank may use; the KV cache gets what the weights leave (default 0.9)",
    )
    k.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=0,
        metavar="N",
        help="exactly N KV blocks per router instead of sizing from memory (default: size from memory)",
    )
    k.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share full KV blocks between requests by the hash of their tokens and keep freed ones "
        "cached, evicted least recently used (default on; vLLM's name)",
    )
    k.add_argument(
        "--routing-policy",
        choices=("cache_aware", "round_robin"),
        default="cache_aware",
        help="which router a new request goes to: cache_aware (the one holding its longest cached "
        "prefix, balanced against the routers' running requests; default) or round_robin",
    )


def add_state_flags(p: argparse.ArgumentParser) -> None:
    """Operator state across restarts (moeserve.state) and the placement at start."""
    g = p.add_argument_group("state")
    g.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep the placement in force and the balancer's settings (pause included) in DIR, replaced "
        "atomically on every change, and start from them (created mode 0700; default: none, a "
        "restart starts from the default placement and forgets the settings)",
    )
    g.add_argument(
        "--init-expert-location",
        metavar="FILE",
        help="start from this placement (SGLang's flag): moeserve placement JSON (moeserve placement "
        "dump) or an SGLang expert-location file (.json or .pt with physical_to_logical_map); "
        "a placement saved in --state-dir takes precedence",
    )


def start_placement(args, model_dir: str, workers: int, workers_per_node: int, num_redundant_experts: int):
    """(phy2log [L, P] or None, where it came from) for a cluster starting now: the placement
    saved in --state-dir, else --init-expert-location, else None (the default). UsageError
    naming the file when it cannot be read or does not fit the model and topology."""
    p, where = start_placement_with_breakeven(args, model_dir, workers, workers_per_node, num_redundant_experts)
    return (None if p is None else p[0]), where


def start_placement_with_breakeven(
    args, model_dir: str, workers: int, workers_per_node: int, num_redundant_experts: int
):
    """((phy2log [L, P], breakeven [L, E] or None) or None, where it came from): as
    :func:`start_placement`, with the break-even counts b of a moeserve placement file that has
    them (None: the file carries none, and the ranks use MOESERVE_EPLB_BREAKEVEN or 0)."""
    state_dir = getattr(args, "state_dir", None)
    init = getattr(args, "init_expert_location", None)
    if not state_dir and not init:
        return None, ""
    from moeserve import state
    from moeserve.models import load_config
    from moeserve.placement import Placement

    try:
        mcfg = load_config(model_dir)
    except Exception as e:
        raise UsageError(f"--model {model_dir}: {e}") from None
    layers, experts = mcfg.num_moe_layers, mcfg.num_experts
    slots = experts + num_redundant_experts
    wpn = workers_per_node or workers
    fits = dict(num_layers=layers, num_logical=experts, num_slots=slots, num_workers=workers, workers_per_node=wpn)
    if state_dir:
        try:
            saved = state.read_placement(state_dir)
            if saved is not None:
                saved_path = os.path.join(state_dir, state.PLACEMENT_FILE)
                state.check_topology(saved, what=f"{saved_path} (the placement saved in --state-dir)", **fits)
                with open(saved_path) as f:
                    has_b = '"breakeven"' in f.read()
                return (saved.phy2log, saved.breakeven if has_b else None), saved_path
        except state.StateError as e:
            raise UsageError(f"{e}; or start with another --state-dir") from None
    if not init:
        return None, ""
    path = Path(init)
    if not path.is_file():
        raise UsageError(f"--init-expert-location {init}: no such file")
    try:
        text = path.read_text(errors="replace") if path.suffix != ".pt" else ""
        has_b = False
        if '"moeserve.placement/' in text:
            p = Placement.from_json(text)
            has_b = '"breakeven"' in text
        else:
            p = Placement.from_sglang(path, mcfg.moe_layer_ids, experts, workers, wpn, mcfg.num_layers)
        state.check_topology(p, what=f"--init-expert-location {init}", **fits)
    except state.StateError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # whatever a parser raises on a file that is not a placement
        msg = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--init-expert-location {init}: not a placement: {msg}") from None
    return (p.phy2log, p.breakeven if has_b else None), str(init)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gRPC servers")
    g.add_argument("--host", default="127.0.0.1", help="address the services listen on (default 127.0.0.1)")
    g.add_argument(
        "--max-message-bytes",
        type=int,
        default=64 << 20,
        metavar="B",
        help="largest gRPC message received or sent (default 64 MiB; larger answer RESOURCE_EXHAUSTED)",
    )
    g.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (needs --tls-key)")
    g.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    g.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds in-flight calls get to finish at shutdown (default 30)",
    )


API_KEY_ENV = "MOESERVE_API_KEY"


class _SameAs(argparse.Action):
    """Another spelling of a flag that stores into the same ``dest``: given after that flag with
    another value, it is an error."""

    def __call__(self, parser, namespace, values, option_string=None):
        prev = getattr(namespace, self.dest, None)
        if prev is not None and prev != values:
            parser.error(f"{option_string} {values} disagrees with --{self.dest.replace('_', '-')} {prev}: give one")
        setattr(namespace, self.dest, values)


def add_http_flags(p: argparse.ArgumentParser, http_port: bool = True, max_model_len: bool = True) -> None:
    """The serving front end's OpenAI-compatible HTTP API and the serving API key."""
    g = p.add_argument_group("OpenAI-compatible HTTP API")
    if http_port:
        g.add_argument(
            "--http-port",
            type=port,
            default=None,
            metavar="PORT",
            help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
            "/v1/models, /health, /version, /metrics) on this port (0 = any free; default: none)",
        )
    g.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"clients of the serving API (HTTP and gRPC) must send 'Authorization: Bearer KEY' "
        f"(default: ${API_KEY_ENV}; none: open)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model name(s) requests use and /v1/models lists (default: the model as given)",
    )
    # vLLM's names of the HTTPS files; moeserve serves one certificate on every port (the HTTP API,
    # gRPC serving, admin, balancer): they are --tls-cert and --tls-key spelled as vLLM spells them.
    g.add_argument(
        "--ssl-certfile",
        dest="tls_cert",
        action=_SameAs,
        metavar="PEM",
        help="serve the HTTP API over HTTPS with this certificate (vLLM's name; the same as --tls-cert: "
        "the gRPC services use it too; needs --ssl-keyfile)",
    )
    g.add_argument(
        "--ssl-keyfile",
        dest="tls_key",
        action=_SameAs,
        metavar="PEM",
        help="the certificate's private key (vLLM's name; the same as --tls-key)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        metavar="N",
        help="the most top logprobs a request may ask for, per token and per prompt position (vLLM's name; default 20)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults for what a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens as max_tokens): auto reads the model folder's "
        "generation_config.json (default), DIR that folder's, vllm none (vLLM's flag)",
    )
    g.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help="sampling defaults that take precedence over the generation config, e.g. "
        "'{\"temperature\": 0.5}' (vLLM's flag)",
    )
    g.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="the chat template to render messages with instead of the model's: a file, or the "
        "template itself (vLLM's flag)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="tool_choice \"auto\": the answers are read for tool calls in --tool-call-parser's format (vLLM's flag)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "llama4_json", "pythonic", "llama4_pythonic"),
        help="the format the model writes tool calls in, for --enable-auto-tool-choice (vLLM's names)",
    )
    if max_model_len:
        g.add_argument(
            "--max-model-len",
            type=int,
            default=4096,
            help="the cluster's max_model_len: longer prompts are refused before tokenization ends (default 4096)",
        )
    add_door_flags(p)


def add_door_flags(p: argparse.ArgumentParser) -> None:
    """The HTTP door's limits (moeserve.services.http.door) and each request's share of the
    batch (moeserve.services.admission.AdmissionLimits), uvicorn's and vLLM's names where they
    have one."""
    from moeserve.services.http.door import DoorLimits

    d = DoorLimits()
    g = p.add_argument_group("HTTP door limits")
    g.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=d.max_header_bytes,
        metavar="B",
        help=f"largest request line and headers in bytes; larger answer 431 unread (default {d.max_header_bytes}; "
        "uvicorn's and vLLM's name)",
    )
    g.add_argument(
        "--h11-max-header-count",
        type=int,
        default=d.max_header_count,
        metavar="N",
        help=f"most header fields of a request; more answer 431 (default {d.max_header_count}; vLLM's name)",
    )
    g.add_argument(
        "--http-header-timeout",
        type=float,
        default=d.header_timeout_s,
        metavar="S",
        help=f"seconds a request's headers may take to arrive from their first byte; then 408 "
        f"(default {d.header_timeout_s:g})",
    )
    g.add_argument(
        "--http-body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="S",
        help=f"seconds a request's body may take to arrive after its headers; then 408 (default {d.body_timeout_s:g})",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=d.keep_alive_s,
        metavar="S",
        help=f"close a connection idle this long: just opened, or between requests (default {d.keep_alive_s:g}; "
        "uvicorn's name)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=d.max_connections,
        metavar="N",
        help=f"most open HTTP connections; one more answers 503 (default {d.max_connections}; uvicorn's name)",
    )
    g.add_argument(
        "--max-request-tokens",
        type=int,
        default=0,
        metavar="N",
        help="tokens one HTTP request may make the cluster hold: n x (prompt + max_tokens), summed over its "
        "prompts; more answer 400 (default 16 x --max-model-len)",
    )
    g.add_argument(
        "--max-choices-in-flight",
        type=int,
        default=16,
        metavar="N",
        help="choices (n x prompts) of one HTTP request on the cluster at a time, the next starting as one "
        "ends, so that one request cannot starve the others (a quarter of it with logprobs; default 16)",
    )


DOOR_FLAGS = {  # flag -> DoorLimits field (the front end's command line carries them from up)
    "--h11-max-incomplete-event-size": "max_header_bytes",
    "--h11-max-header-count": "max_header_count",
    "--http-header-timeout": "header_timeout_s",
    "--http-body-timeout": "body_timeout_s",
    "--timeout-keep-alive": "keep_alive_s",
    "--limit-concurrency": "max_connections",
}
SHARE_FLAGS = ("--max-request-tokens", "--max-choices-in-flight")


def door_limits(args):
    """The DoorLimits of the door flags (UsageError naming the flag for a bad value)."""
    from moeserve.services.http.door import DoorLimits

    values = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in DOOR_FLAGS.items()}
    try:
        return DoorLimits(**values)
    except ValueError as e:
        field = str(e).split()[0]
        flag = next(f for f, name in DOOR_FLAGS.items() if name == field)
        raise UsageError(f"{flag}: {str(e).split(' ', 1)[1]}") from None


def door_argv(args) -> list[str]:
    """The door and share flags as the front end's command line takes them."""
    out = []
    for flag in (*DOOR_FLAGS, *SHARE_FLAGS):
        out += [flag, str(getattr(args, flag[2:].replace("-", "_")))]
    return out


def api_key(args) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


VLLM_EPLB_KEYS = ("use_async", "log_balancedness_interval", "policy")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's parallelism flags, with what each means here (``moeserve serve``)."""
    g = p.add_argument_group("vLLM compatibility")
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="accepted: experts are always sharded over the expert-worker ranks",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        metavar="N",
        help="with --enable-expert-parallel: N co-located ranks (each a router and an expert worker)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="with --enable-expert-parallel: N co-located ranks (N x --data-parallel-size), each a router "
        "with its own attention (data-parallel attention) and an expert worker; without it, 1 only "
        "(moeserve does not split attention layers over GPUs)",
    )
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N", help="1 only")
    g.add_argument(
        "--trust-remote-code", action="store_true", help="accepted and unused: moeserve runs its own model code"
    )


def add_hub_flags(p: argparse.ArgumentParser) -> None:
    """Models by Hugging Face id (moeserve.ops.hub)."""
    g = p.add_argument_group("models by Hugging Face id")
    g.add_argument("--revision", metavar="REV", help="the model's branch, tag or commit (default main)")
    g.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="tokenizer folder or id (default: the model's)")
    g.add_argument("--tokenizer-revision", metavar="REV", help="the tokenizer's branch, tag or commit")
    g.add_argument(
        "--download-dir",
        metavar="DIR",
        help="the Hugging Face cache to read and download into (default: $HF_HUB_CACHE, $HF_HOME/hub "
        "or ~/.cache/huggingface/hub); $HF_HUB_OFFLINE=1 resolves from it alone",
    )


def add_token_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-token", metavar="T", help=f"bearer token of the admin and balancer services (default: ${TOKEN_ENV})"
    )


def add_balancer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("balancer")
    g.add_argument(
        "--eplb-min-balancedness",
        type=float,
        default=0.0,
        metavar="X",
        help="rebalance early when the predicted balancedness falls under X and the gain pays "
        "for the moves (0 = off, default)",
    )
    g.add_argument(
        "--eplb-min-gain",
        type=float,
        default=0.01,
        metavar="G",
        help="a plan of the loop must raise balancedness by at least G (default 0.01)",
    )
    g.add_argument(
        "--eplb-move-cost",
        type=float,
        default=0.5,
        metavar="C",
        help="...and by C times the share of slots whose weights move (default 0.5)",
    )
    g.add_argument(
        "--eplb-move-budget",
        type=float,
        default=0.10,
        metavar="F",
        help="share of slots one plan may move (default 0.10)",
    )
    g.add_argument(
        "--balancer-poll-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between looks at the load (default 0.5)",
    )
    g.add_argument(
        "--eplb-step-model",
        metavar="FILE",
        default=None,
        help="a step-model table (moeserve-step-model/1, made by benchmarks/calibrate.py, e.g. "
        "benchmarks/results/step_model_h200.json): plan, trigger and judge plans by predicted step "
        "time, and send the break-even counts of the replica rule with every plan (docs/eplb.md); "
        "the entry is the one for the GPU kind and the model's expert shape",
    )
    g.add_argument(
        "--eplb-step-model-gpu",
        metavar="NAME",
        default=None,
        help="the table entry's GPU name (default: the table's only GPU kind)",
    )
    g.add_argument(
        "--eplb-step-model-shape",
        metavar="NAME",
        default=None,
        help="the table entry's shape name (default: the entry whose hidden and expert sizes and "
        "dtype are the model's; without --model, the table's only entry)",
    )


def add_api_server_count_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        metavar="N",
        help="serving front-end processes sharing the serving and HTTP ports (vLLM's flag; default 1): "
        "one process streams about 20-50k tokens/s, a core's worth",
    )


def add_metrics_flags(p: argparse.ArgumentParser, per_expert: bool = False) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on --host:PORT/metrics (0 = any free port, printed; default: none)",
    )
    if per_expert:
        g.add_argument(
            "--per-expert-metrics",
            choices=("auto", "on", "off"),
            default="auto",
            help="leader: series per logical expert (auto = while MoE layers x experts <= 4096)",
        )


def start_metrics(args, role: str):
    """The process's ProcessMetrics serving on --host:--metrics-port, or None without the flag."""
    if args.metrics_port is None:
        return None
    from moeserve.ops.metrics import ProcessMetrics

    pm = ProcessMetrics(role)
    try:
        pm.serve(args.metrics_port, args.host)
    except OSError as e:
        raise UsageError(f"cannot serve metrics on {args.host}:{args.metrics_port}: {e.strerror}") from None
    print(f"metrics on http://{args.host}:{pm.port}/metrics", flush=True)
    return pm


def add_client_flags(p: argparse.ArgumentParser, default_port: str) -> None:
    p.add_argument(
        "--address",
        default=f"127.0.0.1:{default_port}",
        metavar="HOST:PORT",
        help=f"the service's address (default 127.0.0.1:{default_port})",
    )
    add_token_flag(p)
    p.add_argument("--ca-file", metavar="PEM", help="connect with TLS, trusting this CA")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="deadline of each call (default 60)")


def token(args) -> str | None:
    return getattr(args, "admin_token", None) or os.environ.get(TOKEN_ENV) or None


def eplb_settings(args) -> dict:
    """EplbConfig's fields from --enable-eplb, --eplb-config and the single-flag aliases."""
    cfg: dict = {}
    if args.eplb_config:
        try:
            raw = json.loads(args.eplb_config)
        except json.JSONDecodeError as e:
            raise UsageError(f"--eplb-config is not valid JSON ({e}); e.g. '{{\"window_size\": 1000}}'") from None
        if not isinstance(raw, dict):
            raise UsageError("--eplb-config must be a JSON object")
        unknown = sorted(set(raw) - set(EPLB_KEYS))
        if unknown:
            raise UsageError(f"--eplb-config has unknown keys {unknown}; allowed: {sorted(EPLB_KEYS)}")
        for k, v in raw.items():
            want = EPLB_KEYS[k]
            if (
                want is int
                and (isinstance(v, bool) or not isinstance(v, int))
                or want is bool
                and not isinstance(v, bool)
            ):
                raise UsageError(
                    f"--eplb-config key {k!r} must be {'an integer' if want is int else 'true or false'}, got {v!r}"
                )
        cfg.update(raw)
    for key, attr in ALIASES.items():
        v = getattr(args, attr)
        if v is None:
            continue
        if key in cfg and cfg[key] != v:
            raise UsageError(f"--{attr.replace('_', '-')} {v} disagrees with --eplb-config's {key} = {cfg[key]}")
        cfg[key] = v
    cfg["enable_eplb"] = bool(args.enable_eplb)
    return cfg


def cluster_kwargs(args, leader: bool = True) -> dict:
    """Keywords of LocalCluster / ClusterConfig from the model and cluster flags; with
    ``--state-dir`` / ``--init-expert-location`` also ``state_dir`` and the ``placement`` to
    start from (``leader``: this process keeps the state folder, so it must be writable)."""
    if not Path(args.model).is_dir():
        raise UsageError(f"--model {args.model}: no such folder")
    for name in (
        "routers",
        "workers",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_waiting",
        "migration_bytes_per_step",
    ):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "seed", None) is not None and not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in 0..{2**63 - 1}, got {args.seed}")
    if getattr(args, "exchange", "auto") == "nvlink" and args.backend != "nccl":
        raise UsageError("--exchange nvlink needs --backend nccl (CUDA devices); use auto or collective")
    from moeserve.config import CacheConfig

    cache = dict(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
    )
    try:
        CacheConfig(**cache)
    except ValueError as e:
        raise UsageError(f"--{str(e).replace('_', '-')}") from None
    eplb = eplb_settings(args)
    from moeserve.config import EplbConfig

    try:
        EplbConfig(**eplb)
    except ValueError as e:
        raise UsageError(
            f"{e} (pass --enable-eplb to use redundant experts)" if "enable_eplb" in str(e) else str(e)
        ) from None
    from moeserve.config import MAX_LATE_SCHEDULING_MARGIN_MS

    margin = getattr(args, "late_scheduling_margin_ms", 1.0)
    if not 0 <= margin <= MAX_LATE_SCHEDULING_MARGIN_MS:
        raise UsageError(
            f"--late-scheduling-margin-ms must be in [0, {MAX_LATE_SCHEDULING_MARGIN_MS:g}] milliseconds, got {margin:g}"
        )
    kw = dict(
        routers=args.routers,
        workers=args.workers,
        colocated=args.colocated,
        backend=args.backend,
        dtype=args.dtype,
        workers_per_node=args.workers_per_node,
        migration_bytes_per_step=args.migration_bytes_per_step,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        exchange=getattr(args, "exchange", "auto"),
        load_format=getattr(args, "load_format", "auto"),
        quantization=getattr(args, "quantization", None) or "",
        enforce_eager=getattr(args, "enforce_eager", False),
        async_scheduling=getattr(args, "async_scheduling", True),
        late_scheduling=getattr(args, "late_scheduling", True),
        late_scheduling_margin_ms=getattr(args, "late_scheduling_margin_ms", 1.0),
        capture_graphs_at_start=getattr(args, "capture_graphs_at_start", True),
        seed=getattr(args, "seed", None),
        routing_policy=getattr(args, "routing_policy", "cache_aware"),
        **cache,
        **eplb,
    )
    state_dir = getattr(args, "state_dir", None)
    if state_dir and leader:
        from moeserve import state

        try:
            state.prepare(state_dir)
            state.read_balancer_settings(state_dir, eplb.get("window_size", 1000))  # readable, valid
        except state.StateError as e:
            raise UsageError(str(e)) from None
    start, _ = start_placement_with_breakeven(
        args, args.model, args.workers, args.workers_per_node, eplb.get("num_redundant_experts", 0)
    )
    if start is not None:
        kw["placement"] = start[0]
        if start[1] is not None:
            kw["breakeven"] = start[1]
    if state_dir:
        kw["state_dir"] = os.path.abspath(state_dir)
    return kw


def server_options(args, port: int, token: str | None = None):
    from moeserve.services.server import ServerOptions

    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("TLS needs both --tls-cert and --tls-key")
    for f in (args.tls_cert, args.tls_key):
        if f and not Path(f).is_file():
            raise UsageError(f"{f}: no such file")
    try:
        return ServerOptions(
            host=args.host,
            port=port,
            max_message_bytes=args.max_message_bytes,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            token=token,
            grace_s=args.grace_period,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def loop_config(
    args,
    window_size: int | None = None,
    step_interval: int | None = None,
    model_dir: str | None = None,
    dtype: str | None = None,
):
    from moeserve.balancer.controller import LoopConfig

    model = step_model(args, model_dir, dtype)
    try:
        return LoopConfig(
            window_steps=window_size or 0,
            step_interval=step_interval or 3000,
            min_balancedness=args.eplb_min_balancedness,
            min_gain=args.eplb_min_gain,
            move_cost=args.eplb_move_cost,
            move_budget=args.eplb_move_budget,
            step_model=model,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_model(args, model_dir: str | None = None, dtype: str | None = None):
    """The StepModel of ``--eplb-step-model FILE`` (None without it): the table's entry for the
    GPU kind (``--eplb-step-model-gpu``, else the table's only one) and the model's shape
    (``--eplb-step-model-shape``, else the entry whose hidden size, expert intermediate size and
    dtype bytes are those of ``model_dir`` at ``dtype``, else, without a model, the only entry
    left). UsageError (exit code 2) saying what is wrong when the file cannot be used or has no
    such entry."""
    path = getattr(args, "eplb_step_model", None)
    if not path:
        return None
    from moeserve.balancer.policy.cost import StepModelError, load_table

    try:
        table = load_table(path)
    except StepModelError as e:
        raise UsageError(f"--eplb-step-model: {e}") from None
    entries = list(table.entries)
    have = "; ".join(
        f"gpu {m.gpu!r} shape {m.shape!r} (H={m.hidden_size}, I={m.intermediate_size}, {m.dtype_bytes}-byte dtype)"
        for m in entries
    )
    gpu = getattr(args, "eplb_step_model_gpu", None)
    if gpu:
        entries = [m for m in entries if m.gpu == gpu]
        if not entries:
            raise UsageError(f"--eplb-step-model {path} has no entry for gpu {gpu!r}; it has: {have}")
    shape = getattr(args, "eplb_step_model_shape", None)
    if shape:
        entries = [m for m in entries if m.shape == shape]
        if not entries:
            raise UsageError(
                f"--eplb-step-model {path} has no entry for shape {shape!r}"
                f"{f' on gpu {gpu!r}' if gpu else ''}; it has: {have}"
            )
    elif model_dir:
        from moeserve.models import load_config

        try:
            mcfg = load_config(model_dir)
        except Exception as e:
            raise UsageError(f"--model {model_dir}: {e}") from None
        dims = (mcfg.hidden_size, mcfg.moe_intermediate_size, DTYPE_BYTES.get(dtype or "bfloat16", 2))
        entries = [m for m in entries if (m.hidden_size, m.intermediate_size, m.dtype_bytes) == dims]
        if not entries:
            raise UsageError(
                f"--eplb-step-model {path} has no entry for this model's shape (hidden size {dims[0]}, "
                f"expert intermediate size {dims[1]}, {dims[2]}-byte dtype){f' on gpu {gpu!r}' if gpu else ''}; "
                f"it has: {have}. Calibrate one (python benchmarks/calibrate.py --shape NAME=H,I) or "
                "name an entry with --eplb-step-model-shape"
            )
    if len(entries) > 1:
        which = sorted({m.gpu for m in entries})
        flag = "--eplb-step-model-gpu" if len(which) > 1 else "--eplb-step-model-shape"
        raise UsageError(
            f"--eplb-step-model {path} has {len(entries)} entries that fit; pick one with {flag}: "
            + "; ".join(f"gpu {m.gpu!r} shape {m.shape!r}" for m in entries)
        )
    return entries[0]


def port(value: str) -> int:
    try:
        p = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port must be an integer in 0..65535, got {value!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in 0..65535 (0 = any free port), got {p}")
    return p
