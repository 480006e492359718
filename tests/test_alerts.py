"""Alert delivery: the pure policy, then a real Alertmanager and a real HTTP webhook receiver.

Alertmanager is Debian's `prometheus-alertmanager`, started here on a free port with clustering off; the
tests skip with the reason when it is not installed (`bash scripts/setup.sh --test` installs it).
"""
from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry

from alerting_support import Alertmanager, alertmanager_binary
from conftest import free_port
from daemon.alert_policy import (
    AlertBook,
    Signal,
    SinkQueue,
    TokenBucket,
    alert_key,
    backoff_delay,
    signals_for_event,
)
from daemon.alerts import AlertDispatcher, AlertsConfig
from daemon.errors import ConfigError
from daemon.events import EventBus
from daemon.journal import Journal
from sdcwatch import event_kinds as ek
from sdcwatch.types import Severity
from deadlines import scaled

GPU = "GPU-5dc0a7e1-0000-4000-8000-000000000001"
BUS = "00000000:39:00.0"
RB = "https://example.org/runbooks"


def _state_event(to: str, frm: str = "HEALTHY") -> dict[str, Any]:
    return dict(kind="gpu.state", severity=Severity.CRITICAL if to == "FAILED" else Severity.INFO,
                subject=f"gpu/{GPU}", message=f"GPU {GPU} {frm} -> {to}",
                details={"uuid": GPU, "pci_bus_id": BUS, "from": frm, "to": to, "reason": f"XID 79 ({to})"})


def _bus_args(event: dict[str, Any]) -> dict[str, Any]:
    """`_state_event` as EventBus.publish's arguments (the kind is passed as the catalogue member)."""
    return {k: v for k, v in event.items() if k != "kind"}


class _Ev:
    """A stand-in for daemon.events.Event in the pure tests."""

    def __init__(self, kind: str, severity: Severity, subject: str, message: str,
                 details: dict[str, Any]) -> None:
        self.kind, self.severity, self.subject = kind, severity, subject
        self.message, self.details = message, details


# ------------------------------------------------------------------------------------------------------------
# Policy (pure)
# ------------------------------------------------------------------------------------------------------------


def test_gpu_state_fires_one_alert_and_resolves_the_others() -> None:
    sigs = signals_for_event(**_state_event("FAILED"), node="n1", runbook_base=RB)
    fired = [s for s in sigs if s.op == "fire"]
    assert [s.labels["alertname"] for s in fired] == ["SDCWatchGPUFailed"]
    f = fired[0]
    assert f.labels["uuid"] == GPU and f.labels["severity"] == "critical" and f.labels["node"] == "n1"
    assert f.annotations["pci_bus_id"] == BUS
    assert f.annotations["runbook_url"] == f"{RB}/SDCWatchGPUFailed.md"
    assert "XID 79" in f.annotations["description"]
    assert {s.labels["alertname"] for s in sigs if s.op == "resolve"} == {"SDCWatchGPUDegraded",
                                                                          "SDCWatchGPUSuspect"}
    # the HEALTHY transition resolves the exact alert that fired (same label set, same key)
    back = signals_for_event(**_state_event("HEALTHY", "FAILED"), node="n1", runbook_base=RB)
    assert f.key in {s.key for s in back if s.op == "resolve"}
    assert not [s for s in back if s.op == "fire"]


def test_event_mapping() -> None:
    def names(kind: str, sev: Severity, details: dict[str, Any], subject: str = "x") -> list[str]:
        return [s.labels["alertname"] for s in signals_for_event(kind, sev, subject, "m", details, node="n",
                                                                 runbook_base=RB) if s.op != "resolve"]

    assert names("gpu.xid", Severity.CRITICAL, {"xid": 79, "action": "REBOOT", "uuid": GPU}) == [
        "SDCWatchGPUXid"]
    assert names("gpu.xid", Severity.WARNING, {"xid": 13, "action": "RESTART_APP", "uuid": GPU}) == []
    assert names("replica.mismatch", Severity.CRITICAL, {"job_id": "j1"}) == ["SDCWatchReplicaMismatch"]
    assert names("sdc.frozen_changed", Severity.CRITICAL, {}, "job/j1/rank/3") == [
        "SDCWatchFrozenParamsChanged"]
    assert names("loss.nonfinite", Severity.CRITICAL, {"job_id": "j1"}) == ["SDCWatchLossNonFinite"]
    assert names("loss.spike", Severity.WARNING, {"job_id": "j1"}) == ["SDCWatchLossSpike"]
    assert names("loss.recovered", Severity.INFO, {"job_id": "j1"}) == []
    assert names("probe.hung", Severity.CRITICAL, {"probe": "nvml"}) == ["SDCWatchProbeHung"]
    assert names("something.new", Severity.CRITICAL, {}) == ["SDCWatchCriticalEvent"]
    assert names("something.new", Severity.WARNING, {}) == []
    job = signals_for_event("sdc.frozen_changed", Severity.CRITICAL, "job/j1/rank/3", "m", {}, node="n",
                            runbook_base=RB)
    assert job[0].labels["job_id"] == "j1"
    hung = signals_for_event("probe.hung", Severity.CRITICAL, "probe/nvml", "m", {"probe": "nvml"}, node="n",
                             runbook_base=RB)[0]
    back = signals_for_event("probe.recovered", Severity.INFO, "probe/nvml", "m", {"probe": "nvml"}, node="n",
                             runbook_base=RB)[0]
    assert back.op == "resolve" and back.key == hung.key


