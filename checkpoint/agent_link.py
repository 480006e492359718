"""`GrpcAgentLink`: the agent's `sdcwatch.v1.Checkpoints` service as plain calls and checkpoint records.

Torch-free: the rank's `CheckpointClient` (checkpoint.client) talks through it, and so does
`sdcwatch ckpt restore`, which fetches verified shards without loading torch. Every call carries a
deadline; gRPC errors become checkpoint errors (UNAVAILABLE / DEADLINE_EXCEEDED -> AgentUnavailableError).
"""
from __future__ import annotations

from typing import Any, Callable

import grpc

from checkpoint.errors import (UNKNOWN_LAYOUT, AgentUnavailableError, CommitError, CorruptCheckpointError,
                               InvalidInputError, NotInMemoryError, UnknownCheckpointError)
from checkpoint.manifest import ShardManifest
from checkpoint.records import (LATEST, LATEST_VERIFIED, BeginResult, CheckpointInfo, CommitResult, Copy,
                                Restored, RestorePlan, RestoreReportMsg, SaveReport, ShardPlan)
from proto.sdcwatch.v1 import checkpoint_pb2 as pb
from proto.sdcwatch.v1 import checkpoint_pb2_grpc as pb_grpc
from sdcwatch.channels import agent_channel


def _state(v: int) -> str:
    return pb.CheckpointState.Name(v).removeprefix("CHECKPOINT_STATE_")


