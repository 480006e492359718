"""Validation of requests from clients. Each function returns None or a message saying what is wrong.

Names from clients never become paths: job ids, hosts and labels are checked against tight patterns
and lengths here, before anything else sees them.
"""
from __future__ import annotations

import math
import re

from proto.sdcwatch.v1 import agent_pb2 as pb
from sdcwatch.names import GPU_UUID, GROUP, HOST, JOB_ID, Rule

LABEL_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")

MAX_REPORT_BYTES = 64 * 1024
MAX_FINGERPRINT_WORDS = 16
MAX_WORLD = 1 << 20
MAX_LABELS = 32
MAX_SUSPECTS = 4096
MAX_DROPPED = 1 << 32    # reports one rank dropped since its last accepted one (sums stay far inside uint64)
MAX_CHECKS = 1 << 53     # a rank's running count of fingerprint checks (exact as a float in /metrics)


class _Accepted:
    """Names of one kind (job ids, hosts, GPU UUIDs, replica groups) that already passed their pattern: a
    rank sends the same few names on every report, so the pattern runs once per name. Bounded; one set per
    kind, so a name accepted as one kind is never taken for another."""

    __slots__ = ("names", "rule", "limit")

    def __init__(self, rule: Rule, limit: int = 4096) -> None:
        self.names: set[str] = set()
        self.rule, self.limit = rule, limit

    def check(self, name: str, field: str) -> str | None:
        """None for an empty or valid name (remembered), else what is wrong with it."""
        if not name or name in self.names:
            return None
        err = self.rule.problem(field, name)
        if err:
            return err
        if len(self.names) >= self.limit:
            self.names.clear()
        self.names.add(name)
        return None


_JOBS = _Accepted(JOB_ID)
_HOSTS = _Accepted(HOST)
_UUIDS = _Accepted(GPU_UUID)
_GROUPS = _Accepted(GROUP)


def check_job_id(job_id: str) -> str | None:
    return _JOBS.check(job_id, "job_id") if job_id else "job_id is empty"


def check_gpu_uuid(uuid: str, field: str = "gpu_uuid") -> str | None:
    return _UUIDS.check(uuid, field)


def check_host(host: str, field: str = "host") -> str | None:
    return _HOSTS.check(host, field)


_INF = float("inf")


def _finite_nonneg(name: str, value: float) -> str | None:
    if math.isnan(value) or math.isinf(value):
        return f"{name} is {value}; it must be a finite number"
    if value < 0:
        return f"{name} is {value}; it must be >= 0"
    return None


def check_report_step(req: pb.ReportStepRequest) -> str | None:
    """None when the report is valid, else what is wrong with it (the first problem found)."""
    if _plain_and_valid(req):
        return None
    return _report_step_error(req)


def _plain_and_valid(req: pb.ReportStepRequest) -> bool:
    """The usual report (names seen before, numbers in range, none of the rarely sent parts), proved valid in
    one expression: True only when `_report_step_error` would find nothing. Anything else, valid or not,
    goes to `_report_step_error`, which says what is wrong. NaN fails every comparison, so it goes there too."""
    rank, world = req.rank, req.world_size
    host, uuid, group = req.host, req.gpu_uuid, req.replica_group
    tm = req.timings   # unset: all zero
    return (req.job_id in _JOBS.names and 0 <= rank and 0 <= world <= MAX_WORLD and (rank < world or not world)
            and req.step >= 0 and req.grad_norm >= 0.0 and req.loss_scale >= 0.0
            and 0.0 <= tm.step_s < _INF and 0.0 <= tm.check_s < _INF and 0.0 <= tm.data_s < _INF
            and 0.0 <= req.time < _INF and req.micro_batch >= 0
            and req.dropped_reports <= MAX_DROPPED and req.checks_run <= MAX_CHECKS
            and (not host or host in _HOSTS.names) and (not uuid or uuid in _UUIDS.names)
            and (not group or group in _GROUPS.names)
            and len(req.fingerprint) <= MAX_FINGERPRINT_WORDS
            and not req.labels and not req.frozen_changed and not req.HasField("frozen_step")
            and not req.HasField("canary")
            and not req.HasField("vote") and not req.compute and len(req.compute_checks) <= 120
            and len(req.vote_unavailable) <= 120 and not req.stage_error
            and req.ByteSize() <= MAX_REPORT_BYTES)


