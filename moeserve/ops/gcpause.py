"""Keep Python's cyclic garbage collector out of the serving path.

A serving process holds millions of long-lived objects made at start (torch, Triton, the model,
gRPC); every full (generation 2) collection walks all of them, on whichever thread allocates
when the thresholds fall: a step or a stream of tokens stalls for as long.

``freeze_startup_heap`` runs once a process is ready: one full collection, then ``gc.freeze()``
moves every surviving object to the permanent generation, which later collections skip (what
vLLM does after start-up, and what CPython's documentation recommends for a process that
allocates its long-lived state once). ``watch`` logs every collection longer than
``SLOW_GC_S`` with its generation, so a pause is never silent. On the H200 host no collection
over 0.1 s was logged while serving with the heap frozen (benchmarks/results/
serving-scout8-1gpu-gcfreeze.json); the multi-second host stalls seen there at burst starts
were not the collector (most likely Triton recompiles: tests/test_triton_specialization.py).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

SLOW_GC_S = 0.1
_started: dict[int, float] = {}
_watching = False


def _callback(phase: str, info: dict) -> None:
    gen = info.get("generation", -1)
    if phase == "start":
        _started[gen] = time.perf_counter()
        return
    t0 = _started.pop(gen, None)
    if t0 is None:
        return
    took = time.perf_counter() - t0
    if took > SLOW_GC_S:
        log.warning(
            "slow garbage collection: generation %d took %.2f s (%d collected, %d uncollectable, %d objects tracked)",
            gen,
            took,
            info.get("collected", 0),
            info.get("uncollectable", 0),
            len(gc.get_objects(gen)) if gen >= 0 else -1,
        )


def watch() -> None:
    """Log collections longer than ``SLOW_GC_S`` (once per process; idempotent)."""
    global _watching
    if not _watching:
        gc.callbacks.append(_callback)
        _watching = True


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation. Returns how
    many objects were frozen. Call when start-up is over (weights loaded, graphs captured)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector's reach (%.2f s)", n, time.perf_counter() - t0)
    watch()
    return n
