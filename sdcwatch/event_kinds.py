"""The catalogue of the agent's event kinds: the one place that names what can be journaled.

Every event the agent publishes is one of the `EventKind` members below. A publisher passes the member
(`bus.publish(REPLICA_MISMATCH, subject, message, details)`), never a string, and the bus refuses anything
that is not a member of this catalogue. The member says:

- `name`       the wire string: journal records, the `sdcwatch.v1` Event, the Redis stream, the
               `kind` label of `sdcwatch_events_total`, `sdcwatch events --kind` (unchanged by this module);
- `severity`   the usual severity; `severities` the ones a publisher may choose among (e.g. `gpu.state`
               is CRITICAL for FAILED, WARNING for DEGRADED, INFO for HEALTHY);
- `subjects`   the subject kinds it is about (`node`, `gpu/<uuid>`, `job/<id>`, `job/<id>/rank/<r>`,
               `probe/<name>`); the bus checks the subject's prefix;
- `means`      one line for the docs (docs/metrics.md's table of event kinds is generated from it);
- `alerts`     the alerts it raises (Prometheus rules in deploy/prometheus/ and the agent's own pushes,
               daemon/alert_policy.py); each has a runbook, docs/runbooks/<alert>.md (`runbooks`);
- `fold_s`     the repeat-folding window: 0 publishes every occurrence; > 0 publishes the first occurrence
               per (kind, subject) at once and folds later ones within `fold_s` seconds into one event that
               carries `repeats` in its details (daemon/event_fold.py; docs/metrics.md "Repeats");
- `fold_by`    detail keys that are part of the folding key besides (kind, subject): `gpu.xid` folds per XID
               number, so a flood of XID 13 never delays an XID 79 on the same GPU.

Torch-free and I/O-free: the training side and the agent both import it. Tests check that every member is
emitted somewhere, that the alert policy and the Prometheus rules name only members, and that every
runbook exists (tests/test_event_kinds.py).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterator, Mapping, Protocol

from sdcwatch.errors import SdcwatchError
from sdcwatch.severity import Severity

INFO, WARNING, CRITICAL = Severity.INFO, Severity.WARNING, Severity.CRITICAL
REPEATS = "repeats"   # the details key of an event that stands for several occurrences (daemon/event_fold.py)


class SubjectKind(enum.Enum):
    """What an event is about, by the shape of its subject string."""

    NODE = "node"
    GPU = "gpu"
    JOB = "job"
    RANK = "rank"
    PROBE = "probe"

    def matches(self, subject: str) -> bool:
        if self is SubjectKind.NODE:
            return subject == "node"
        if self is SubjectKind.RANK:
            parts = subject.split("/")
            return len(parts) == 4 and parts[0] == "job" and parts[2] == "rank"
        if self is SubjectKind.JOB:
            return subject.startswith("job/") and not SubjectKind.RANK.matches(subject)
        return subject.startswith(f"{self.value}/")


NODE, GPU, JOB, RANK, PROBE = (SubjectKind.NODE, SubjectKind.GPU, SubjectKind.JOB, SubjectKind.RANK,
                               SubjectKind.PROBE)


class UnknownEventKind(SdcwatchError, ValueError):
    """A kind that is not a member of the catalogue (a publisher bug, or a name typed by hand)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class EventKind:
    """One kind of event (see the module docstring). Compared by identity: one member per name."""

    name: str
    severity: Severity
    subjects: tuple[SubjectKind, ...]
    means: str
    alerts: tuple[str, ...] = ()
    severities: frozenset[Severity] = frozenset()
    fold_s: float = 0.0
    fold_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.severities:
            object.__setattr__(self, "severities", frozenset({self.severity}))
        if self.severity not in self.severities:
            raise ValueError(f"{self.name}: default severity {self.severity.name} is not among its severities")
        if self.fold_s < 0:
            raise ValueError(f"{self.name}: fold_s must be >= 0, got {self.fold_s}")

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"EventKind({self.name!r})"

    @property
    def runbooks(self) -> tuple[str, ...]:
        """Paths (from the repository root) of the runbooks of its alerts."""
        return tuple(f"docs/runbooks/{a}.md" for a in self.alerts)

    def check(self, severity: Severity, subject: str) -> None:
        """Raise ValueError when `severity` or `subject` is not one this kind allows."""
        if severity not in self.severities:
            allowed = ", ".join(s.name for s in sorted(self.severities))
            raise ValueError(f"event {self.name}: severity {Severity(severity).name} not allowed (allowed: "
                             f"{allowed}; sdcwatch/event_kinds.py)")
        if not any(s.matches(subject) for s in self.subjects):
            shapes = ", ".join(s.value for s in self.subjects)
            raise ValueError(f"event {self.name}: subject {subject!r} is not a {shapes} subject "
                             f"(sdcwatch/event_kinds.py)")


