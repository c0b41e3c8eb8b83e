"""A step-time model of one MoE layer on one worker, and its calibration table (numpy only).

Dimension letters: L MoE layers, E logical experts, P slots per layer, W workers, K bins of a
per-step token-count histogram.

The grouped matmul reads the full weights of every slot that receives at least one token in a
step, whatever the number of tokens; at decode-sized batches those reads, not the tokens, set
the step time. The model of one layer on one worker in one step::

    time = layer_overhead_s + slot_overhead_s * busy
           + max(busy * expert_bytes / hbm_bytes_per_s, pairs * flops_per_pair / matmul_flops_per_s)

``busy``: slots of the worker that receive at least one (token, k) pair; ``pairs``: the pairs
the worker computes; ``expert_bytes = 3 * H * I * dtype_bytes`` (gate, up and down projections),
``flops_per_pair = 2 * 3 * H * I``. All ranks run a layer in lockstep, so a layer's time is its
slowest worker's and a step's MoE time the sum over layers.

Which slots are busy follows from the per-step token counts of each (layer, expert). Given
only window sums (``load`` over ``steps`` forward steps) the count of a replica in a step is
taken as Poisson with mean ``load / logcnt / steps`` (the data plane spreads an expert's tokens
evenly over its replicas), so P(busy) = 1 - exp(-mean). Given a power-of-two histogram of
per-step counts (bin 0: steps with no token, bin j >= 1: steps with 2**(j-1) .. 2**j - 1 tokens),
an expert with n tokens in a step on c replicas keeps c * (1 - (1 - 1/c)**n) of them busy in
expectation (each token's replica taken as uniform), n at the bin's geometric middle.

The parameters are measured per GPU kind and expert shape by ``benchmarks/calibrate.py`` and
kept in a small JSON table (:func:`load_table`):

    {"format": "moeserve-step-model/1",
     "measured_on": "...", "command": "...", "note": "...",
     "entries": [{"gpu": "NVIDIA H200", "shape": "llama4-scout", "hidden_size": 5120,
                  "intermediate_size": 8192, "dtype_bytes": 2, "hbm_bytes_per_s": 4.1e12,
                  "matmul_flops_per_s": 7.0e14, "slot_overhead_s": 4e-6, "layer_overhead_s": 2e-5}]}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeserve.placement import logical_counts

__all__ = [
    "FORMAT",
    "StepModel",
    "StepModelTable",
    "StepModelError",
    "load_table",
    "busy_probability",
    "expected_busy",
    "worker_times",
    "layer_times",
    "step_time",
    "breakeven",
    "step_efficiency",
]

FORMAT = "moeserve-step-model/1"
_TOP_KEYS = {"format": str, "entries": list}
_OPTIONAL_TOP = {"measured_on": str, "command": str, "note": str, "made_at": str, "fit": dict, "rows": list}
_ENTRY_INTS = ("hidden_size", "intermediate_size", "dtype_bytes")
_ENTRY_RATES = ("hbm_bytes_per_s", "matmul_flops_per_s")
_ENTRY_TIMES = ("slot_overhead_s", "layer_overhead_s")


class StepModelError(ValueError):
    """A step-model table that cannot be used: the message says what is wrong and what is allowed."""


@dataclass(frozen=True)
class StepModel:
    """The parameters of one (GPU kind, expert shape); see the module's docstring."""

    gpu: str
    shape: str
    hidden_size: int
    intermediate_size: int
    dtype_bytes: int
    hbm_bytes_per_s: float
    matmul_flops_per_s: float
    slot_overhead_s: float
    layer_overhead_s: float = 0.0

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size * self.dtype_bytes

    @property
    def flops_per_pair(self) -> float:
        return 2.0 * 3 * self.hidden_size * self.intermediate_size

    def time(self, busy, pairs) -> np.ndarray:
        """Seconds of one layer on one worker with ``busy`` slots receiving ``pairs`` (token, k)
        pairs (arrays broadcast). Non-decreasing in both."""
        busy = np.asarray(busy, dtype=np.float64)
        pairs = np.asarray(pairs, dtype=np.float64)
        read = busy * (self.expert_bytes / self.hbm_bytes_per_s)
        compute = pairs * (self.flops_per_pair / self.matmul_flops_per_s)
        return self.layer_overhead_s + self.slot_overhead_s * busy + np.maximum(read, compute)

    @property
    def breakeven_count(self) -> int:
        """b, the break-even count of the data plane's replica rule (docs/eplb.md): the pairs
        whose matmul takes as long as one copy of the expert costs its worker to hold busy,

            b = floor((expert_bytes / hbm_bytes_per_s + slot_overhead_s)
                      / (flops_per_pair / matmul_flops_per_s)),   at least 1.

        A copy given at most b pairs spends no less time reading its weights than multiplying,
        so at or below b pairs in a step one copy takes them all (another copy would add a
        read and take no time off the first); above, ceil(n / b) copies (as many as exist)
        keep each copy's matmul within about one read: a copy is read only when the matmul
        time it takes off its peers (about b pairs) covers its own read."""
        read = self.expert_bytes / self.hbm_bytes_per_s + self.slot_overhead_s
        per_pair = self.flops_per_pair / self.matmul_flops_per_s
        return max(1, int(math.floor(read / per_pair)))

    def to_entry(self) -> dict:
        return {k: getattr(self, k) for k in ("gpu", "shape", *_ENTRY_INTS, *_ENTRY_RATES, *_ENTRY_TIMES)}


