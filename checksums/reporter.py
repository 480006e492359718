"""The training rank's reporter to the node agent: ReportStep from a background thread.

Training never waits on the agent. `submit()` puts the request on a bounded queue and returns at once;
when the queue is full the request is dropped and counted. A daemon thread sends each request with a
per-call deadline; a failed call (agent down, slow, restarting) is counted and the request is lost. The
number of requests lost since the last accepted one travels in the next request's `dropped_reports`.
The first outage is logged as one WARNING; when the agent answers again one INFO line sums up what was
lost. Nothing here raises into the training thread.

Lifecycle: `StepReporter(target)` -> `submit(request)` per step -> `take_directives()` on the training
thread whenever convenient -> `close(timeout)` at the end (also closed at interpreter exit).

Transport: the channel comes from `sdcwatch.channels.agent_channel` (the rules every client shares): a
unix socket (`unix:/path`, or a bare path) with no credentials; or TCP (`host:port`) with TLS
(`root_cert`: PEM bytes or a file path, else the system roots) and an optional bearer token sent as
`authorization: Bearer <token>`. Plain TCP only with `allow_insecure_tcp=True` and no root_cert (tests).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import grpc

from sdcwatch.channels import agent_channel, agent_target
from proto.sdcwatch.v1 import agent_pb2, agent_pb2_grpc

logger = logging.getLogger(__name__)

# Reconnect quickly to a local agent that restarts; the channel reconnects by itself.
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
)
_OUTAGE_WARN_INTERVAL_S = 300.0
_STOP = object()


class StepReporter:
    """Sends ReportStep requests to the agent from a daemon thread; see the module docstring.

    Counters (read from any thread): `sent` (accepted by the agent), `failed` (calls that failed),
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
        self._down = False
        self._outage_lost_at_start = 0
        self._outage_started = 0.0
        self._last_warned = -_OUTAGE_WARN_INTERVAL_S
        self._outage_warned = False
        self._directives: list[agent_pb2.Directive] = []
        self._last_directives: tuple[agent_pb2.Directive, ...] = ()
        self._last_error = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- training thread -------------------------------------------------------------------------

    def submit(self, request: agent_pb2.ReportStepRequest) -> bool:
        """Queue `request` for sending; never blocks. False if it was dropped (queue full or closed)."""
        if self._closed:
            with self._lock:
                self._dropped_full += 1
                self._unreported += 1
            return False
        try:
            self._queue.put_nowait(request)
            return True
        except queue.Full:
            with self._lock:
                self._dropped_full += 1
                self._unreported += 1
            return False

    def take_directives(self) -> list[agent_pb2.Directive]:
        """The directives received since the last call (oldest first), and forget them."""
        with self._lock:
            if not self._directives:
                return []
            out, self._directives = self._directives, []
            return out

    @property
    def last_directives(self) -> tuple[agent_pb2.Directive, ...]:
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

    def _send(self, request: agent_pb2.ReportStepRequest) -> None:
        with self._lock:
            carried = self._unreported
        request.dropped_reports = request.dropped_reports + carried
        try:
            reply = self._stub.ReportStep(request, timeout=self.deadline_s)
        except grpc.RpcError as err:
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
                self._last_directives = tuple(reply.directives)
                self._directives.extend(reply.directives)
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