class Publish(Protocol):
    """What publishers are given: `daemon.events.EventBus.publish` (or a test's recorder)."""

    def __call__(self, kind: EventKind, subject: str, message: str, details: Mapping[str, Any] | None = None,
                 *, severity: Severity | None = None) -> Any: ...


_CATALOGUE: dict[str, EventKind] = {}


def _kind(name: str, severity: Severity, subjects: SubjectKind | tuple[SubjectKind, ...], means: str, *,
          alerts: tuple[str, ...] = (), severities: tuple[Severity, ...] = (), fold_s: float = 0.0,
          fold_by: tuple[str, ...] = ()) -> EventKind:
    if name in _CATALOGUE:
        raise ValueError(f"event kind {name} declared twice")
    member = EventKind(name, severity, subjects if isinstance(subjects, tuple) else (subjects,), means,
                       alerts, frozenset(severities), fold_s, fold_by)
    _CATALOGUE[name] = member
    return member


def lookup(name: str) -> EventKind:
    """The member named `name` (a wire string); UnknownEventKind when the catalogue has none."""
    try:
        return _CATALOGUE[name]
    except KeyError:
        raise UnknownEventKind(f"unknown event kind {name!r}: not in the catalogue (sdcwatch/event_kinds.py)") \
            from None


def is_member(kind: object) -> bool:
    """True when `kind` is one of the catalogue's members (not a look-alike, not a string)."""
    return isinstance(kind, EventKind) and _CATALOGUE.get(kind.name) is kind


def members() -> Iterator[EventKind]:
    """Every member, in the order declared."""
    return iter(tuple(_CATALOGUE.values()))


# ---- the agent ---------------------------------------------------------------------------------------------
AGENT_STARTING = _kind("agent.starting", INFO, NODE, "the agent started (version, pid, state dir, Redis)")
AGENT_READY = _kind("agent.ready", INFO, NODE, "the agent serves its API and health (its addresses)")
AGENT_STOPPING = _kind("agent.stopping", INFO, NODE, "the agent is shutting down")
JOURNAL_REPAIRED = _kind("journal.repaired", WARNING, NODE, "at start the journal held lines it could not use (a "
                         "torn last line, a seq that is not a valid number): truncated or skipped (what)")
JOURNAL_WRITE_FAILED = _kind("journal.write_failed", WARNING, NODE, "events were not written to the journal (disk "
                             "full, read-only, I/O error); watchers, the Redis stream and alerts got them from memory "
                             "(count, seq range, error); journaled once writes work again")
EVENTS_SKIPPED = _kind("events.skipped", WARNING, NODE, "sent to a watcher in place of events it cannot have (lost "
                       "to a journal failure, or rotated out of the kept files): from_seq..to_seq; its seq is "
                       "to_seq, so a watcher resuming from it misses nothing more (never journaled)")
REDIS_DOWN = _kind("redis.down", CRITICAL, NODE, "the agent's embedded redis-server died: checkpoints are "
                   "UNAVAILABLE until it is back (restarted with backoff; its index is reloaded from the state dir)",
                   alerts=("SDCWatchCriticalEvent",))
REDIS_RESTARTED = _kind("redis.restarted", INFO, NODE, "the embedded redis-server is back (after redis.down); "
                        "checkpoints work again, with the index it persisted")
NVML_DISCOVERED = _kind("nvml.discovered", INFO, NODE, "NVML found the node's GPUs (uuid, PCI bus id, name)")
PROBE_HUNG = _kind("probe.hung", CRITICAL, PROBE, "a probe call did not return within its timeout; the probe is "
                   "not re-entered until it does", alerts=("SDCWatchProbeHung",))