def _report_step_error(req: pb.ReportStepRequest) -> str | None:
    size = req.ByteSize()
    if size > MAX_REPORT_BYTES:
        return f"ReportStep is {size} bytes; the limit is {MAX_REPORT_BYTES}"
    err = check_job_id(req.job_id)
    if err:
        return err
    if req.rank < 0:
        return f"rank is {req.rank}; it must be >= 0"
    if req.world_size < 0 or req.world_size > MAX_WORLD:
        return f"world_size is {req.world_size}; it must be in 0..{MAX_WORLD} (0 = unknown)"
    if req.world_size and req.rank >= req.world_size:
        return f"rank {req.rank} is not below world_size {req.world_size}"
    if req.step < 0:
        return f"step is {req.step}; it must be >= 0"
    # loss and grad_norm may be NaN/Inf: that is the signal. grad_norm cannot be negative.
    if req.HasField("grad_norm") and req.grad_norm < 0:
        return f"grad_norm is {req.grad_norm}; a norm cannot be negative"
    if req.HasField("loss_scale"):
        if math.isnan(req.loss_scale) or req.loss_scale < 0:
            return f"loss_scale is {req.loss_scale}; it must be a number >= 0"
    if len(req.fingerprint) > MAX_FINGERPRINT_WORDS:
        return f"fingerprint has {len(req.fingerprint)} words; the limit is {MAX_FINGERPRINT_WORDS}"
    err = _GROUPS.check(req.replica_group, "replica_group") or check_host(req.host) or check_gpu_uuid(req.gpu_uuid)
    if err:
        return err
    if req.HasField("timings"):
        tm = req.timings
        step_s, check_s, data_s = tm.step_s, tm.check_s, tm.data_s
        # the common case in one test (NaN fails every comparison, +inf fails the bound)
        if not (0.0 <= step_s < _INF and 0.0 <= check_s < _INF and 0.0 <= data_s < _INF):
            for name, value in (("step_s", step_s), ("check_s", check_s), ("data_s", data_s)):
                err = _finite_nonneg(f"timings.{name}", value)
                if err:
                    return err
    t = req.time
    if not 0.0 <= t < _INF:
        return _finite_nonneg("time", t)
    if req.micro_batch < 0:
        return f"micro_batch is {req.micro_batch}; it must be >= 0"
    if req.dropped_reports > MAX_DROPPED:
        return f"dropped_reports is {req.dropped_reports}; the limit is {MAX_DROPPED}"
    if req.checks_run > MAX_CHECKS:
        return f"checks_run is {req.checks_run}; the limit is {MAX_CHECKS}"
    if req.labels:
        if len(req.labels) > MAX_LABELS:
            return f"{len(req.labels)} labels; the limit is {MAX_LABELS}"
        for key, value in req.labels.items():
            if not LABEL_KEY.match(key):
                return f"label key {key[:64]!r} is invalid"
            if len(value) > 256:
                return f"label {key} is {len(value)} characters; the limit is 256"
    if req.frozen_changed and (len(req.frozen_changed) > 10_000 or any(len(n) > 512 for n in req.frozen_changed)):
        return "frozen_changed: too many names or a name over 512 characters"
    if req.HasField("frozen_step") and (req.frozen_step < 0 or not req.frozen_changed):
        return (f"frozen_step is {req.frozen_step}; it must be >= 0" if req.frozen_step < 0 else
                "frozen_step is set without frozen_changed (it is the step those names changed at)")
    if req.HasField("canary"):
        if req.canary.status not in ("PASS", "FAIL", "UNKNOWN"):
            return f"canary.status {req.canary.status[:16]!r} is not PASS, FAIL or UNKNOWN"
        if len(req.canary.check) > 256 or len(req.canary.why) > 2000 or req.canary.step < 0:
            return "canary: check (max 256) or why (max 2000) too long, or a negative step"
    if req.HasField("vote"):
        vote = req.vote
        if len(vote.suspects) > MAX_SUSPECTS:
            return f"vote has {len(vote.suspects)} suspects; the limit is {MAX_SUSPECTS}"
        if vote.replicas < 0 or vote.step < 0:
            return "vote.replicas and vote.step must be >= 0"
        if vote.checked and (vote.replicas < 2 or (req.world_size and vote.replicas > req.world_size)):
            return (f"vote.replicas is {vote.replicas}: a checked vote compares 2 or more replicas, at most "
                    f"world_size ({req.world_size})")
        if vote.suspect_count and not len(vote.suspects) <= vote.suspect_count <= MAX_WORLD:
            return (f"vote.suspect_count is {vote.suspect_count}; it counts every suspect, at least the "
                    f"{len(vote.suspects)} listed (or 0)")
        if vote.method not in ("", "majority", "all_disagreeing", "none"):
            return f"vote.method {vote.method[:32]!r} is unknown (majority, all_disagreeing)"
        for s in vote.suspects:
            if s.rank < 0 or (req.world_size and s.rank >= req.world_size):
                return f"vote suspect rank {s.rank} is out of range"
            err = check_host(s.host, "vote suspect host") or check_gpu_uuid(s.gpu_uuid, "vote suspect gpu_uuid")
            if err:
                return err
            if len(s.fingerprint) > MAX_FINGERPRINT_WORDS:
                return "vote suspect fingerprint too long"
    return _check_compute(req)


