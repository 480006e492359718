from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    STATE_HEALTHY: _ClassVar[State]
    STATE_SUSPECT: _ClassVar[State]
    STATE_DEGRADED: _ClassVar[State]
    STATE_FAILED: _ClassVar[State]
    STATE_UNKNOWN: _ClassVar[State]

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    SEVERITY_INFO: _ClassVar[Severity]
    SEVERITY_WARNING: _ClassVar[Severity]
    SEVERITY_CRITICAL: _ClassVar[Severity]

class ProbeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_STATE_UNSPECIFIED: _ClassVar[ProbeState]
    PROBE_STATE_OK: _ClassVar[ProbeState]
    PROBE_STATE_FAILING: _ClassVar[ProbeState]
    PROBE_STATE_HUNG: _ClassVar[ProbeState]
    PROBE_STATE_DISABLED: _ClassVar[ProbeState]
    PROBE_STATE_PENDING: _ClassVar[ProbeState]
STATE_UNSPECIFIED: State
STATE_HEALTHY: State
STATE_SUSPECT: State
STATE_DEGRADED: State
STATE_FAILED: State
STATE_UNKNOWN: State
SEVERITY_UNSPECIFIED: Severity
SEVERITY_INFO: Severity
SEVERITY_WARNING: Severity
SEVERITY_CRITICAL: Severity
PROBE_STATE_UNSPECIFIED: ProbeState
PROBE_STATE_OK: ProbeState
PROBE_STATE_FAILING: ProbeState
PROBE_STATE_HUNG: ProbeState
PROBE_STATE_DISABLED: ProbeState
PROBE_STATE_PENDING: ProbeState

class Evidence(_message.Message):
    __slots__ = ("source", "signal", "value", "implies", "reason", "time", "count")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    IMPLIES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    source: str
    signal: str
    value: str
    implies: State
    reason: str
    time: float
    count: int
    def __init__(self, source: _Optional[str] = ..., signal: _Optional[str] = ..., value: _Optional[str] = ..., implies: _Optional[_Union[State, str]] = ..., reason: _Optional[str] = ..., time: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class GpuStatus(_message.Message):
    __slots__ = ("uuid", "pci_bus_id", "name", "index", "state", "reason", "evidence", "unsupported_fields", "state_since")
    UUID_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FIELDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SINCE_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    pci_bus_id: str
    name: str
    index: int
    state: State
    reason: str
    evidence: _containers.RepeatedCompositeFieldContainer[Evidence]
    unsupported_fields: _containers.RepeatedScalarFieldContainer[str]
    state_since: float
    def __init__(self, uuid: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., name: _Optional[str] = ..., index: _Optional[int] = ..., state: _Optional[_Union[State, str]] = ..., reason: _Optional[str] = ..., evidence: _Optional[_Iterable[_Union[Evidence, _Mapping]]] = ..., unsupported_fields: _Optional[_Iterable[str]] = ..., state_since: _Optional[float] = ...) -> None: ...

class ProbeStatus(_message.Message):
    __slots__ = ("name", "state", "last_run", "last_duration_s", "last_error", "runs", "failures")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_RUN_FIELD_NUMBER: _ClassVar[int]
    LAST_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ProbeState
    last_run: float
    last_duration_s: float
    last_error: str
    runs: int
    failures: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ProbeState, str]] = ..., last_run: _Optional[float] = ..., last_duration_s: _Optional[float] = ..., last_error: _Optional[str] = ..., runs: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "ranks", "last_step", "last_report", "steps_seen", "dropped_reports", "state", "reason", "compute_checks", "vote_unavailable", "stage_errors")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    STEPS_SEEN_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REPORTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CHECKS_FIELD_NUMBER: _ClassVar[int]
    VOTE_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    last_step: int
    last_report: float
    steps_seen: int
    dropped_reports: int
    state: State
    reason: str
    compute_checks: str
    vote_unavailable: str
    stage_errors: int
    def __init__(self, job_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., last_step: _Optional[int] = ..., last_report: _Optional[float] = ..., steps_seen: _Optional[int] = ..., dropped_reports: _Optional[int] = ..., state: _Optional[_Union[State, str]] = ..., reason: _Optional[str] = ..., compute_checks: _Optional[str] = ..., vote_unavailable: _Optional[str] = ..., stage_errors: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("node_state", "node_reason", "hostname", "gpus", "probes", "jobs", "nvml_available", "nvml_reason", "versions", "started_at", "uptime_s", "last_event_seq", "ready", "checkpoints")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_REASON_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NVML_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NVML_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    node_state: State
    node_reason: str
    hostname: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStatus]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeStatus]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    nvml_available: bool
    nvml_reason: str
    versions: _containers.ScalarMap[str, str]
    started_at: float
    uptime_s: float
    last_event_seq: int
    ready: bool
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointSummary]
    def __init__(self, node_state: _Optional[_Union[State, str]] = ..., node_reason: _Optional[str] = ..., hostname: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuStatus, _Mapping]]] = ..., probes: _Optional[_Iterable[_Union[ProbeStatus, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., nvml_available: _Optional[bool] = ..., nvml_reason: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ..., started_at: _Optional[float] = ..., uptime_s: _Optional[float] = ..., last_event_seq: _Optional[int] = ..., ready: _Optional[bool] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointSummary, _Mapping]]] = ...) -> None: ...

