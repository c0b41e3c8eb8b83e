"""Typed results of the SDK: frozen dataclasses built from the moeserve.v1 messages.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from moeserve.rpc import admin_pb2, balancer_pb2, common_pb2, serving_pb2
from moeserve.services.convert import STATE_NAMES, from_int64_matrix

FINISH_NAMES = {serving_pb2.STOP: "stop", serving_pb2.LENGTH: "length", serving_pb2.CANCELLED: "cancelled"}


class MoeserveError(Exception):
    """Any failed call: ``code`` is the grpc.StatusCode, ``message`` the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class GenerateResult:
    """token_ids: the generated ids (prompt excluded); text: their text ("" without a tokenizer);
    finish_reason: "stop", "length" or "cancelled"."""

    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage

    @classmethod
    def from_msg(cls, m: serving_pb2.GenerateResponse) -> "GenerateResult":
        return cls(list(m.token_ids), m.text, FINISH_NAMES.get(m.finish_reason, ""),
                   Usage(m.usage.prompt_tokens, m.usage.completion_tokens))


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed piece: the new ids and text; the last chunk has finish_reason and usage."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None

    @classmethod
    def from_msg(cls, m: serving_pb2.GenerateStreamResponse) -> "GenerateChunk":
        last = m.finish_reason != serving_pb2.FINISH_REASON_UNSPECIFIED
        return cls(list(m.token_ids), m.text, FINISH_NAMES.get(m.finish_reason) if last else None,
                   Usage(m.usage.prompt_tokens, m.usage.completion_tokens) if last else None)


@dataclass(frozen=True)
class Balancedness:
    """per_layer [L]; mean over layers with tokens; sum_ratio as vLLM logs it."""

    per_layer: np.ndarray
    mean: float
    sum_ratio: float

    @classmethod
    def from_msg(cls, m: common_pb2.Balancedness) -> "Balancedness":
        return cls(np.asarray(m.per_layer, dtype=np.float64), m.mean, m.sum_ratio)


@dataclass(frozen=True)
class Migration:
    """A live migration's progress; state: planned, staging, moving, done, aborted, failed."""

    migration_id: str
    state: str
    error: str
    target_version: int
    moves_total: int
    moves_done: int
    bytes_total: int
    bytes_done: int
    layers_total: int
    layers_committed: int

    @property
    def ended(self) -> bool:
        return self.state in ("done", "aborted", "failed")

    @classmethod
    def from_msg(cls, m: common_pb2.MigrationProgress) -> "Migration":
        return cls(m.migration_id, STATE_NAMES.get(m.state, "unknown"), m.error, m.target_version, m.moves_total,
                   m.moves_done, m.bytes_total, m.bytes_done, m.layers_total, m.layers_committed)


@dataclass(frozen=True)
class Placement:
    """phy2log int64 [L, P]; version; layer_versions [L]."""

    phy2log: np.ndarray
    version: int
    layer_versions: np.ndarray
    num_logical_experts: int
    num_workers: int
    workers_per_node: int

    @classmethod
    def from_msg(cls, m: admin_pb2.Placement) -> "Placement":
        return cls(from_int64_matrix(m.phy2log, "phy2log"), m.version, np.asarray(m.layer_versions, dtype=np.int64),
                   m.num_logical_experts, m.num_workers, m.workers_per_node)


@dataclass(frozen=True)
class ApplyResult:
    """What ApplyPlacement answered: the migration (None on a dry run), the plan's size, and
    the balancedness of the placement in force and of the new one under the load window."""

    migration_id: str
    dry_run: bool
    migration: Migration | None
    moves: int
    bytes: int
    balancedness_before: Balancedness
    balancedness_after: Balancedness
    phy2log: np.ndarray

    @classmethod
    def from_msg(cls, m: admin_pb2.ApplyPlacementResponse, migration: Migration | None = None) -> "ApplyResult":
        mig = migration or (Migration.from_msg(m.migration) if m.HasField("migration") else None)
        return cls(m.migration_id, m.dry_run, mig, m.moves, m.bytes, Balancedness.from_msg(m.balancedness_before),
                   Balancedness.from_msg(m.balancedness_after), from_int64_matrix(m.phy2log, "phy2log"))