PROBE_RECOVERED = _kind("probe.recovered", INFO, PROBE, "a hung probe call returned (resolves SDCWatchProbeHung)")
AGENT_LOOP_STALE = _kind("agent.loop_stale", CRITICAL, PROBE, "a loop of the agent published no heartbeat for 3 "
                         "of its intervals (and at least 5 s): the agent is not watching (sdcwatch.v1.Agent "
                         "NOT_SERVING)",
                         alerts=("SDCWatchAgentLoopStale",))
AGENT_LOOP_RECOVERED = _kind("agent.loop_recovered", INFO, PROBE, "a stale loop beats again (resolves "
                             "SDCWatchAgentLoopStale)")
NVML_UNRESPONSIVE = _kind("nvml.unresponsive", CRITICAL, NODE, "an NVML call did not return within nvml.timeout_s "
                          "(at most 30 s): the driver is unresponsive, the GPUs are UNKNOWN",
                          alerts=("SDCWatchDriverUnresponsive",))
NVML_RESPONSIVE = _kind("nvml.responsive", INFO, NODE, "the hung NVML call returned (resolves "
                        "SDCWatchDriverUnresponsive)")

# ---- GPUs -----------------------------------------------------------------------------------------------------
GPU_STATE = _kind("gpu.state", INFO, GPU, "a GPU's state changed (from, to, the evidence behind it); CRITICAL "
                  "for FAILED/SUSPECT, WARNING for DEGRADED",
                  alerts=("SDCWatchGPUFailed", "SDCWatchGPUDegraded", "SDCWatchGPUSuspect"),
                  severities=(INFO, WARNING, CRITICAL))
GPU_CLEARED = _kind("gpu.cleared", WARNING, GPU, "an operator cleared a GPU's evidence (who, why, states; the "
                    "state alerts follow the state it leaves)",
                    alerts=("SDCWatchGPUFailed", "SDCWatchGPUDegraded", "SDCWatchGPUSuspect"))
GPU_XID = _kind("gpu.xid", WARNING, GPU, "the driver raised an XID (number, catalog name, action); repeats of one "
                "XID on one GPU fold per minute", alerts=("SDCWatchGPUXid", "SDCWatchGPUXidReboot",
                                                          "SDCWatchGPUXidResetRequired", "SDCWatchGPUXidContactSupport",
                                                          "SDCWatchGPUXidAppRepeats", "SDCWatchGPUXidUnknown"),
                severities=(INFO, WARNING, CRITICAL), fold_s=60.0, fold_by=("xid",))
GPU_LOST = _kind("gpu.lost", CRITICAL, GPU, "a GPU NVML saw before is gone (fell off the bus)",
                 alerts=("SDCWatchGPUFailed",))
GPU_SIGNAL = _kind("gpu.signal", WARNING, GPU, "an NVML condition changed (remap pending, link down, ...) and "
                   "what state it implies", alerts=("SDCWatchCriticalEvent",), severities=(INFO, WARNING, CRITICAL))
GPU_COUNTER_JUMP = _kind("gpu_counter_jump", INFO, GPU, "an NVML error counter rose between polls (counter, delta); "
                         "one event per counter and GPU a minute", alerts=("SDCWatchCriticalEvent",),
                         severities=(INFO, WARNING, CRITICAL), fold_s=60.0, fold_by=("field",))
GPU_ECC_STORM = _kind("gpu.ecc_storm", WARNING, GPU, "correctable ECC errors at storm rate: NVML's single-bit-ECC "
                      "storm event, or the polled rate rule (sbe_storm_count in sbe_window_s)",
                      alerts=("SDCWatchGPUCorrectableECCStorm",), fold_s=60.0)
GPU_NVML_EVENT = _kind("gpu.nvml_event", WARNING, GPU, "an NVML event other than an XID: recovery action changed, "
                       "poison (contained or fatal), DRAM retirement or its failure, GPU unavailable",
                       alerts=("SDCWatchCriticalEvent",), severities=(INFO, WARNING, CRITICAL), fold_s=60.0,
                       fold_by=("event",))
GPU_RESET_DETECTED = _kind("gpu_reset_detected", WARNING, GPU, "a GPU's volatile counters went back to zero: it "
                           "was reset")
