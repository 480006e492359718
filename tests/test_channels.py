"""sdcwatch/channels.py: the one channel builder, against real grpc servers (a unix socket, TLS TCP that
records the bearer token), its refusals, and that no other module opens agent channels its own way."""
from __future__ import annotations

import re
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sdcwatch.channels import agent_channel, agent_target, read_token
from support import self_signed_cert

ROOT = Path(__file__).resolve().parent.parent


class _Recorder(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.auth: list[str] = []

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        self.auth.append(dict(details.invocation_metadata).get("authorization", ""))
        return continuation(details)


@pytest.fixture
def servers(short_tmp: Path) -> Iterator[tuple[str, int, bytes, _Recorder]]:
    """A health service on a unix socket and on TLS TCP 127.0.0.1:0 (certificate for `localhost`)."""
    cert, key = self_signed_cert()
    rec = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[rec])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    sock = str(short_tmp / "a.sock")
    server.add_insecure_port(f"unix:{sock}")
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    try:
        yield sock, port, cert, rec
    finally:
        server.stop(None)


def _check(ch: grpc.Channel) -> int:
    with ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_unix_socket_and_tls_with_token(servers: tuple[str, int, bytes, _Recorder], short_tmp: Path) -> None:
    sock, port, cert, rec = servers
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _check(agent_channel(sock)) == serving                       # a bare path
    assert _check(agent_channel(f"unix:{sock}", token="ignored")) == serving   # no token on the socket
    assert rec.auth[-1] == ""
    (short_tmp / "ca.pem").write_bytes(cert)
    assert _check(agent_channel(f"localhost:{port}", tls_ca=short_tmp / "ca.pem", token="s3cret")) == serving
    assert rec.auth[-1] == "Bearer s3cret"
    # the certificate names localhost: reach it by address with the expected name overridden
    assert _check(agent_channel(f"127.0.0.1:{port}", tls_ca=cert, tls_server_name="localhost")) == serving
    with pytest.raises(grpc.RpcError):   # plain TCP to the TLS port
        _check(agent_channel(f"127.0.0.1:{port}", insecure=True))


def test_refusals_name_the_setting(short_tmp: Path) -> None:
    with pytest.raises(ValueError, match="never sent over plain TCP"):
        agent_channel("h:1", insecure=True, token="t")
    with pytest.raises(ValueError, match="unix socket"):
        agent_channel("/x/a.sock", tls_ca=b"pem")
    with pytest.raises(ValueError, match="contradict"):
        agent_channel("h:1", insecure=True, tls_ca=b"pem")
    with pytest.raises(ValueError, match="empty"):
        agent_target("")
    empty = short_tmp / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(empty)
    assert read_token(None) is None


def test_no_module_builds_agent_channels_its_own_way() -> None:
    """grpc.insecure_channel / secure_channel (sync or aio) are called by sdcwatch/channels.py alone (tests and benches
    talk to bare servers and are exempt)."""
    pattern = re.compile(r"grpc\.(aio\.)?(insecure|secure)_channel\(")
    offenders = []
    for pkg in ("sdcwatch", "daemon", "checksums", "checkpoint", "probes"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "sdcwatch/channels.py":
                continue
            if pattern.search(path.read_text()):
                offenders.append(path.relative_to(ROOT).as_posix())
    assert offenders == []
