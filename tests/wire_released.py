"""The released wire (proto/released/sdcwatch-X.Y.Z.binpb) as Python classes and gRPC stubs, for the
compatibility tests (not a test module).

Why built from the committed descriptor set, not from copied `*_pb2.py` files: the snapshot is the one
record of what was released (scripts/proto_compat.py checks against the same file), and its classes live in
a private DescriptorPool, so they load beside today's generated stubs in one process (same file and
message names, different definitions) without renaming anything. The classes are what protoc's Python
output builds at import time from the same serialized descriptors; the stubs are what `*_pb2_grpc.py` does
(channel.unary_unary & co. with SerializeToString / FromString, on the method path /package.Service/Rpc).

`PreviousAgent` is a stand-in for the released agent: a grpc server speaking only the released messages,
for the calls a training rank and `sdcwatch status` make. Its replies fill every field the released wire
has, so the new clients parse all of them. It checks the wire, not the old agent's behaviour (docs/wire-compat.md
says why the released agent's code itself is not run).
"""
from __future__ import annotations

import functools
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from checkpoint.records import (LATEST, LATEST_VERIFIED, BeginResult, CheckpointInfo, CommitResult, Copy,
                                RestorePlan, RestoreReportMsg, SaveReport, ShardPlan)
from checkpoint.manifest import ShardManifest

ROOT = Path(__file__).resolve().parent.parent
RELEASED_DIR = ROOT / "proto" / "released"
PACKAGE = "sdcwatch.v1"


class ReleasedWire:
    """Message classes and stubs of one released FileDescriptorSet, in a pool of their own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fds = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
        self.pool = descriptor_pool.DescriptorPool()
        for f in fds.file:  # --include_imports writes dependencies first
            self.pool.Add(f)
        self.classes: dict[str, type[Message]] = message_factory.GetMessages(list(fds.file), pool=self.pool)

    def __getattr__(self, name: str) -> type[Message]:
        """`wire.ReportStepRequest` -> the released class of sdcwatch.v1.ReportStepRequest."""
        try:
            return self.classes[f"{PACKAGE}.{name}"]
        except KeyError:
            raise AttributeError(f"{name} is not a message of the released {PACKAGE}") from None

    def enum_value(self, enum: str, name: str) -> int:
        """The number of a released enum value: enum_value("Directive.Kind", "KIND_ROLLBACK")."""
        return self.pool.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_name[name].number

    def stub(self, channel: grpc.Channel, service: str) -> Any:
        """A client of `service` ("Agent", "Checkpoints", ...): one callable attribute per RPC."""
        desc = self.pool.FindServiceByName(f"{PACKAGE}.{service}")
        calls = {}
        for m in desc.methods:
            make = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
                (m.client_streaming, m.server_streaming)]
            calls[m.name] = make(f"/{desc.full_name}/{m.name}",
                                 request_serializer=self.classes[m.input_type.full_name].SerializeToString,
                                 response_deserializer=self.classes[m.output_type.full_name].FromString)
        return type(f"Released{service}Stub", (), calls)()

    def handler(self, service: str, impl: dict[str, Callable[[Any, grpc.ServicerContext], Any]]
                ) -> grpc.GenericRpcHandler:
        """A server-side handler of the RPCs named in `impl`, on released messages."""
        desc = self.pool.FindServiceByName(f"{PACKAGE}.{service}")
        handlers = {}
        for m in desc.methods:
            if m.name not in impl:
                continue
            make = {(False, False): grpc.unary_unary_rpc_method_handler,
                    (False, True): grpc.unary_stream_rpc_method_handler,
                    (True, False): grpc.stream_unary_rpc_method_handler,
                    (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
            handlers[m.name] = make(impl[m.name],
                                    request_deserializer=self.classes[m.input_type.full_name].FromString,
                                    response_serializer=self.classes[m.output_type.full_name].SerializeToString)
        return grpc.method_handlers_generic_handler(desc.full_name, handlers)


@functools.cache
def released_wire() -> ReleasedWire:
    """The newest released wire (by version in the file name)."""
    found = sorted(RELEASED_DIR.glob("sdcwatch-*.binpb"),
                   key=lambda p: tuple(int(x) for x in p.name[len("sdcwatch-"):-len(".binpb")].split(".")))
    assert found, f"no released snapshot in {RELEASED_DIR}: the wire-compat tests need one"
    return ReleasedWire(found[-1])


def unknown_enum_values(msg: Message, where: str = "") -> list[str]:
    """Every enum field in `msg` (recursively) holding a number its released enum does not name.

    A released reader keeps such a number, but its code calls `Enum.Name()` on it (checkpoint states,
    directive kinds) and fails: a peer must never send a value the other side's release lacks."""
    bad: list[str] = []
    for field, value in msg.ListFields():
        path = f"{where}.{field.name}" if where else field.name
        values = list(enumerate(value)) if field.is_repeated else [(None, value)]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            values = list(value.items()) if field.message_type.fields_by_name["value"].message_type else []
        for i, v in values:
            at = path if i is None else f"{path}[{i!r}]"
            if field.enum_type is not None and v not in field.enum_type.values_by_number:
                bad.append(f"{at} = {v} ({field.enum_type.full_name})")
            elif isinstance(v, Message):
                bad.extend(unknown_enum_values(v, at))
    return bad