def test_book_dedups_resends_and_resolves_level_alerts() -> None:
    book = AlertBook(resend_interval_s=60, hold_s=900)
    fire = Signal("fire", {"alertname": "A", "uuid": "g"}, {"summary": "s"})
    book.apply(fire, 100.0)
    first = book.tick(100.0)
    assert len(first) == 1 and not first[0].resolved and first[0].ends_at == 100.0 + 240
    book.apply(fire, 110.0)                       # the same condition again: deduplicated
    assert book.tick(110.0) == []
    again = book.tick(160.0)                      # resend interval passed: re-sent, same start
    assert len(again) == 1 and again[0].starts_at == 100.0 and again[0].ends_at == 160.0 + 240
    book.apply(Signal("resolve", fire.labels), 170.0)
    done = book.tick(170.0)
    assert len(done) == 1 and done[0].resolved and done[0].ends_at == 170.0
    assert book.tick(1000.0) == [] and not book.alerts   # forgotten once resolved and handed over
    book.apply(fire, 2000.0)                      # it comes back: a new alert with a new start
    assert book.tick(2000.0)[0].starts_at == 2000.0


def test_pulse_repeats_extend_and_count_then_resolve_on_their_own() -> None:
    book = AlertBook(resend_interval_s=60, hold_s=300)
    pulse = Signal("pulse", {"alertname": "SDCWatchReplicaMismatch", "job_id": "j"}, {"summary": "s"})
    book.apply(pulse, 0.0)
    assert book.tick(0.0)[0].ends_at == 300.0
    book.apply(pulse, 100.0)                      # a repeat is not hidden: sent at once with its count
    rep = book.tick(100.0)
    assert len(rep) == 1 and rep[0].annotations["count"] == "2" and rep[0].ends_at == 400.0
    assert rep[0].starts_at == 0.0
    assert all(not n.resolved for n in book.tick(399.0))
    end = book.tick(400.0)
    assert len(end) == 1 and end[0].resolved and end[0].ends_at == 400.0
    assert not book.alerts


def test_a_folded_event_counts_its_repeats_in_the_pulse() -> None:
    """An event that stands for folded repeats (daemon/event_fold.py) adds them all to the pulse's count."""
    book = AlertBook(resend_interval_s=60, hold_s=300)
    details = {"job_id": "j"}
    book.apply_event("replica.mismatch", Severity.CRITICAL, "job/j", "m", details, 0.0, node="n", runbook_base=RB)
    book.apply_event("replica.mismatch", Severity.CRITICAL, "job/j", "m", {**details, "repeats": 5}, 60.0,
                     node="n", runbook_base=RB)
    [n] = book.tick(60.0)
    assert n.annotations["count"] == "6"


def test_book_is_bounded_and_counts_refusals() -> None:
    book = AlertBook(resend_interval_s=60, hold_s=300, max_alerts=2)
    for i in range(3):
        book.apply(Signal("fire", {"alertname": "A", "i": str(i)}), 0.0)
    assert len(book.alerts) == 2 and book.refused == 1