COMPUTE_DETECTORS = ("stats", "nonfinite", "audit", "loss")
COMPUTE_CAUSES = ("transient", "persistent", "data", "unresolved", "diverged")
MAX_COMPUTE_FINDINGS = 16
MAX_STAGE_ERROR = 200      # ReportStepRequest.stage_error (checksums/reporter.py cuts to it)


def _check_compute(req: pb.ReportStepRequest) -> str | None:
    if len(req.compute_checks) > 120:
        return f"compute_checks is {len(req.compute_checks)} characters; the limit is 120"
    if len(req.vote_unavailable) > 120:
        return f"vote_unavailable is {len(req.vote_unavailable)} characters; the limit is 120"
    if len(req.stage_error) > MAX_STAGE_ERROR:
        return f"stage_error is {len(req.stage_error)} characters; the limit is {MAX_STAGE_ERROR}"
    if len(req.compute) > MAX_COMPUTE_FINDINGS:
        return f"{len(req.compute)} compute findings; the limit is {MAX_COMPUTE_FINDINGS}"
    for f in req.compute:
        if f.detector not in COMPUTE_DETECTORS:
            return f"compute.detector {f.detector[:32]!r} is unknown ({', '.join(COMPUTE_DETECTORS)})"
        if f.cause not in COMPUTE_CAUSES:
            return f"compute.cause {f.cause[:32]!r} is unknown ({', '.join(COMPUTE_CAUSES)})"
        if f.step < 0 or f.since_step < 0 or f.suspect < 0 or (req.world_size and f.suspect >= req.world_size):
            return "compute: step and since_step must be >= 0 and suspect a rank of the job"
        if len(f.detail) > 2000 or len(f.stat) > 16 or not math.isfinite(f.score) or len(f.faulty) > MAX_SUSPECTS:
            return "compute: detail (max 2000) or stat (max 16) too long, score not finite, or too many faulty"
        for s in f.faulty:
            if s.rank < 0 or (req.world_size and s.rank >= req.world_size):
                return f"compute faulty rank {s.rank} is out of range"
            err = check_host(s.host, "compute faulty host") or check_gpu_uuid(s.gpu_uuid, "compute faulty gpu_uuid")
            if err:
                return err
    return None


def check_watch_events(req: pb.WatchEventsRequest) -> str | None:
    if req.min_severity not in pb.Severity.values():
        return f"min_severity {req.min_severity} is not a Severity"
    if len(req.kinds) > 64 or any(len(k) > 128 for k in req.kinds):
        return "kinds: at most 64 prefixes of at most 128 characters"
    return None


def check_clear_gpu(req: pb.ClearGpuRequest) -> str | None:
    if not req.uuid:
        return "uuid is empty"
    err = check_gpu_uuid(req.uuid, "uuid")
    if err:
        return err
    if not req.reason.strip():
        return "reason is empty: say why the GPU is cleared (it is journaled)"
    if len(req.reason) > 1024 or len(req.who) > 256:
        return "reason (max 1024) or who (max 256) too long"
    return None
