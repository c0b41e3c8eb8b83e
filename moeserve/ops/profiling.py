"""Where a step's time goes, on demand: ``MOESERVE_PROFILE=DIR[:START[:COUNT]]``.

Every rank of a cluster started with that variable profiles its forward steps START ..
START+COUNT-1 (defaults 40 and 20) with ``torch.profiler`` and writes ``DIR/rank<R>.json`` and
``DIR/rank<R>.txt``:

- ``wall_per_step_s``: host wall time per step over the window (header broadcast to result
  gather, the leader's scheduling included);
- ``device_busy_per_step_s``: the sum of every device kernel's time per step (on CPU: 0);
- ``spans``: per named span (``SPANS``), calls per step, host time per step, and the device
  time of the kernels launched inside it (children included) per step;
- ``kernels``: the 200 kernels with the most device time, per step (inside a replayed CUDA
  graph the spans are not recorded, only kernels: ``benchmarks/serving.py`` then classifies
  kernels by name).

Spans cost nothing when profiling is off (``span`` returns one shared null context). Spans
nest (``moe_combine`` holds ``expert_matmul`` on a co-located rank), so their times do not add
up; ``benchmarks/serving.py`` derives the breakdown (attention, expert matmuls, exchange,
rest) from them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

ENV = "MOESERVE_PROFILE"
SPANS = (
    "pacing",
    "schedule",
    "header_broadcast",
    "result_gather",
    "batch_build",
    "embed",
    "attention",
    "dense_mlp",
    "gate",
    "shared_expert",
    "moe_dispatch",
    "moe_combine",
    "expert_matmul",
    "lm_head",
    "sampling",
    "load_read",
)
_NULL = contextlib.nullcontext()
_active = False


def span(name: str):
    """A named range in the profile while a window is being recorded; a no-op otherwise."""
    return torch.profiler.record_function(name) if _active else _NULL


def parse(value: str) -> tuple[str, int, int]:
    """``DIR[:START[:COUNT]]`` -> (dir, start, count); ValueError naming the allowed form."""
    parts = value.split(":")
    try:
        start = int(parts[1]) if len(parts) > 1 and parts[1] else 40
        count = int(parts[2]) if len(parts) > 2 and parts[2] else 20
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected DIR[:START[:COUNT]] with integer START and COUNT") from None
    if not parts[0] or start < 0 or count < 1 or len(parts) > 3:
        raise ValueError(f"{ENV}={value!r}: expected DIR[:START[:COUNT]], START >= 0, COUNT >= 1")
    return parts[0], start, count


class StepProfiler:
    """Profiles forward steps [start, start + count) of one rank; call ``step(forward)`` once
    per step before it runs and ``finish()`` when the loop ends."""

    def __init__(self, rank: int, out_dir: str, start: int, count: int):
        self.rank, self.dir, self.start, self.count = rank, Path(out_dir), start, count
        self.seen = 0  # forward steps begun
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0
        self.done = False

    @classmethod
    def from_env(cls, rank: int) -> StepProfiler | None:
        value = os.environ.get(ENV, "")
        return cls(rank, *parse(value)) if value else None

    def step(self, forward: bool) -> None:
        """Called before each step; only forward steps count."""
        if self.done or not forward:
            return
        if self.seen == self.start:
            self._begin()
        elif self.seen == self.start + self.count:
            self._end()
        self.seen += 1

    def finish(self) -> None:
        if self.prof is not None and not self.done:
            self._end(steps=self.seen - self.start)

    def _begin(self) -> None:
        global _active
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        _active = True
        self.t0 = time.perf_counter()

    def _end(self, steps: int | None = None) -> None:
        global _active
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        _active = False
        prof = self.prof
        assert prof is not None  # step() and finish() end only a window _begin started
        prof.__exit__(None, None, None)
        self.done = True
        try:
            self._write(prof, wall, steps or self.count)
        finally:
            self.prof = None

    def _write(self, prof, wall: float, steps: int) -> None:
        avgs = prof.key_averages()
        us = 1e-6
        spans: dict[str, dict[str, float]] = {}
        kernels: list[tuple[float, float, str]] = []  # (device s, calls, name) per step
        busy = 0.0
        for a in avgs:
            on_device = str(getattr(a, "device_type", "")).endswith("CUDA")
            self_dev = getattr(a, "self_device_time_total", 0.0)
            if a.key in SPANS:
                # A span appears twice: its host range (kernels launched inside it, children
                # included, give device_s) and its range on the device's timeline (span_s: first
                # to last kernel, idle gaps included: a span much longer on the device than its
                # kernels waits for the host).
                row = spans.setdefault(a.key, {"calls_per_step": 0.0, "host_s": 0.0, "device_s": 0.0, "span_s": 0.0})
                if on_device:
                    row["span_s"] = a.device_time_total * us / steps
                else:
                    row.update(
                        calls_per_step=a.count / steps,
                        host_s=a.cpu_time_total * us / steps,
                        device_s=getattr(a, "device_time_total", 0.0) * us / steps,
                    )
                continue
            if on_device and self_dev:
                busy += self_dev
                kernels.append((self_dev * us / steps, a.count / steps, a.key))
        kernels.sort(reverse=True)
        report = {
            "rank": self.rank,
            "steps": steps,
            "wall_per_step_s": wall / steps,
            "device_busy_per_step_s": busy * us / steps,
            "spans": spans,
            "kernels": [{"name": k[:160], "device_s": t, "calls_per_step": c} for t, c, k in kernels[:200]],
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(report, indent=1))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        (self.dir / f"rank{self.rank}.txt").write_text(
            avgs.table(sort_by=sort_by, row_limit=60, max_name_column_width=80)
        )