def test_sink_queue_keeps_newest_version_and_counts_drops() -> None:
    book = AlertBook(resend_interval_s=1, hold_s=10)
    q = SinkQueue(2)
    for i in range(3):
        book.apply(Signal("fire", {"alertname": "A", "i": str(i)}), 0.0)
    for n in book.tick(0.0):
        q.put(n)
    assert len(q) == 2 and q.dropped == 1
    batch = q.take(10)
    assert [n.labels["i"] for n in batch] == ["1", "2"]
    newer = book.tick(5.0)                       # resends: newer versions of the same two (and of "0")
    q.put(newer[-1])
    q.put_back(batch)                            # the failed old batch must not overwrite the newer one
    assert len(q) == 2
    assert {n.labels["i"]: n.ends_at for n in q.take(10)}["2"] == 5.0 + 4


def test_token_bucket_and_backoff() -> None:
    tb = TokenBucket(per_minute=6, burst=2, now=0.0)
    assert tb.take(0.0) and tb.take(0.0) and not tb.take(0.0)
    assert tb.wait_time(0.0) == pytest.approx(10.0)
    assert tb.take(10.0) and not tb.take(10.0)
    delays = [backoff_delay(a, base_s=1, cap_s=30, rand=lambda: 0.0) for a in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0]
    assert backoff_delay(3, base_s=1, cap_s=30, rand=lambda: 1.0) == 4.0
    with pytest.raises(ValueError, match="attempt"):
        backoff_delay(0)


def test_config_validation() -> None:
    AlertsConfig().validate()
    assert not AlertsConfig().enabled
    with pytest.raises(ConfigError, match="alerts.alertmanager_url"):
        AlertsConfig(alertmanager_url="alertmanager:9093").validate()
    with pytest.raises(ConfigError, match="alerts.rate_limit_per_min"):
        AlertsConfig(rate_limit_per_min=0).validate()
    with pytest.raises(ConfigError, match="alerts.queue_size"):
        AlertsConfig(queue_size=0).validate()


# ------------------------------------------------------------------------------------------------------------
# Real servers
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture()
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    if not alertmanager_binary():
        pytest.fail("prometheus-alertmanager not installed: bash scripts/setup.sh --test installs it")
    am = Alertmanager(tmp_path)
    try:
        yield am
    finally:
        am.stop()


