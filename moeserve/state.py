"""Operator state that survives a restart: the state folder (``--state-dir DIR``).

Two files, each replaced atomically (written to a temporary file in the folder, flushed to
disk, then ``os.replace``-d over the old one, so a reader finds the old or the new file, never
a torn one):

- ``placement.json``: the placement in force (moeserve's placement JSON, the format of
  ``moeserve placement dump`` and ``--init-expert-location``), written by the leader whenever
  its maps or versions change (a layer commits, a migration ends or is aborted). At start the
  CLI hands it to every rank as the initial placement (the workers load those experts from the
  checkpoint) and the leader takes its version back, so versions keep increasing.
- ``balancer.json``: the balancer's runtime settings (PutBalancerSettings: window, interval,
  threshold, paused), written by the admin service before it answers, read back at start.

Nothing here imports torch or gRPC (the leader's step driver writes the placement).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
from pathlib import Path

import numpy as np

from moeserve.placement import Placement

log = logging.getLogger("moeserve.state")

PLACEMENT_FILE = "placement.json"
BALANCER_FILE = "balancer.json"
BALANCER_FORMAT = "moeserve.balancer_settings/1"
BALANCER_KEYS = ("window_steps", "step_interval", "min_balancedness", "paused")


class StateError(ValueError):
    """The state folder cannot be used, or a file in it is not what it should be (names it)."""


def write_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text``: a temporary file in the same folder, fsync, os.replace."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # the rename itself reaches the disk
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def prepare(state_dir: str | Path) -> Path:
    """Create the folder (mode 0700) and check that files can be written there; StateError
    naming the folder otherwise."""
    d = Path(state_dir)
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = d / ".write-check"
        write_atomically(probe, "ok")
        probe.unlink()
    except OSError as e:
        raise StateError(f"--state-dir {d}: cannot write there: {e.strerror or e}") from None
    return d


# -- the placement ----------------------------------------------------------------------------


def read_placement(state_dir: str | Path) -> Placement | None:
    """The placement saved in the folder, or None when there is none; StateError naming the file
    when it cannot be read."""
    path = Path(state_dir) / PLACEMENT_FILE
    if not path.is_file():
        return None
    try:
        return Placement.from_json(path.read_text())
    except (OSError, ValueError) as e:
        raise StateError(f"{path}: {e}; move it away to start from the default placement") from None


def check_topology(
    p: Placement, num_layers: int, num_logical: int, num_slots: int, num_workers: int, workers_per_node: int, what: str
) -> None:
    """StateError naming ``what`` unless ``p`` fits this cluster."""
    have = (p.phy2log.shape, p.num_logical, p.num_workers, p.workers_per_node)
    want = ((num_layers, num_slots), num_logical, num_workers, workers_per_node)
    if have != want:
        raise StateError(
            f"{what} is a placement of {p.phy2log.shape[0]} MoE layers x {p.phy2log.shape[1]} slots, "
            f"{p.num_logical} logical experts on {p.num_workers} workers ({p.workers_per_node} per node); "
            f"this cluster has {num_layers} x {num_slots}, {num_logical} experts on {num_workers} workers "
            f"({workers_per_node} per node)"
        )


class PlacementSaver:
    """Saves the leader's placement in force to ``placement.json`` off the step driver: ``save``
    only records the newest placement; a writer thread (not a daemon, so that the last write
    completes before the process exits normally) writes the newest one it finds."""

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / PLACEMENT_FILE
        self._lock = threading.Lock()
        self._pending: Placement | None = None
        self._writer: threading.Thread | None = None
        self.errors = 0
        self.writes = 0

    def save(self, placement: Placement) -> None:
        with self._lock:
            self._pending = placement
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="state-writer", daemon=False)
                self._writer.start()

    def _write(self) -> None:
        while True:
            with self._lock:
                p, self._pending = self._pending, None
                if p is None:
                    self._writer = None
                    return
            try:
                write_atomically(self.path, p.to_json())
                self.writes += 1
            except OSError as e:
                self.errors += 1
                log.error("cannot save the placement in force to %s: %s", self.path, e)

    def flush(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            writer = self._writer
        if writer is not None:
            writer.join(timeout_s)


# -- the balancer's settings ------------------------------------------------------------------


def check_balancer_settings(s: dict, window_size: int | None = None) -> None:
    """ValueError saying what is allowed unless ``s`` (window_steps, step_interval,
    min_balancedness, paused; None = unset) holds values a balancer can run with."""
    w = s.get("window_steps")
    if w is not None:
        hi = f"..{window_size} (the leader's window size)" if window_size else " or more"
        if isinstance(w, bool) or not isinstance(w, int) or w < 0 or (window_size and w > window_size):
            raise ValueError(f"window_steps must be an integer in 0{hi}; 0 = the whole window; got {w!r}")
    i = s.get("step_interval")
    if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 1):
        raise ValueError(
            f"step_interval must be an integer >= 1 (forward steps between periodic rebalances), got {i!r}"
        )
    b = s.get("min_balancedness")
    if b is not None and (
        isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not 0.0 <= b <= 1.0
    ):
        raise ValueError(f"min_balancedness must be a number in [0, 1] (0 = off), got {b!r}")
    p = s.get("paused")
    if p is not None and not isinstance(p, bool):
        raise ValueError(f"paused must be true or false, got {p!r}")


def read_balancer_settings(state_dir: str | Path, window_size: int | None = None) -> dict:
    """The settings saved in the folder ({} when there are none); StateError naming the file."""
    path = Path(state_dir) / BALANCER_FILE
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("format") != BALANCER_FORMAT:
            raise ValueError(f'expected a JSON object with "format": "{BALANCER_FORMAT}"')
        s = {k: d.get(k) for k in BALANCER_KEYS}
        check_balancer_settings(s, window_size)
    except (OSError, ValueError) as e:
        raise StateError(f"{path}: {e}; fix or remove it") from None
    return s


def write_balancer_settings(state_dir: str | Path, s: dict) -> None:
    write_atomically(
        Path(state_dir) / BALANCER_FILE, json.dumps({"format": BALANCER_FORMAT, **{k: s.get(k) for k in BALANCER_KEYS}})
    )


def phy2log_tuple(phy2log) -> tuple:
    return tuple(tuple(int(x) for x in row) for row in np.asarray(phy2log))


__all__ = [
    "PLACEMENT_FILE",
    "BALANCER_FILE",
    "StateError",
    "PlacementSaver",
    "prepare",
    "read_placement",
    "check_topology",
    "check_balancer_settings",
    "read_balancer_settings",
    "write_balancer_settings",
    "write_atomically",
]
