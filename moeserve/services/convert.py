"""numpy arrays and engine values <-> moeserve.v1 messages (used by services and the SDK).

Matrices travel row-major with their shape; :func:`from_int64_matrix` checks that the values
fill the shape, so a malformed message is an error that says so.
"""
from __future__ import annotations

import numpy as np

from moeserve.placement import model_balancedness, worker_balancedness
from moeserve.rpc import common_pb2

MIGRATION_STATES = {"planned": 1, "staging": 2, "moving": 3, "done": 4, "aborted": 5, "failed": 6}
STATE_NAMES = {v: k for k, v in MIGRATION_STATES.items()}


def int64_matrix(a) -> common_pb2.Int64Matrix:
    a = np.asarray(a, dtype=np.int64)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {a.shape}")
    return common_pb2.Int64Matrix(rows=a.shape[0], cols=a.shape[1], values=a.ravel().tolist())


def from_int64_matrix(m: common_pb2.Int64Matrix, what: str = "matrix") -> np.ndarray:
    """-> int64 [rows, cols]; ValueError when the values do not fill the shape."""
    if m.rows < 0 or m.cols < 0 or m.rows * m.cols != len(m.values):
        raise ValueError(f"{what} says shape ({m.rows}, {m.cols}) but holds {len(m.values)} values "
                         f"(rows * cols values, row-major)")
    return np.asarray(m.values, dtype=np.int64).reshape(m.rows, m.cols)


def balancedness_msg(per_layer, worker_load=None) -> common_pb2.Balancedness:
    """From per-layer values (and, for sum_ratio, the [L, W] loads they come from)."""
    per_layer = np.asarray(per_layer, dtype=np.float64)
    if worker_load is not None:
        b = worker_balancedness(worker_load)
        mean, ratio = b["mean"], b["sum_ratio"]
    else:
        mean = float(per_layer.mean()) if per_layer.size else 1.0
        ratio = mean
    return common_pb2.Balancedness(per_layer=per_layer.tolist(), mean=mean, sum_ratio=ratio)


def placement_balancedness(load, phy2log, num_workers: int) -> common_pb2.Balancedness:
    """Predicted balancedness of ``phy2log [L, P]`` under ``load [L, E]``."""
    from moeserve.placement import balancedness
    m = model_balancedness(load, phy2log, num_workers)
    return common_pb2.Balancedness(per_layer=balancedness(load, phy2log, num_workers).tolist(),
                                   mean=m["mean"], sum_ratio=m["sum_ratio"])


def migration_msg(summary: dict) -> common_pb2.MigrationProgress:
    """From ``Migration.summary()``."""
    s = summary
    return common_pb2.MigrationProgress(
        migration_id=s["migration_id"], state=MIGRATION_STATES.get(s["state"], 0), error=s["error"],
        target_version=s["target_version"], moves_total=s["moves_total"], moves_done=s["moves_done"],
        bytes_total=s["bytes_total"], bytes_done=s["bytes_done"], layers_total=s["layers_total"],
        layers_committed=s["layers_committed"])
