"""The agent's watchdog (daemon/watchdog.py): the pure stale rule, its transitions, the liveness answer
(real NodeHealth and grpc HealthServicer) and the alert it raises; the runner's heartbeat while a call hangs."""
from __future__ import annotations

import asyncio
import threading
import time

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from daemon import alert_policy
from daemon.gpus import GpuRegistry
from daemon.health import AGENT_SERVICE, NodeHealth
from daemon.metrics import AgentMetrics
from daemon.probe_runner import ProbeRunner
from daemon.watchdog import LoopBeat, Watchdog, stale_loops
from sdcwatch import event_kinds as ek
from sdcwatch.types import Severity
from deadlines import scaled

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[ek.EventKind, str, str, dict]] = []

    def __call__(self, kind, subject, message, details=None, *, severity=None):
        kind.check(severity or kind.severity, subject)
        self.events.append((kind, subject, message, dict(details or {})))


def test_stale_after_three_intervals() -> None:
    loops = [LoopBeat("nvml", 2.0, 100.0), LoopBeat("canary", 600.0, 0.0)]
    assert stale_loops(loops, 106.0) == {}
    got = stale_loops(loops, 106.5)
    assert list(got) == ["nvml"] and "no heartbeat for 6s (3 intervals of 2s, at least 5s)" in got["nvml"]
    assert list(stale_loops(loops, 1801.0)) == ["nvml", "canary"]


def test_a_short_interval_is_not_stale_before_the_floor() -> None:
    """A 0.5 s loop whose wake-up waited 3 s for a busy node's CPU is late, not stopped: stale only past
    STALE_FLOOR_S (5 s) without a beat."""
    loops = [LoopBeat("nvml", 0.5, 100.0)]
    assert stale_loops(loops, 103.0) == {} and stale_loops(loops, 105.0) == {}
    assert list(stale_loops(loops, 105.5)) == ["nvml"]


def test_transitions_are_published_once_and_raise_the_alert() -> None:
    beats = {"nvml": 0.0}
    told: list[dict] = []

    class Sink:
        def set_stale_loops(self, stale: dict[str, str]) -> None:
            told.append(stale)

    pub = Recorder()
    wd = Watchdog(lambda: [LoopBeat("nvml", 1.0, beats["nvml"])], publish=pub, health=Sink())
    assert wd.check(5.0) == {} and not pub.events and not told
    for now in (5.5, 6.0, 10.0):   # stale: one event, however long it stays stale
        assert list(wd.check(now)) == ["nvml"]
    assert [e[0] for e in pub.events] == [ek.AGENT_LOOP_STALE] and len(told) == 1
    kind, subject, message, details = pub.events[0]
    sigs = alert_policy.signals_for_event(kind.name, kind.severity, subject, message, details, node="n1",
                                          runbook_base="rb")
    assert [(s.op, s.labels["alertname"], s.labels["probe"]) for s in sigs] == \
        [("fire", "SDCWatchAgentLoopStale", "nvml")]
    beats["nvml"] = 10.5
    assert wd.check(11.0) == {}
    assert [e[0] for e in pub.events] == [ek.AGENT_LOOP_STALE, ek.AGENT_LOOP_RECOVERED] and told[-1] == {}
    kind, subject, message, details = pub.events[1]
    sigs = alert_policy.signals_for_event(kind.name, Severity.INFO, subject, message, details, node="n1",
                                          runbook_base="rb")
    assert [(s.op, s.labels["alertname"]) for s in sigs] == [("resolve", "SDCWatchAgentLoopStale")]


def test_liveness_follows_the_watchdog() -> None:
    async def main() -> None:
        servicer = HealthServicer()
        health = NodeHealth(servicer, GpuRegistry(), AgentMetrics(), asyncio.Event())
        await health.set_serving(True)

        async def agent_status() -> int:
            resp = await servicer.Check(health_pb2.HealthCheckRequest(service=AGENT_SERVICE), None)
            return resp.status

        assert await agent_status() == SERVING
        health.set_stale_loops({"nvml": "loop nvml published no heartbeat"})
        await health.sync()
        assert await agent_status() == NOT_SERVING
        health.set_stale_loops({})
        await health.sync()
        assert await agent_status() == SERVING

    asyncio.run(main())


def test_runner_beats_while_a_call_hangs_and_stops_beating_when_its_loop_stops() -> None:
    release = threading.Event()

    async def main() -> None:
        pub = Recorder()
        frozen = asyncio.Event()

        async def on_result(result, now):
            if result == "freeze":
                await frozen.wait()   # a loop stuck in our own code

        calls = iter(["ok", "hang", "freeze"])

        def fn(now):
            what = next(calls)
            if what == "hang":
                release.wait(10)
            return what

        runner = ProbeRunner("nvml", fn, interval_s=0.1, timeout_s=0.2, on_result=on_result, publish=pub)
        task = asyncio.get_running_loop().create_task(runner.run_forever())
        deadline = time.monotonic() + scaled(10)
        while ek.PROBE_HUNG not in [e[0] for e in pub.events]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)                       # 6 intervals into the hang
        assert stale_loops([runner.heartbeat()], time.monotonic()) == {}, "waiting on the driver still beats"
        release.set()
        deadline = time.monotonic() + scaled(10)
        while not stale_loops([runner.heartbeat()], time.monotonic()):
            assert time.monotonic() < deadline, "the frozen loop was never seen stale"
            await asyncio.sleep(0.05)
        task.cancel()
        runner.stop()

    asyncio.run(main())


def test_thread_beat_counts_driver_waits_as_beating_and_goes_stale_when_the_thread_stops() -> None:
    from daemon.watchdog import ThreadBeat
    now = [100.0]
    beat = ThreadBeat("xid", 1.0, clock=lambda: now[0])
    with beat.waiting():
        now[0] += 50.0     # a driver wait that takes long: not a stopped loop
        assert stale_loops([beat.heartbeat()], now[0]) == {}
    assert stale_loops([beat.heartbeat()], now[0]) == {}
    now[0] += 5.5          # no beat for 5.5 intervals (past the floor): dead, or stuck in our code
    assert "xid" in stale_loops([beat.heartbeat()], now[0])
    beat.beat()
    assert stale_loops([beat.heartbeat()], now[0]) == {}
