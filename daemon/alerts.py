"""Alert delivery from the agent: its events become alerts pushed to Alertmanager (v2 API) and a webhook.

Besides being scraped by Prometheus (whose rules in deploy/prometheus/ are the primary alerting path),
the agent can push alerts itself, so a node whose metrics are not scraped still pages someone and a
replica mismatch reaches on-call within a second. The policy (what fires, what resolves, dedup, resend)
is `daemon.alert_policy` (pure); this module is the I/O around it:

- a watcher task reads the agent's `EventBus` (`watch(since_seq, follow=True)`) and applies each event;
- a ticker task asks the policy every `tick_s` what to send and puts it on every sink's queue;
- one sender task per sink takes a batch from its bounded queue (newest version per alert, oldest
  dropped and counted when full), waits for the rate limit, POSTs it from a thread (urllib, `timeout_s`),
  and on failure puts the batch back and retries with exponential backoff and jitter. A 4xx answer other
  than 408/429 is the sink refusing the payload: the batch is dropped (counted), never retried forever.

Lifecycle: `AlertDispatcher(config, node=..., registry=...)` -> `start(bus, since_seq)` (or feed
`handle_event()` / `apply()` directly without a bus) -> `stop()`: one last tick and a bounded flush.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from daemon.alert_policy import AlertBook, Notification, Signal, SinkQueue, TokenBucket, backoff_delay
from daemon.background import cancel_tasks
from daemon.errors import ConfigError
from daemon.pools import WorkPool
from sdcwatch.errors import SdcwatchError
from sdcwatch.settings import setting

log = logging.getLogger(__name__)

DEFAULT_RUNBOOK_BASE = "https://github.com/sdcwatch/sdcwatch/blob/main/docs/runbooks"


@dataclasses.dataclass(kw_only=True, slots=True)
class AlertsConfig:
    """`[alerts]` in the agent config. Both URLs empty (the default): no push, only /metrics."""

    alertmanager_url: str = setting("", "Alertmanager base URL, e.g. http://alertmanager:9093 "
                                    "(alerts POSTed to <url>/api/v2/alerts)")
    webhook_url: str = setting("", "any URL taking a JSON POST (Slack/Teams bridges, incident tools)")
    resend_interval_s: float = setting(60.0, "active alerts are re-sent this often (endsAt = now + 4x this)")
    rate_limit_per_min: float = setting(30.0, "POSTs per minute per sink (alerts in between are batched)")
    queue_size: int = setting(1000, "alerts waiting per sink; beyond it the oldest is dropped (counted)")
    timeout_s: float = setting(5.0, "seconds one HTTP POST may take")
    hold_s: float = setting(900.0, "seconds an event-type alert (XID, replica mismatch) stays active")
    runbook_url_base: str = setting(DEFAULT_RUNBOOK_BASE, "base URL of the runbooks linked from each alert")

    def validate(self) -> None:
        for key, url in (("alertmanager_url", self.alertmanager_url), ("webhook_url", self.webhook_url)):
            if url and not url.startswith(("http://", "https://")):
                raise ConfigError(f"alerts.{key}", f"expected an http:// or https:// URL, got {redact_url(url)!r}")
        for key, value in (("resend_interval_s", self.resend_interval_s),
                           ("rate_limit_per_min", self.rate_limit_per_min), ("timeout_s", self.timeout_s),
                           ("hold_s", self.hold_s)):
            if not value > 0:   # also rejects NaN
                raise ConfigError(f"alerts.{key}", f"must be > 0, got {value!r}")
        if self.queue_size < 1:
            raise ConfigError("alerts.queue_size", f"must be >= 1, got {self.queue_size}")

    @property
    def enabled(self) -> bool:
        return bool(self.alertmanager_url or self.webhook_url)


class DeliveryError(SdcwatchError):
    """A POST failed; `transient` when sending the same payload again can succeed (5xx, 408, 429, no answer)."""


class Transport(Protocol):
    def __call__(self, url: str, body: bytes, timeout_s: float) -> int: ...


def redact_url(url: str) -> str:
    """`url` as logs and errors show it: scheme, host and port only. Credentials ride in the user info and,
    for many webhooks (Slack, Teams), in the path or the query: none of those is ever shown."""
    try:
        p = urllib.parse.urlsplit(url)
        host = p.hostname or "?"
        port = f":{p.port}" if p.port else ""
    except ValueError:
        return "<unparsable URL>"
    hidden = "/..." if (p.path not in ("", "/") or p.query or p.username or p.password) else ""
    return f"{p.scheme}://{host}{port}{hidden}"


def post_json(url: str, body: bytes, timeout_s: float) -> int:
    """POST a JSON body with the standard library; returns the status or raises DeliveryError."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "sdcwatch-agent"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode(errors="replace")
        retry = exc.code >= 500 or exc.code in (408, 429)
        raise DeliveryError(f"HTTP {exc.code} from {redact_url(url)}: {detail}", transient=retry) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise DeliveryError(f"POST {redact_url(url)} failed: {getattr(exc, 'reason', exc)}", transient=True) from exc


class AlertMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()
        self.sent = Counter("sdcwatch_alert_notifications_total", "Alert notifications delivered to a sink",
                            ["sink", "status"], registry=r)
        self.failures = Counter("sdcwatch_alert_send_failures_total", "Failed POSTs to an alert sink",
                                ["sink"], registry=r)
        self.dropped = Counter("sdcwatch_alert_notifications_dropped_total",
                               "Alert notifications dropped: sink queue full or payload refused",
                               ["sink", "reason"], registry=r)
        self.queued = Gauge("sdcwatch_alert_queue_length", "Alert notifications waiting for a sink",
                            ["sink"], registry=r)
        self.active = Gauge("sdcwatch_alerts_active", "Alerts the agent currently holds active", registry=r)


class Sink:
    """One destination: a bounded queue, a rate limit, a sender with retries."""

    def __init__(self, name: str, url: str, encode: Callable[[list[Notification]], bytes], cfg: AlertsConfig,
                 metrics: AlertMetrics, transport: Transport, now: float, retry_base_s: float = 1.0,
                 pool: WorkPool | None = None) -> None:
        self.name = name
        # deliveries block (DNS, connect, the POST): their own pool, never asyncio's shared default executor
        self.pool = pool or WorkPool(f"alerts-{name}", workers=1)
        self.retry_base_s = retry_base_s
        self.url = url
        self.encode = encode
        self.cfg = cfg
        self.metrics = metrics
        self.transport = transport
        self.queue = SinkQueue(cfg.queue_size)
        self.bucket = TokenBucket(cfg.rate_limit_per_min, burst=max(1, min(10, int(cfg.rate_limit_per_min))),
                                  now=now)
        self.wakeup = asyncio.Event()
        self.attempt = 0
        self.last_error = ""
        self._dropped_seen = 0

    def put(self, batch: list[Notification]) -> None:
        for n in batch:
            self.queue.put(n)
        self._sync_metrics()
        if batch:
            self.wakeup.set()

    def _sync_metrics(self) -> None:
        if self.queue.dropped > self._dropped_seen:
            self.metrics.dropped.labels(self.name, "queue_full").inc(self.queue.dropped - self._dropped_seen)
            log.warning("alert sink %s: queue full, %d notification(s) dropped", self.name,
                        self.queue.dropped - self._dropped_seen)
            self._dropped_seen = self.queue.dropped
        self.metrics.queued.labels(self.name).set(len(self.queue))

    async def send_once(self, clock: Callable[[], float]) -> bool:
        """Send one batch if any. True when the queue was emptied by a successful POST."""
        batch = self.queue.take(self.cfg.queue_size)
        if not batch:
            return True
        body = self.encode(batch)
        try:
            try:   # the transport's own timeout does not bound DNS: this does
                await asyncio.wait_for(self.pool.run(self.transport, self.url, body, self.cfg.timeout_s),
                                       self.cfg.timeout_s * 3)
            except asyncio.TimeoutError:
                raise DeliveryError(f"no answer from {self.name} in {self.cfg.timeout_s * 3:.0f}s "
                                    f"({self.pool.describe()})", transient=True) from None
        except DeliveryError as exc:
            self.metrics.failures.labels(self.name).inc()
            self.last_error = str(exc)
            if not exc.transient:
                self.metrics.dropped.labels(self.name, "refused").inc(len(batch))
                log.error("alert sink %s refused %d notification(s): %s", self.name, len(batch), exc)
                self._sync_metrics()
                return False
            self.queue.put_back(batch)
            self._sync_metrics()
            raise
        for n in batch:
            self.metrics.sent.labels(self.name, "resolved" if n.resolved else "firing").inc()
        self.attempt = 0
        self.last_error = ""
        self._sync_metrics()
        return len(self.queue) == 0

    async def run(self, clock: Callable[[], float], rand: Callable[[], float]) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while len(self.queue):
                wait = self.bucket.wait_time(clock())
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                self.bucket.take(clock())
                try:
                    await self.send_once(clock)
                except DeliveryError as exc:
                    self.attempt += 1
                    delay = backoff_delay(self.attempt, base_s=self.retry_base_s,
                                          cap_s=max(self.retry_base_s, self.cfg.resend_interval_s), rand=rand)
                    log.warning("alert sink %s: %s (attempt %d, retrying in %.1fs)", self.name, exc,
                                self.attempt, delay)
                    await asyncio.sleep(delay)
                except Exception:  # one bug never kills the sender
                    log.exception("alert sink %s: send failed", self.name)
                    await asyncio.sleep(1.0)


def encode_alertmanager(batch: list[Notification]) -> bytes:
    return json.dumps([n.to_alertmanager() for n in batch]).encode()


def make_webhook_encoder(node: str) -> Callable[[list[Notification]], bytes]:
    def encode(batch: list[Notification]) -> bytes:
        firing = any(not n.resolved for n in batch)
        return json.dumps({"version": "1", "sender": "sdcwatch-agent", "node": node,
                           "status": "firing" if firing else "resolved",
                           "alerts": [n.to_webhook() for n in batch]}).encode()
    return encode


