"""Load estimation for the balancer: a window over recent steps, optionally smoothed across windows.

Dimension letters: L MoE layers, E logical experts, T steps kept (``window_size``).

The leader reports, for every step, the logical counts ``[L, E]`` (tokens routed to each logical
expert, summed over routers; per-slot counts taken under different maps must never be added,
which is why the window holds logical counts). :class:`LoadWindow` keeps the last
``window_size`` steps in a ring buffer; its :meth:`LoadWindow.load` is the window sum, or, with
``ema`` set, an exponential moving average over windows (each :meth:`LoadWindow.close_window`
folds the current window sum into it), which is what a policy is given.
"""
from __future__ import annotations

import numpy as np

__all__ = ["LoadWindow"]


class LoadWindow:
    """Ring buffer of the last ``window_size`` steps of logical counts, with an optional EMA.

    num_layers L, num_logical E, window_size T >= 1 steps.
    ema: None (the load is the sum over the window) or a weight in (0, 1]: at every
    :meth:`close_window` the smoothed load becomes ``ema * window_sum + (1 - ema) * smoothed``
    (the first closed window starts it), and :meth:`load` returns that smoothed load.
    """

    def __init__(self, num_layers: int, num_logical: int, window_size: int, ema: float | None = None):
        for name, v in (("num_layers", num_layers), ("num_logical", num_logical), ("window_size", window_size)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if ema is not None and not (0.0 < ema <= 1.0):
            raise ValueError(f"ema must be in (0, 1] or None, got {ema!r}")
        self.num_layers, self.num_logical, self.window_size, self.ema = num_layers, num_logical, window_size, ema
        self._buf = np.zeros((window_size, num_layers, num_logical))            # [T, L, E]
        self._next = 0                                                           # ring position
        self._steps = 0                                                          # steps recorded, ever
        self._smoothed: np.ndarray | None = None                                 # [L, E]

    @property
    def steps(self) -> int:
        """Steps recorded since the start (not capped by the window)."""
        return self._steps

    @property
    def filled(self) -> int:
        """Steps currently in the window, at most ``window_size``."""
        return min(self._steps, self.window_size)

    def record(self, counts: np.ndarray) -> None:
        """Add one step's logical counts ``[L, E]`` (non-negative, finite); the oldest step drops out."""
        c = np.asarray(counts, dtype=np.float64)
        if c.shape != (self.num_layers, self.num_logical):
            raise ValueError(f"counts have shape {c.shape}, expected {(self.num_layers, self.num_logical)}")
        if not np.isfinite(c).all() or (c < 0).any():
            raise ValueError("counts must be finite and non-negative")
        self._buf[self._next] = c
        self._next = (self._next + 1) % self.window_size
        self._steps += 1

    def window_sum(self) -> np.ndarray:
        """Sum of the counts over the steps in the window: ``[L, E]`` (a copy)."""
        return self._buf.sum(0)

    def close_window(self) -> np.ndarray:
        """Fold the current window sum into the moving average (with ``ema``) and return the load."""
        if self.ema is not None:
            w = self.window_sum()
            self._smoothed = w if self._smoothed is None else self.ema * w + (1 - self.ema) * self._smoothed
        return self.load()

    def load(self) -> np.ndarray:
        """The load a policy plans on, ``[L, E]``: the smoothed load if ``ema`` is set and a
        window was closed, else the window sum."""
        if self.ema is not None and self._smoothed is not None:
            return self._smoothed.copy()
        return self.window_sum()

    def reset(self) -> None:
        """Forget everything (e.g. after the model or the placement's shape changed)."""
        self._buf[:] = 0
        self._next = self._steps = 0
        self._smoothed = None