@dataclass(frozen=True)
class ExpertLoad:
    """load [L, E] and worker_load [L, W] over the window (``steps`` forward steps), with
    balancedness measured (of worker_load) and predicted (of load on the placement in force)."""

    load: np.ndarray
    worker_load: np.ndarray
    steps: int
    total_steps: int
    measured: Balancedness
    predicted: Balancedness
    placement_version: int
    steps_since_placement_change: int
    window_size: int

    @classmethod
    def from_msg(cls, m: admin_pb2.ExpertLoad) -> "ExpertLoad":
        return cls(from_int64_matrix(m.load, "load"), from_int64_matrix(m.worker_load, "worker_load"), m.steps,
                   m.total_steps, Balancedness.from_msg(m.measured), Balancedness.from_msg(m.predicted),
                   m.placement_version, m.steps_since_placement_change, m.window_size)


@dataclass(frozen=True)
class LoadDump:
    """total_load and window_load [L, E]; moe_layer_ids[m] = decoder layer of MoE layer m."""

    total_load: np.ndarray
    window_load: np.ndarray
    total_steps: int
    window_steps: int
    moe_layer_ids: list[int]
    num_decoder_layers: int

    @classmethod
    def from_msg(cls, m: admin_pb2.LoadDump) -> "LoadDump":
        return cls(from_int64_matrix(m.total_load, "total_load"), from_int64_matrix(m.window_load, "window_load"),
                   m.total_steps, m.window_steps, list(m.moe_layer_ids), m.num_decoder_layers)


def _fields(m) -> dict:
    """A flat message's fields as a dict of Python values."""
    return {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}


@dataclass(frozen=True)
class ClusterStatus:
    """Steps, versions, the running migration, the queue, the ranks and the model's shape."""

    step: int
    forward_steps: int
    uptime_s: float
    placement_version: int
    layer_versions: list[int]
    migration: Migration | None
    waiting: int
    running: int
    ranks: list[dict]
    metrics_ports: dict[str, int]
    model: dict
    eplb: dict
    error: str

    @classmethod
    def from_msg(cls, m: admin_pb2.ClusterStatus) -> "ClusterStatus":
        return cls(m.step, m.forward_steps, m.uptime_s, m.placement_version, list(m.layer_versions),
                   Migration.from_msg(m.migration) if m.HasField("migration") else None, m.waiting, m.running,
                   [_fields(r) for r in m.ranks], dict(m.metrics_ports), _fields(m.model), _fields(m.eplb), m.error)


@dataclass(frozen=True)
class RebalanceResult:
    """A plan (phy2log [L, P]) with its predicted balancedness and size; ``applied`` with the
    migration when it was applied; ``note`` says why not otherwise."""

    phy2log: np.ndarray
    balancedness_before: Balancedness
    balancedness_after: Balancedness
    slots_moved: int
    slots_moved_across_workers: int
    bytes_moved: int
    base_version: int
    applied: bool
    migration_id: str
    migration: Migration | None
    note: str

    @classmethod
    def from_msg(cls, m: balancer_pb2.RebalanceResponse) -> "RebalanceResult":
        return cls(from_int64_matrix(m.phy2log, "phy2log"), Balancedness.from_msg(m.balancedness_before),
                   Balancedness.from_msg(m.balancedness_after), m.slots_moved, m.slots_moved_across_workers,
                   m.bytes_moved, m.base_version, m.applied, m.migration_id,
                   Migration.from_msg(m.migration) if m.HasField("migration") else None, m.note)


@dataclass(frozen=True)
class BalancerStatus:
    window_steps: int
    step_interval: int
    min_balancedness: float
    paused: bool
    state: str
    rebalances: int
    last_trigger: str
    last_migration_id: str
    last_error: str
    admin_reachable: bool
    balancedness: float
    placement_version: int
    loop_iterations: int

    @classmethod
    def from_msg(cls, m: balancer_pb2.BalancerStatus) -> "BalancerStatus":
        return cls(m.window_steps, m.step_interval, m.min_balancedness, m.paused, m.state, m.rebalances,
                   m.last_trigger, m.last_migration_id, m.last_error, m.admin_reachable, m.balancedness,
                   m.placement_version, m.loop_iterations)