class CheckpointSummary(_message.Message):
    __slots__ = ("job_id", "count", "latest_step", "latest_verified_step", "latest_verified_at", "bytes", "latest_state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LATEST_STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERIFIED_STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERIFIED_AT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATEST_STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    count: int
    latest_step: int
    latest_verified_step: int
    latest_verified_at: float
    bytes: int
    latest_state: str
    def __init__(self, job_id: _Optional[str] = ..., count: _Optional[int] = ..., latest_step: _Optional[int] = ..., latest_verified_step: _Optional[int] = ..., latest_verified_at: _Optional[float] = ..., bytes: _Optional[int] = ..., latest_state: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time", "kind", "severity", "subject", "message", "details")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    kind: str
    severity: Severity
    subject: str
    message: str
    details: _struct_pb2.Struct
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., severity: _Optional[_Union[Severity, str]] = ..., subject: _Optional[str] = ..., message: _Optional[str] = ..., details: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_seq", "follow", "min_severity", "kinds")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    MIN_SEVERITY_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    follow: bool
    min_severity: Severity
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, since_seq: _Optional[int] = ..., follow: _Optional[bool] = ..., min_severity: _Optional[_Union[Severity, str]] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("step_s", "check_s", "data_s")
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    CHECK_S_FIELD_NUMBER: _ClassVar[int]
    DATA_S_FIELD_NUMBER: _ClassVar[int]
    step_s: float
    check_s: float
    data_s: float
    def __init__(self, step_s: _Optional[float] = ..., check_s: _Optional[float] = ..., data_s: _Optional[float] = ...) -> None: ...

class SuspectRank(_message.Message):
    __slots__ = ("rank", "host", "gpu_uuid", "fingerprint")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    gpu_uuid: str
    fingerprint: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., fingerprint: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaVote(_message.Message):
    __slots__ = ("checked", "agreed", "replicas", "suspects", "method", "step", "replica_group", "suspect_count")
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_COUNT_FIELD_NUMBER: _ClassVar[int]
    checked: bool
    agreed: bool
    replicas: int
    suspects: _containers.RepeatedCompositeFieldContainer[SuspectRank]
    method: str
    step: int
    replica_group: str
    suspect_count: int
    def __init__(self, checked: _Optional[bool] = ..., agreed: _Optional[bool] = ..., replicas: _Optional[int] = ..., suspects: _Optional[_Iterable[_Union[SuspectRank, _Mapping]]] = ..., method: _Optional[str] = ..., step: _Optional[int] = ..., replica_group: _Optional[str] = ..., suspect_count: _Optional[int] = ...) -> None: ...

class CanaryResult(_message.Message):
    __slots__ = ("status", "check", "why", "step")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    status: str
    check: str
    why: str
    step: int
    def __init__(self, status: _Optional[str] = ..., check: _Optional[str] = ..., why: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ComputeFinding(_message.Message):
    __slots__ = ("step", "detector", "suspect", "cause", "faulty", "dropped", "detail", "score", "bucket", "stat", "since_step", "one_of")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    FAULTY_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    STAT_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    ONE_OF_FIELD_NUMBER: _ClassVar[int]
    step: int
    detector: str
    suspect: int
    cause: str
    faulty: _containers.RepeatedCompositeFieldContainer[SuspectRank]
    dropped: bool
    detail: str
    score: float
    bucket: int
    stat: str
    since_step: int
    one_of: bool
    def __init__(self, step: _Optional[int] = ..., detector: _Optional[str] = ..., suspect: _Optional[int] = ..., cause: _Optional[str] = ..., faulty: _Optional[_Iterable[_Union[SuspectRank, _Mapping]]] = ..., dropped: _Optional[bool] = ..., detail: _Optional[str] = ..., score: _Optional[float] = ..., bucket: _Optional[int] = ..., stat: _Optional[str] = ..., since_step: _Optional[int] = ..., one_of: _Optional[bool] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "step", "loss", "grad_norm", "loss_scale", "fingerprint", "replica_group", "host", "gpu_uuid", "timings", "dropped_reports", "time", "micro_batch", "labels", "vote", "frozen_changed", "checks_run", "canary", "compute", "compute_checks", "vote_unavailable", "stage_errors", "stage_error", "frozen_step")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REPORTS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VOTE_FIELD_NUMBER: _ClassVar[int]
    FROZEN_CHANGED_FIELD_NUMBER: _ClassVar[int]
    CHECKS_RUN_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CHECKS_FIELD_NUMBER: _ClassVar[int]
    VOTE_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STAGE_ERROR_FIELD_NUMBER: _ClassVar[int]
    FROZEN_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    step: int
    loss: float
    grad_norm: float
    loss_scale: float
    fingerprint: _containers.RepeatedScalarFieldContainer[int]
    replica_group: str
    host: str
    gpu_uuid: str
    timings: StepTimings
    dropped_reports: int
    time: float
    micro_batch: int
    labels: _containers.ScalarMap[str, str]
    vote: ReplicaVote
    frozen_changed: _containers.RepeatedScalarFieldContainer[str]
    checks_run: int
    canary: CanaryResult
    compute: _containers.RepeatedCompositeFieldContainer[ComputeFinding]
    compute_checks: str
    vote_unavailable: str
    stage_errors: int
    stage_error: str
    frozen_step: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., loss_scale: _Optional[float] = ..., fingerprint: _Optional[_Iterable[int]] = ..., replica_group: _Optional[str] = ..., host: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., dropped_reports: _Optional[int] = ..., time: _Optional[float] = ..., micro_batch: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., vote: _Optional[_Union[ReplicaVote, _Mapping]] = ..., frozen_changed: _Optional[_Iterable[str]] = ..., checks_run: _Optional[int] = ..., canary: _Optional[_Union[CanaryResult, _Mapping]] = ..., compute: _Optional[_Iterable[_Union[ComputeFinding, _Mapping]]] = ..., compute_checks: _Optional[str] = ..., vote_unavailable: _Optional[str] = ..., stage_errors: _Optional[int] = ..., stage_error: _Optional[str] = ..., frozen_step: _Optional[int] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("kind", "target_step", "skip_batches", "reason", "event_seq")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Directive.Kind]
        KIND_ROLLBACK: _ClassVar[Directive.Kind]
        KIND_SKIP_BATCHES: _ClassVar[Directive.Kind]
        KIND_STOP: _ClassVar[Directive.Kind]
    KIND_UNSPECIFIED: Directive.Kind
    KIND_ROLLBACK: Directive.Kind
    KIND_SKIP_BATCHES: Directive.Kind
    KIND_STOP: Directive.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    SKIP_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: Directive.Kind
    target_step: int
    skip_batches: int
    reason: str
    event_seq: int
    def __init__(self, kind: _Optional[_Union[Directive.Kind, str]] = ..., target_step: _Optional[int] = ..., skip_batches: _Optional[int] = ..., reason: _Optional[str] = ..., event_seq: _Optional[int] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ("accepted", "directives")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    def __init__(self, accepted: _Optional[bool] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ...) -> None: ...

class ClearGpuRequest(_message.Message):
    __slots__ = ("uuid", "who", "reason")
    UUID_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    who: str
    reason: str
    def __init__(self, uuid: _Optional[str] = ..., who: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ClearGpuResponse(_message.Message):
    __slots__ = ("previous", "state")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    previous: State
    state: State
    def __init__(self, previous: _Optional[_Union[State, str]] = ..., state: _Optional[_Union[State, str]] = ...) -> None: ...
