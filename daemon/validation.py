"""Validation of requests from clients. Each function returns None or a message saying what is wrong.

Names from clients never become paths: job ids, hosts and labels are checked against tight patterns
and lengths here, before anything else sees them.
"""
from __future__ import annotations

import math
import re

from proto.sdcwatch.v1 import agent_pb2 as pb

JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$")
HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]{0,252})?$")
GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z\-/]{1,90}$")
GROUP = re.compile(r"^[A-Za-z0-9._:@+=/-]{0,128}$")
LABEL_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")

MAX_REPORT_BYTES = 64 * 1024
MAX_FINGERPRINT_WORDS = 16
MAX_WORLD = 1 << 20
MAX_LABELS = 32
MAX_SUSPECTS = 4096


_GOOD_NAMES: dict[str, None] = {}   # job ids, hosts and GPU UUIDs already accepted (bounded)


def _known_good(name: str) -> bool:
    return name in _GOOD_NAMES


def _remember(name: str) -> None:
    if len(_GOOD_NAMES) >= 4096:
        _GOOD_NAMES.clear()
    _GOOD_NAMES[name] = None


def check_job_id(job_id: str) -> str | None:
    if not job_id:
        return "job_id is empty"
    if _known_good(job_id):
        return None
    if not JOB_ID.match(job_id):
        return (f"job_id {job_id[:64]!r} is invalid: 1-128 characters from A-Z a-z 0-9 . _ : @ + = -, "
                "starting with a letter or digit")
    _remember(job_id)
    return None


def check_gpu_uuid(uuid: str, field: str = "gpu_uuid") -> str | None:
    if not uuid or _known_good(uuid):
        return None
    if not GPU_UUID.match(uuid):
        return f"{field} {uuid[:64]!r} is not a GPU UUID (GPU-... or MIG-...)"
    _remember(uuid)
    return None


_INF = float("inf")


def _finite_nonneg(name: str, value: float) -> str | None:
    if math.isnan(value) or math.isinf(value):
        return f"{name} is {value}; it must be a finite number"
    if value < 0:
        return f"{name} is {value}; it must be >= 0"
    return None


def check_report_step(req: pb.ReportStepRequest) -> str | None:
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
    if req.replica_group and not GROUP.match(req.replica_group):
        return f"replica_group {req.replica_group[:64]!r} is invalid"
    if req.host and not _known_good(req.host):
        if not HOST.match(req.host):
            return f"host {req.host[:64]!r} is not a hostname"
        _remember(req.host)
    err = check_gpu_uuid(req.gpu_uuid)
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
        if vote.method not in ("", "majority", "all_disagreeing", "none"):
            return f"vote.method {vote.method[:32]!r} is unknown (majority, all_disagreeing)"
        for s in vote.suspects:
            if s.rank < 0 or (req.world_size and s.rank >= req.world_size):
                return f"vote suspect rank {s.rank} is out of range"
            if s.host and not HOST.match(s.host):
                return f"vote suspect host {s.host[:64]!r} is not a hostname"
            err = check_gpu_uuid(s.gpu_uuid, "vote suspect gpu_uuid")
            if err:
                return err
            if len(s.fingerprint) > MAX_FINGERPRINT_WORDS:
                return "vote suspect fingerprint too long"
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
