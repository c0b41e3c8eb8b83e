"""One client process's share of a request plan: the common start, each request's record, and
the requests sent at their offsets with a deadline (for the SDK and the HTTP clients alike)."""

from __future__ import annotations

import asyncio
import time


async def start(go, t0_value) -> float:
    """The common start (``time.monotonic()``), once the parent set ``go``."""
    while not go.wait(0.05):
        await asyncio.sleep(0)
    return t0_value.value


def record(i, offset, prompt, n, t0) -> dict:
    """One request's record: submit time, every token's time (both from t0), its end."""
    return {
        "i": i,
        "submit": time.monotonic() - t0,
        "tokens": [],
        "prompt_len": len(prompt),
        "max_tokens": n,
        "finish": None,
        "error": None,
    }


async def run_plan(plan: list, t0: float, deadline_s: float, request, fields: dict | None = None):
    """Every request of ``plan`` at its offset from ``t0``, ``request(rec, prompt, n)`` streaming it
    into its record (``fields``: more of them), all of them ending within ``deadline_s`` of t0 (then
    cancelled: finish "timeout"); (the records, this process's CPU seconds meanwhile)."""
    cpu0 = time.process_time()
    deadline = t0 + deadline_s

    async def one(i, offset, prompt, n):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        rec = record(i, offset, prompt, n, t0)
        rec.update(fields or {})
        try:
            await asyncio.wait_for(request(rec, prompt, n), timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            rec["finish"] = "timeout"
        except Exception as e:  # noqa: BLE001 - recorded per request
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec

    recs = await asyncio.gather(*(one(*p) for p in plan))
    return recs, time.process_time() - cpu0