CANARY_FAIL = _kind("canary.fail", CRITICAL, (GPU, RANK), "a known-answer canary computed a wrong result (the "
                    "agent's, or a rank's in-job canary)", alerts=("SDCWatchCanaryFailed",))
CANARY_UNKNOWN = _kind("canary.unknown", WARNING, (GPU, NODE), "a canary round could not judge (crash, timeout, "
                       "no GPU snapshot): not proof of bad math")

# ---- jobs -----------------------------------------------------------------------------------------------------
JOB_STARTED = _kind("job.started", INFO, JOB, "the first report of a job reached this agent")
JOB_REPORTS_DROPPED = _kind("job.reports_dropped", WARNING, JOB, "a job's ranks dropped step reports (the agent "
                            "was slow or down) or sent them too late to judge; one event per job per window, "
                            "details.dropped_total the running count", fold_s=60.0)
JOB_FORGOTTEN = _kind("job.forgotten", INFO, JOB, "a job sent no report for jobs.job_idle_s; its state is dropped")
JOB_ROLLBACK = _kind("job.rollback", INFO, JOB, "a job's steps went back: it restored a checkpoint")
JOB_ROLLBACK_DIRECTIVE = _kind("job.rollback_directive", WARNING, JOB, "the agent tells the job's ranks to restore "
                               "a VERIFIED checkpoint and skip batches")
JOB_STOP_DIRECTIVE = _kind("job.stop_directive", WARNING, JOB, "the agent tells the job's ranks to stop: a "
                           "GPU of the job keeps computing wrong (a persistent compute fault, or faults on "
                           "two steps); target_step is the newest VERIFIED checkpoint older than the fault's "
                           "first suspect step, to restart from without that GPU")
JOB_ROLLBACK_IMPOSSIBLE = _kind("job.rollback_impossible", CRITICAL, JOB, "a rollback was due but none was "
                                "planned: no VERIFIED checkpoint is older than the anomaly, or the checkpoints did "
                                "not answer in time (a replica mismatch is planned again while its replicas "
                                "disagree)", alerts=("SDCWatchCriticalEvent",))
JOB_VOTE_UNAVAILABLE = _kind("job.vote_unavailable", WARNING, JOB, "a job's ranks cannot vote: their shards have "
                             "no replica (plain FSDP); silent corruption of the weights is not caught by a vote "
                             "(checks still run; use HSDP for a vote); once per job")
RANK_STAGE_FAILED = _kind("rank.stage_failed", WARNING, RANK, "a check around a rank's optimizer step (a step-guard "
                          "stage: the compute gate, the replica gate, ...) raised: the steps it failed on went "
                          "unchecked by it; training went on (the stage, its error, how many failures so far); "
                          "repeats fold", fold_s=600.0)
REPLICA_MISMATCH = _kind("replica.mismatch", CRITICAL, JOB, "data-parallel replicas held different weights after "
                         "a step (suspect ranks, hosts, GPUs); repeats fold per incident (a new one after a restore is "
                         "its own event)", alerts=("SDCWatchReplicaMismatch",), fold_s=60.0, fold_by=("incident",))
COMPUTE_FAULT = _kind("compute.fault", CRITICAL, RANK, "one rank's forward or backward computed a wrong gradient "
                      "(pre-reduction check or replay audit): rank, host, GPU, cause, whether the update was "
                      "dropped", alerts=("SDCWatchComputeFault",), fold_s=60.0)
COMPUTE_CLEARED = _kind("compute.cleared", INFO, JOB, "a compute suspicion that the replays cleared: the "
                        "outlier gradient reproduces on every rank (the data's), the update was applied (a "
                        "non-finite one was not: a loss scale's overflow)")
COMPUTE_DIVERGED = _kind("compute.diverged", WARNING, JOB, "a compute suspicion whose replays split by "
                         "replica: ranks that agree bit for bit among themselves and not with the others "
                         "compute from other weights or optimizer state (an HSDP replica a bit flip "
                         "changed), not wrongly: no GPU named, the update dropped, checkpoints from that "
                         "step not VERIFIED (the replica vote names the shard)", fold_s=60.0)
