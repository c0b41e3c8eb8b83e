"""Values <-> moeserve.v1 messages: every conversion the services and the SDK share, once.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

Matrices travel row-major with their shape (``Int64Matrix``); :func:`from_int64_matrix` checks
that the values fill the shape, so a malformed message is an error that says so. Placements
and migration progress travel as :class:`moeserve.placement.Placement` and
:class:`moeserve.placement.MigrationProgress` on both ends; the proto enums of migration states
and finish reasons are mapped here and nowhere else.

This module imports numpy, :mod:`moeserve.placement` and the generated code only, so that the
SDK built on it never pulls in server code (the services, the router, torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from moeserve.placement import MigrationProgress, MigrationState, Placement, worker_balancedness, worker_load
from moeserve.rpc import admin_pb2, common_pb2, serving_pb2

# Trailing metadata every moeserve server sets on every call its handlers answer (value: the
# service name). An UNAVAILABLE without it came from the transport: the call reached no server,
# so a client may repeat it even when it is not idempotent.
SERVER_METADATA_KEY = "moeserve-server"

FINISH_REASONS = {"stop": serving_pb2.STOP, "length": serving_pb2.LENGTH, "cancelled": serving_pb2.CANCELLED}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}

# The proto enum spells the states as MigrationState's member names: a state added on one side
# only fails here, at import, rather than on the wire.
# (Value is typed as returning int; the number is a State.)
_STATE_TO_MSG = {
    s: cast(common_pb2.MigrationProgress.State, common_pb2.MigrationProgress.State.Value(s.name))
    for s in MigrationState
}
_STATE_OF_MSG = {v: k for k, v in _STATE_TO_MSG.items()}


# -- matrices -----------------------------------------------------------------------------------


def int64_matrix(a) -> common_pb2.Int64Matrix:
    """A 2-D array ``[rows, cols]`` -> ``Int64Matrix`` (row-major values)."""
    a = np.asarray(a, dtype=np.int64)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {a.shape}")
    return common_pb2.Int64Matrix(rows=a.shape[0], cols=a.shape[1], values=a.ravel().tolist())


def from_int64_matrix(m: common_pb2.Int64Matrix, what: str = "matrix") -> np.ndarray:
    """``Int64Matrix`` -> int64 ``[rows, cols]``; ValueError naming ``what`` and the shape when
    the values do not fill it."""
    if m.rows < 0 or m.cols < 0 or m.rows * m.cols != len(m.values):
        raise ValueError(
            f"{what} says shape ({m.rows}, {m.cols}) but holds {len(m.values)} values (rows * cols values, row-major)"
        )
    return np.asarray(m.values, dtype=np.int64).reshape(m.rows, m.cols)


# -- balancedness -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Balancedness:
    """per_layer [L]: mean / max worker load (1.0 for a layer without tokens); mean: over the
    layers with tokens; sum_ratio: sum of means / sum of maxes, as vLLM logs it."""

    per_layer: np.ndarray
    mean: float
    sum_ratio: float


def worker_balancedness_msg(worker_load_) -> common_pb2.Balancedness:
    """Balancedness of worker loads ``[L, W]`` (measured by the routers, or predicted)."""
    b = worker_balancedness(worker_load_)
    return common_pb2.Balancedness(per_layer=b["per_layer"].tolist(), mean=b["mean"], sum_ratio=b["sum_ratio"])


def placement_balancedness(load, phy2log, num_workers: int) -> common_pb2.Balancedness:
    """Predicted balancedness of ``phy2log [L, P]`` under ``load [L, E]``."""
    return worker_balancedness_msg(worker_load(load, phy2log, num_workers))


def balancedness_from_msg(m: common_pb2.Balancedness) -> Balancedness:
    return Balancedness(np.asarray(m.per_layer, dtype=np.float64), m.mean, m.sum_ratio)


# -- placement ----------------------------------------------------------------------------------


def placement_msg(p: Placement) -> admin_pb2.Placement:
    assert p.layer_versions is not None  # Placement.__post_init__ fills it
    return admin_pb2.Placement(
        phy2log=int64_matrix(p.phy2log),
        version=int(p.version),
        layer_versions=p.layer_versions.tolist(),
        num_logical_experts=p.num_logical,
        num_workers=p.num_workers,
        workers_per_node=p.workers_per_node,
        breakeven=int64_matrix(p.breakeven),
    )


def breakeven_from_msg(m, field: str = "breakeven") -> np.ndarray | None:
    """The ``breakeven`` [L, E] matrix of a message (Placement, ApplyPlacementRequest), or None
    when it is unset; ValueError when its values do not fill its shape."""
    if not m.HasField(field):
        return None
    return from_int64_matrix(getattr(m, field), "breakeven")


def placement_from_msg(m: admin_pb2.Placement) -> Placement:
    """ValueError when the message is not a valid placement (Placement checks it whole; an
    unset breakeven is all zeros)."""
    return Placement(
        from_int64_matrix(m.phy2log, "phy2log"),
        m.num_logical_experts,
        m.num_workers,
        m.workers_per_node,
        m.version,
        np.asarray(m.layer_versions, dtype=np.int64),
        breakeven_from_msg(m),
    )


# -- migrations ---------------------------------------------------------------------------------


def migration_msg(p: MigrationProgress) -> common_pb2.MigrationProgress:
    return common_pb2.MigrationProgress(
        migration_id=p.migration_id,
        state=_STATE_TO_MSG[p.state],
        error=p.error,
        target_version=p.target_version,
        moves_total=p.moves_total,
        moves_done=p.moves_done,
        bytes_total=p.bytes_total,
        bytes_done=p.bytes_done,
        layers_total=p.layers_total,
        layers_committed=p.layers_committed,
    )


def migration_from_msg(m: common_pb2.MigrationProgress) -> MigrationProgress:
    """ValueError for a state this side does not know (unset, or from a newer server)."""
    if m.state not in _STATE_OF_MSG:
        raise ValueError(
            f"migration {m.migration_id!r} has state {m.state}, not one of "
            f"{sorted(_STATE_OF_MSG)} ({', '.join(s.value for s in MigrationState)})"
        )
    return MigrationProgress(
        m.migration_id,
        _STATE_OF_MSG[m.state],
        m.error,
        m.target_version,
        m.moves_total,
        m.moves_done,
        m.bytes_total,
        m.bytes_done,
        m.layers_total,
        m.layers_committed,
    )


__all__ = [
    "SERVER_METADATA_KEY",
    "FINISH_REASONS",
    "FINISH_NAMES",
    "int64_matrix",
    "from_int64_matrix",
    "Balancedness",
    "worker_balancedness_msg",
    "placement_balancedness",
    "balancedness_from_msg",
    "placement_msg",
    "placement_from_msg",
    "breakeven_from_msg",
    "migration_msg",
    "migration_from_msg",
]
