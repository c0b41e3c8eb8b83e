#!/usr/bin/env python3
"""A GPU session's runs in one call, within a time budget: the open targets of
benchmarks/README.md ("The open targets on one H200") by name, in the order given.

    python3 benchmarks/gpu_session.py --list
    python3 benchmarks/gpu_session.py --budget 540 rows-per-pass fp8-ernie28 fp8-ernie28-bm32
    python3 benchmarks/gpu_session.py --dry-run prefix grouped-routing

A lent GPU machine is released ~30 s after a command ends and a new one costs minutes to start,
so a session chains its runs in one command. This runs ``scripts/gpu-setup`` first (skip it with
``--no-setup``), then each target while its expected time fits what is left of ``--budget``
(a target that does not fit is skipped and said, the next ones still tried), each under a
timeout of what is left. Every target writes its JSON as ``<out>/<target>.json``; their output
goes to one log, ``<out>/session.log``; ``<out>/session.json`` says what ran, its exit code and
wall time, and what was skipped and why. ``<out>`` is ``--out``, else ``$OUT`` (the device
tool's folder), else benchmarks/results/session. ``MOESERVE_GIT_COMMIT`` is set from git when
unset, so that each result names the code it ran. Exits 1 when a target that ran failed or the
set-up failed, 2 on a bad argument.

``--h200 a,b,c`` names targets that only an H200 should run (the must-shows measured on one):
on an H200 they run first, then the positional targets; on any other card they are skipped,
said in the report with the card's name, and the positional targets run. A session whose
machine may come as either card then needs one command:

    python3 benchmarks/gpu_session.py --budget 540 --h200 prefix,fp8-scout8 fp8-prefill-rows
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@dataclass(frozen=True)
class Target:
    what: str
    argv: tuple[str, ...]  # a benchmark script of this folder and its arguments, --json added
    seconds: int  # expected wall time on an H100 / H200, start-up included
    env: dict[str, str] = field(default_factory=dict)


# mixed-step token buckets to 4,096 (MOESERVE_MIXED_TOKEN_BUCKETS): a 2,048-token chunk and its
# decodes in a graph, steps to 4,096 tokens padded at most to the next 512
BUCKETS = "128,256,512,1024,2048,2560,3072,3584,4096"


def _serving(shape: str, configs: str, *more: str) -> tuple[str, ...]:
    return ("serving.py", "--shape", shape, "--configs", configs, *more)


def _online(shape: str, max_batched_tokens: int) -> tuple[str, ...]:
    """The burst, then the online load at 70 % of its rate with this step budget (serving.py)."""
    return _serving(
        shape, "moeserve-1rank", "--workloads", "burst,online", "--duration", "15", "--drain", "20",
        "--max-num-batched-tokens", str(max_batched_tokens),
    )  # fmt: skip


def _eplb_off(cases: str, *more: str) -> tuple[str, ...]:
    """EPLB on against EPLB off through a live migration, one rank (gpu_correctness.py)."""
    return ("gpu_correctness.py", "--ranks", "1", "--compare", "eplb-off", *more, "--cases", cases)


# the argv and settings several targets share
PREFIX_AB = _serving("scout8", "moeserve-1rank,moeserve-1rank-no-prefix-cache", "--workloads", "prefix,multiturn")
FP8_SIDE = {s: _serving(s, "moeserve-1rank,moeserve-1rank-fp8", "--workloads", "burst") for s in ("scout8", "ernie28")}
DSV3_BURST = _serving("dsv3_7", "moeserve-1rank", "--workloads", "burst")
# ERNIE's faster W8A8 down tile below 64 rows (4 warps; the 64-row tile keeps 8), not in the table
A8_DOWN_4WARPS = {"MOESERVE_FP8_A8_TUNING": '{"down": [128, 128, 4, 3, 1]}'}

TARGETS: dict[str, Target] = {
    "prefix": Target(
        "prefix caching A/B, Scout-8L: TTFT p50 with and without the cache, multi-turn hit rate",
        PREFIX_AB,
        200,
    ),
    "prefix-learn-lead": Target(
        "prefix caching A/B with the pacer learning its look-ahead from the slack (MOESERVE_PACER_LEARN_LEAD=1)",
        PREFIX_AB,
        200,
        {"MOESERVE_PACER_LEARN_LEAD": "1"},
    ),
    "fp8-scout8": Target(
        "Scout-8L decode step, bf16 beside FP8 (burst 256 x (128 -> 256))",
        FP8_SIDE["scout8"],
        150,
    ),
    "fp8-ernie28": Target(
        "ERNIE-28L decode step, bf16 beside FP8",
        FP8_SIDE["ernie28"],
        150,
    ),
    "rows-per-pass": Target(
        "ERNIE's expert kernels (bf16, FP8, W8A8) at 256 tokens with 64-, 32- and 16-row passes",
        ("expert_kernel.py", "--shapes", "ernie", "--tokens", "256", "--fp8", "--block-m", "auto,32,16"),
        70,
    ),
    "w8a8-down-4warps": Target(
        "ERNIE's W8A8 down tile with 4 warps below 64 rows: every row bitwise the same at 64, 32 and 16 rows, and its speed",
        ("expert_kernel.py", "--shapes", "ernie", "--tokens", "256", "--fp8", "--block-m", "auto,64,16"),
        40,
        A8_DOWN_4WARPS,
    ),
    "w8a8-down-4warps-eplb": Target(
        "EPLB on = off in FP8 (ERNIE, Llama 4) with the 4-warp W8A8 down tile below 64 rows",
        _eplb_off("ernie45:bfloat16,llama4:bfloat16", "--quantization", "fp8"),
        120,
        A8_DOWN_4WARPS,
    ),
    "w8a8-down-4warps-ernie28": Target(
        "ERNIE-28L bf16 beside FP8 with the 4-warp W8A8 down tile below 64 rows",
        FP8_SIDE["ernie28"],
        120,
        A8_DOWN_4WARPS,
    ),
    "rows-per-pass-scout": Target(
        "Scout's and Qwen3's expert kernels (bf16, FP8, W8A8) at 64 and 256 tokens with 64-, 32- and 16-row passes",
        ("expert_kernel.py", "--shapes", "scout,qwen3", "--tokens", "64,256", "--fp8", "--block-m", "auto,32,16"),
        80,
    ),
    "w8a8-tune-bm32": Target(
        "ERNIE's W8A8 expert tiles swept at 32 rows per pass (256 tokens)",
        (
            "expert_kernel.py",
            "--shapes",
            "ernie",
            "--tokens",
            "256",
            "--fp8",
            "--block-m",
            "32",
            "--tune",
            "--tune-kinds",
            "w8a8",
            "--tune-bn",
            "64,128,256",
            "--tune-bk",
            "64,128,256",
        ),
        90,
    ),
    "fp8-scout8-bm16": Target(
        "Scout-8L bf16 beside FP8 with 16-row passes (MOESERVE_EXPERT_BLOCK_M=16)",
        FP8_SIDE["scout8"],
        150,
        {"MOESERVE_EXPERT_BLOCK_M": "16"},
    ),
    "fp8-ernie28-bm32": Target(
        "ERNIE-28L bf16 beside FP8 with 32-row passes (MOESERVE_EXPERT_BLOCK_M=32)",
        FP8_SIDE["ernie28"],
        150,
        {"MOESERVE_EXPERT_BLOCK_M": "32"},
    ),
    "expert-silu": Target(
        "a worker's activation over its 65,536-row buffer: the fixed grid beside a program per row (ERNIE's I)",
        ("norm_kernels.py", "--cases", "ernie_expert_silu,ernie_silu", "--rows", "64,256,1024", "--models", ""),
        40,
    ),
    "silu-quant": Target(
        "a W8A8 MLP's activation quantized in its own launch (silu_mul_quant) against silu_mul + quant_rows: bitwise, and its time",
        ("norm_kernels.py", "--cases", "ernie_silu_quant,scout_silu_quant", "--rows", "64,256,2048", "--models", ""),
        40,
    ),
    "grouped-routing": Target(
        "DeepSeek-V3's grouped routing, fused against torch's, and its gate",
        ("norm_kernels.py", "--cases", "dsv3_route,dsv3_gate", "--rows", "256,2048", "--models", ""),
        40,
    ),
    "grouped-routing-eplb": Target(
        "EPLB on = off with the fused grouped routing (the default), DeepSeek-V3 bf16",
        _eplb_off("deepseek_v3:bfloat16"),
        90,
    ),
    "dsv3-torch-grouped-routing": Target(
        "DeepSeek-V3 (7 layers, an H200's memory) burst with torch's grouped routing",
        DSV3_BURST,
        150,
        {"MOESERVE_FUSED_GROUPED_ROUTING": "0"},
    ),
    "dsv3": Target(
        "DeepSeek-V3 (7 layers, an H200's memory) burst as it is (the fused grouped routing)",
        DSV3_BURST,
        150,
    ),
    "ernie-1024-profile": Target(
        "ERNIE-28L decode of 1,024 sequences profiled (steps 80-99): where the 33 ms step's ~11 ms above its roofline go",
        _serving(
            "ernie28",
            "moeserve-1rank",
            "--workloads",
            "burst",
            "--burst-requests",
            "1024",
            "--max-num-seqs",
            "1024",
            "--profile",
            "80:20",
        ),
        120,
    ),
    "fp8-ernie28-profile": Target(
        "ERNIE-28L FP8 burst 256 profiled (steps 80-99): the W8A8 expert kernels' share of the 14 ms step",
        _serving("ernie28", "moeserve-1rank-fp8", "--workloads", "burst", "--profile", "80:20"),
        110,
    ),
    "ernie-1024": Target(
        "ERNIE-28L decode of 1,024 sequences as it is (bf16 steps on torch._grouped_mm)",
        _serving(
            "ernie28", "moeserve-1rank", "--workloads", "burst", "--burst-requests", "1024", "--max-num-seqs", "1024"
        ),
        100,
    ),
    "ernie-1024-triton": Target(
        "ERNIE-28L decode of 1,024 sequences on the Triton kernels (MOESERVE_EXPERT_KERNEL=triton)",
        _serving(
            "ernie28", "moeserve-1rank", "--workloads", "burst", "--burst-requests", "1024", "--max-num-seqs", "1024"
        ),
        100,
        {"MOESERVE_EXPERT_KERNEL": "triton"},
    ),
    "eplb-off-fp8": Target(
        "EPLB on = off in FP8, ERNIE and Llama 4",
        _eplb_off("ernie45:bfloat16,llama4:bfloat16", "--quantization", "fp8"),
        120,
    ),
    **{
        f"prefill-{backend}-{shape}": Target(
            f"{shape} prefill burst 256 x 2,048 with MOESERVE_ATTENTION_PREFILL={backend}, two rounds: "
            "first-burst TTFT against the second's, compiles while serving (the log)",
            _serving(
                shape,
                "moeserve-1rank",
                "--workloads",
                "burst",
                "--burst-requests",
                "256",
                "--burst-prompt",
                "2048",
                "--burst-output",
                "32",
                "--max-model-len",
                "4096",
                "--rounds",
                "2",
            ),
            90,
            {"MOESERVE_ATTENTION_PREFILL": backend},
        )
        for shape in ("scout8", "ernie28")
        for backend in ("auto", "triton")  # the switch, then the default (the paged kernel), one machine
    },
    **{
        f"online-{shape}-{n}": Target(
            f"{shape} online at 70 % of the burst's rate with --max-num-batched-tokens {n}: ITL p50 / p99, TTFT p99",
            _online(shape, n),
            130,
        )
        for shape in ("scout8", "ernie28")
        for n in (1024, 2048, 8192)
    },
    **{
        f"mixed-ernie28{suffix}": Target(
            f"ERNIE-28L steps carrying a 2,048- or 8,192-token prompt beside 64 decodes, profiled{what}",
            ("mixed_steps.py", "--shape", "ernie28", "--chunks", "2048,8192", *more),
            seconds,  # a cluster per chunk size: FP8 dummy weights take ~70 s to start
        )
        for suffix, what, more, seconds in (
            ("", "", (), 150),
            ("-fp8", ", FP8 experts and MLPs", ("--quantization", "fp8"), 240),
        )
    },
    **{
        f"mixed-ernie28-2048{suffix}": Target(
            f"ERNIE-28L steps of a 2,048-token chunk beside 64 decodes (2,112 tokens), profiled{what}",
            ("mixed_steps.py", "--shape", "ernie28", "--chunks", "2048"),
            90,
            env,
        )
        for suffix, what, env in (
            ("", ": eager, past the largest mixed graph", {}),
            (
                "-buckets",
                ", as a graph (MOESERVE_MIXED_TOKEN_BUCKETS to 4,096)",
                {"MOESERVE_MIXED_TOKEN_BUCKETS": BUCKETS},
            ),
        )
    },
    "online-ernie28-8192-buckets": Target(
        "ernie28 online at 70 % with --max-num-batched-tokens 8192 and mixed graphs to 4,096 tokens: ITL p50 / p99",
        _online("ernie28", 8192),
        130,
        {"MOESERVE_MIXED_TOKEN_BUCKETS": BUCKETS},
    ),
    "mixed-ernie28-fp8-bm128": Target(
        "the same FP8 mixed steps with W8A8 prefill passes of 128 rows (MOESERVE_FP8_PREFILL_BLOCK_M=128)",
        ("mixed_steps.py", "--shape", "ernie28", "--chunks", "2048,8192", "--quantization", "fp8"),
        240,
        {"MOESERVE_FP8_PREFILL_BLOCK_M": "128"},
    ),
    "fp8-prefill-rows": Target(
        "W8A8 expert kernels at prefill sizes (ERNIE, Scout; 2,048 and 8,192 tokens) with 64- and 128-row passes: "
        "every row bitwise the same, and the time beside bf16's torch._grouped_mm",
        ("expert_kernel.py", "--shapes", "ernie,scout", "--tokens", "2048,8192", "--fp8", "--block-m", "64,128"),
        120,
    ),
    "fp8-prefill-tune": Target(
        "ERNIE's W8A8 tiles swept at 128 rows per pass, 8,192 tokens (K tiles of 128: the row-invariant ones)",
        tuple(
            "expert_kernel.py --shapes ernie --tokens 8192 --fp8 --block-m 128 --tune --tune-kinds w8a8 "
            "--tune-bn 64,128,256 --tune-bk 128".split()
        ),
        120,
    ),
    "eplb-off-bf16": Target(
        "EPLB on = off in bf16, ERNIE, DeepSeek-V3 and Llama 4",
        _eplb_off("ernie45:bfloat16,deepseek_v3:bfloat16,llama4:bfloat16"),
        150,
    ),
}

Runner = Callable[[list[str], dict[str, str], float, object], int]
SETUP_S = 20  # scripts/gpu-setup's expected time (installing the carried wheels)


def gpu_name() -> str:
    """The first GPU's name (nvidia-smi), "" where none answers."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""