def _checkpoint_error(e: grpc.RpcError) -> Exception:
    """The checkpoint error a failed call raises (UNAVAILABLE / DEADLINE_EXCEEDED -> AgentUnavailableError)."""
    code, details = e.code(), e.details()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return AgentUnavailableError(f"sdcwatch agent unavailable ({code.name}): {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidInputError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        if "not in memory" in details or "no record" in details:
            return NotInMemoryError(details)
        return UnknownCheckpointError(details)
    if code == grpc.StatusCode.DATA_LOSS:
        return CorruptCheckpointError(details)
    return CommitError(f"{code.name}: {details}")


def _put_report(req: Any, report: SaveReport | None) -> None:
    """A commit request's fields on how the save went (for metrics; all optional)."""
    if report is not None:
        req.blocking_seconds, req.safe_seconds = report.blocking_s, report.safe_s
        req.stall_seconds, req.skipped_saves, req.staging = report.stall_s, report.skipped_saves, report.staging


def _info(i: Any) -> CheckpointInfo:
    return CheckpointInfo(i.job_id, i.step, _state(i.state), i.world_size, i.shards, i.bytes, i.begun_at,
                          i.committed_at, i.verified_at, i.reason,
                          tuple(Copy(c.rank, c.node, c.location, c.tier or "memory") for c in i.copies),
                          i.vouched_by)


class GrpcAgentLink:
    """The Checkpoints service over a grpc channel, each call with `deadline_s`; errors become
    checkpoint errors (UNAVAILABLE / DEADLINE_EXCEEDED -> AgentUnavailableError)."""

    def __init__(self, channel: grpc.Channel, deadline_s: float = 5.0) -> None:
        self.pb = pb
        self.stub = pb_grpc.CheckpointsStub(channel)
        self.channel = channel
        self.deadline_s = deadline_s
        self._layouts_sent: set[str] = set()   # the shard layouts this agent has been sent (commit_words)
        self._words_ok = True                   # False: the agent predates layout_id (manifest JSON sent)

    @classmethod
    def connect(cls, target: str | None = None, deadline_s: float = 5.0, *, tls_ca: bytes | str | None = None,
                tls_server_name: str | None = None, token: str | None = None,
                insecure: bool = False) -> "GrpcAgentLink":
        """`target`: a socket path, a grpc target, or None for the default socket; TCP takes TLS and a token
        under the rules every client shares (sdcwatch.channels.agent_channel)."""
        return cls(agent_channel(target, tls_ca=tls_ca, tls_server_name=tls_server_name, token=token,
                                 insecure=insecure), deadline_s)

    def _rpc(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return method(request, timeout=self.deadline_s)
        except grpc.RpcError as e:
            raise _checkpoint_error(e) from None

    def begin(self, job_id: str, step: int, rank: int, world_size: int, *,
              restored: Restored | None = None) -> BeginResult:
        """`restored`: the rank's last restore into its training state (the agent cuts the history there)."""
        req = self.pb.BeginRequest(job_id=job_id, step=step, rank=rank, world_size=world_size)
        if restored is not None:
            req.restored_step, req.restored_at = restored.step, restored.at
        r = self._rpc(self.stub.Begin, req)
        return BeginResult(_state(r.state), r.node, r.location, r.blob_key)

    def commit_shard(self, job_id: str, step: int, rank: int, world_size: int, manifest_json: str, *,
                     report: SaveReport | None = None) -> CommitResult:
        req = self.pb.CommitShardRequest(job_id=job_id, step=step, rank=rank, world_size=world_size,
                                         manifest_json=manifest_json)
        _put_report(req, report)
        r = self._rpc(self.stub.CommitShard, req)
        return CommitResult(_state(r.state), r.committed, r.shards)

    def commit_words(self, job_id: str, step: int, rank: int, world_size: int, layout: Any, words: Any,
                     created: float, *, blob: str, report: SaveReport | None = None) -> CommitResult:
        """`commit_shard` of a source-checksummed shard as its layout (checkpoint.shard_layout.ShardLayout)
        and its pieces' words: the agent renders the manifest. The layout's JSON goes with its first commit
        to this agent, and again when the agent does not know it (restarted); an agent from before this
        field gets the manifest rendered here, as before."""
        if not self._words_ok:
            return self.commit_shard(job_id, step, rank, world_size, layout.render(step, blob, words, created),
                                     report=report)
        req = self.pb.CommitShardRequest(job_id=job_id, step=step, rank=rank, world_size=world_size,
                                         layout_id=layout.id, piece_words=layout.words_to_bytes(words),
                                         created=created)
        _put_report(req, report)
        for attempt in range(2):
            if layout.id not in self._layouts_sent:
                req.layout_json = layout.json
            try:
                r = self.stub.CommitShard(req, timeout=self.deadline_s)
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if code == grpc.StatusCode.FAILED_PRECONDITION and UNKNOWN_LAYOUT in details and attempt == 0:
                    self._layouts_sent.discard(layout.id)   # the agent restarted: the layout once more
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT and "manifest_json is empty" in details:
                    self._words_ok = False                  # an agent from before layout_id
                    return self.commit_words(job_id, step, rank, world_size, layout, words, created,
                                             blob=blob, report=report)
                raise _checkpoint_error(e) from None
            self._layouts_sent.add(layout.id)
            return CommitResult(_state(r.state), r.committed, r.shards)
        raise CommitError(f"the agent does not keep shard layout {layout.id[:12]}")

    def report_restore(self, r: RestoreReportMsg) -> None:
        self._rpc(self.stub.ReportRestore, self.pb.ReportRestoreRequest(
            job_id=r.job_id, step=r.step, rank=r.rank, seconds=r.seconds, bytes=r.nbytes, chunks=r.chunks,
            fallbacks=r.fallbacks, checksum_failures=r.checksum_failures, ok=r.ok, error=r.error[:2000],
            source=r.source[:200]))

    def list(self, job_id: str = "") -> list[CheckpointInfo]:
        """Checkpoints of `job_id`, or of every job the agent knows when it is empty."""
        r = self._rpc(self.stub.List, self.pb.ListCheckpointsRequest(job_id=job_id))
        return [_info(i) for i in r.checkpoints]

    def latest(self, job_id: str) -> CheckpointInfo | None:
        r = self._rpc(self.stub.Latest, self.pb.LatestRequest(job_id=job_id))
        return _info(r.checkpoint) if r.found else None

    def latest_verified(self, job_id: str) -> CheckpointInfo | None:
        r = self._rpc(self.stub.LatestVerified, self.pb.LatestRequest(job_id=job_id))
        return _info(r.checkpoint) if r.found else None

    def restore_plan(self, job_id: str, target: int | str, rank: int | None = None) -> RestorePlan:
        pb = self.pb
        req = pb.RestorePlanRequest(job_id=job_id, rank=-1 if rank is None else rank)
        if target == LATEST:
            req.selector = pb.RESTORE_SELECTOR_LATEST
        elif target == LATEST_VERIFIED:
            req.selector = pb.RESTORE_SELECTOR_LATEST_VERIFIED
        elif isinstance(target, int) and not isinstance(target, bool):
            req.step = target
        else:
            raise InvalidInputError(f"restore target must be a step, {LATEST!r} or {LATEST_VERIFIED!r}, got {target!r}")
        r = self._rpc(self.stub.RestorePlan, req)
        return RestorePlan(_info(r.checkpoint), tuple(
            ShardPlan(s.rank, ShardManifest.from_json(s.manifest_json),
                      tuple(Copy(c.rank, c.node, c.location, c.tier or "memory") for c in s.copies))
            for s in r.shards))

    def close(self) -> None:
        self.channel.close()
