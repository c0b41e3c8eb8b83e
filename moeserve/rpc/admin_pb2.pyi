from moeserve.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Placement(_message.Message):
    __slots__ = ("phy2log", "version", "layer_versions", "num_logical_experts", "num_workers", "workers_per_node", "breakeven")
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    BREAKEVEN_FIELD_NUMBER: _ClassVar[int]
    phy2log: _common_pb2.Int64Matrix
    version: int
    layer_versions: _containers.RepeatedScalarFieldContainer[int]
    num_logical_experts: int
    num_workers: int
    workers_per_node: int
    breakeven: _common_pb2.Int64Matrix
    def __init__(self, phy2log: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., version: _Optional[int] = ..., layer_versions: _Optional[_Iterable[int]] = ..., num_logical_experts: _Optional[int] = ..., num_workers: _Optional[int] = ..., workers_per_node: _Optional[int] = ..., breakeven: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ...) -> None: ...

class PlacementFile(_message.Message):
    __slots__ = ("format", "content")
    class Format(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORMAT_UNSPECIFIED: _ClassVar[PlacementFile.Format]
        MOESERVE_JSON: _ClassVar[PlacementFile.Format]
        SGLANG_JSON: _ClassVar[PlacementFile.Format]
        SGLANG_PT: _ClassVar[PlacementFile.Format]
    FORMAT_UNSPECIFIED: PlacementFile.Format
    MOESERVE_JSON: PlacementFile.Format
    SGLANG_JSON: PlacementFile.Format
    SGLANG_PT: PlacementFile.Format
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    format: PlacementFile.Format
    content: bytes
    def __init__(self, format: _Optional[_Union[PlacementFile.Format, str]] = ..., content: _Optional[bytes] = ...) -> None: ...

class ApplyPlacementRequest(_message.Message):
    __slots__ = ("phy2log", "file", "expected_version", "dry_run", "breakeven")
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    BREAKEVEN_FIELD_NUMBER: _ClassVar[int]
    phy2log: _common_pb2.Int64Matrix
    file: PlacementFile
    expected_version: int
    dry_run: bool
    breakeven: _common_pb2.Int64Matrix
    def __init__(self, phy2log: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., file: _Optional[_Union[PlacementFile, _Mapping]] = ..., expected_version: _Optional[int] = ..., dry_run: _Optional[bool] = ..., breakeven: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ...) -> None: ...

class ApplyPlacementResponse(_message.Message):
    __slots__ = ("migration_id", "dry_run", "migration", "moves", "bytes", "balancedness_before", "balancedness_after", "phy2log", "breakeven")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    BREAKEVEN_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    dry_run: bool
    migration: _common_pb2.MigrationProgress
    moves: int
    bytes: int
    balancedness_before: _common_pb2.Balancedness
    balancedness_after: _common_pb2.Balancedness
    phy2log: _common_pb2.Int64Matrix
    breakeven: _common_pb2.Int64Matrix
    def __init__(self, migration_id: _Optional[str] = ..., dry_run: _Optional[bool] = ..., migration: _Optional[_Union[_common_pb2.MigrationProgress, _Mapping]] = ..., moves: _Optional[int] = ..., bytes: _Optional[int] = ..., balancedness_before: _Optional[_Union[_common_pb2.Balancedness, _Mapping]] = ..., balancedness_after: _Optional[_Union[_common_pb2.Balancedness, _Mapping]] = ..., phy2log: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., breakeven: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ...) -> None: ...

class GetMigrationRequest(_message.Message):
    __slots__ = ("migration_id", "wait_s")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    wait_s: float
    def __init__(self, migration_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class AbortMigrationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortMigrationResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ("window_steps",)
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    window_steps: int
    def __init__(self, window_steps: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("load", "worker_load", "steps", "total_steps", "measured", "predicted", "placement_version", "steps_since_placement_change", "window_size", "histogram", "histogram_bins", "slot_busy_steps")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    WORKER_LOAD_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_SINCE_PLACEMENT_CHANGE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_BINS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BUSY_STEPS_FIELD_NUMBER: _ClassVar[int]
    load: _common_pb2.Int64Matrix
    worker_load: _common_pb2.Int64Matrix
    steps: int
    total_steps: int
    measured: _common_pb2.Balancedness
    predicted: _common_pb2.Balancedness
    placement_version: int
    steps_since_placement_change: int
    window_size: int
    histogram: _common_pb2.Int64Matrix
    histogram_bins: int
    slot_busy_steps: _common_pb2.Int64Matrix
    def __init__(self, load: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., worker_load: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., steps: _Optional[int] = ..., total_steps: _Optional[int] = ..., measured: _Optional[_Union[_common_pb2.Balancedness, _Mapping]] = ..., predicted: _Optional[_Union[_common_pb2.Balancedness, _Mapping]] = ..., placement_version: _Optional[int] = ..., steps_since_placement_change: _Optional[int] = ..., window_size: _Optional[int] = ..., histogram: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., histogram_bins: _Optional[int] = ..., slot_busy_steps: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ...) -> None: ...

class DumpLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadDump(_message.Message):
    __slots__ = ("total_load", "window_load", "total_steps", "window_steps", "moe_layer_ids", "num_decoder_layers")
    TOTAL_LOAD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LOAD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    total_load: _common_pb2.Int64Matrix
    window_load: _common_pb2.Int64Matrix
    total_steps: int
    window_steps: int
    moe_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    num_decoder_layers: int
    def __init__(self, total_load: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., window_load: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., total_steps: _Optional[int] = ..., window_steps: _Optional[int] = ..., moe_layer_ids: _Optional[_Iterable[int]] = ..., num_decoder_layers: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "role", "router_index", "worker_index")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    rank: int
    role: str
    router_index: int
    worker_index: int
    def __init__(self, rank: _Optional[int] = ..., role: _Optional[str] = ..., router_index: _Optional[int] = ..., worker_index: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("num_moe_layers", "num_logical_experts", "num_slots", "num_workers", "workers_per_node", "top_k", "vocab_size", "expert_bytes")
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_moe_layers: int
    num_logical_experts: int
    num_slots: int
    num_workers: int
    workers_per_node: int
    top_k: int
    vocab_size: int
    expert_bytes: int
    def __init__(self, num_moe_layers: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_workers: _Optional[int] = ..., workers_per_node: _Optional[int] = ..., top_k: _Optional[int] = ..., vocab_size: _Optional[int] = ..., expert_bytes: _Optional[int] = ...) -> None: ...

class EplbInfo(_message.Message):
    __slots__ = ("enable_eplb", "num_redundant_experts", "window_size", "step_interval", "log_balancedness")
    ENABLE_EPLB_FIELD_NUMBER: _ClassVar[int]
    NUM_REDUNDANT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LOG_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    enable_eplb: bool
    num_redundant_experts: int
    window_size: int
    step_interval: int
    log_balancedness: bool
    def __init__(self, enable_eplb: _Optional[bool] = ..., num_redundant_experts: _Optional[int] = ..., window_size: _Optional[int] = ..., step_interval: _Optional[int] = ..., log_balancedness: _Optional[bool] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("step", "forward_steps", "uptime_s", "placement_version", "layer_versions", "migration", "waiting", "running", "ranks", "metrics_ports", "model", "eplb", "error", "kv_blocks_total", "kv_blocks_used", "preemptions", "kv_blocks_cached", "prefix_cache_queries", "prefix_cache_hits")
    class MetricsPortsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STEPS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPLB_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    step: int
    forward_steps: int
    uptime_s: float
    placement_version: int
    layer_versions: _containers.RepeatedScalarFieldContainer[int]
    migration: _common_pb2.MigrationProgress
    waiting: int
    running: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    metrics_ports: _containers.ScalarMap[str, int]
    model: ModelInfo
    eplb: EplbInfo
    error: str
    kv_blocks_total: int
    kv_blocks_used: int
    preemptions: int
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, step: _Optional[int] = ..., forward_steps: _Optional[int] = ..., uptime_s: _Optional[float] = ..., placement_version: _Optional[int] = ..., layer_versions: _Optional[_Iterable[int]] = ..., migration: _Optional[_Union[_common_pb2.MigrationProgress, _Mapping]] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., metrics_ports: _Optional[_Mapping[str, int]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., eplb: _Optional[_Union[EplbInfo, _Mapping]] = ..., error: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class GetBalancerSettingsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BalancerSettings(_message.Message):
    __slots__ = ("window_steps", "step_interval", "min_balancedness", "paused")
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MIN_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    window_steps: int
    step_interval: int
    min_balancedness: float
    paused: bool
    def __init__(self, window_steps: _Optional[int] = ..., step_interval: _Optional[int] = ..., min_balancedness: _Optional[float] = ..., paused: _Optional[bool] = ...) -> None: ...