def unset_fields(msg: Message, where: str = "") -> list[str]:
    """Fields of `msg`'s type left at their default (recursively, first element of lists; a oneof counts as
    set when one member is): a reply meant to exercise every released field must return []."""
    out: list[str] = []
    for field in msg.DESCRIPTOR.fields:
        path = f"{where}.{field.name}" if where else field.name
        oneof = field.containing_oneof
        if oneof is not None and msg.WhichOneof(oneof.name) not in (None, field.name):
            continue
        value = getattr(msg, field.name)
        if field.is_repeated:
            if len(value) == 0:
                out.append(path)
            elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
                out.extend(unset_fields(value[0], f"{path}[0]"))
        elif field.message_type is not None:
            if msg.HasField(field.name):
                out.extend(unset_fields(value, path) if field.message_type.full_name.startswith(PACKAGE) else [])
            else:
                out.append(path)
        elif value == field.default_value:
            out.append(path)
    return out


# ---- the released client side: the 0.1.0 checkpoint link, on released messages --------------------------


def _state_name(wire: ReleasedWire, v: int) -> str:
    return wire.pool.FindEnumTypeByName(f"{PACKAGE}.CheckpointState").values_by_number[v].name.removeprefix(
        "CHECKPOINT_STATE_")


def _copies(copies: Any) -> tuple[Copy, ...]:
    return tuple(Copy(c.rank, c.node, c.location, c.tier or "memory") for c in copies)