COMPUTE_UNREPRODUCIBLE = _kind("compute.unreproducible", WARNING, JOB, "a job's compute replays do not "
                               "reproduce its steps (its loss_fn is not what the loop back-propagates: a "
                               "GradScaler not passed as scaler=, a missing division): audits are off and no "
                               "GPU is named on a replay; once per job")
SDC_FROZEN_CHANGED = _kind("sdc.frozen_changed", CRITICAL, RANK, "parameters that must not change changed their "
                           "fingerprint", alerts=("SDCWatchFrozenParamsChanged",), fold_s=60.0)

# ---- the loss detector (probes/loss_detector.py: signal loss, grad_norm or loss_scale) -------------------------
LOSS_NONFINITE = _kind("loss.nonfinite", CRITICAL, (JOB, RANK), "a NaN or Inf loss (the job's mean, or one "
                       "rank's own)", alerts=("SDCWatchLossNonFinite",), fold_s=60.0)
LOSS_SPIKE = _kind("loss.spike", WARNING, JOB, "one loss sample far above the baseline",
                   alerts=("SDCWatchLossSpike",))
LOSS_RECOVERED = _kind("loss.recovered", INFO, JOB, "the loss came back to its baseline after a spike (peak)")
LOSS_SHIFT = _kind("loss.shift", WARNING, JOB, "the loss level shifted up by many sigmas of its noise but less than "
                   "sustained_ratio, and became the new level", alerts=("SDCWatchLossSpike",))
LOSS_SUSTAINED = _kind("loss.sustained", CRITICAL, JOB, "the loss level stayed above the baseline for "
                       "patience_steps", alerts=("SDCWatchLossSustained",))
LOSS_DIVERGENCE = _kind("loss.divergence", CRITICAL, JOB, "the loss rose gradually well above its lowest level",
                        alerts=("SDCWatchLossSustained",))
GRAD_NORM_NONFINITE = _kind("grad_norm.nonfinite", CRITICAL, (JOB, RANK), "a NaN or Inf gradient norm (without "
                            "a loss scale, or a rank's own)", alerts=("SDCWatchGradNormNonFinite",), fold_s=60.0)
GRAD_NORM_SPIKE = _kind("grad_norm.spike", WARNING, JOB, "one gradient-norm sample far above the baseline (an "
                        "early warning of a loss spike)", alerts=("SDCWatchGradNormSpike",),
                        severities=(WARNING, CRITICAL))
GRAD_NORM_RECOVERED = _kind("grad_norm.recovered", INFO, JOB, "the gradient norm came back to its baseline")
GRAD_NORM_SUSTAINED = _kind("grad_norm.sustained", WARNING, JOB, "the gradient-norm level stayed above the "
                            "baseline for patience_steps", alerts=("SDCWatchGradNormSpike",),
                            severities=(WARNING, CRITICAL))
LOSS_SCALE_COLLAPSE = _kind("loss_scale.collapse", CRITICAL, JOB, "the fp16 loss scale fell far below its settled "
                            "value (overflowing gradients, step after step)", alerts=("SDCWatchLossScaleCollapse",))

# ---- checkpoints (checkpoint/coordinator.py, drainer.py, peers.py) ---------------------------------------------
CHECKPOINT_COMMITTED = _kind("checkpoint.committed", INFO, JOB, "every shard of a step is stored: COMMITTED")
CHECKPOINT_VERIFIED = _kind("checkpoint.verified", INFO, JOB, "a committed step is VERIFIED (replicas agree, no "
                            "bad event since)")
CHECKPOINT_REVOKED = _kind("checkpoint.revoked", WARNING, JOB, "a step lost VERIFIED (a bad event touched it)",
                           alerts=("SDCWatchCheckpointNotVerified",))
CHECKPOINT_REPLICAS_DIFFER = _kind("checkpoint.replicas_differ", CRITICAL, JOB, "replicas saved different bytes "
                                   "for one checkpoint (fingerprints of the saved tensors differ): it is never "
                                   "VERIFIED; the odd ranks are named",
                                   alerts=("SDCWatchCriticalEvent", "SDCWatchCheckpointNotVerified"))
