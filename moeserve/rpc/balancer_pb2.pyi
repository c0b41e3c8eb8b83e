from moeserve.rpc import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RebalanceRequest(_message.Message):
    __slots__ = ("dry_run", "wait")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    wait: bool
    def __init__(self, dry_run: _Optional[bool] = ..., wait: _Optional[bool] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("phy2log", "balancedness_before", "balancedness_after", "slots_moved", "slots_moved_across_workers", "bytes_moved", "base_version", "applied", "migration_id", "migration", "note", "breakeven", "predicted_step_s_before", "predicted_step_s_after")
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_ACROSS_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    BREAKEVEN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_BEFORE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_AFTER_FIELD_NUMBER: _ClassVar[int]
    phy2log: _common_pb2.Int64Matrix
    balancedness_before: _common_pb2.Balancedness
    balancedness_after: _common_pb2.Balancedness
    slots_moved: int
    slots_moved_across_workers: int
    bytes_moved: int
    base_version: int
    applied: bool
    migration_id: str
    migration: _common_pb2.MigrationProgress
    note: str
    breakeven: _common_pb2.Int64Matrix
    predicted_step_s_before: float
    predicted_step_s_after: float
    def __init__(self, phy2log: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., balancedness_before: _Optional[_Union[_common_pb2.Balancedness, _Mapping]] = ..., balancedness_after: _Optional[_Union[_common_pb2.Balancedness, _Mapping]] = ..., slots_moved: _Optional[int] = ..., slots_moved_across_workers: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., base_version: _Optional[int] = ..., applied: _Optional[bool] = ..., migration_id: _Optional[str] = ..., migration: _Optional[_Union[_common_pb2.MigrationProgress, _Mapping]] = ..., note: _Optional[str] = ..., breakeven: _Optional[_Union[_common_pb2.Int64Matrix, _Mapping]] = ..., predicted_step_s_before: _Optional[float] = ..., predicted_step_s_after: _Optional[float] = ...) -> None: ...

class BalancerConfig(_message.Message):
    __slots__ = ("window_steps", "step_interval", "min_balancedness")
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MIN_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    window_steps: int
    step_interval: int
    min_balancedness: float
    def __init__(self, window_steps: _Optional[int] = ..., step_interval: _Optional[int] = ..., min_balancedness: _Optional[float] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBalancerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BalancerStatus(_message.Message):
    __slots__ = ("window_steps", "step_interval", "min_balancedness", "paused", "state", "rebalances", "last_trigger", "last_migration_id", "last_error", "admin_reachable", "balancedness", "placement_version", "loop_iterations", "step_model", "predicted_step_s", "step_efficiency")
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MIN_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REBALANCES_FIELD_NUMBER: _ClassVar[int]
    LAST_TRIGGER_FIELD_NUMBER: _ClassVar[int]
    LAST_MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    ADMIN_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOOP_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_MODEL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STEP_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
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
    step_model: str
    predicted_step_s: float
    step_efficiency: float
    def __init__(self, window_steps: _Optional[int] = ..., step_interval: _Optional[int] = ..., min_balancedness: _Optional[float] = ..., paused: _Optional[bool] = ..., state: _Optional[str] = ..., rebalances: _Optional[int] = ..., last_trigger: _Optional[str] = ..., last_migration_id: _Optional[str] = ..., last_error: _Optional[str] = ..., admin_reachable: _Optional[bool] = ..., balancedness: _Optional[float] = ..., placement_version: _Optional[int] = ..., loop_iterations: _Optional[int] = ..., step_model: _Optional[str] = ..., predicted_step_s: _Optional[float] = ..., step_efficiency: _Optional[float] = ...) -> None: ...
