from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Int64Matrix(_message.Message):
    __slots__ = ("rows", "cols", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class DoubleMatrix(_message.Message):
    __slots__ = ("rows", "cols", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class Balancedness(_message.Message):
    __slots__ = ("per_layer", "mean", "sum_ratio")
    PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    SUM_RATIO_FIELD_NUMBER: _ClassVar[int]
    per_layer: _containers.RepeatedScalarFieldContainer[float]
    mean: float
    sum_ratio: float
    def __init__(self, per_layer: _Optional[_Iterable[float]] = ..., mean: _Optional[float] = ..., sum_ratio: _Optional[float] = ...) -> None: ...

class MigrationProgress(_message.Message):
    __slots__ = ("migration_id", "state", "error", "target_version", "moves_total", "moves_done", "bytes_total", "bytes_done", "layers_total", "layers_committed")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[MigrationProgress.State]
        PLANNED: _ClassVar[MigrationProgress.State]
        STAGING: _ClassVar[MigrationProgress.State]
        MOVING: _ClassVar[MigrationProgress.State]
        DONE: _ClassVar[MigrationProgress.State]
        ABORTED: _ClassVar[MigrationProgress.State]
        FAILED: _ClassVar[MigrationProgress.State]
    STATE_UNSPECIFIED: MigrationProgress.State
    PLANNED: MigrationProgress.State
    STAGING: MigrationProgress.State
    MOVING: MigrationProgress.State
    DONE: MigrationProgress.State
    ABORTED: MigrationProgress.State
    FAILED: MigrationProgress.State
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    MOVES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MOVES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    state: MigrationProgress.State
    error: str
    target_version: int
    moves_total: int
    moves_done: int
    bytes_total: int
    bytes_done: int
    layers_total: int
    layers_committed: int
    def __init__(self, migration_id: _Optional[str] = ..., state: _Optional[_Union[MigrationProgress.State, str]] = ..., error: _Optional[str] = ..., target_version: _Optional[int] = ..., moves_total: _Optional[int] = ..., moves_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., layers_total: _Optional[int] = ..., layers_committed: _Optional[int] = ...) -> None: ...
