"""The `sdcwatch.v1.Agent` gRPC service. Thin: validates, then asks the agent core (`AgentApi`, the few
calls it needs; daemon/agent.py's Agent is the one in production, a test may pass its own)."""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Protocol

import grpc
from google.protobuf import struct_pb2

from daemon import validation
from daemon.events import Event, JournalReadTimeout, TooManyWatchers, WatchAhead
from sdcwatch import event_kinds as ek
from sdcwatch.types import State
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_PROBE_STATES = {"PENDING": pb.PROBE_STATE_PENDING, "OK": pb.PROBE_STATE_OK, "FAILING": pb.PROBE_STATE_FAILING,
                 "HUNG": pb.PROBE_STATE_HUNG, "DISABLED": pb.PROBE_STATE_DISABLED}


def event_to_pb(event: Event) -> pb.Event:
    details = struct_pb2.Struct()
    try:
        details.update(_jsonable(event.details))
    except (ValueError, TypeError):
        details.update({"repr": repr(event.details)})
    return pb.Event(seq=event.seq, time=event.time, kind=event.kind, severity=int(event.severity),
                    subject=event.subject, message=event.message, details=details)


def _jsonable(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value) if isinstance(value, float) or abs(value) < 2**53 else str(value)
    return str(value)


_SKIPPED = ek.EVENTS_SKIPPED.name

# The usual reply, built once: gRPC only serializes it, and nothing writes to it.
_ACCEPTED = pb.ReportStepResponse(accepted=True)


class AgentApi(Protocol):
    def status_pb(self) -> pb.GetStatusResponse: ...

    def watch(self, since_seq: int, follow: bool) -> AsyncIterator[Event]: ...

    def handle_report(self, req: pb.ReportStepRequest, now: float, late: bool = False) -> list[pb.Directive]:
        """One validated report; the rank's directives (usually none). `late`: its deadline passed before
        the agent got to it (the rank gave up and counts it as dropped)."""
        ...

    def report_rejected(self) -> None: ...

    def has_gpu(self, uuid: str) -> bool: ...

    def clear_gpu(self, uuid: str, who: str, reason: str) -> tuple[State, State]: ...


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, agent: AgentApi) -> None:
        self.agent = agent

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        return self.agent.status_pb()

    async def WatchEvents(self, request: pb.WatchEventsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Event]:
        err = validation.check_watch_events(request)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        kinds = tuple(request.kinds)
        min_sev = request.min_severity or 0
        try:
            async for event in self.agent.watch(request.since_seq, request.follow):
                # a gap signal passes every filter: the events it stands for might have matched
                if event.kind != _SKIPPED and (event.severity < min_sev or
                                               (kinds and not event.kind.startswith(kinds))):
                    continue
                yield event_to_pb(event)
        except TooManyWatchers as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except WatchAhead as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except JournalReadTimeout as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def ReportStep(self, request: pb.ReportStepRequest,
                         context: grpc.aio.ServicerContext) -> pb.ReportStepResponse:
        err = validation.check_report_step(request)
        if err:
            self.agent.report_rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        remaining = context.time_remaining()   # None: no deadline; 0: the rank already gave up on it
        directives = self.agent.handle_report(request, time.time(), late=remaining is not None and remaining <= 0)
        return pb.ReportStepResponse(accepted=True, directives=directives) if directives else _ACCEPTED

    async def ClearGpu(self, request: pb.ClearGpuRequest, context: grpc.aio.ServicerContext) -> pb.ClearGpuResponse:
        err = validation.check_clear_gpu(request)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if not self.agent.has_gpu(request.uuid):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no GPU {request.uuid} on this node")
        before, after = self.agent.clear_gpu(request.uuid, request.who or _peer_user(context), request.reason)
        return pb.ClearGpuResponse(previous=int(before), state=int(after))


def _peer_user(context: grpc.aio.ServicerContext) -> str:
    return context.peer() or "unknown"


def probe_state_pb(name: str) -> int:
    return _PROBE_STATES.get(name, pb.PROBE_STATE_UNSPECIFIED)