def is_h200(card: str) -> bool:
    return "H200" in card.upper()


def ordered(names: Sequence[str], h200: Sequence[str], card: str) -> list[str]:
    """The targets a session on ``card`` runs, in order: ``h200``'s first on an H200, then
    ``names``."""
    return [*h200, *names] if h200 and is_h200(card) else list(names)


def plan(names: list[str], budget_s: float, setup: bool = True) -> list[tuple[str, float]]:
    """(target, seconds left before it) for each of ``names`` if every run took its expected
    time: the rule ``run_session`` applies, a target running only where its time fits."""
    left, out = budget_s - (SETUP_S if setup else 0), []
    for name in names:
        out.append((name, left))
        if left >= TARGETS[name].seconds:
            left -= TARGETS[name].seconds
    return out


def _run(cmd: list[str], env: dict[str, str], timeout: float, log) -> int:
    """One command, its output appended to ``log``; 124 when it ran past ``timeout``."""
    try:
        return subprocess.run(cmd, env=env, cwd=HERE, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def run_session(
    names: list[str],
    budget_s: float,
    out: str,
    setup: bool = True,
    runner: Runner = _run,
    clock: Callable[[], float] = time.monotonic,
    h200: Sequence[str] = (),
    card: str | None = None,
) -> dict:
    """Run the targets ``names`` in order within ``budget_s`` seconds (see the module's doc),
    after ``h200``'s where ``card`` (default: ``gpu_name()``) is an H200; returns what
    session.json holds."""
    os.makedirs(out, exist_ok=True)
    t0 = clock()
    env = dict(os.environ)
    if not env.get("MOESERVE_GIT_COMMIT"):
        env["MOESERVE_GIT_COMMIT"] = _commit()
    card = gpu_name() if card is None else card
    report: dict = {
        "budget_s": budget_s,
        "commit": env["MOESERVE_GIT_COMMIT"],
        "card": card,
        "setup": None,
        "targets": [],
    }
    if h200 and not is_h200(card):
        for name in h200:
            row = {"target": name, "what": TARGETS[name].what, "skipped": f"needs an H200, this is {card or 'no GPU'}"}
            report["targets"].append(row)
            print(_line(row), flush=True)
    names = ordered(names, h200, card)
    with open(os.path.join(out, "session.log"), "a") as log:
        if setup:
            t = clock()
            rc = runner([os.path.join(REPO, "scripts", "gpu-setup")], env, max(1.0, budget_s), log)
            report["setup"] = {"rc": rc, "wall_s": round(clock() - t, 1)}
            if rc != 0:
                report["failed"] = True
                return _write(out, report)
        for name in names:
            tg = TARGETS[name]
            left = budget_s - (clock() - t0)
            row = {"target": name, "what": tg.what, "env": tg.env, "expected_s": tg.seconds}
            if left < tg.seconds:
                row["skipped"] = f"needs ~{tg.seconds} s, {max(0, int(left))} s left"
            else:
                cmd = [sys.executable, *tg.argv, "--json", os.path.join(out, f"{name}.json")]
                row["command"] = " ".join(f"{k}={shlex.quote(v)}" for k, v in tg.env.items()) + (" " if tg.env else "")
                row["command"] += "python3 benchmarks/" + " ".join(repr(a) if a == "" else a for a in cmd[1:])
                print(f"== {name}: {row['command']}", file=log, flush=True)
                t = clock()
                row["rc"] = runner(cmd, {**env, **tg.env}, max(1.0, left - 5), log)
                row["wall_s"] = round(clock() - t, 1)
            report["targets"].append(row)
            print(_line(row), flush=True)
    report["failed"] = any(r.get("rc", 0) != 0 for r in report["targets"])
    return _write(out, report)


def _line(row: dict) -> str:
    if "skipped" in row:
        return f"{row['target']:<22} skipped: {row['skipped']}"
    return f"{row['target']:<22} rc {row['rc']:>3}  {row['wall_s']:>6.1f} s  {row['what']}"


def _write(out: str, report: dict) -> dict:
    with open(os.path.join(out, "session.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if sha.returncode == 0 and sha.stdout.strip():
            return sha.stdout.strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("targets", nargs="*", help="open targets by name, run in this order (--list names them)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole session (default 540)")
    p.add_argument("--out", default=None, help="folder for the JSON and the log (default $OUT)")
    p.add_argument("--list", action="store_true", help="the targets, their commands and expected times")
    p.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    p.add_argument("--no-setup", action="store_true", help="skip scripts/gpu-setup")
    p.add_argument(
        "--h200", default="", metavar="A,B", help="targets run first on an H200 and skipped on any other card"
    )
    a = p.parse_args(argv)
    h200 = [n for n in a.h200.split(",") if n]
    if a.list:
        for name, tg in TARGETS.items():
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in tg.env.items())
            print(f"{name:<22} ~{tg.seconds:>3} s  {tg.what}\n{'':<30}{env + ' ' if env else ''}{' '.join(tg.argv)}")
        return 0
    bad = [n for n in [*h200, *a.targets] if n not in TARGETS]
    if bad or not (a.targets or h200):
        p.error(f"unknown targets {bad}: allowed {', '.join(TARGETS)}" if bad else "name at least one target (--list)")
    if not 1 <= a.budget <= 3600:
        p.error(f"--budget must be 1 .. 3600 seconds, got {a.budget:g}")
    out = a.out or os.environ.get("OUT") or os.path.join(HERE, "results", "session")
    if a.dry_run:
        card = gpu_name() if h200 else ""
        if h200:
            print(f"card: {card or 'no GPU'}: --h200 targets {'run first' if is_h200(card) else 'skipped'}")
        for name, left in plan(ordered(a.targets, h200, card), a.budget, setup=not a.no_setup):
            tg = TARGETS[name]
            fits = (
                "runs" if left >= tg.seconds else f"would be skipped: needs ~{tg.seconds} s, {max(0, int(left))} s left"
            )
            print(f"{name:<22} ~{tg.seconds:>3} s, {int(left):>4} s left before it: {fits}")
        return 0
    report = run_session(a.targets, a.budget, out, setup=not a.no_setup, h200=h200)
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