class AlertDispatcher:
    def __init__(self, config: AlertsConfig, *, node: str, registry: CollectorRegistry | None = None,
                 transport: Transport = post_json, clock: Callable[[], float] = time.time,
                 rand: Callable[[], float] = random.random, tick_s: float = 1.0,
                 retry_base_s: float = 1.0) -> None:
        config.validate()
        self.config = config
        self.node = node
        self.clock = clock
        self.rand = rand
        self.tick_s = tick_s
        self.metrics = AlertMetrics(registry)
        self.book = AlertBook(resend_interval_s=config.resend_interval_s, hold_s=config.hold_s,
                              max_alerts=config.queue_size)
        now = clock()
        self.sinks: list[Sink] = []
        if config.alertmanager_url:
            self.sinks.append(Sink("alertmanager", config.alertmanager_url.rstrip("/") + "/api/v2/alerts",
                                   encode_alertmanager, config, self.metrics, transport, now, retry_base_s))
        if config.webhook_url:
            self.sinks.append(Sink("webhook", config.webhook_url, make_webhook_encoder(node), config,
                                   self.metrics, transport, now, retry_base_s))
        self._tasks: list[asyncio.Task[Any]] = []
        self._refused_seen = 0

    # -- feeding ---------------------------------------------------------------------------------------------
    def handle_event(self, event: Any) -> list[Signal]:
        """Apply one `daemon.events.Event` (anything with kind/severity/subject/message/details)."""
        return self.book.apply_event(event.kind, event.severity, event.subject, event.message,
                                     event.details or {}, self.clock(), node=self.node,
                                     runbook_base=self.config.runbook_url_base)

    def apply(self, signal: Signal) -> None:
        self.book.apply(signal, self.clock())

    def tick(self) -> list[Notification]:
        """Plan and enqueue what is due now (also called by the ticker task)."""
        batch = self.book.tick(self.clock())
        for sink in self.sinks:
            sink.put(batch)
        self.metrics.active.set(len(self.book.active))
        if self.book.refused > self._refused_seen:
            for sink in self.sinks:
                self.metrics.dropped.labels(sink.name, "too_many_alerts").inc(
                    self.book.refused - self._refused_seen)
            self._refused_seen = self.book.refused
        return batch

    # -- tasks -----------------------------------------------------------------------------------------------
    async def start(self, bus: Any = None, since_seq: int | None = None) -> None:
        """Start the tasks. With a bus, follow its events after `since_seq` (default: its newest seq)."""
        if not self.sinks:
            log.info("alerts: no alertmanager_url or webhook_url configured; not pushing alerts")
            return
        if bus is not None:
            start = bus.last_seq if since_seq is None else since_seq
            self._tasks.append(asyncio.create_task(self._watch(bus, start), name="alerts-watch"))
        self._tasks.append(asyncio.create_task(self._ticker(), name="alerts-tick"))
        for sink in self.sinks:
            self._tasks.append(asyncio.create_task(sink.run(self.clock, self.rand),
                                                   name=f"alerts-{sink.name}"))
        log.info("alerts: pushing to %s", ", ".join(f"{s.name} {redact_url(s.url)}" for s in self.sinks))

    async def _watch(self, bus: Any, since_seq: int) -> None:
        last = since_seq
        while True:
            try:
                async for event in bus.watch(last, follow=True):
                    last = event.seq
                    try:
                        self.handle_event(event)
                    except Exception:  # one odd event never stops alerting
                        log.exception("alerts: cannot handle event %s %s", event.seq, event.kind)
                return   # the bus closed
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("alerts: event watch failed; resuming after seq %d", last)
                await asyncio.sleep(1.0)

    async def _ticker(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("alerts: tick failed")
            await asyncio.sleep(self.tick_s)

    async def flush(self, timeout_s: float) -> bool:
        """Tick once and try to empty every sink's queue within `timeout_s` (no retries past it)."""
        self.tick()

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def drain(sink: Sink) -> None:
            while len(sink.queue) and loop.time() < deadline:   # (a cancel lost in a delivery ends it too)
                try:
                    await sink.send_once(self.clock)
                except DeliveryError:
                    await asyncio.sleep(0.2)

        try:
            await asyncio.wait_for(asyncio.gather(*(drain(s) for s in self.sinks)), timeout_s)
        except asyncio.TimeoutError:
            return False
        return not any(len(s.queue) for s in self.sinks)

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Cancel the tasks, then a bounded last flush (e.g. resolutions published while stopping). The
        cancel is repeated until they end (`cancel_tasks`): Python 3.11's `asyncio.wait_for` returns the
        inner result, and loses the cancel, when a delivery finishes as it is cancelled; the sender then
        waited for its next wake-up for good and the stop hung (seen twice in loaded suite runs)."""
        await cancel_tasks(self._tasks, max(5.0, flush_timeout_s))
        self._tasks.clear()
        if self.sinks:
            if not await self.flush(flush_timeout_s):
                log.warning("alerts: %d notification(s) not delivered at stop",
                            sum(len(s.queue) for s in self.sinks))
