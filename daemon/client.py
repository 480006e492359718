"""A small synchronous client for the agent (the CLI and scripts use it)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc

from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc


def channel_for(socket: str | None = None, address: str | None = None, *, tls_ca: str | None = None,
                tls_server_name: str | None = None, token: str | None = None,
                insecure: bool = False) -> grpc.Channel:
    """A channel to the agent: unix socket (default) or TCP with TLS (plain TCP only with insecure)."""
    options: list[tuple[str, object]] = []
    if address:
        if insecure:
            if token:
                raise ValueError("a bearer token is never sent over plain TCP: use TLS")
            return grpc.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes() if tls_ca else None)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        return grpc.secure_channel(address, creds, options=options)
    from sdcwatch.paths import default_socket

    path = socket or str(default_socket())
    return grpc.insecure_channel(f"unix:{path}", options=options)


class AgentClient:
    def __init__(self, channel: grpc.Channel, timeout_s: float = 5.0) -> None:
        self.channel = channel
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
