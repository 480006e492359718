from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_STATE_UNSPECIFIED: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_PENDING: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_COMMITTED: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_VERIFIED: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_ABORTED: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_EVICTED: _ClassVar[CheckpointState]

class RestoreSelector(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESTORE_SELECTOR_UNSPECIFIED: _ClassVar[RestoreSelector]
    RESTORE_SELECTOR_LATEST: _ClassVar[RestoreSelector]
    RESTORE_SELECTOR_LATEST_VERIFIED: _ClassVar[RestoreSelector]
CHECKPOINT_STATE_UNSPECIFIED: CheckpointState
CHECKPOINT_STATE_PENDING: CheckpointState
CHECKPOINT_STATE_COMMITTED: CheckpointState
CHECKPOINT_STATE_VERIFIED: CheckpointState
CHECKPOINT_STATE_ABORTED: CheckpointState
CHECKPOINT_STATE_EVICTED: CheckpointState
RESTORE_SELECTOR_UNSPECIFIED: RestoreSelector
RESTORE_SELECTOR_LATEST: RestoreSelector
RESTORE_SELECTOR_LATEST_VERIFIED: RestoreSelector

class ShardCopy(_message.Message):
    __slots__ = ("rank", "node", "location", "tier")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    location: str
    tier: str
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., location: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("job_id", "step", "state", "world_size", "shards", "bytes", "begun_at", "committed_at", "verified_at", "reason", "copies", "tiers", "vouched_by")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BEGUN_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    VOUCHED_BY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    state: CheckpointState
    world_size: int
    shards: int
    bytes: int
    begun_at: float
    committed_at: float
    verified_at: float
    reason: str
    copies: _containers.RepeatedCompositeFieldContainer[ShardCopy]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    vouched_by: str
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., state: _Optional[_Union[CheckpointState, str]] = ..., world_size: _Optional[int] = ..., shards: _Optional[int] = ..., bytes: _Optional[int] = ..., begun_at: _Optional[float] = ..., committed_at: _Optional[float] = ..., verified_at: _Optional[float] = ..., reason: _Optional[str] = ..., copies: _Optional[_Iterable[_Union[ShardCopy, _Mapping]]] = ..., tiers: _Optional[_Iterable[str]] = ..., vouched_by: _Optional[str] = ...) -> None: ...

class BeginRequest(_message.Message):
    __slots__ = ("job_id", "step", "rank", "world_size", "restored_step", "restored_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    rank: int
    world_size: int
    restored_step: int
    restored_at: float
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., restored_step: _Optional[int] = ..., restored_at: _Optional[float] = ...) -> None: ...

class BeginResponse(_message.Message):
    __slots__ = ("state", "node", "location", "blob_key")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    BLOB_KEY_FIELD_NUMBER: _ClassVar[int]
    state: CheckpointState
    node: str
    location: str
    blob_key: str
    def __init__(self, state: _Optional[_Union[CheckpointState, str]] = ..., node: _Optional[str] = ..., location: _Optional[str] = ..., blob_key: _Optional[str] = ...) -> None: ...

class CommitShardRequest(_message.Message):
    __slots__ = ("job_id", "step", "rank", "world_size", "manifest_json", "blocking_seconds", "safe_seconds", "stall_seconds", "skipped_saves", "staging", "layout_id", "layout_json", "piece_words", "created")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAFE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_SAVES_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    PIECE_WORDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    rank: int
    world_size: int
    manifest_json: str
    blocking_seconds: float
    safe_seconds: float
    stall_seconds: float
    skipped_saves: int
    staging: str
    layout_id: str
    layout_json: str
    piece_words: bytes
    created: float
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., manifest_json: _Optional[str] = ..., blocking_seconds: _Optional[float] = ..., safe_seconds: _Optional[float] = ..., stall_seconds: _Optional[float] = ..., skipped_saves: _Optional[int] = ..., staging: _Optional[str] = ..., layout_id: _Optional[str] = ..., layout_json: _Optional[str] = ..., piece_words: _Optional[bytes] = ..., created: _Optional[float] = ...) -> None: ...

class CommitShardResponse(_message.Message):
    __slots__ = ("state", "committed", "shards")
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    state: CheckpointState
    committed: bool
    shards: int
    def __init__(self, state: _Optional[_Union[CheckpointState, str]] = ..., committed: _Optional[bool] = ..., shards: _Optional[int] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("found", "checkpoint")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    checkpoint: CheckpointInfo
    def __init__(self, found: _Optional[bool] = ..., checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class RestorePlanRequest(_message.Message):
    __slots__ = ("job_id", "step", "selector", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    selector: RestoreSelector
    rank: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., selector: _Optional[_Union[RestoreSelector, str]] = ..., rank: _Optional[int] = ...) -> None: ...

class ShardPlan(_message.Message):
    __slots__ = ("rank", "manifest_json", "copies")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    manifest_json: str
    copies: _containers.RepeatedCompositeFieldContainer[ShardCopy]
    def __init__(self, rank: _Optional[int] = ..., manifest_json: _Optional[str] = ..., copies: _Optional[_Iterable[_Union[ShardCopy, _Mapping]]] = ...) -> None: ...

class RestorePlanResponse(_message.Message):
    __slots__ = ("checkpoint", "shards")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    shards: _containers.RepeatedCompositeFieldContainer[ShardPlan]
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardPlan, _Mapping]]] = ...) -> None: ...

class ReportRestoreRequest(_message.Message):
    __slots__ = ("job_id", "step", "rank", "seconds", "bytes", "chunks", "fallbacks", "checksum_failures", "ok", "error", "source")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    rank: int
    seconds: float
    bytes: int
    chunks: int
    fallbacks: int
    checksum_failures: int
    ok: bool
    error: str
    source: str
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., fallbacks: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class ReportRestoreResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyCopiesRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CopyCheck(_message.Message):
    __slots__ = ("tier", "location", "rank", "ok", "detail", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    location: str
    rank: int
    ok: bool
    detail: str
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., location: _Optional[str] = ..., rank: _Optional[int] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class VerifyCopiesResponse(_message.Message):
    __slots__ = ("checks",)
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[CopyCheck]
    def __init__(self, checks: _Optional[_Iterable[_Union[CopyCheck, _Mapping]]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("done_bytes", "total_bytes", "what")
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    done_bytes: int
    total_bytes: int
    what: str
    def __init__(self, done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., what: _Optional[str] = ...) -> None: ...

class VerifyCopiesUpdate(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    result: VerifyCopiesResponse
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., result: _Optional[_Union[VerifyCopiesResponse, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DrainHop(_message.Message):
    __slots__ = ("tier", "job_id", "step", "ok", "detail", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    job_id: str
    step: int
    ok: bool
    detail: str
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("hops", "tiers")
    HOPS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[DrainHop]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    def __init__(self, hops: _Optional[_Iterable[_Union[DrainHop, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...

class DrainUpdate(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    result: DrainResponse
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., result: _Optional[_Union[DrainResponse, _Mapping]] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("tier", "location", "healthy", "reason", "backlog_bytes", "checkpoints", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    location: str
    healthy: bool
    reason: str
    backlog_bytes: int
    checkpoints: int
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., location: _Optional[str] = ..., healthy: _Optional[bool] = ..., reason: _Optional[str] = ..., backlog_bytes: _Optional[int] = ..., checkpoints: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class TiersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TiersResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...
