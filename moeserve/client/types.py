"""Typed results of the SDK: frozen dataclasses built from the moeserve.v1 messages.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

Placements and migrations are the engine's own value types (:class:`moeserve.placement.Placement`,
:class:`moeserve.placement.MigrationProgress`); every conversion that is not a plain field copy
lives in :mod:`moeserve.wire`, which the services use too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import grpc
import numpy as np

from moeserve.placement import MigrationProgress
from moeserve.rpc import admin_pb2, balancer_pb2, serving_pb2
from moeserve.wire import (
    FINISH_NAMES,
    Balancedness,
    balancedness_from_msg,
    breakeven_from_msg,
    from_int64_matrix,
    migration_from_msg,
)


class MoeserveError(Exception):
    """Any failed call: ``code`` is the grpc.StatusCode, ``message`` the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def _flat(cls, m):
    """A dataclass whose fields are a flat message's scalar fields of the same names."""
    return cls(**{f.name: getattr(m, f.name) for f in dataclasses.fields(cls)})


def _migration_or_none(m, field: str = "migration") -> MigrationProgress | None:
    return migration_from_msg(getattr(m, field)) if m.HasField(field) else None


@dataclass(frozen=True)
class Usage:
    """Tokens of a request: its prompt, those generated, and the prompt tokens read from the
    prefix cache instead of computed."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class GenerateResult:
    """token_ids: the generated ids (prompt excluded); text: their text ("" without a tokenizer);
    finish_reason: "stop", "length" or "cancelled"."""

    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage

    @classmethod
    def from_msg(cls, m: serving_pb2.GenerateResponse) -> GenerateResult:
        return cls(
            list(m.token_ids),
            m.text,
            FINISH_NAMES.get(m.finish_reason, ""),
            Usage(m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_tokens),
        )


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed piece: the new ids and text; the last chunk has finish_reason and usage."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None

    @classmethod
    def from_msg(cls, m: serving_pb2.GenerateStreamResponse) -> GenerateChunk:
        last = m.finish_reason != serving_pb2.FINISH_REASON_UNSPECIFIED
        return cls(
            list(m.token_ids),
            m.text,
            FINISH_NAMES.get(m.finish_reason) if last else None,
            Usage(m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_tokens) if last else None,
        )


@dataclass(frozen=True)
class ApplyResult:
    """What ApplyPlacement answered: the migration (None on a dry run), the plan's size, and
    the balancedness of the placement in force and of the new one under the load window.
    phy2log: the new placement [L, P]; breakeven: its break-even counts [L, E] (None from a
    server that does not send them)."""

    migration_id: str
    dry_run: bool
    migration: MigrationProgress | None
    moves: int
    bytes: int
    balancedness_before: Balancedness
    balancedness_after: Balancedness
    phy2log: np.ndarray
    breakeven: np.ndarray | None = None

    @classmethod
    def from_msg(cls, m: admin_pb2.ApplyPlacementResponse) -> ApplyResult:
        return cls(
            m.migration_id,
            m.dry_run,
            _migration_or_none(m),
            m.moves,
            m.bytes,
            balancedness_from_msg(m.balancedness_before),
            balancedness_from_msg(m.balancedness_after),
            from_int64_matrix(m.phy2log, "phy2log"),
            breakeven_from_msg(m),
        )


@dataclass(frozen=True)
class ExpertLoad:
    """load [L, E] and worker_load [L, W] over the window (``steps`` forward steps), with
    balancedness measured (of worker_load) and predicted (of load on the placement in force);
    the window's per-step statistics, None when the cluster sent none: histogram [L, E, K] (per
    step, router and expert, the replica rule's estimate of the step's count, the router's
    pairs x routers, in power-of-two bins: 0, 1, 2-3, 4-7, ...) and slot_busy_steps [L, P]
    (the (router, step) pairs in which a router sent the slot a pair)."""

    load: np.ndarray
    worker_load: np.ndarray
    steps: int
    total_steps: int
    measured: Balancedness
    predicted: Balancedness
    placement_version: int
    steps_since_placement_change: int
    window_size: int
    histogram: np.ndarray | None = None
    slot_busy_steps: np.ndarray | None = None

    @classmethod
    def from_msg(cls, m: admin_pb2.ExpertLoad) -> ExpertLoad:
        hist = busy = None
        if m.histogram.rows and m.histogram_bins > 0:
            flat = from_int64_matrix(m.histogram, "histogram")
            if flat.shape[1] % m.histogram_bins:
                raise ValueError(
                    f"histogram has {flat.shape[1]} columns, not a multiple of its {m.histogram_bins} bins"
                )
            hist = flat.reshape(flat.shape[0], -1, m.histogram_bins)
        if m.slot_busy_steps.rows:
            busy = from_int64_matrix(m.slot_busy_steps, "slot_busy_steps")
        return cls(
            from_int64_matrix(m.load, "load"),
            from_int64_matrix(m.worker_load, "worker_load"),
            m.steps,
            m.total_steps,
            balancedness_from_msg(m.measured),
            balancedness_from_msg(m.predicted),
            m.placement_version,
            m.steps_since_placement_change,
            m.window_size,
            hist,
            busy,
        )


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
    def from_msg(cls, m: admin_pb2.LoadDump) -> LoadDump:
        return cls(
            from_int64_matrix(m.total_load, "total_load"),
            from_int64_matrix(m.window_load, "window_load"),
            m.total_steps,
            m.window_steps,
            list(m.moe_layer_ids),
            m.num_decoder_layers,
        )


@dataclass(frozen=True)
class RankInfo:
    """role: "router", "worker" or "router+worker"; router_index / worker_index: the rank's
    index among the routers / workers, -1 when it is not one."""

    rank: int
    role: str
    router_index: int
    worker_index: int


@dataclass(frozen=True)
class ModelInfo:
    """The model's shape as the cluster serves it; expert_bytes: the weights of one expert."""

    num_moe_layers: int
    num_logical_experts: int
    num_slots: int
    num_workers: int
    workers_per_node: int
    top_k: int
    vocab_size: int
    expert_bytes: int


