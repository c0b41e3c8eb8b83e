"""The leader's forward steps over time: a poller of its admin status, and from it the engine's
own decode step, apart from what the clients see (a front end behind the leader makes the
clients' gaps longer than the steps)."""

from __future__ import annotations

import threading
import time

import numpy as np

from servinglib.cluster import TOKEN


class StepPoller:
    """Samples the leader's forward-step count (admin status) every ``period`` seconds in a thread,
    so that the steps of a time window (a burst's prefill) can be counted afterwards."""

    def __init__(self, admin: str, period: float = 0.1):
        from moeserve.client import Client

        self.samples: list[tuple[float, int]] = []
        self._client = Client(admin, TOKEN, timeout=10)
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                steps = self._client.status().forward_steps
                self.samples.append((time.monotonic(), steps))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
            self._stop.wait(self._period)

    def steps_at(self, t: float) -> float | None:
        """Forward steps at monotonic time t, interpolated between samples."""
        xs = self.samples
        if not xs or t < xs[0][0] or t > xs[-1][0]:
            return None
        return float(np.interp(t, [x[0] for x in xs], [x[1] for x in xs]))

    def steps_between(self, t0: float, t1: float) -> float | None:
        a, b = self.steps_at(t0), self.steps_at(t1)
        return (b - a) if a is not None and b is not None else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()

    def time_at(self, steps: float) -> float | None:
        """Monotonic time when the leader's step count reached ``steps``, interpolated between
        samples; None outside them."""
        xs = self.samples
        if not xs or steps < xs[0][1] or steps > xs[-1][1]:
            return None
        counts = np.array([x[1] for x in xs], dtype=np.float64)
        times = np.array([x[0] for x in xs], dtype=np.float64)
        keep = np.concatenate(([True], np.diff(counts) > 0))  # the first sample of each count
        return float(np.interp(steps, counts[keep], times[keep]))


def decode_step_s(poller: StepPoller, end_steps: int, output: int, trim: int) -> float | None:
    """The engine's mean decode step over a burst whose sequences all ran at once: its last
    ``output - 1`` steps are decodes only (every first token comes from a prefill step), less
    ``trim`` at each end; None when the samples do not cover them or too few are left."""
    lo, hi = end_steps - (output - 1) + trim, end_steps - trim
    if hi - lo < 2:
        return None
    t_lo, t_hi = poller.time_at(lo), poller.time_at(hi)
    if t_lo is None or t_hi is None or t_hi <= t_lo:
        return None
    return (t_hi - t_lo) / (hi - lo)
