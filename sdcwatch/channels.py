"""The one way to open a grpc channel to an agent: the CLI, the step reporter, the checkpoint client and
peer stores all call `agent_channel`, so the path and TLS rules are the same everywhere.

Targets (`agent_target`):
- `None`: the default socket (`sdcwatch.paths.default_socket()`: `$SDCWATCH_SOCKET` or the state dir's);
- a path (an `os.PathLike`, or text starting with `/` or `.`, or holding no `:`): that unix socket;
- `unix:/path`, `unix:///path`, `unix-abstract:name`: a unix socket, as given;
- anything else (`host:port`, `[::1]:7000`, `dns:///host:port`): TCP.

Security:
- a unix socket is trusted by its file mode: no TLS, no token (a TLS setting for it is an error);
- TCP is TLS (`tls_ca`: PEM bytes or a file, else the system roots; `tls_server_name` overrides the name
  checked in the agent's certificate), with the bearer `token` sent on every call as
  `authorization: Bearer <token>`;
- plain TCP only with `insecure=True`, and then never with a token or TLS settings.
Bad combinations raise ValueError naming the setting and the fix.
"""
from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any, Sequence

import grpc

from sdcwatch.paths import default_socket

_UNIX_PREFIXES = ("unix:", "unix-abstract:")


def agent_target(target: str | os.PathLike[str] | None = None) -> str:
    """The grpc target for `target` (see the module docstring): a bare path becomes `unix:<abs path>`."""
    if target is None:
        return "unix:" + os.path.abspath(default_socket())
    text = os.fspath(target)
    if not text:
        raise ValueError("the agent target is empty: give a unix socket path or HOST:PORT")
    if not isinstance(target, str) or text.startswith(("/", ".")) or ":" not in text:
        return "unix:" + os.path.abspath(text)   # a path (a TCP target always has `:PORT`)
    return text


def is_unix(target: str) -> bool:
    """True for a unix socket target (`unix:`, `unix-abstract:`), as `agent_target` returns them."""
    return target.startswith(_UNIX_PREFIXES)


def agent_channel(target: str | os.PathLike[str] | None = None, *,
                  tls_ca: bytes | str | os.PathLike[str] | None = None, tls_server_name: str | None = None,
                  token: str | None = None, insecure: bool = False,
                  options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A synchronous channel to the agent at `target` under the rules of the module docstring."""
    resolved = agent_target(target)
    opts = list(options)
    if is_unix(resolved):
        if tls_ca is not None or tls_server_name:
            raise ValueError(f"TLS settings are for TCP targets; {resolved} is a unix socket (no TLS): "
                             "drop the CA / server name, or give HOST:PORT")
        return grpc.insecure_channel(resolved, options=opts)
    if insecure:
        if token:
            raise ValueError(f"a bearer token is never sent over plain TCP ({resolved}): use TLS, "
                             "or the agent's unix socket")
        if tls_ca is not None or tls_server_name:
            raise ValueError(f"TLS settings and insecure (plain TCP) contradict each other for {resolved}: "
                             "choose one")
        return grpc.insecure_channel(resolved, options=opts)
    pem = tls_ca if tls_ca is None or isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=pem)
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    channel = grpc.secure_channel(resolved, creds, options=opts)
    return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call's metadata (TLS channels only: `agent_channel`)."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [kv for kv in (d.metadata or ()) if kv[0] != "authorization"] + [self._entry]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def unix_aio_channel(path: str | os.PathLike[str]) -> grpc.aio.Channel:
    """An asyncio channel to a local service's unix socket (e.g. NVSentinel's platform connector): trusted by
    its file mode, as the agent's own socket is; no TLS, no token."""
    return grpc.aio.insecure_channel("unix:" + os.path.abspath(os.fspath(path)))


def read_token(path: str | os.PathLike[str] | None) -> str | None:
    """The bearer token held in the file at `path` (stripped); None for no path. OSError if unreadable,
    ValueError if empty."""
    if not path:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the token file {os.fspath(path)} is empty")
    return token