class ReleasedCheckpointLink:
    """What the 0.1.0 rank library's gRPC link sends and reads, built on the released messages: the link a
    `CheckpointClient` of a job started before the agent's upgrade still uses."""

    def __init__(self, channel: grpc.Channel, deadline_s: float = 10.0) -> None:
        self.wire = released_wire()
        self.stub = self.wire.stub(channel, "Checkpoints")
        self.deadline_s = deadline_s
        self.replies: list[Message] = []   # every reply, for the tests to inspect

    def _call(self, rpc: str, request: Message) -> Any:
        reply = getattr(self.stub, rpc)(request, timeout=self.deadline_s)
        self.replies.append(reply)
        return reply

    def _info(self, i: Any) -> CheckpointInfo:
        return CheckpointInfo(i.job_id, i.step, _state_name(self.wire, i.state), i.world_size, i.shards, i.bytes,
                              i.begun_at, i.committed_at, i.verified_at, i.reason, _copies(i.copies))

    def begin(self, job_id: str, step: int, rank: int, world_size: int) -> BeginResult:
        r = self._call("Begin", self.wire.BeginRequest(job_id=job_id, step=step, rank=rank,
                                                       world_size=world_size))
        return BeginResult(_state_name(self.wire, r.state), r.node, r.location, r.blob_key)

    def commit_shard(self, job_id: str, step: int, rank: int, world_size: int, manifest_json: str, *,
                     report: SaveReport | None = None) -> CommitResult:
        req = self.wire.CommitShardRequest(job_id=job_id, step=step, rank=rank, world_size=world_size,
                                           manifest_json=manifest_json)
        if report is not None:
            req.blocking_seconds, req.safe_seconds = report.blocking_s, report.safe_s
            req.stall_seconds = report.stall_s
            req.skipped_saves, req.staging = report.skipped_saves, report.staging
        r = self._call("CommitShard", req)
        return CommitResult(_state_name(self.wire, r.state), r.committed, r.shards)

    def report_restore(self, r: RestoreReportMsg) -> None:
        self._call("ReportRestore", self.wire.ReportRestoreRequest(
            job_id=r.job_id, step=r.step, rank=r.rank, seconds=r.seconds, bytes=r.nbytes, chunks=r.chunks,
            fallbacks=r.fallbacks, checksum_failures=r.checksum_failures, ok=r.ok, error=r.error,
            source=r.source))

    def list(self, job_id: str = "") -> list[CheckpointInfo]:
        r = self._call("List", self.wire.ListCheckpointsRequest(job_id=job_id))
        return [self._info(i) for i in r.checkpoints]

    def latest_verified(self, job_id: str) -> CheckpointInfo | None:
        r = self._call("LatestVerified", self.wire.LatestRequest(job_id=job_id))
        return self._info(r.checkpoint) if r.found else None

    def latest(self, job_id: str) -> CheckpointInfo | None:
        r = self._call("Latest", self.wire.LatestRequest(job_id=job_id))
        return self._info(r.checkpoint) if r.found else None

    def restore_plan(self, job_id: str, target: int | str, rank: int | None = None) -> RestorePlan:
        req = self.wire.RestorePlanRequest(job_id=job_id, rank=-1 if rank is None else rank)
        if target in (LATEST, LATEST_VERIFIED):
            req.selector = self.wire.enum_value("RestoreSelector", f"RESTORE_SELECTOR_{str(target).upper()}")
        else:
            req.step = int(target)
        r = self._call("RestorePlan", req)
        return RestorePlan(self._info(r.checkpoint), tuple(
            ShardPlan(s.rank, ShardManifest.from_json(s.manifest_json), _copies(s.copies)) for s in r.shards))


# ---- the released agent side: a stand-in server on released messages ---------------------------------------