@dataclass(frozen=True)
class StepModelTable:
    """A loaded table: its entries and what it says about where they came from."""

    entries: tuple[StepModel, ...]
    measured_on: str = ""
    command: str = ""
    note: str = ""

    def get(self, gpu: str, shape: str) -> StepModel:
        """The entry for ``gpu`` and ``shape``; KeyError naming those the table has."""
        for m in self.entries:
            if m.gpu == gpu and m.shape == shape:
                return m
        have = ", ".join(f"({m.gpu!r}, {m.shape!r})" for m in self.entries) or "none"
        raise KeyError(f"no step model for gpu {gpu!r} and shape {shape!r}; the table has: {have}")


def _positive_number(where: str, key: str, v, allow_zero: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise StepModelError(f"{where}: {key} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise StepModelError(f"{where}: {key} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)


def parse_table(doc) -> StepModelTable:
    """Validate a table already parsed from JSON; :class:`StepModelError` says what is wrong."""
    if not isinstance(doc, dict):
        raise StepModelError(f"a step-model table is a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise StepModelError(f"format must be {FORMAT!r}, got {doc.get('format')!r}")
    unknown = set(doc) - set(_TOP_KEYS) - set(_OPTIONAL_TOP)
    if unknown:
        raise StepModelError(f"unknown keys {sorted(unknown)}; allowed: {sorted({*_TOP_KEYS, *_OPTIONAL_TOP})}")
    for key, kind in {**_TOP_KEYS, **_OPTIONAL_TOP}.items():
        if key in doc and not isinstance(doc[key], kind):
            raise StepModelError(f"{key} must be a {kind.__name__}, got {type(doc[key]).__name__}")
    if "entries" not in doc or not doc["entries"]:
        raise StepModelError("entries must be a non-empty list of models, one per (gpu, shape)")
    allowed = {"gpu", "shape", *_ENTRY_INTS, *_ENTRY_RATES, *_ENTRY_TIMES}
    out, seen = [], set()
    for i, ent in enumerate(doc["entries"]):
        where = f"entries[{i}]"
        if not isinstance(ent, dict):
            raise StepModelError(f"{where} must be an object, got {type(ent).__name__}")
        missing = allowed - {"layer_overhead_s"} - set(ent)
        if missing:
            raise StepModelError(
                f"{where} lacks {sorted(missing)}; an entry has {sorted(allowed)} "
                "(layer_overhead_s optional, 0 by default)"
            )
        extra = set(ent) - allowed
        if extra:
            raise StepModelError(f"{where}: unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
        for key in ("gpu", "shape"):
            if not isinstance(ent[key], str) or not ent[key]:
                raise StepModelError(f"{where}: {key} must be a non-empty string, got {ent[key]!r}")
        # Any: the keyword arguments of StepModel below, an int, float or time each
        ints: dict[str, Any] = {}
        for key in _ENTRY_INTS:
            v = ent[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise StepModelError(f"{where}: {key} must be a positive integer, got {v!r}")
            ints[key] = v
        rates: dict[str, Any] = {k: _positive_number(where, k, ent[k], allow_zero=False) for k in _ENTRY_RATES}
        times: dict[str, Any] = {k: _positive_number(where, k, ent.get(k, 0.0), allow_zero=True) for k in _ENTRY_TIMES}
        gpu_shape = (ent["gpu"], ent["shape"])
        if gpu_shape in seen:
            raise StepModelError(f"{where}: a second entry for gpu {gpu_shape[0]!r} and shape {gpu_shape[1]!r}")
        seen.add(gpu_shape)
        out.append(StepModel(ent["gpu"], ent["shape"], **ints, **rates, **times))
    return StepModelTable(tuple(out), doc.get("measured_on", ""), doc.get("command", ""), doc.get("note", ""))


def load_table(path) -> StepModelTable:
    """Read and validate a step-model table (JSON file); :class:`StepModelError` says what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise StepModelError(f"cannot read the step-model table {path}: {e}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise StepModelError(f"{path} is not JSON: {e}") from e
    try:
        return parse_table(doc)
    except StepModelError as e:
        raise StepModelError(f"{path}: {e}") from e


# ---- which slots are busy ---------------------------------------------------------------------


def busy_probability(mean_per_step) -> np.ndarray:
    """P(a slot receives at least one pair in a step) for Poisson counts of this mean."""
    return -np.expm1(-np.asarray(mean_per_step, dtype=np.float64))


def _bin_counts(k: int) -> np.ndarray:
    """A representative count per histogram bin: 0, 1, then the geometric middle of 2**(j-1) .. 2**j - 1."""
    j = np.arange(k)
    lo, hi = 2.0 ** np.maximum(j - 1, 0), 2.0**j - 1
    return np.where(j == 0, 0.0, np.sqrt(lo * np.maximum(hi, lo)))


def expected_busy(load, phy2log, steps: int | None = None, histogram=None) -> np.ndarray:
    """Expected P(busy) of every slot in a step: ``[L, P]``.

    load [L, E]: pairs per expert summed over ``steps`` forward steps (Poisson per step), or
    histogram [L, E, K]: steps per power-of-two bin of per-step counts (``steps`` then unused).
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, p = phy2log.shape
    if histogram is not None:
        hist = np.asarray(histogram, dtype=np.float64)
        e = hist.shape[1]
        logcnt = logical_counts(phy2log, e).astype(np.float64)  # [L, E]
        total = hist.sum(2, keepdims=True)
        share = hist / np.where(total > 0, total, 1.0)  # [L, E, K]
        n = _bin_counts(hist.shape[2])  # [K]
        c = logcnt[:, :, None]
        busy_replicas = c * -np.expm1(n * np.log1p(-1.0 / np.maximum(c, 1.0 + 1e-12)))
        busy_replicas = np.where(c == 1, (n > 0).astype(np.float64), busy_replicas)
        per_slot = (share * busy_replicas).sum(2) / logcnt  # [L, E]
        return np.take_along_axis(per_slot, phy2log, 1)
    if steps is None or steps < 1:
        raise ValueError(f"steps must be a positive integer (forward steps in the window), got {steps!r}")
    load = np.asarray(load, dtype=np.float64)
    logcnt = logical_counts(phy2log, load.shape[1])
    per_slot_mean = np.take_along_axis(load / np.maximum(logcnt, 1), phy2log, 1) / steps
    return busy_probability(per_slot_mean)


def worker_times(
    model: StepModel, load, phy2log, num_workers: int, steps: int | None = None, histogram=None
) -> np.ndarray:
    """Predicted seconds of every layer on every worker in one step: ``[L, W]``.

    load [L, E]: pairs per expert over ``steps`` steps (a worker's pairs per step: its share of
    them / steps); histogram [L, E, K], optional: per-step counts for which slots are busy.
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, p = phy2log.shape
    if steps is None or steps < 1:
        raise ValueError(f"steps must be a positive integer (forward steps in the window), got {steps!r}")
    busy = expected_busy(load, phy2log, steps, histogram)  # [L, P]
    logcnt = logical_counts(phy2log, load.shape[1])
    pairs = np.take_along_axis(load / np.maximum(logcnt, 1), phy2log, 1) / steps
    w = num_workers
    return model.time(busy.reshape(layers, w, p // w).sum(2), pairs.reshape(layers, w, p // w).sum(2))


def layer_times(
    model: StepModel, load, phy2log, num_workers: int, steps: int | None = None, histogram=None
) -> np.ndarray:
    """Predicted seconds of every layer (its slowest worker): ``[L]``."""
    return worker_times(model, load, phy2log, num_workers, steps, histogram).max(1)


def step_time(model: StepModel, load, phy2log, num_workers: int, steps: int | None = None, histogram=None) -> float:
    """Predicted seconds of a step's MoE layers (the sum of every layer's slowest worker)."""
    return float(layer_times(model, load, phy2log, num_workers, steps, histogram).sum())


# ---- the break-even counts the data plane applies, and the trigger's step-time measure ---------


def breakeven(model: StepModel | None, num_layers: int, num_experts: int) -> np.ndarray:
    """int64 [L, E]: the break-even count b of every (MoE layer, logical expert) for the data
    plane's replica rule (``StepModel.breakeven_count``: every expert of a model has one
    shape, so one value); zeros (every replica always used) without a model. This b is per
    copy; :func:`~moeserve.balancer.policy.rule.plan_breakeven` chooses b per (layer, expert)
    for a placement and a window by the predicted layer time (the cost-aware policy's)."""
    value = 0 if model is None else model.breakeven_count
    return np.full((num_layers, num_experts), value, dtype=np.int64)


def step_efficiency(model: StepModel, load, phy2log, num_workers: int, steps: int, histogram=None) -> float:
    """The step-time analogue of balancedness, in (0, 1]: the sum over layers of the mean
    worker's predicted time over the sum of the slowest worker's (1.0: no worker waits on
    another); 1.0 when nothing is predicted to run."""
    t = worker_times(model, load, phy2log, num_workers, steps, histogram)  # [L, W]
    slowest = float(t.max(1).sum())
    return float(t.mean(1).sum()) / slowest if slowest > 0 else 1.0
