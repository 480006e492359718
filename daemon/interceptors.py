"""Server interceptors: bearer-token auth (TCP only) and per-RPC metrics.

Each registered handler is also given a request deserializer that never raises: bytes that do not decode as
the method's request message are answered INVALID_ARGUMENT (not UNKNOWN with a traceback). A call that ends
because the client's deadline passed or the client cancelled is counted as DEADLINE_EXCEEDED or CANCELLED
(`_ended_by_client`: a client's deadline passes a little before the server's, so a cancel that leaves the
server less than `DEADLINE_SLACK` of the call's deadline is that deadline).

The token check runs for every method of every service on the server (Agent, Checkpoints, PeerStore,
reflection...), whatever its streaming kind: a denied call is answered UNAUTHENTICATED by a handler of the
same kind, before the real handler reads a single request."""
from __future__ import annotations

import asyncio
import hmac
import inspect
import time
from typing import Any, Awaitable, Callable

import grpc

from daemon.metrics import AgentMetrics


def _method_name(full: str) -> str:
    return full.rsplit("/", 1)[-1] if full else "?"


class MeteredServer:
    """What the `add_*Servicer_to_server` functions see instead of the server: every method handler they
    register is wrapped once with the RPC metrics, so a call pays no interceptor on its path (an interceptor
    costs a coroutine and a lookup per call; on the unix socket, where no token is checked, nothing else needs
    one). `AgentInterceptor(token)` still guards the TCP server."""

    def __init__(self, server: grpc.aio.Server, metrics: AgentMetrics) -> None:
        self._server = server
        self._meter = _Meter(metrics)

    def _wrap(self, handler: Any, method: str) -> Any:
        return self._meter.wrap(handler, method) if handler is not None else None

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(
            service_name, {m: self._wrap(h, m) for m, h in method_handlers.items()})

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(_MeteredGeneric(h, self._wrap) for h in handlers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class _MeteredGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: Any, wrap: Callable[[Any, str], Any]) -> None:
        self._inner, self._wrap_fn = inner, wrap
        self._cache: dict[str, tuple[Any, Any]] = {}

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(details)
        if handler is None:
            return None
        method = _method_name(details.method)
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap_fn(handler, method)
        self._cache[method] = (handler, wrapped)
        return wrapped


class AgentInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call of the TCP server (the RPC metrics are not an
    interceptor: `MeteredServer` wraps each handler once)."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or self._authorized(details):
            return handler
        return _deny(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, b"Bearer " + self.token)
        return False


class _Meter:
    """Wraps a method handler so each call is counted by status code and timed (`sdcwatch_rpc_*`, kept by
    `daemon.metrics.RpcStats`: plain counts, no lock on the call's path)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.rpc = metrics.rpc

    def wrap(self, handler: Any, method: str) -> Any:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, checked=True),
                request_deserializer=_never_raises(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                request_deserializer=_never_raises(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:   # a client stream (PeerStore.PutBlob): timed like a unary call
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler

    def _wrap_unary(self, fn: Callable[..., Any], method: str, checked: bool = False) -> Callable[..., Any]:
        stats = self.rpc.method(method)
        observe, count = stats.observe, stats.count
        clock = time.perf_counter

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = clock()
            try:
                if checked and type(request) is Undecodable:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
                response = await fn(request, context)
            except asyncio.CancelledError:
                count(_ended_by_client(context, clock() - started))
                raise
            except BaseException:
                count(_code_name(context.code(), "UNKNOWN"))
                raise
            observe(clock() - started)
            code = context.code()   # a handler may set a code and return instead of aborting
            count("OK" if code is None or code is _OK else _code_name(code, "UNKNOWN"))
            return response

        return wrapped

    def _wrap_stream(self, fn: Callable[..., Any], method: str) -> Callable[..., Any]:
        count = self.rpc.method(method).count
        if not inspect.isasyncgenfunction(fn):  # a handler that writes with context.write()
            async def wrapped_writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
                code = "OK"
                try:
                    return await fn(request, context)
                except BaseException:
                    code = _code_name(context.code(), "CANCELLED")
                    raise
                finally:
                    count(code)

            return wrapped_writer

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            code = "OK"
            try:
                if type(request) is Undecodable:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
                async for item in fn(request, context):
                    yield item
            except asyncio.CancelledError:
                code = _ended_by_client(context)
                raise
            except BaseException:
                code = _code_name(context.code(), "CANCELLED")
                raise
            finally:
                count(code)

        return wrapped


_OK = grpc.StatusCode.OK


class Undecodable:
    """What a request deserializer gives for bytes that are not the method's request message."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _never_raises(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the client's bad bytes
            return Undecodable(f"the request is not a valid message of this method ({type(exc).__name__}: "
                               f"{str(exc)[:200]})")

    return deserialize


# A client's deadline passes before the server's: the server's runs from when it read the call's headers, by
# the time the client had left when it sent them. The client then cancels the call, and that cancel can reach
# the server just before its own deadline (1.9 ms before it on a loaded 2-core machine: counted CANCELLED).
# A cancel that leaves less than this share of the call's deadline (at least the floor, at most the cap) is
# the deadline's.
DEADLINE_SLACK = 0.1
DEADLINE_SLACK_FLOOR_S = 0.05
DEADLINE_SLACK_CAP_S = 1.0


def _ended_by_client(context: grpc.aio.ServicerContext, elapsed: float | None = None) -> str:
    """The code of a call cancelled under its handler: its deadline passed (or was about to: the client's
    passes first, `DEADLINE_SLACK`), or the client cancelled. `elapsed`: seconds the handler ran."""
    try:
        remaining = context.time_remaining()
    except Exception:  # noqa: BLE001
        remaining = None
    if remaining is None:
        return "CANCELLED"
    slack = DEADLINE_SLACK_FLOOR_S
    if elapsed is not None:
        slack = min(DEADLINE_SLACK_CAP_S, max(slack, DEADLINE_SLACK * (elapsed + remaining)))
    return "DEADLINE_EXCEEDED" if remaining <= slack else "CANCELLED"


def _code_name(code: Any, default: str) -> str:
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c.name
    return default


def _deny(handler: Any) -> Any:
    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield  # pragma: no cover

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny_unary, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(deny_stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny_unary, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)
