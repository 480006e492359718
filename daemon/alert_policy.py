"""Alert policy (pure): which agent events raise or clear which alerts, when each alert is (re)sent.

No I/O and no clock here: every method takes `now` (unix seconds). `daemon.alerts` feeds it the agent's
events and delivers what `due()` returns to Alertmanager and to a webhook.

Two kinds of alert:

- **level** alerts follow a condition: `fire` starts one (a GPU went FAILED, a probe is HUNG), `resolve`
  ends it (the GPU is HEALTHY again, the probe returned). Re-sent every `resend_interval_s` while active,
  each time with `endsAt = now + 4 * resend_interval_s`, so Alertmanager resolves it by itself if the
  agent dies without resolving it (Prometheus does the same).
- **pulse** alerts stand for something that happened (a replica mismatch, an XID, a NaN loss): active for
  `hold_s` after the newest occurrence, then resolved. A repeat while active extends it and bumps its
  `count` annotation; it is not a new alert (no page storm) but it is not hidden either: the next send
  carries the new count and end time.

Deduplication: alerts are keyed by their label set (as Alertmanager does). An unchanged alert is sent
again only when its resend time comes; a changed one (new annotations, resolved) is sent at once.
`max_alerts` bounds the number kept; a new alert beyond it is refused and counted in `refused`.

Lifecycle: `AlertBook(...)` -> for each event `apply_event(event, now)` (or `fire`/`pulse`/`resolve`
directly) -> periodically `tick(now)`, which expires pulses and returns the alerts to send now ->
the caller delivers them (a failed delivery is retried by the sink's queue, not re-planned here).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import random
from typing import Any, Callable, Iterable, Mapping

from daemon.event_fold import REPEATS
from sdcwatch import event_kinds as ek
from sdcwatch.types import Severity

SEVERITY_LABEL = {Severity.INFO: "info", Severity.WARNING: "warning", Severity.CRITICAL: "critical"}
SOURCE_LABEL = "sdcwatch-agent"

# Alert names shared with deploy/prometheus/sdcwatch-rules.yml where they mean the same thing; the event kinds
# are the catalogue's (sdcwatch/event_kinds.py), whose `alerts` name these too (tests/test_event_kinds.py).
GPU_STATE_ALERTS = {"FAILED": "SDCWatchGPUFailed", "DEGRADED": "SDCWatchGPUDegraded",
                    "SUSPECT": "SDCWatchGPUSuspect"}
# Job-scoped pulses: kind -> (alert, summary with {job})
JOB_PULSES: dict[str, tuple[str, str]] = {
    ek.REPLICA_MISMATCH.name: ("SDCWatchReplicaMismatch", "SDC suspected: replicas of job {job} disagree"),
    ek.COMPUTE_FAULT.name: ("SDCWatchComputeFault",
                            "SDC suspected: one rank of job {job} computed a wrong gradient"),
    ek.SDC_FROZEN_CHANGED.name: ("SDCWatchFrozenParamsChanged",
                                 "SDC suspected: frozen parameters of job {job} changed"),
    ek.LOSS_NONFINITE.name: ("SDCWatchLossNonFinite", "NaN/Inf loss in job {job}"),
    ek.GRAD_NORM_NONFINITE.name: ("SDCWatchGradNormNonFinite", "NaN/Inf gradient norm in job {job}"),
}
# The loss detector's anomalies: kind -> alert (labelled with the kind; INFO events, e.g. recoveries, raise none)
LOSS_ALERTS: dict[str, str] = {
    ek.LOSS_SPIKE.name: "SDCWatchLossSpike", ek.LOSS_SHIFT.name: "SDCWatchLossSpike",
    ek.LOSS_SUSTAINED.name: "SDCWatchLossSustained", ek.LOSS_DIVERGENCE.name: "SDCWatchLossSustained",
    ek.GRAD_NORM_SPIKE.name: "SDCWatchGradNormSpike", ek.GRAD_NORM_SUSTAINED.name: "SDCWatchGradNormSpike",
    ek.LOSS_SCALE_COLLAPSE.name: "SDCWatchLossScaleCollapse",
}
CATCH_ALL = "SDCWatchCriticalEvent"   # any other CRITICAL event, so nothing critical is lost
QUIET_XID_ACTIONS = {"NONE", "RESTART_APP"}   # application-class XIDs: repeats make the GPU SUSPECT


@dataclasses.dataclass(frozen=True, slots=True)
class Signal:
    """What one event means for one alert. `op` is 'fire', 'resolve' or 'pulse'."""

    op: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    occurrences: int = 1   # a folded event stands for its `repeats` (daemon/event_fold.py)

    @property
    def key(self) -> str:
        return alert_key(self.labels)


@dataclasses.dataclass(slots=True)
class AlertRecord:
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    pulse_until: float | None      # pulses: when it resolves by itself; None for level alerts
    ends_at: float | None = None   # set when resolved
    count: int = 1
    last_sent: float | None = None
    changed: bool = True           # something new to tell since the last send

    @property
    def resolved(self) -> bool:
        return self.ends_at is not None


@dataclasses.dataclass(frozen=True, slots=True)
class Notification:
    """One alert as it is sent: a snapshot (labels, annotations, times)."""

    key: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: float
    ends_at: float
    resolved: bool

    def to_alertmanager(self, generator_url: str = "") -> dict[str, Any]:
        """One element of Alertmanager's `POST /api/v2/alerts` body."""
        out: dict[str, Any] = {"labels": dict(self.labels), "annotations": dict(self.annotations),
                               "startsAt": rfc3339(self.starts_at), "endsAt": rfc3339(self.ends_at)}
        if generator_url:
            out["generatorURL"] = generator_url
        return out

    def to_webhook(self) -> dict[str, Any]:
        """One element of the generic webhook's `alerts` list (shaped like Alertmanager's webhook)."""
        return {"status": "resolved" if self.resolved else "firing", "labels": dict(self.labels),
                "annotations": dict(self.annotations), "startsAt": rfc3339(self.starts_at),
                "endsAt": rfc3339(self.ends_at), "fingerprint": self.key}


def rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def alert_key(labels: Mapping[str, str]) -> str:
    """A stable fingerprint of a label set (16 hex digits)."""
    blob = json.dumps(sorted(labels.items()), separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------------
# Events -> signals
# ------------------------------------------------------------------------------------------------------------


def _job_of(subject: str, details: Mapping[str, Any]) -> str:
    job = details.get("job_id")
    if job:
        return str(job)
    parts = subject.split("/")
    return parts[1] if len(parts) > 1 and parts[0] == "job" else ""


def _uuid_of(subject: str, details: Mapping[str, Any]) -> str:
    uuid = details.get("uuid")
    if uuid:
        return str(uuid)
    return subject.split("/", 1)[1] if subject.startswith("gpu/") else ""


def signals_for_event(kind: str, severity: Severity, subject: str, message: str,
                      details: Mapping[str, Any], *, node: str, runbook_base: str) -> list[Signal]:
    """The alert signals one agent event implies (pure). `kind` is a catalogue name (sdcwatch/event_kinds.py),
    whose `alerts` list what this returns. An INFO/WARNING event with no alert of its own implies none; a
    CRITICAL one raises the catch-all pulse `SDCWatchCriticalEvent` so nothing critical is lost. An event that
    stands for folded repeats (`repeats` in its details) counts that many in a pulse's `count`."""

    def labels(alertname: str, sev: str, **extra: Any) -> dict[str, str]:
        out = {"alertname": alertname, "severity": sev, "node": node, "source": SOURCE_LABEL}
        out.update({k: str(v) for k, v in extra.items() if v not in (None, "")})
        return out

    def notes(alertname: str, summary: str, description: str = "") -> dict[str, str]:
        return {"summary": summary, "description": description or message,
                "runbook_url": f"{runbook_base.rstrip('/')}/{alertname}.md", "event_kind": kind}

    sev = SEVERITY_LABEL[Severity(severity)]
    if kind in (ek.GPU_STATE.name, ek.GPU_CLEARED.name):
        uuid = _uuid_of(subject, details)
        to = str(details.get("to", ""))
        ident = {"uuid": uuid, "pci_bus_id": details.get("pci_bus_id", "")}
        out: list[Signal] = []
        for state, name in GPU_STATE_ALERTS.items():
            lab = labels(name, "critical" if state == "FAILED" else "warning", uuid=uuid)
            if state == to:
                reason = str(details.get("reason", "")) or message
                out.append(Signal("fire", lab, {**notes(name, f"GPU {uuid} on {node} is {to}", reason),
                                                **{k: str(v) for k, v in ident.items() if v}}))
            else:
                out.append(Signal("resolve", lab))
        return out
    if kind == ek.GPU_XID.name:
        action = str(details.get("action", ""))
        if action in QUIET_XID_ACTIONS or severity is Severity.INFO:
            return []
        uuid = _uuid_of(subject, details)
        xid = details.get("xid", "")
        name = "SDCWatchGPUXid"
        return [Signal("pulse", labels(name, sev, uuid=uuid, xid=xid, action=action),
                       {**notes(name, f"XID {xid} ({details.get('name', '?')}) on GPU {uuid} ({node}): "
                                f"{action}"), "pci_bus_id": str(details.get("pci_bus_id", ""))})]
    if kind == ek.PROBE_HUNG.name:
        probe = str(details.get("probe", subject.split("/", 1)[-1]))
        name = "SDCWatchProbeHung"
        return [Signal("fire", labels(name, "critical", probe=probe),
                       notes(name, f"probe {probe} on {node} is hung"))]
    if kind == ek.PROBE_RECOVERED.name:
        probe = str(details.get("probe", subject.split("/", 1)[-1]))
        return [Signal("resolve", labels("SDCWatchProbeHung", "critical", probe=probe))]
    if kind == ek.GPU_ECC_STORM.name:
        uuid = _uuid_of(subject, details)
        name = "SDCWatchGPUCorrectableECCStorm"
        return [Signal("pulse", labels(name, "warning", uuid=uuid),
                       {**notes(name, f"correctable ECC storm on GPU {uuid} ({node})"),
                        "pci_bus_id": str(details.get("pci_bus_id", ""))})]
    if kind == ek.AGENT_LOOP_STALE.name:
        probe = str(details.get("probe", subject.split("/", 1)[-1]))
        name = "SDCWatchAgentLoopStale"
        return [Signal("fire", labels(name, "critical", probe=probe),
                       notes(name, f"the agent's {probe} loop on {node} stopped: the agent is not watching"))]
    if kind == ek.AGENT_LOOP_RECOVERED.name:
        probe = str(details.get("probe", subject.split("/", 1)[-1]))
        return [Signal("resolve", labels("SDCWatchAgentLoopStale", "critical", probe=probe))]
    if kind == ek.NVML_UNRESPONSIVE.name:
        name = "SDCWatchDriverUnresponsive"
        return [Signal("fire", labels(name, "critical"), notes(name, f"the NVIDIA driver on {node} does not answer"))]
    if kind == ek.NVML_RESPONSIVE.name:
        return [Signal("resolve", labels("SDCWatchDriverUnresponsive", "critical"))]
    job = _job_of(subject, details)
    if kind in JOB_PULSES:
        name, summary = JOB_PULSES[kind]
        return [Signal("pulse", labels(name, "critical", job_id=job), notes(name, summary.format(job=job)))]
    if kind in LOSS_ALERTS:
        if severity is Severity.INFO:
            return []
        name = LOSS_ALERTS[kind]
        return [Signal("pulse", labels(name, sev, job_id=job, kind=kind),
                       notes(name, f"{kind} in job {job}"))]
    if kind == ek.CANARY_FAIL.name:
        name = "SDCWatchCanaryFailed"
        uuid = _uuid_of(subject, details)
        return [Signal("pulse", labels(name, "critical", uuid=uuid),
                       notes(name, f"SDC suspected: canary failed on GPU {uuid or '?'} ({node})"))]
    if severity is Severity.CRITICAL and kind != ek.GPU_LOST.name:   # gpu.lost: SDCWatchGPUFailed covers it
        name = CATCH_ALL
        return [Signal("pulse", labels(name, "critical", kind=kind, subject=subject),
                       notes(name, f"{kind} on {node}: {message}"))]
    return []


# ------------------------------------------------------------------------------------------------------------
# The book of alerts
# ------------------------------------------------------------------------------------------------------------


class AlertBook:
    def __init__(self, *, resend_interval_s: float = 60.0, hold_s: float = 900.0,
                 max_alerts: int = 1000) -> None:
        if resend_interval_s <= 0 or hold_s <= 0 or max_alerts < 1:
            raise ValueError(f"AlertBook: resend_interval_s ({resend_interval_s}) and hold_s ({hold_s}) must "
                             f"be > 0 and max_alerts ({max_alerts}) >= 1")
        self.resend_interval_s = resend_interval_s
        self.hold_s = hold_s
        self.max_alerts = max_alerts
        self.alerts: dict[str, AlertRecord] = {}
        self.refused = 0

    @property
    def active(self) -> list[AlertRecord]:
        return [a for a in self.alerts.values() if not a.resolved]

    def apply(self, signal: Signal, now: float) -> None:
        rec = self.alerts.get(signal.key)
        if signal.op == "resolve":
            if rec is not None and not rec.resolved:
                rec.ends_at = now
                rec.changed = True
            return
        if signal.op not in ("fire", "pulse"):
            raise ValueError(f"unknown signal op {signal.op!r} (expected fire, pulse or resolve)")
        pulse_until = now + self.hold_s if signal.op == "pulse" else None
        if rec is None or rec.resolved:
            if rec is None and not self._make_room():
                self.refused += 1
                return
            self.alerts[signal.key] = AlertRecord(labels=dict(signal.labels),
                                                  annotations=dict(signal.annotations),
                                                  starts_at=now, pulse_until=pulse_until,
                                                  count=signal.occurrences)
            if signal.op == "pulse" and signal.occurrences > 1:
                self.alerts[signal.key].annotations["count"] = str(signal.occurrences)
            return
        # a repeat of an active alert: dedup, but keep what is new
        rec.count += signal.occurrences
        annotations = dict(signal.annotations)
        if signal.op == "pulse":
            rec.pulse_until = pulse_until
            annotations["count"] = str(rec.count)
        if annotations != rec.annotations:
            rec.annotations = annotations
            rec.changed = True

    def apply_event(self, kind: str, severity: Severity, subject: str, message: str,
                    details: Mapping[str, Any], now: float, *, node: str, runbook_base: str) -> list[Signal]:
        signals = signals_for_event(kind, severity, subject, message, details, node=node,
                                    runbook_base=runbook_base)
        n = details.get(REPEATS, 1)
        if isinstance(n, int) and n > 1:
            signals = [dataclasses.replace(s, occurrences=n) for s in signals]
        for s in signals:
            self.apply(s, now)
        return signals

    def _make_room(self) -> bool:
        if len(self.alerts) < self.max_alerts:
            return True
        # forget the oldest resolved alert; never an active one
        resolved = [k for k, a in self.alerts.items() if a.resolved]
        if not resolved:
            return False
        oldest = min(resolved, key=lambda k: self.alerts[k].ends_at or 0.0)
        del self.alerts[oldest]
        return True

    def tick(self, now: float) -> list[Notification]:
        """Expire pulses; return what to send now (new, changed, resolved, or due for a resend). Resolved
        alerts are forgotten once returned: the sink queues own their delivery from here."""
        out: list[Notification] = []
        for key, rec in list(self.alerts.items()):
            if not rec.resolved and rec.pulse_until is not None and now >= rec.pulse_until:
                rec.ends_at = rec.pulse_until
                rec.changed = True
            due = rec.changed or rec.last_sent is None or now - rec.last_sent >= self.resend_interval_s
            if not due:
                continue
            out.append(self._snapshot(key, rec, now))
            rec.last_sent = now
            rec.changed = False
            if rec.resolved:
                del self.alerts[key]
        return out

    def _snapshot(self, key: str, rec: AlertRecord, now: float) -> Notification:
        if rec.resolved:
            ends = rec.ends_at or now
        elif rec.pulse_until is not None:
            ends = rec.pulse_until
        else:
            ends = now + 4 * self.resend_interval_s
        return Notification(key=key, labels=dict(rec.labels), annotations=dict(rec.annotations),
                            starts_at=rec.starts_at, ends_at=ends, resolved=rec.resolved)


# ------------------------------------------------------------------------------------------------------------
# Sink-side policy: bounded dedup queue, token bucket, backoff
# ------------------------------------------------------------------------------------------------------------


class SinkQueue:
    """Notifications waiting for one sink, newest version per alert key, at most `size` keys. A full
    queue drops its oldest entry (counted in `dropped`): the newest news is worth more."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"SinkQueue size must be >= 1, got {size}")
        self.size = size
        self._items: dict[str, Notification] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, n: Notification) -> None:
        if n.key in self._items:
            del self._items[n.key]   # re-insert: the newest version goes to the back
        elif len(self._items) >= self.size:
            oldest = next(iter(self._items))
            del self._items[oldest]
            self.dropped += 1
        self._items[n.key] = n

    def take(self, limit: int) -> list[Notification]:
        keys = list(self._items)[:limit]
        return [self._items.pop(k) for k in keys]

    def put_back(self, batch: Iterable[Notification]) -> None:
        """Return a failed batch; a newer version of an alert already queued wins over the old one."""
        for n in batch:
            if n.key not in self._items:
                if len(self._items) >= self.size:
                    self.dropped += 1
                    continue
                self._items = {n.key: n, **self._items}   # to the front: it is older


class TokenBucket:
    """At most `per_minute` sends per minute on average, bursts up to `burst`."""

    def __init__(self, per_minute: float, burst: int, now: float) -> None:
        if per_minute <= 0 or burst < 1:
            raise ValueError(f"TokenBucket: per_minute must be > 0 and burst >= 1, got {per_minute}, {burst}")
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self, now: float) -> float:
        """Seconds until a token is available (0 if one is)."""
        self._refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def take(self, now: float) -> bool:
        self._refill(now)
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def backoff_delay(attempt: int, *, base_s: float = 1.0, cap_s: float = 60.0,
                  rand: Callable[[], float] = random.random) -> float:
    """Delay before retry number `attempt` (1, 2, ...): exponential, capped, with 'equal jitter'
    (half fixed, half random) so that agents that failed together do not retry together."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    ceiling = min(cap_s, base_s * 2 ** (attempt - 1))
    return ceiling / 2 + rand() * ceiling / 2