class PreviousAgent:
    """A grpc server on `target` that speaks only the released wire, for the calls the new rank library,
    CLI and peer agents make: Agent.GetStatus / ReportStep / WatchEvents, Checkpoints.Begin / CommitShard /
    List / Latest / LatestVerified / RestorePlan / ReportRestore, and the whole PeerStore (its blobs in a
    dict). One node; shards go to `memory_dir` (its memory tier).

    Every request is kept (as released messages) in `requests[rpc]`; replies fill every released field."""

    NODE = "node-old"

    def __init__(self, target: str, memory_dir: Path) -> None:
        self.wire = released_wire()
        self.target = target
        self.memory_dir = memory_dir
        self.requests: dict[str, list[Message]] = {}
        self.directive_from_step: int | None = None   # reply with a rollback directive from this step on
        self._lock = threading.Lock()
        self._manifests: dict[tuple[str, int], dict[int, str]] = {}
        self._world: dict[tuple[str, int], int] = {}
        self.blobs: dict[str, bytes] = {}   # the PeerStore's memory tier
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        w = self.wire
        agent = {"GetStatus": self.get_status, "ReportStep": self.report_step, "WatchEvents": self.watch_events}
        checkpoints = {"Begin": self.begin, "CommitShard": self.commit_shard, "List": self.list,
                       "Latest": self.latest, "LatestVerified": self.latest, "RestorePlan": self.restore_plan,
                       "ReportRestore": self.report_restore}
        self._server.add_generic_rpc_handlers((
            w.handler("Agent", {rpc: self._kept(rpc, fn) for rpc, fn in agent.items()}),
            w.handler("Checkpoints", {rpc: self._kept(rpc, fn) for rpc, fn in checkpoints.items()}),
            w.handler("PeerStore", {"PutBlob": self.put_blob, "GetBlob": self._kept("GetBlob", self.get_blob),
                                    "StatBlob": self._kept("StatBlob", self.stat_blob),
                                    "ListBlobs": self._kept("ListBlobs", self.list_blobs),
                                    "DeleteBlob": self._kept("DeleteBlob", self.delete_blob)}),
        ))

    def start(self) -> "PreviousAgent":
        self.memory_dir.mkdir(parents=True, exist_ok=True)
        self._server.add_insecure_port(self.target)
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0).wait(10)

    def __enter__(self) -> "PreviousAgent":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _kept(self, rpc: str, fn: Callable[[Any, grpc.ServicerContext], Any]
              ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            with self._lock:
                self.requests.setdefault(rpc, []).append(request)
            return fn(request, context)
        return handle

    # -- Agent --------------------------------------------------------------------------------------------

    def get_status(self, request: Any, context: grpc.ServicerContext) -> Any:
        w = self.wire
        st = w.GetStatusResponse(
            node_state=w.enum_value("State", "STATE_SUSPECT"), node_reason="1 GPU SUSPECT", hostname=self.NODE,
            nvml_available=True, nvml_reason="read through libnvidia-ml.so.1",
            versions={"sdcwatch": "0.1.0", "driver": "550.54"},
            started_at=1_700_000_000.0, uptime_s=42.5, last_event_seq=7, ready=True)
        gpu = st.gpus.add(uuid="GPU-0a", pci_bus_id="0000:01:00.0", name="NVIDIA H200", index=3,
                          state=w.enum_value("State", "STATE_SUSPECT"), reason="replica mismatch",
                          unsupported_fields=["clocks.throttle"], state_since=1_700_000_010.0)
        gpu.evidence.add(source="replica_vote", signal="replica.mismatch", value="step 9",
                         implies=w.enum_value("State", "STATE_SUSPECT"), reason="minority fingerprint",
                         time=1_700_000_010.0, count=2)
        st.probes.add(name="nvml", state=w.enum_value("ProbeState", "PROBE_STATE_HUNG"), last_run=1_700_000_020.0,
                      last_duration_s=0.5, last_error="nvmlDeviceGetPowerUsage timed out", runs=10, failures=1)
        st.jobs.add(job_id="job-old", ranks=[0, 1], last_step=9, last_report=1_700_000_030.0, steps_seen=9,
                    dropped_reports=1, state=w.enum_value("State", "STATE_HEALTHY"), reason="reports on time")
        st.checkpoints.add(job_id="job-old", count=2, latest_step=8, latest_verified_step=4,
                           latest_verified_at=1_700_000_025.0, bytes=4096, latest_state="COMMITTED")
        return st

    def report_step(self, request: Any, context: grpc.ServicerContext) -> Any:
        w = self.wire
        reply = w.ReportStepResponse(accepted=True)
        if self.directive_from_step is not None and request.step >= self.directive_from_step:
            reply.directives.add(kind=w.enum_value("Directive.Kind", "KIND_ROLLBACK"), target_step=4,
                                 skip_batches=3, reason="loss nonfinite from step 6", event_seq=77)
        return reply

    def watch_events(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        w = self.wire
        for seq, (kind, sev, subject) in enumerate([("agent.started", "SEVERITY_INFO", "node"),
                                                    ("gpu.state", "SEVERITY_WARNING", "gpu/GPU-0a"),
                                                    ("loss.nonfinite", "SEVERITY_CRITICAL", "job/job-old")], 1):
            if seq <= request.since_seq:
                continue
            ev = w.Event(seq=seq, time=1_700_000_000.0 + seq, kind=kind, severity=w.enum_value("Severity", sev),
                         subject=subject, message=f"{kind} on {subject}")
            ev.details.update({"seq": seq, "subject": subject, "nested": {"ok": True}})
            yield ev

    # -- Checkpoints --------------------------------------------------------------------------------------

    def _state(self, name: str) -> int:
        return self.wire.enum_value("CheckpointState", f"CHECKPOINT_STATE_{name}")

    def begin(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self._world[(request.job_id, request.step)] = request.world_size
            self._manifests.setdefault((request.job_id, request.step), {})
        key = f"{request.job_id}/{request.step:012d}/rank-{request.rank:05d}.bin"   # the 0.1.0 blob key
        return self.wire.BeginResponse(state=self._state("PENDING"), node=self.NODE,
                                       location=str(self.memory_dir), blob_key=key)

    def commit_shard(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.manifest_json:   # as the released agent: a commit without its manifest is refused
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "manifest_json is empty")
        key = (request.job_id, request.step)
        with self._lock:
            shards = self._manifests.setdefault(key, {})
            shards[request.rank] = request.manifest_json
            done = len(shards) == self._world.get(key, request.world_size)
        return self.wire.CommitShardResponse(state=self._state("COMMITTED" if done else "PENDING"),
                                             committed=done, shards=len(shards))

    def _info(self, job: str, step: int) -> Any:
        w = self.wire
        shards = self._manifests[(job, step)]
        nbytes = sum(ShardManifest.from_json(m).nbytes for m in shards.values())
        info = w.CheckpointInfo(job_id=job, step=step, state=self._state("VERIFIED"),
                                world_size=self._world[(job, step)],
                                shards=len(shards), bytes=nbytes, begun_at=1_700_000_000.0,
                                committed_at=1_700_000_001.0, verified_at=1_700_000_002.0, reason="vote agreed",
                                tiers=["memory"])
        for rank in sorted(shards):
            info.copies.add(rank=rank, node=self.NODE, location=str(self.memory_dir), tier="memory")
        return info

    def _steps(self, job: str) -> list[int]:
        return sorted(s for (j, s), m in self._manifests.items() if j == job and len(m) == self._world[(j, s)])

    def list(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            return self.wire.ListCheckpointsResponse(checkpoints=[self._info(request.job_id, s)
                                                                  for s in self._steps(request.job_id)])

    def latest(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            steps = self._steps(request.job_id)
            if not steps:
                return self.wire.LatestResponse(found=False)
            # every complete checkpoint here is VERIFIED: Latest and LatestVerified answer alike
            return self.wire.LatestResponse(found=True, checkpoint=self._info(request.job_id, steps[-1]))

    def restore_plan(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            steps = self._steps(request.job_id)
            step = request.step if request.WhichOneof("target") == "step" else (steps[-1] if steps else None)
            if step not in steps:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint of {request.job_id} at step {step}")
            plan = self.wire.RestorePlanResponse(checkpoint=self._info(request.job_id, step))
            for rank, manifest in sorted(self._manifests[(request.job_id, step)].items()):
                if request.rank in (-1, rank):
                    shard = plan.shards.add(rank=rank, manifest_json=manifest)
                    shard.copies.add(rank=rank, node=self.NODE, location=str(self.memory_dir), tier="memory")
            return plan

    def report_restore(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.wire.ReportRestoreResponse()


    # -- PeerStore ----------------------------------------------------------------------------------------

    def put_blob(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        key, total, data, finished = "", 0, bytearray(), False
        for i, r in enumerate(requests):
            with self._lock:
                self.requests.setdefault("PutBlob", []).append(r)
            if i == 0:
                key, total = r.key, r.total_bytes
            data += r.data
            finished = r.finish
        if not finished or (total and len(data) != total):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unfinished blob {key!r}")
        with self._lock:
            self.blobs[key] = bytes(data)
        return self.wire.PutBlobResponse(bytes=len(data))

    def get_blob(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with self._lock:
            blob = self.blobs.get(request.key)
        if blob is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no blob {request.key!r}")
        end = len(blob) if request.to_end else min(len(blob), request.offset + request.length)
        step = request.chunk_bytes or 4096
        for i, off in enumerate(range(request.offset, end, step)):
            yield self.wire.BlobChunk(offset=off, data=blob[off:min(end, off + step)],
                                      blob_bytes=len(blob) if i == 0 else 0)

    def stat_blob(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            blob = self.blobs.get(request.key)
        return self.wire.StatBlobResponse(exists=blob is not None, size=len(blob or b""))

    def list_blobs(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            return self.wire.ListBlobsResponse(keys=sorted(k for k in self.blobs if k.startswith(request.prefix)))

    def delete_blob(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            return self.wire.DeleteBlobResponse(deleted=self.blobs.pop(request.key, None) is not None)
