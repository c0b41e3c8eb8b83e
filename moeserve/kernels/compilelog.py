"""Say when a Triton kernel compiles while serving.

Triton compiles a kernel once per specialization: each distinct set of constexpr values, and
each new divisibility class of its integer and pointer arguments. A compile costs ~0.5-3 s of
host time on the H200 host, and while it runs the step that launched the kernel waits: a launch
argument that follows the batch shape as a constexpr stalls serving whenever a shape is new
(the race kernel's chunk count did), and so does an integer or address argument whose class
follows the step (``tests/test_triton_specialization.py`` holds every serving kernel to one
compile per launch configuration).

``watch`` installs Triton's JIT hooks (``triton.knobs.runtime.jit_cache_hook`` before a compile,
``jit_post_compile_hook`` after it) and logs every compile with the kernel's specialization and
its duration (a warning over ``SLOW_COMPILE_S``); rank processes call it once they are ready,
so every compile logged is one that ran while serving. Nothing happens without Triton, under
its interpreter (nothing compiles), or with a Triton that lacks the hooks.

A library that builds a plan per shape outside Triton (cuDNN's attention: one per sequence
length) is not seen by the hooks; its caller keeps the shapes it has launched and calls
``planned`` at a new one, which logs it the same way once ``watch`` ran.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger(__name__)

SLOW_COMPILE_S = 0.2
_started: dict = {}
_installed = False
counts: Counter = Counter()  # compiles since ``watch``, by kernel name (benchmarks/gpu_compiles.py)


def _before(*, key, repr, **_):
    _started[str(key)] = time.perf_counter()
    return None  # compile as usual


def _after(*, key, repr, **_):
    counts[repr.split("[", 1)[0]] += 1
    t0 = _started.pop(str(key), None)
    took = time.perf_counter() - t0 if t0 is not None else float("nan")
    (log.warning if not took <= SLOW_COMPILE_S else log.info)(
        "Triton compiled %s while serving in %.2f s; key %s",
        " ".join(repr.split())[:400],
        took,
        " ".join(str(key).split())[:4000],  # the arguments' specialization: what the warm-up missed
    )
    return None


def watch() -> bool:
    """Install the hooks (idempotent; keeps hooks someone else set). True when installed."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs

        rt = knobs.runtime
        if getattr(rt, "jit_cache_hook", None) is not None or getattr(rt, "jit_post_compile_hook", None) is not None:
            return False  # hooks of someone else's: leave them
        rt.jit_cache_hook = _before
        rt.jit_post_compile_hook = _after
    except Exception:  # noqa: BLE001 - no Triton, or one without the hooks
        return False
    _installed = True
    return True


def planned(what: str) -> None:
    """A shape the caller had not launched before, launched now (``what``: the kernel's name,
    then its shape in brackets): once ``watch`` ran (the rank is serving) it is logged as a
    compile while serving and counted; before that (the warm-up) nothing is said."""
    if not _installed:
        return
    counts[what.split("[", 1)[0]] += 1
    log.warning("cuDNN compiled %s while serving (a shape the warm-up did not launch)", what[:400])