CHECKPOINT_ABORTED = _kind("checkpoint.aborted", INFO, JOB, "a save was abandoned before it committed")
CHECKPOINT_EVICTED = _kind("checkpoint.evicted", INFO, JOB, "retention removed a step from node memory")
CHECKPOINT_RESTORED_FROM_TIER = _kind("checkpoint.restored_from_tier", INFO, JOB, "a restore read its bytes from a "
                                      "slower tier (NVMe, flash, S3)")
CHECKPOINT_RESTORE_FAILED = _kind("checkpoint.restore_failed", WARNING, JOB, "a rank reported a failed restore")
CHECKPOINT_RESTORE_FALLBACK = _kind("checkpoint.restore_fallback", WARNING, JOB, "a restore used another copy "
                                    "than planned (a bad or missing one)")
CHECKPOINT_DRAINED = _kind("checkpoint.drained", INFO, JOB, "a step was copied to a tier and verified there")
CHECKPOINT_DRAIN_DROPPED = _kind("checkpoint.drain_dropped", WARNING, JOB, "a step was not copied to a tier: the "
                                 "drain backlog is over its bound", alerts=("SDCWatchCheckpointDrainBacklog",))
CHECKPOINT_TIER_VERIFY_FAILED = _kind("checkpoint.tier_verify_failed", WARNING, JOB, "a copy read back from a "
                                      "tier did not match its checksums (deleted, retried)",
                                      alerts=("SDCWatchCheckpointTierFailing",))
CHECKPOINT_DRAIN_SOURCE_CORRUPT = _kind("checkpoint.drain_source_corrupt", CRITICAL, JOB, "no good source copy "
                                        "of a chunk to drain (never retried)", alerts=("SDCWatchCriticalEvent",))
CHECKPOINT_TIER_UNHEALTHY = _kind("checkpoint.tier_unhealthy", WARNING, JOB, "a tier failed (disk full, "
                                  "read-only, S3 down, hung); copies retry with backoff",
                                  alerts=("SDCWatchCheckpointTierFailing",))
CHECKPOINT_TIER_HEALTHY = _kind("checkpoint.tier_healthy", INFO, JOB, "an unhealthy tier works again")
CHECKPOINT_TIER_DELETED = _kind("checkpoint.tier_deleted", INFO, JOB, "retention deleted a step from a tier")
CHECKPOINT_COPY_CORRUPT = _kind("checkpoint.copy_corrupt", WARNING, JOB, "verifying a step found a bad copy on a "
                                "tier")
CHECKPOINT_REPLICATION_FAILED = _kind("checkpoint.replication_failed", WARNING, JOB, "copying a shard to a peer "
                                      "node failed (unreachable, full, bad read-back)")
CHECKPOINT_VERIFICATION_WITHHELD = _kind(
    "checkpoint.verification_withheld", WARNING, JOB, "the agent was too busy to hand the checkpoint coordinator "
    "every job event: a lost vote leaves its step unverified; a lost bad event withholds VERIFIED from its step "
    "on until the job rolls back or is cleared (from_step)", fold_s=60.0)


# ---- the docs' table ------------------------------------------------------------------------------------------
def markdown_table() -> str:
    """The table of event kinds in docs/metrics.md (scripts/gen_event_kinds_doc.py writes it; a test checks
    that the doc holds exactly this)."""
    rows = ["| kind | severity | subject | means | alerts | repeats folded |", "|---|---|---|---|---|---|"]
    for k in members():
        sev = "/".join(s.name.lower() for s in sorted(k.severities, reverse=True))
        if len(k.severities) > 1:
            sev = f"{k.severity.name.lower()} ({sev})"
        subjects = ", ".join(f"`{_SUBJECT_SHAPES[s]}`" for s in k.subjects)
        alerts = ", ".join(f"[{a}](runbooks/{a}.md)" for a in k.alerts) or "-"
        fold = f"{k.fold_s:g}s" if k.fold_s else "-"
        rows.append(f"| `{k.name}` | {sev} | {subjects} | {k.means} | {alerts} | {fold} |")
    return "\n".join(rows) + "\n"


_SUBJECT_SHAPES = {NODE: "node", GPU: "gpu/<uuid>", JOB: "job/<id>", RANK: "job/<id>/rank/<r>",
                   PROBE: "probe/<name>"}
