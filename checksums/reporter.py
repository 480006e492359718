"""The training rank's reporter to the node agent: ReportStep from a background thread.

The Monitor talks to a `StepSink` (below): it submits a plain `StepReport`, takes the agent's
`Directive`s and reads `ReporterStats`; it never sees a protobuf. `StepReporter` is the gRPC `StepSink`:
it turns each report into a `ReportStepRequest` (`to_request`) on its own thread and each directive of a
reply into a plain `Directive`.

Training never waits on the agent. `submit()` puts the report on a bounded queue and returns at once;
when the queue is full the report is dropped and counted. A daemon thread sends each report with a
per-call deadline; a failed call (agent down, slow, restarting) is counted and the report is lost. The
number of reports lost since the last accepted one travels in the next request's `dropped_reports`.
What a lost report said of a GPU is not lost with it: its compute findings (the compute gate's faults and
their outcomes), its in-job canary result and its changed frozen parameters (with the step they changed
at: the Monitor takes their baseline again, so the change is not seen twice) ride on the next report sent
(at most `_CARRIED_FINDINGS` findings are kept meanwhile, the oldest given up first, with a warning).
The agent announces a finding once per (step, detector, suspect) (a frozen change once per step) and counts
a GPU's faulty steps as a set, so a finding sent twice (a call that failed after the agent took it) is
harmless.
The first outage is logged as one WARNING; when the agent answers again one INFO line sums up what was
lost. Nothing here raises into the training thread.

Lifecycle: `StepReporter(target)` -> `submit(report)` per step -> `take_directives()` on the training
thread whenever convenient -> `close(timeout)` at the end (also closed at interpreter exit).

Transport: the channel comes from `sdcwatch.channels.agent_channel` (the rules every client shares): a
unix socket (`unix:/path`, or a bare path) with no credentials; or TCP (`host:port`) with TLS
(`root_cert`: PEM bytes or a file path, else the system roots) and an optional bearer token sent as
`authorization: Bearer <token>`. Plain TCP only with `allow_insecure_tcp=True` and no root_cert (tests).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

import grpc

from checksums.replica_vote import VoteResult
from proto.sdcwatch.v1 import agent_pb2, agent_pb2_grpc
from sdcwatch.channels import agent_channel, agent_target

logger = logging.getLogger(__name__)

# Reconnect quickly to a local agent that restarts; the channel reconnects by itself.
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
)
_OUTAGE_WARN_INTERVAL_S = 300.0
_CANARY_WHY_CHARS = 1000
_COMPUTE_MODE_CHARS = 120
_STAGE_ERROR_CHARS = 200    # the agent's limit on ReportStepRequest.stage_error (daemon/validation.py)
_MAX_COMPUTE = 16          # compute findings per report (each step has at most three)
_CARRIED_FINDINGS = 256    # compute findings of lost reports kept for the next one sent
_MAX_SUSPECTS = 64          # a disagreeing vote's suspects on the wire (`_suspects_sent`)
_MAX_FROZEN_NAMES = 64      # frozen-parameter names on the wire, the last saying how many more changed
_FROZEN_NAME_CHARS = 256    # a name's characters on the wire
_CARRIED_FROZEN = 1_000     # frozen-parameter names of lost reports kept for the next one sent
_STOP = object()


# ---- the Monitor's side: plain values and the protocol -------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryReport:
    """The in-job canary result that rides on a step report."""

    step: int                   # the step the canary ran after
    check: str                  # e.g. "injob/gemm/fp32/..."
    status: str                 # PASS | FAIL | UNKNOWN
    why: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ComputeFinding:
    """A compute-fault suspicion of the compute gate (checksums/compute_gate.py) and its outcome.

    detector: "nonfinite", "stats" (pre-reduction outlier) or "audit" (replay); cause: "transient",
    "persistent", "data", "unresolved" or "diverged" (checksums.replay.Cause); faulty: the ranks named,
    `where` their (rank, host, gpu_uuid) (`one_of`: the fault is on one of them, the replays cannot say which:
    a tensor-parallel group's GPUs); since_step: the earliest step the fault may have touched (an
    audit's: the step after the previous audit of that rank; a step's own check: the step itself)."""

    step: int
    detector: str
    suspect: int
    cause: str
    faulty: tuple[int, ...]
    dropped: bool
    detail: str
    score: float = 0.0
    bucket: int = -1
    stat: str = ""
    where: tuple[tuple[int, str, str], ...] = ()
    since_step: int = 0
    one_of: bool = False       # the fault is on one of the GPUs named, not told apart (a tp group's GPUs)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """One rank's report of one optimizer step (what the Monitor read back for it).

    `fingerprint`: this rank's vote words (empty when the step was not checked); `vote`: the replica
    vote taken at this step, if any (its group is `replica_group`); loss, grad norm and loss scale are
    None when not given.
    """

    job_id: str
    rank: int
    world_size: int
    step: int
    time: float = 0.0
    host: str = ""
    gpu_uuid: str = ""
    replica_group: str = ""
    fingerprint: tuple[int, ...] = ()
    frozen_changed: tuple[str, ...] = ()
    frozen_step: int | None = None  # the step of `frozen_changed` when before `step` (carried), or None
    checks_run: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    step_s: float = 0.0
    check_s: float = 0.0
    vote: VoteResult | None = None
    canary: CanaryReport | None = None
    compute: tuple[ComputeFinding, ...] = ()
    compute_checks: str = ""    # the compute gate's replay mode: "exact", "bounded: why", "" (no gate)
    vote_unavailable: str = ""  # why no replica vote is possible (plain FSDP), or ""
    stage_errors: int = 0       # step-guard stage calls that raised on this rank so far (checks that did not run)
    stage_error: str = ""       # the newest of them, "STAGE at step N: Type: message", or ""


@dataclasses.dataclass(frozen=True, slots=True)
class Directive:
    """What the agent asks the rank to do (its `kind` numbers are the wire's `sdcwatch.v1.Directive.Kind`)."""

    KIND_UNSPECIFIED: ClassVar[int] = 0
    KIND_ROLLBACK: ClassVar[int] = 1        # restore target_step, then skip skip_batches batches
    KIND_SKIP_BATCHES: ClassVar[int] = 2
    KIND_STOP: ClassVar[int] = 3

    kind: int
    target_step: int = 0
    skip_batches: int = 0
    reason: str = ""
    event_seq: int = 0          # the agent event announcing it (0: none): ranks act on each seq once, in order


@dataclasses.dataclass(frozen=True, slots=True)
class ReporterStats:
    sent: int = 0               # reports the agent accepted
    failed: int = 0             # calls that failed
    dropped: int = 0            # never reached the agent (refused by a full queue, or a failed call)
    agent_down: bool = False    # between a failed call and the next successful one
    last_error: str = ""


@runtime_checkable
class StepSink(Protocol):
    """Where the Monitor sends its step reports. Called on the training thread; none of it may block."""

    def submit(self, report: StepReport) -> bool:
        """Take one report (False if it was dropped)."""
        ...

    def take_directives(self) -> list[Directive]:
        """The agent's directives received since the last call, oldest first."""
        ...

    def stats(self) -> ReporterStats:
        ...


def _frozen_step(report: StepReport) -> int:
    """The step `report`'s frozen-parameter change was seen at."""
    return report.step if report.frozen_step is None else report.frozen_step


def _frozen_union(a: tuple[int, tuple[str, ...]] | None,
                  b: tuple[int, tuple[str, ...]] | None) -> tuple[int, tuple[str, ...]]:
    """Two frozen-parameter changes as one: the earlier step (checkpoints from it on are not VERIFIED) and
    the names of both, each once, at most `_CARRIED_FROZEN`. Pure."""
    if a is None or b is None:
        got = a or b
        assert got is not None
        return got
    names = tuple(dict.fromkeys((*a[1], *b[1])))[:_CARRIED_FROZEN]
    return min(a[0], b[0]), names


def _frozen_names(names: tuple[str, ...]) -> list[str]:
    """The changed frozen parameters' names as the wire takes them: at most `_MAX_FROZEN_NAMES`, the last
    one saying how many more there were, each cut to `_FROZEN_NAME_CHARS`. A job whose "frozen" set is
    trained after all changes every tensor of it each step: thousands of names would pass the agent's
    size limit, and it would refuse the whole report (its loss, its vote, the change itself). Pure."""
    if len(names) > _MAX_FROZEN_NAMES:
        more = len(names) - (_MAX_FROZEN_NAMES - 1)
        names = (*names[:_MAX_FROZEN_NAMES - 1], f"... and {more} more")
    return [n[:_FROZEN_NAME_CHARS] for n in names]


def _suspects_sent(suspects: Sequence[Any], host: str) -> list[Any]:
    """A disagreeing vote's suspects as the wire takes them: at most `_MAX_SUSPECTS`, this rank's own node's
    first (its agent keeps evidence on its own GPUs only, and every rank of the group reports the same vote,
    so each node's agent still hears of each of its GPUs), in rank order. A group of hundreds of replicas
    that all disagree (a nondeterministic update) would pass the agent's size limit, and it would refuse
    every rank's report whole. Pure."""
    if len(suspects) <= _MAX_SUSPECTS:
        return list(suspects)
    own = [s for s in suspects if s.host == host]
    chosen = (own + [s for s in suspects if s.host != host])[:_MAX_SUSPECTS]
    return sorted(chosen, key=lambda s: s.rank)


# ---- the gRPC implementation ----------------------------------------------------------------------------


def to_request(report: StepReport) -> agent_pb2.ReportStepRequest:
    """The wire form of `report` (`dropped_reports` is the sender's business)."""
    req = agent_pb2.ReportStepRequest(
        job_id=report.job_id, rank=report.rank, world_size=report.world_size, step=report.step,
        fingerprint=report.fingerprint, replica_group=report.replica_group, host=report.host,
        gpu_uuid=report.gpu_uuid, time=report.time, frozen_changed=_frozen_names(report.frozen_changed),
        checks_run=report.checks_run, compute_checks=report.compute_checks[:_COMPUTE_MODE_CHARS],
        vote_unavailable=report.vote_unavailable[:_COMPUTE_MODE_CHARS], stage_errors=report.stage_errors,
        stage_error=report.stage_error[:_STAGE_ERROR_CHARS])
    if report.frozen_step is not None and report.frozen_changed:
        req.frozen_step = report.frozen_step
    if report.loss is not None:
        req.loss = report.loss
    if report.grad_norm is not None:
        req.grad_norm = report.grad_norm
    if report.loss_scale is not None:
        req.loss_scale = report.loss_scale
    req.timings.step_s = report.step_s
    req.timings.check_s = report.check_s
    if report.canary is not None:
        c = report.canary
        req.canary.status = c.status
        req.canary.check = c.check
        req.canary.why = c.why[:_CANARY_WHY_CHARS]
        req.canary.step = c.step
    for f in report.compute[:_MAX_COMPUTE]:
        pf = req.compute.add(step=f.step, detector=f.detector, suspect=f.suspect, cause=f.cause,
                             dropped=f.dropped, detail=f.detail[:_CANARY_WHY_CHARS], score=f.score,
                             bucket=f.bucket, stat=f.stat, since_step=f.since_step or f.step, one_of=f.one_of)
        for rank, host, uuid in f.where:
            pf.faulty.add(rank=rank, host=host, gpu_uuid=uuid)
    if report.vote is not None:
        r, pv = report.vote, req.vote
        pv.checked = True
        pv.agreed = r.agreed
        pv.replicas = r.replicas
        pv.method = r.method
        pv.step = report.step
        pv.replica_group = report.replica_group
        sent = _suspects_sent(r.suspects, report.host)
        if len(sent) < len(r.suspects):
            pv.suspect_count = len(r.suspects)
        for s in sent:
            pv.suspects.add(rank=s.rank, host=s.host, gpu_uuid=s.gpu_uuid, fingerprint=s.fingerprint)
    return req


def from_wire(d: agent_pb2.Directive) -> Directive:
    return Directive(kind=int(d.kind), target_step=int(d.target_step), skip_batches=int(d.skip_batches),
                     reason=d.reason, event_seq=int(d.event_seq))


class StepReporter:
    """The gRPC `StepSink`: sends each report as a ReportStep request from a daemon thread; see the module
    docstring.

    Counters (read from any thread; `stats()` reads them together): `sent` (accepted by the agent), `failed` (calls that failed),
    `dropped_full` (refused by a full queue), `dropped` (= failed + dropped_full: never reached the agent).
    `agent_down` is True between a failed call and the next successful one.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        queue_size: int = 256,
        deadline_s: float = 0.5,
        root_cert: bytes | str | os.PathLike[str] | None = None,
        token: str | None = None,
        allow_insecure_tcp: bool = False,
        channel_options: Sequence[tuple[str, Any]] = (),
        stub_factory: Callable[[grpc.Channel], Any] = agent_pb2_grpc.AgentStub,
        name: str = "sdcwatch-reporter",
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.target = agent_target(target)
        self.deadline_s = float(deadline_s)
        self._channel = agent_channel(self.target, tls_ca=root_cert, token=token,
                                      insecure=allow_insecure_tcp and root_cert is None,
                                      options=list(_CHANNEL_OPTIONS) + list(channel_options))
        self._stub = stub_factory(self._channel)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._sent = 0
        self._failed = 0
        self._dropped_full = 0
        self._unreported = 0          # lost since the last accepted request: goes in dropped_reports
        # what lost reports said of the GPUs, for the next report sent: compute findings (oldest first)
        # and the newest in-job canary result
        self._carried: list[ComputeFinding] = []
        self._carried_canary: CanaryReport | None = None
        self._carried_frozen: tuple[int, tuple[str, ...]] | None = None   # (the earliest step, the names)
        self._carry_overflow_said = False
        self._down = False
        self._outage_lost_at_start = 0
        self._outage_started = 0.0
        self._last_warned = -_OUTAGE_WARN_INTERVAL_S
        self._outage_warned = False
        self._directives: list[Directive] = []
        self._last_directives: tuple[Directive, ...] = ()
        self._last_error = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- training thread -------------------------------------------------------------------------

    def submit(self, report: StepReport) -> bool:
        """Queue `report` for sending; never blocks. False if it was dropped (queue full or closed)."""
        if self._closed:
            with self._lock:
                self._dropped_full += 1
                self._unreported += 1
                self._carry(report)
            return False
        try:
            self._queue.put_nowait(report)
            return True
        except queue.Full:
            with self._lock:
                self._dropped_full += 1
                self._unreported += 1
                self._carry(report)
            return False

    def _carry(self, report: StepReport, taken: int | None = None) -> None:
        """Keep what a lost `report` said of the GPUs for the next report sent (under the lock). `taken`
        (a failed send): its first `taken` findings were carried already (`_with_carried`; older than any
        carried now): they go back in front, its own at the end (the carried ones stay ahead of those
        found after them); and its canary result only where no newer one waits."""
        if report.canary is not None and (taken is None or self._carried_canary is None):
            self._carried_canary = report.canary
        if report.frozen_changed:
            self._carried_frozen = _frozen_union(
                self._carried_frozen, (_frozen_step(report), report.frozen_changed))
        taken = taken or 0
        self._carried[:0] = report.compute[:taken]
        self._carried.extend(report.compute[taken:])
        over = len(self._carried) - _CARRIED_FINDINGS
        if over > 0:
            del self._carried[:over]
            if not self._carry_overflow_said:
                self._carry_overflow_said = True
                logger.warning("sdcwatch reporter: more than %d compute findings waited for the agent; the "
                               "oldest were given up (said once)", _CARRIED_FINDINGS)

    def _with_carried(self, report: StepReport) -> tuple[StepReport, int]:
        """`report` with the findings and canary result of lost reports before its own, and how many
        findings it took (under the lock; what does not fit in one request stays carried for the next)."""
        if not self._carried and self._carried_canary is None and self._carried_frozen is None:
            return report, 0
        take = self._carried[:max(_MAX_COMPUTE - len(report.compute), 0)]
        del self._carried[:len(take)]
        canary = report.canary
        if canary is None:
            canary, self._carried_canary = self._carried_canary, None
        frozen_step, frozen = report.frozen_step, report.frozen_changed
        if self._carried_frozen is not None:
            own = (_frozen_step(report), frozen) if frozen else None
            frozen_step, frozen = _frozen_union(self._carried_frozen, own)
            self._carried_frozen = None
        return dataclasses.replace(report, compute=(*take, *report.compute), canary=canary,
                                   frozen_step=frozen_step, frozen_changed=frozen), len(take)

    def take_directives(self) -> list[Directive]:
        """The directives received since the last call (oldest first), and forget them."""
        with self._lock:
            if not self._directives:
                return []
            out, self._directives = self._directives, []
            return out

    @property
    def last_directives(self) -> tuple[Directive, ...]:
        """The directives of the most recent reply that carried any."""
        with self._lock:
            return self._last_directives

    @property
    def sent(self) -> int:
        with self._lock:
            return self._sent

    @property
    def failed(self) -> int:
        with self._lock:
            return self._failed

    @property
    def dropped_full(self) -> int:
        with self._lock:
            return self._dropped_full

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped_full + self._failed

    def stats(self) -> ReporterStats:
        """The counters below, read together."""
        with self._lock:
            return ReporterStats(sent=self._sent, failed=self._failed, dropped=self._dropped_full + self._failed,
                                 agent_down=self._down, last_error=self._last_error)

    @property
    def agent_down(self) -> bool:
        with self._lock:
            return self._down

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._last_error

    def pending(self) -> int:
        """Requests waiting in the queue."""
        return self._queue.qsize()

    def flush(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) until the queue is empty and the last call returned. Not for the step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return self._queue.unfinished_tasks == 0

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout` s), stop the thread and close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            self._queue.put(_STOP, timeout=max(0.0, timeout))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("sdcwatch reporter: %d report(s) not sent at close (agent %s)",
                           self._queue.qsize(), self.target)
        try:
            self._channel.close()
        except Exception:  # closing must not raise at shutdown
            logger.debug("sdcwatch reporter: channel close failed", exc_info=True)

    def __enter__(self) -> "StepReporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reporter thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._send(item)
            except Exception:  # never let the thread die: log and carry on
                logger.exception("sdcwatch reporter: unexpected error while sending a report")
            finally:
                self._queue.task_done()

    def _send(self, report: StepReport) -> None:
        with self._lock:
            carried = self._unreported
            report, taken = self._with_carried(report)
        request = to_request(report)
        request.dropped_reports = carried
        try:
            reply = self._stub.ReportStep(request, timeout=self.deadline_s)
        except grpc.RpcError as err:
            # a request the agent refused as invalid would be refused again with whatever rides on it: its
            # findings are not carried (the refusal is counted and logged like any failed call)
            if getattr(err, "code", lambda: None)() != grpc.StatusCode.INVALID_ARGUMENT:
                with self._lock:
                    self._carry(report, taken)
            self._on_failure(err)
            return
        now = time.monotonic()
        with self._lock:
            self._sent += 1
            self._unreported -= carried
            was_down = self._down
            self._down = False
            lost = self._failed + self._dropped_full - self._outage_lost_at_start
            if reply.directives:
                self._last_directives = tuple(from_wire(d) for d in reply.directives)
                self._directives.extend(self._last_directives)
        if was_down and self._outage_warned:
            logger.info("sdcwatch agent at %s answers again after %.1f s: %d report(s) lost meanwhile",
                        self.target, now - self._outage_started, lost)

    def _on_failure(self, err: grpc.RpcError) -> None:
        code = err.code() if hasattr(err, "code") else None
        detail = err.details() if hasattr(err, "details") else str(err)
        now = time.monotonic()
        with self._lock:
            self._failed += 1
            self._unreported += 1
            self._last_error = f"{getattr(code, 'name', code)}: {detail}"
            starting = not self._down
            if starting:
                self._down = True
                self._outage_started = now
                self._outage_lost_at_start = self._failed + self._dropped_full - 1
            warn = starting and now - self._last_warned >= _OUTAGE_WARN_INTERVAL_S
            if warn:
                self._last_warned = now
            if starting:
                self._outage_warned = warn
        if warn:
            logger.warning(
                "sdcwatch agent at %s is slow or down (%s); training continues, step reports are "
                "dropped and counted until it answers", self.target, self._last_error)
