"""A small synchronous client for the agent (the CLI and scripts use it). Build its channel with
`sdcwatch.channels.agent_channel` (the rules every client shares)."""
from __future__ import annotations

from typing import Iterator

import grpc

from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc


class AgentClient:
    def __init__(self, channel: grpc.Channel, timeout_s: float = 5.0, where: str = "") -> None:
        self.channel = channel
        self.where = where   # the agent's address and how it was found, for error messages
        self.stub = pb_grpc.AgentStub(channel)
        self.timeout_s = timeout_s

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout_s)

    def events(self, since: int = 0, follow: bool = False, min_severity: int = 0,
               kinds: list[str] | None = None) -> Iterator[pb.Event]:
        req = pb.WatchEventsRequest(since_seq=since, follow=follow, min_severity=min_severity, kinds=kinds or [])
        return self.stub.WatchEvents(req, timeout=None if follow else self.timeout_s * 6)

    def report(self, req: pb.ReportStepRequest) -> pb.ReportStepResponse:
        return self.stub.ReportStep(req, timeout=self.timeout_s)

    def clear_gpu(self, uuid: str, who: str, reason: str) -> pb.ClearGpuResponse:
        return self.stub.ClearGpu(pb.ClearGpuRequest(uuid=uuid, who=who, reason=reason), timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()