@dataclass(frozen=True)
class EplbInfo:
    """The leader's EPLB flags."""

    enable_eplb: bool
    num_redundant_experts: int
    window_size: int
    step_interval: int
    log_balancedness: bool


@dataclass(frozen=True)
class ClusterStatus:
    """Steps, versions (layer_versions [L]), the running migration, the queue, the ranks, the
    metrics ports (service -> port) and the model's shape; error: set when the cluster failed;
    the routers' KV blocks (total, in use, holding a prefix-cache hash) and the preemptions
    since start; the prompt tokens of admitted requests that looked the prefix cache up
    (``prefix_cache_queries``) and those found in it (``prefix_cache_hits``)."""

    step: int
    forward_steps: int
    uptime_s: float
    placement_version: int
    layer_versions: list[int]
    migration: MigrationProgress | None
    waiting: int
    running: int
    ranks: list[RankInfo]
    metrics_ports: dict[str, int]
    model: ModelInfo
    eplb: EplbInfo
    error: str
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    preemptions: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @classmethod
    def from_msg(cls, m: admin_pb2.ClusterStatus) -> ClusterStatus:
        return cls(
            m.step,
            m.forward_steps,
            m.uptime_s,
            m.placement_version,
            list(m.layer_versions),
            _migration_or_none(m),
            m.waiting,
            m.running,
            [_flat(RankInfo, r) for r in m.ranks],
            dict(m.metrics_ports),
            _flat(ModelInfo, m.model),
            _flat(EplbInfo, m.eplb),
            m.error,
            m.kv_blocks_total,
            m.kv_blocks_used,
            m.preemptions,
            m.kv_blocks_cached,
            m.prefix_cache_queries,
            m.prefix_cache_hits,
        )


@dataclass(frozen=True)
class BalancerSettings:
    """The balancer's runtime settings as the leader keeps them; None: not set (the balancer's
    own flag applies)."""

    window_steps: int | None = None
    step_interval: int | None = None
    min_balancedness: float | None = None
    paused: bool | None = None

    @classmethod
    def from_msg(cls, m: admin_pb2.BalancerSettings) -> BalancerSettings:
        return cls(**{f.name: getattr(m, f.name) if m.HasField(f.name) else None for f in dataclasses.fields(cls)})

    def to_msg(self) -> admin_pb2.BalancerSettings:
        return admin_pb2.BalancerSettings(**{k: v for k, v in dataclasses.asdict(self).items() if v is not None})


@dataclass(frozen=True)
class RebalanceResult:
    """A plan (phy2log [L, P]) with its predicted balancedness and size; ``applied`` with the
    migration when it was applied; ``note`` says why not otherwise. With a step model: the
    break-even counts sent with it (``breakeven`` [L, E]) and the predicted MoE seconds of a step
    before and after."""

    phy2log: np.ndarray
    balancedness_before: Balancedness
    balancedness_after: Balancedness
    slots_moved: int
    slots_moved_across_workers: int
    bytes_moved: int
    base_version: int
    applied: bool
    migration_id: str
    migration: MigrationProgress | None
    note: str
    breakeven: np.ndarray | None = None
    predicted_step_s_before: float = 0.0
    predicted_step_s_after: float = 0.0

    @classmethod
    def from_msg(cls, m: balancer_pb2.RebalanceResponse) -> RebalanceResult:
        return cls(
            from_int64_matrix(m.phy2log, "phy2log"),
            balancedness_from_msg(m.balancedness_before),
            balancedness_from_msg(m.balancedness_after),
            m.slots_moved,
            m.slots_moved_across_workers,
            m.bytes_moved,
            m.base_version,
            m.applied,
            m.migration_id,
            _migration_or_none(m),
            m.note,
            breakeven_from_msg(m),
            m.predicted_step_s_before,
            m.predicted_step_s_after,
        )


@dataclass(frozen=True)
class BalancerStatus:
    """state: "idle", "planning" or "migrating"; balancedness: the predicted mean of the
    placement in force on the window, last seen; last_error: "" when the admin API answered;
    with a step model (``step_model``: "GPU / shape"), predicted_step_s and step_efficiency of the
    placement in force on the window, last seen (0 without one)."""

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
    step_model: str = ""
    predicted_step_s: float = 0.0
    step_efficiency: float = 0.0

    @classmethod
    def from_msg(cls, m: balancer_pb2.BalancerStatus) -> BalancerStatus:
        return _flat(cls, m)
