from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "total_bytes", "offset", "data", "bucket")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    offset: int
    data: bytes
    bucket: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., bucket: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Piece(_message.Message):
    __slots__ = ("name", "shape", "start", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    start: int
    numel: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "num_servers", "rows_held")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    num_servers: int
    rows_held: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., num_servers: _Optional[int] = ..., rows_held: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("shard_id", "ready", "version", "parameters", "buffers", "pieces", "tables", "job")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    ready: bool
    version: int
    parameters: _containers.RepeatedScalarFieldContainer[str]
    buffers: _containers.RepeatedScalarFieldContainer[str]
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    job: str
    def __init__(self, shard_id: _Optional[int] = ..., ready: _Optional[bool] = ..., version: _Optional[int] = ..., parameters: _Optional[_Iterable[str]] = ..., buffers: _Optional[_Iterable[str]] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., job: _Optional[str] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "rows", "bytes", "rows_pulled", "rows_pushed", "max_staleness", "admitted", "filtered", "evicted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    bytes: int
    rows_pulled: int
    rows_pushed: int
    max_staleness: int
    admitted: int
    filtered: int
    evicted: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., max_staleness: _Optional[int] = ..., admitted: _Optional[int] = ..., filtered: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("shard_id", "version", "workers_seen", "pushes_applied", "pushes_rejected", "steps_skipped", "max_staleness", "bytes_in", "bytes_out", "calls", "tables", "staleness_histogram", "max_lead", "pushes_by_worker", "pid", "host", "steps_without", "workers_replaced", "replica")
    class CallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StalenessHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class PushesByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class StepsWithoutEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: Workers
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[Workers, _Mapping]] = ...) -> None: ...
    class WorkersReplacedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_SEEN_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_LEAD_FIELD_NUMBER: _ClassVar[int]
    PUSHES_BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STEPS_WITHOUT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    version: int
    workers_seen: _containers.RepeatedScalarFieldContainer[int]
    pushes_applied: int
    pushes_rejected: int
    steps_skipped: int
    max_staleness: int
    bytes_in: int
    bytes_out: int
    calls: _containers.ScalarMap[str, int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    staleness_histogram: _containers.ScalarMap[int, int]
    max_lead: int
    pushes_by_worker: _containers.ScalarMap[int, int]
    pid: int
    host: str
    steps_without: _containers.MessageMap[int, Workers]
    workers_replaced: _containers.ScalarMap[int, int]
    replica: str
    def __init__(self, shard_id: _Optional[int] = ..., version: _Optional[int] = ..., workers_seen: _Optional[_Iterable[int]] = ..., pushes_applied: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., steps_skipped: _Optional[int] = ..., max_staleness: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., calls: _Optional[_Mapping[str, int]] = ..., tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., staleness_histogram: _Optional[_Mapping[int, int]] = ..., max_lead: _Optional[int] = ..., pushes_by_worker: _Optional[_Mapping[int, int]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., steps_without: _Optional[_Mapping[int, Workers]] = ..., workers_replaced: _Optional[_Mapping[int, int]] = ..., replica: _Optional[str] = ...) -> None: ...

class Workers(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "names")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    worker: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("shard_id", "version", "partial")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    version: int
    partial: float
    def __init__(self, shard_id: _Optional[int] = ..., version: _Optional[int] = ..., partial: _Optional[float] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("header", "chunk", "stamp")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Tensor
    stamp: PieceStamp
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Tensor, _Mapping]] = ..., stamp: _Optional[_Union[PieceStamp, _Mapping]] = ...) -> None: ...

class PieceStamp(_message.Message):
    __slots__ = ("bucket", "arrived", "applied")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    arrived: float
    applied: float
    def __init__(self, bucket: _Optional[int] = ..., arrived: _Optional[float] = ..., applied: _Optional[float] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker", "version")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    version: int
    def __init__(self, worker: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Tensor
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AbsentEntries(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, entries: _Optional[_Iterable[int]] = ...) -> None: ...

class JobPushHeader(_message.Message):
    __slots__ = ("worker", "version", "absent", "options", "norm_type", "skip_nonfinite", "pieces", "timeline")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NORM_TYPE_FIELD_NUMBER: _ClassVar[int]
    SKIP_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    version: int
    absent: _containers.RepeatedCompositeFieldContainer[AbsentEntries]
    options: bytes
    norm_type: float
    skip_nonfinite: bool
    pieces: bool
    timeline: bool
    def __init__(self, worker: _Optional[int] = ..., version: _Optional[int] = ..., absent: _Optional[_Iterable[_Union[AbsentEntries, _Mapping]]] = ..., options: _Optional[bytes] = ..., norm_type: _Optional[float] = ..., skip_nonfinite: _Optional[bool] = ..., pieces: _Optional[bool] = ..., timeline: _Optional[bool] = ...) -> None: ...

class JobFinishRequest(_message.Message):
    __slots__ = ("worker", "version", "coefficient")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    worker: int
    version: int
    coefficient: float
    def __init__(self, worker: _Optional[int] = ..., version: _Optional[int] = ..., coefficient: _Optional[float] = ...) -> None: ...

class PlainData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class JobPushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: JobPushHeader
    chunk: Tensor
    def __init__(self, header: _Optional[_Union[JobPushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class JobPullRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
