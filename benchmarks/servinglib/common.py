"""Small helpers of the serving benchmark: the repository's root, percentiles, ratios, the git
commit, a CPU benchmark's result file, and a function run in a process of its own."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def git_commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10)

    if os.environ.get("MOESERVE_GIT_COMMIT"):  # a tree copied without its repository (git archive)
        return {"commit": os.environ["MOESERVE_GIT_COMMIT"], "dirty": None}
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            raise OSError(head.stderr)
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": os.environ.get("MOESERVE_GIT_COMMIT", "unknown"), "dirty": None}


def switches(environ=os.environ) -> dict:
    """The ``MOESERVE_*`` settings of the environment the benchmark's clusters inherit (kernel
    choices and measurement switches such as ``MOESERVE_ATTENTION_PREFILL``), so that a result
    says what it ran; ``MOESERVE_GIT_COMMIT`` is the commit's, not a switch."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith("MOESERVE_") and k != "MOESERVE_GIT_COMMIT"}


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


def pacing(s0: dict, s1: dict) -> dict:
    """The late schedules between two status reads: how many, their mean delay (s), how long
    before the running step's estimated end they started and the slack the GPU was left (means,
    s), and the bubbles after them (``Cluster.leader_counters``); {} where the leader exports none."""
    if "late_schedules" not in s1:
        return {}
    n = s1["late_schedules"] - s0.get("late_schedules", 0.0)

    def mean(key: str) -> float | None:
        return (s1.get(key, 0.0) - s0.get(key, 0.0)) / n if n else None

    return dict(
        late_schedules=int(n),
        late_schedule_mean_delay_s=mean("late_schedule_delay_s"),
        late_schedule_mean_ahead_s=mean("late_schedule_ahead_s"),
        late_schedule_mean_slack_s=mean("late_schedule_slack_s"),
        late_schedule_bubbles=int(s1.get("late_schedule_bubbles", 0.0) - s0.get("late_schedule_bubbles", 0.0)),
    )


def write_rows(path: str, script: str, argv, rows: list) -> None:
    """A CPU benchmark's JSON: the command that made it (``script`` with ``argv``, or this
    process's arguments), the commit, the machine and its ``rows``; says where it went."""
    doc = dict(
        command="python3 " + " ".join([os.path.relpath(script, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        git=git_commit(),
        machine=dict(arch=platform.machine(), cpus=os.cpu_count(), python=platform.python_version()),
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