class Webhook:
    """A tiny HTTP receiver on a free port: records JSON bodies; answers `codes` in order, then 200."""

    def __init__(self, codes: list[int] | None = None) -> None:
        self.bodies: list[Any] = []
        self.codes = list(codes or [])
        self.requests = 0
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.requests += 1
                code = hook.codes.pop(0) if hook.codes else 200
                if code == 200:
                    hook.bodies.append(json.loads(body))
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self) -> list[dict[str, Any]]:
        return [a for b in self.bodies for a in b["alerts"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    try:
        yield hook
    finally:
        hook.close()


async def _until(pred: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def _metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_alertmanager_gets_the_alert_and_its_resolution(alertmanager: Alertmanager, webhook: Webhook,
                                                        tmp_path: Path) -> None:
    """A GPU going FAILED on the agent's bus shows up in a real Alertmanager with its labels and in the
    webhook; going HEALTHY resolves it in both."""

    async def scenario() -> None:
        journal = Journal(tmp_path / "journal").open()
        bus = EventBus(journal, host="node-a")
        bus.bind_loop(asyncio.get_running_loop())
        reg = CollectorRegistry()
        cfg = AlertsConfig(alertmanager_url=alertmanager.url, webhook_url=webhook.url, resend_interval_s=30,
                           runbook_url_base=RB)
        disp = AlertDispatcher(cfg, node="node-a", registry=reg, tick_s=0.05)
        bus.publish(ek.AGENT_READY, "node", "before the dispatcher started: not replayed")
        await disp.start(bus)
        bus.publish(ek.GPU_STATE, **_bus_args(_state_event("FAILED")))

        def am_alert() -> dict[str, Any] | None:
            found = [a for a in alertmanager.alerts() if a["labels"].get("alertname") == "SDCWatchGPUFailed"]
            return found[0] if found else None

        await _until(lambda: am_alert() is not None)
        a = am_alert()
        assert a is not None
        assert a["labels"] == {"alertname": "SDCWatchGPUFailed", "severity": "critical", "node": "node-a",
                               "source": "sdcwatch-agent", "uuid": GPU}
        assert a["annotations"]["runbook_url"] == f"{RB}/SDCWatchGPUFailed.md"
        assert a["annotations"]["pci_bus_id"] == BUS
        assert a["status"]["state"] == "active"
        await _until(lambda: any(x["labels"]["alertname"] == "SDCWatchGPUFailed" for x in webhook.alerts()))
        hooked = [x for x in webhook.alerts() if x["labels"]["alertname"] == "SDCWatchGPUFailed"][0]
        assert hooked["status"] == "firing" and hooked["labels"]["uuid"] == GPU
        assert webhook.bodies[0]["node"] == "node-a"

        bus.publish(ek.GPU_STATE, **_bus_args(_state_event("HEALTHY", "FAILED")))
        await _until(lambda: am_alert() is None)   # resolved: no longer in the active list
        await _until(lambda: any(x["status"] == "resolved" for x in webhook.alerts()))
        assert _metric(reg, "sdcwatch_alert_notifications_total", sink="alertmanager", status="resolved") == 1
        assert _metric(reg, "sdcwatch_alert_notifications_total", sink="webhook", status="firing") >= 1
        await disp.stop()
        await bus.close()
        journal.close()

    asyncio.run(scenario())


def test_alertmanager_pulse_alert_carries_repeat_count(alertmanager: Alertmanager) -> None:
    async def scenario() -> None:
        disp = AlertDispatcher(AlertsConfig(alertmanager_url=alertmanager.url), node="n", tick_s=0.05)
        await disp.start()
        ev = _Ev("replica.mismatch", Severity.CRITICAL, "job/train-7", "vote failed", {"job_id": "train-7"})
        disp.handle_event(ev)
        disp.handle_event(ev)

        def found() -> list[dict[str, Any]]:
            return [a for a in alertmanager.alerts() if a["labels"]["alertname"] == "SDCWatchReplicaMismatch"]

        await _until(lambda: bool(found()) and found()[0]["annotations"].get("count") == "2")
        assert found()[0]["labels"]["job_id"] == "train-7"
        await disp.stop()

    asyncio.run(scenario())


def test_webhook_retries_with_backoff_until_it_answers() -> None:
    hook = Webhook(codes=[503, 503])
    reg = CollectorRegistry()

    async def scenario() -> None:
        disp = AlertDispatcher(AlertsConfig(webhook_url=hook.url), node="n", registry=reg, tick_s=0.05,
                               retry_base_s=0.05)
        await disp.start()
        disp.apply(Signal("fire", {"alertname": "A", "x": "1"}, {"summary": "s"}))
        await _until(lambda: len(hook.bodies) == 1)
        await disp.stop()

    try:
        asyncio.run(scenario())
    finally:
        hook.close()
    assert hook.requests == 3
    assert _metric(reg, "sdcwatch_alert_send_failures_total", sink="webhook") == 2
    assert hook.alerts()[0]["labels"] == {"alertname": "A", "x": "1"}


def test_stop_ends_when_a_sender_loses_its_cancel() -> None:
    """Python 3.11's `asyncio.wait_for` returns the delivery's result, and loses the cancel, when the POST
    finishes just as the sender is cancelled; the sender then waited for its next wake-up for good and
    `stop()` (the agent's too) hung (twice in loaded suite runs, in the test above). A sender that swallows
    its first cancel, as that race does: `stop()` cancels it again and ends."""
    reg = CollectorRegistry()
    swallowed = []

    async def scenario() -> None:
        disp = AlertDispatcher(AlertsConfig(webhook_url=f"http://127.0.0.1:{free_port()}/hook"), node="n",
                               registry=reg, tick_s=0.05)

        async def loses_its_first_cancel(clock: Any, rand: Any) -> None:
            idle = asyncio.Event()
            try:
                await idle.wait()
            except asyncio.CancelledError:
                swallowed.append(1)      # what the race does: carry on as if not cancelled
            await idle.wait()

        disp.sinks[0].run = loses_its_first_cancel   # type: ignore[method-assign]
        await disp.start()
        await asyncio.sleep(0.05)
        await asyncio.wait_for(disp.stop(flush_timeout_s=0.1), scaled(20))

    asyncio.run(scenario())
    assert swallowed == [1]


def test_refused_payload_is_dropped_not_retried() -> None:
    hook = Webhook(codes=[400])
    reg = CollectorRegistry()

    async def scenario() -> None:
        disp = AlertDispatcher(AlertsConfig(webhook_url=hook.url), node="n", registry=reg, tick_s=0.05,
                               retry_base_s=0.05)
        await disp.start()
        disp.apply(Signal("fire", {"alertname": "A"}))
        await _until(lambda: _metric(reg, "sdcwatch_alert_notifications_dropped_total", sink="webhook",
                                     reason="refused") == 1)
        await asyncio.sleep(0.3)
        await disp.stop(flush_timeout_s=0.5)

    try:
        asyncio.run(scenario())
    finally:
        hook.close()
    assert hook.requests == 1


def test_sink_down_queue_is_bounded_and_drops_are_counted() -> None:
    reg = CollectorRegistry()
    dead = f"http://127.0.0.1:{free_port()}/hook"   # nothing listens there

    async def scenario() -> None:
        disp = AlertDispatcher(AlertsConfig(webhook_url=dead, queue_size=3), node="n", registry=reg,
                               tick_s=0.05, retry_base_s=0.05)
        for i in range(5):
            disp.apply(Signal("pulse", {"alertname": "P", "i": str(i)}))
        disp.tick()
        assert len(disp.sinks[0].queue) == 3
        await disp.start()
        await _until(lambda: _metric(reg, "sdcwatch_alert_send_failures_total", sink="webhook") >= 2)
        await disp.stop(flush_timeout_s=0.3)

    asyncio.run(scenario())
    # 5 alerts -> the book keeps 3 (2 refused), and the queue of 3 holds them all
    assert _metric(reg, "sdcwatch_alert_notifications_dropped_total", sink="webhook",
                   reason="too_many_alerts") == 2
    assert _metric(reg, "sdcwatch_alert_queue_length", sink="webhook") == 3


def test_rate_limit_batches_instead_of_flooding() -> None:
    hook = Webhook()
    reg = CollectorRegistry()

    async def scenario() -> None:
        disp = AlertDispatcher(AlertsConfig(webhook_url=hook.url, rate_limit_per_min=1), node="n",
                               registry=reg, tick_s=0.05)
        await disp.start()
        disp.apply(Signal("fire", {"alertname": "A", "i": "0"}))
        await _until(lambda: len(hook.bodies) == 1)
        for i in range(1, 6):                 # five more alerts: the token is spent, they wait together
            disp.apply(Signal("fire", {"alertname": "A", "i": str(i)}))
        await _until(lambda: _metric(reg, "sdcwatch_alert_queue_length", sink="webhook") == 5)
        assert len(hook.bodies) == 1
        for t in disp._tasks:
            t.cancel()
        disp._tasks.clear()
        assert await disp.flush(5.0)         # a flush (at stop) sends them as one batch
        assert len(hook.bodies) == 2 and len(hook.bodies[1]["alerts"]) == 5

    try:
        asyncio.run(scenario())
    finally:
        hook.close()


def test_alert_key_is_order_independent() -> None:
    assert alert_key({"a": "1", "b": "2"}) == alert_key({"b": "2", "a": "1"})
    assert alert_key({"a": "1"}) != alert_key({"a": "2"})


def test_agent_pushes_xid_alert_to_alertmanager_and_webhook(alertmanager: Alertmanager, webhook: Webhook,
                                                            short_tmp: Path) -> None:
    """The real agent, fed an XID 79 by the scenario NVML backend, pushes to both sinks."""
    from agent_harness import AgentProcess

    scenario = short_tmp / "xid.json"
    scenario.write_text(json.dumps({
        "gpus": [{"uuid": "GPU-5dc0a7e1-0000-4000-8000-0000000000a0", "pci_bus_id": "00000000:19:00.0",
                  "name": "NVIDIA H200"}],
        "timeline": [{"at": 1.0, "gpu": 0, "xid": 79}]}))
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", str(scenario), "--nvml-poll-interval-s", "0.2",
                         "--alerts-alertmanager-url", alertmanager.url, "--alerts-webhook-url", webhook.url,
                         "--hostname", "node-7").start()
    try:
        deadline = time.monotonic() + scaled(20)
        names: set[str] = set()
        while time.monotonic() < deadline:
            names = {a["labels"]["alertname"] for a in alertmanager.alerts()}
            if "SDCWatchGPUFailed" in names and webhook.alerts():
                break
            time.sleep(0.1)
        assert "SDCWatchGPUFailed" in names, names
        failed = [a for a in alertmanager.alerts() if a["labels"]["alertname"] == "SDCWatchGPUFailed"][0]
        assert failed["labels"]["uuid"] == "GPU-5dc0a7e1-0000-4000-8000-0000000000a0"
        assert failed["labels"]["node"] == "node-7"
        assert any(a["labels"]["alertname"] == "SDCWatchGPUFailed" for a in webhook.alerts())
    finally:
        agent.stop()
