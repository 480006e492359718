"""Server interceptors: bearer-token auth (TCP only) and per-RPC metrics.

The token check runs for every method of every service on the server (Agent, Checkpoints, PeerStore,
reflection...), whatever its streaming kind: a denied call is answered UNAUTHENTICATED by a handler of the
same kind, before the real handler reads a single request."""
from __future__ import annotations

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
    one). `AgentInterceptor(None, token)` still guards the TCP server."""

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
    """Checks `authorization: Bearer <token>` when a token is set; counts and times every RPC."""

    def __init__(self, metrics: AgentMetrics | None, token: str | None = None) -> None:
        self._meter = _Meter(metrics) if metrics is not None else None
        self.token = token.encode() if token else None
        self._wrapped: dict[str, tuple[Any, Any]] = {}   # method -> (handler, its wrapped handler)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = _method_name(details.method)
        if self.token is not None and not self._authorized(details):
            return _deny(handler)
        if self._meter is None:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:  # built once per method, not per call
            return cached[1]
        wrapped = self._meter.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        assert self.token is not None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, b"Bearer " + self.token)
        return False


class _Meter:
    """Wraps a method handler so each call is counted by status code and timed (`sdcwatch_rpc_*`)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def wrap(self, handler: Any, method: str) -> Any:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:   # a client stream (PeerStore.PutBlob): timed like a unary call
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler

    def _wrap_unary(self, fn: Callable[..., Any], method: str) -> Callable[..., Any]:
        metrics = self.metrics
        seconds = metrics.rpc_seconds.labels(method)
        ok_counter = metrics.rpc_total.labels(method, "OK")

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                response = await fn(request, context)
            except BaseException:
                code = context.code() if hasattr(context, "code") else None
                metrics.rpc_total.labels(method, _code_name(code, "UNKNOWN")).inc()
                raise
            seconds.observe(time.perf_counter() - started)
            code = context.code()
            if code is None or code == grpc.StatusCode.OK or code == 0:
                ok_counter.inc()
            else:
                metrics.rpc_total.labels(method, _code_name(code, "UNKNOWN")).inc()
            return response

        return wrapped

    def _wrap_stream(self, fn: Callable[..., Any], method: str) -> Callable[..., Any]:
        metrics = self.metrics
        if not inspect.isasyncgenfunction(fn):  # a handler that writes with context.write()
            async def wrapped_writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
                code = "OK"
                try:
                    return await fn(request, context)
                except BaseException:
                    code = _code_name(context.code(), "CANCELLED")
                    raise
                finally:
                    metrics.rpc_total.labels(method, code).inc()

            return wrapped_writer

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            code = "OK"
            try:
                async for item in fn(request, context):
                    yield item
            except BaseException:
                code = _code_name(context.code(), "CANCELLED")
                raise
            finally:
                metrics.rpc_total.labels(method, code).inc()

        return wrapped


def _code_name(code: Any, default: str) -> str:
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
