"""The node's GPU probes (`GpuProbes`): NVML discovery, polling and XID events, then the canary.

Every NVML call runs on the probe's own worker thread (discovery and polls) or the XID thread, never on
the event loop. With no NVML the GPUs stay UNKNOWN and GetStatus says why (`static`). What the probes find
goes to the GPU table (`GpuRegistry`: evidence, identities), the event publisher (findings) and the GPU
metrics; their tasks and closers belong to the agent's `Background`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from daemon.background import Background
from daemon.config import CanaryConfig, NvmlConfig
from daemon.events import Publisher
from daemon.gpu_metrics import GpuMetrics
from daemon.gpus import GpuRegistry
from daemon.metrics import AgentMetrics
from daemon.probe_runner import ProbeRunner
from daemon.watchdog import LoopBeat, ThreadBeat
from probes.canary_agent import AgentCanaryProbe
from probes.nvml_backend import GpuIdentity, NvmlUnavailable, open_backend
from probes.nvml_fake import ScenarioBackend
from probes.nvml_fields import EVENT_TYPES
from probes.nvml_probe import NvmlProbe, NvmlProbeConfig
from probes.nvml_types import EventFold
from sdcwatch import event_kinds as ek
from sdcwatch.types import Evidence, State

log = logging.getLogger(__name__)


class GpuProbes:
    """`runners`: the probes that run (GetStatus lists their status); `static`: the ones that never run, with
    why (name -> (state, why)); `versions`: what they learnt (the NVIDIA driver)."""

    def __init__(self, nvml: NvmlConfig, canary: CanaryConfig, *, gpus: GpuRegistry, publisher: Publisher,
                 metrics: AgentMetrics, gpu_metrics: GpuMetrics | None, state_dir: Path) -> None:
        self.nvml_config = nvml
        self.canary_config = canary
        self.gpus = gpus
        self.publisher = publisher
        self.metrics = metrics
        self.gpu_metrics = gpu_metrics   # None when NVML is disabled
        self.state_dir = state_dir
        self.runners: dict[str, ProbeRunner] = {}
        self._xid_beat: ThreadBeat | None = None
        self.static: dict[str, tuple[str, str]] = {}
        self.versions: dict[str, str] = {}
        self._nvml: NvmlProbe | None = None   # opened by start()
        self._poller: NvmlPoller | None = None

    async def start(self, background: Background) -> None:
        cfg = self.nvml_config
        gpus = self.gpus
        if not cfg.enabled or self.gpu_metrics is None:
            self._without_nvml("DISABLED", "NVML probe disabled by configuration (nvml.enabled = false)")
            return
        nvml = NvmlPoller(gpus, self.publisher, self.gpu_metrics, self.metrics)
        self._poller = nvml
        runner = ProbeRunner("nvml", self._poll_nvml, interval_s=cfg.poll_interval_s,
                             timeout_s=cfg.timeout_s, on_result=nvml.on_poll, publish=self.publisher.publish,
                             observe=self.metrics.observe_probe, on_hung=nvml.on_hung)
        try:
            backend = await runner.call(lambda: open_backend(cfg.scenario or None, clock=time.monotonic))
            probe = NvmlProbe(backend, NvmlProbeConfig(skip_fields=cfg.skip_list(), sweep_s=cfg.sweep_s,
                                                       rotate_per_poll=cfg.rotate_per_poll))
            identities = await runner.call(probe.discover)
        except NvmlUnavailable as exc:
            runner.stop()
            self._without_nvml("DISABLED", str(exc))
            log.warning("%s: GPUs stay UNKNOWN", exc)
            return
        except Exception as exc:  # a bad scenario file, a driver error at start: run without GPU probes
            runner.stop()
            self._without_nvml("FAILING", f"NVML probe could not start: {type(exc).__name__}: {exc}")
            log.error("%s", gpus.nvml_reason)
            return
        if isinstance(backend, ScenarioBackend):   # a rehearsal of the watchdog (scenario "agent_faults")
            nvml.frozen = functools.partial(backend.loop_frozen, "nvml")
        gpus.nvml_available = True
        gpus.nvml_reason = ""
        if identities and identities[0].driver_version:
            self.versions["driver"] = identities[0].driver_version
        now = time.time()
        for ident in identities:
            nvml.register(ident, now)
        self._nvml = probe
        self._run(runner, background)
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        beat = _ListenerBeat("xid", max(1.0, probe.config.xid_wait_ms / 1000.0), stop)
        if isinstance(backend, ScenarioBackend):   # the rehearsal of a listener stuck in our own code
            beat.frozen = functools.partial(backend.loop_frozen, "xid")
        self._xid_beat = beat

        inbox = EventInbox(loop, nvml.on_events)

        def listen() -> None:
            try:
                probe.run_xid_listener(
                    lambda ev: inbox.put([ev]), stop, beat=beat, on_batch=inbox.put,
                    on_open=lambda registered: loop.call_soon_threadsafe(nvml.on_events_open, registered))
            except BaseException:   # a bug: the thread is gone, its beat goes stale and the watchdog says so
                log.exception("the NVML event listener died")
                return
            self._xid_beat = None   # it ended by design (events unsupported, a fatal driver error, stop)

        thread = threading.Thread(target=listen, name="sdcwatch-xid", daemon=True)
        thread.start()

        def close() -> None:   # the XID thread told to stop first, then NVML closed under it
            stop.set()
            probe.close()

        background.on_close(close)
        if self.canary_config.enabled:
            self._start_canary(background)
        self.publisher.publish(
            ek.NVML_DISCOVERED, "node",
            f"{len(identities)} GPU(s): " + ", ".join(f"{i.uuid} ({i.pci_bus_id})" for i in identities),
            {"gpus": [{"uuid": i.uuid, "pci_bus_id": i.pci_bus_id, "name": i.name, "index": i.index}
                      for i in identities]})

    def _poll_nvml(self, now: float) -> Any:
        """One NVML poll, on the nvml runner's worker (the runner opened the backend there first)."""
        assert self._nvml is not None, "polled before start() opened NVML"
        return self._nvml.poll(now)

    def on_loop_stale(self, name: str, why: str | None) -> None:
        """The watchdog's news: while the nvml loop is stale its GPUs are UNKNOWN (no fresh readings), never
        the HEALTHY of their last poll; the next poll after it beats again replaces that."""
        if name == "nvml" and self._poller is not None:
            self._poller.mark_unknown(why)

    def loops(self) -> list[LoopBeat]:
        """The heartbeats of the probe loops, for the agent's watchdog (daemon/watchdog.py)."""
        beats = [r.heartbeat() for r in self.runners.values()]
        xid = self._xid_beat
        return beats + ([xid.heartbeat()] if xid is not None else [])

    def stop(self) -> None:
        """Stop the probes' worker threads (their tasks are cancelled by the Background first)."""
        for runner in self.runners.values():
            runner.stop()

    def _without_nvml(self, state: str, why: str) -> None:
        self.gpus.nvml_available = False
        self.gpus.nvml_reason = why
        self.static = {"nvml": (state, why)}

    def _run(self, runner: ProbeRunner, background: Background) -> None:
        self.runners[runner.name] = runner
        background.start(runner.run_forever(), name=f"probe-{runner.name}")

    def _start_canary(self, background: Background) -> None:
        """The agent's canary: idle GPUs only, one at a time, memory capped, each round in a child process
        that is killed a little before the runner would mark the probe HUNG (a crash or overrun is
        `canary.unknown`)."""
        cfg = self.canary_config
        probe = AgentCanaryProbe(level=cfg.level, evidence_dir=self.state_dir / "canary",
                                 nvml_scenario=self.nvml_config.scenario or None,
                                 timeout_s=0.9 * cfg.timeout_s)
        results = CanaryResults(self.gpus, self.publisher, self.gpu_metrics)
        self._run(ProbeRunner("canary", probe.run_once, interval_s=cfg.interval_s, timeout_s=cfg.timeout_s,
                              on_result=results.on_result, publish=self.publisher.publish,
                              observe=self.metrics.observe_probe), background)


class EventInbox:
    """Where the listener thread leaves NVML events for the event loop: folded as they arrive (memory bounded by
    the distinct events), handed over by at most one pending loop callback. A flood of single events costs the
    loop one call per turn, not one per event: on the H200 host the listener drained about one XID per wait
    and the loop, given one callback per batch, fell behind the flood until health checks missed their 1 s
    deadline (bench/bench_storm.py)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[Any]], None]) -> None:
        self._loop = loop
        self._deliver = deliver
        self._lock = threading.Lock()
        self._fold = EventFold()
        self._scheduled = False

    def put(self, batch: list[Any]) -> None:
        """From the listener thread."""
        with self._lock:
            self._fold.add(batch)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # the loop closed under a stopping agent: nothing left to tell
            pass

    def _drain(self) -> None:
        with self._lock:
            events = self._fold.take()
            self._scheduled = False
        if events:
            self._deliver(events)


class _ListenerBeat(ThreadBeat):
    """The XID listener's heartbeat; `frozen` (a scenario's rehearsal) stops the thread at its beat, as a
    deadlock in our own code would, until the agent stops."""

    def __init__(self, name: str, interval_s: float, stop: threading.Event) -> None:
        super().__init__(name, interval_s)
        self._stop = stop
        self.frozen: Callable[[], bool] = lambda: False

    def beat(self) -> None:
        if self.frozen():
            self._stop.wait()
        super().beat()


class NvmlPoller:
    """What NVML's polls and XID events do: evidence and identities in the GPU table, findings journaled,
    GPU metrics updated."""

    def __init__(self, gpus: GpuRegistry, publisher: Publisher, gpu_metrics: GpuMetrics,
                 metrics: AgentMetrics) -> None:
        self.gpus = gpus
        self.publisher = publisher
        self.gpu_metrics = gpu_metrics
        self.metrics = metrics
        self.frozen: Callable[[], bool] = lambda: False   # a scenario's rehearsal of a stopped loop
        self.events_unsupported: dict[str, list[str]] = {}   # uuid -> NVML event types it does not deliver

    def register(self, ident: GpuIdentity, now: float) -> None:
        self.gpu_metrics.identify(ident)
        self.gpus.ensure(ident.uuid, now, pci_bus_id=ident.pci_bus_id, name=ident.name, index=ident.index,
                         discovered_by="nvml")

    async def on_poll(self, result: Any, now: float) -> None:
        if self.frozen():   # the rehearsal: this loop stops here, as a deadlock in our own code would stop it
            log.warning("scenario agent_faults: the nvml loop stops now")
            await asyncio.Event().wait()
        gpus = self.gpus
        for uuid, ident in result.identities.items():
            if uuid not in gpus.gpus:
                self.register(ident, now)
            self.gpu_metrics.identify(ident)
        for uuid, evidence in result.evidence.items():
            if uuid in gpus.gpus:
                gpus.replace_source(uuid, "nvml", evidence, now)
        for uuid, fields in result.unsupported.items():
            if uuid in gpus.gpus:
                gpus.set_unsupported(uuid, [*fields, *self.events_unsupported.get(uuid, ())])
        for finding in result.findings:
            self.publisher.publish_finding(finding)
        for uuid, readings in result.readings.items():
            ident = self.gpu_metrics.identity(uuid)
            if ident is not None and uuid in gpus.gpus:
                self.gpu_metrics.update(ident, readings, gpus.gpus[uuid].state)

    def on_events(self, batch: list[Any]) -> None:
        """A batch of NVML events from the listener thread (identical ones folded, `count` each): evidence,
        metrics and one journal offer per distinct event; the bus folds repeats per (kind, GPU, XID, window)."""
        now = time.time()
        touched: dict[str, list[Evidence]] = {}
        for ev in batch:
            evidence, finding = NvmlProbe.event_evidence(ev)
            if ev.uuid not in self.gpus.gpus:
                self.gpus.ensure(ev.uuid, now, pci_bus_id=ev.pci_bus_id)
            ident = self.gpu_metrics.identity(ev.uuid)
            if ident is not None and ev.event == "xid":
                self.gpu_metrics.observe_xid(ident, ev.xid, ev.count)
            self.publisher.publish_finding(finding)
            touched.setdefault(ev.uuid, []).append(evidence)
        for uuid, evidence in touched.items():
            self.gpus.add_evidence(uuid, evidence, now)

    def on_events_open(self, registered: dict[int, list[str]]) -> None:
        """The event types registered per GPU index: the others are recorded NotSupported (`event.<name>`
        among the GPU's unsupported fields)."""
        by_index = {rec.index: uuid for uuid, rec in self.gpus.gpus.items() if rec.discovered_by == "nvml"}
        for index, uuid in by_index.items():
            names = registered.get(index, [])
            self.events_unsupported[uuid] = [f"event.{n}" for n in EVENT_TYPES if n not in names]
            rec = self.gpus.gpus[uuid]
            self.gpus.set_unsupported(uuid, [*rec.unsupported, *self.events_unsupported[uuid]])

    def mark_unknown(self, why: str | None) -> None:
        """Every NVML GPU UNKNOWN with `why` (no fresh readings), or back to its readings (None)."""
        now = time.time()
        for uuid in list(self.gpus.gpus):
            if self.gpus.gpus[uuid].discovered_by != "nvml":
                continue
            ev = Evidence(source="nvml", signal="hung", value="0" if why is None else "1",
                          implies=State.HEALTHY if why is None else State.UNKNOWN,
                          reason=why or "NVML answers again", time=now)
            self.gpus.add_evidence(uuid, [ev], now)

    def on_hung(self, hung: bool) -> None:
        self.mark_unknown("an NVML call is hung: no fresh readings" if hung else None)
        self.metrics.probe_hung.labels("nvml").set(1 if hung else 0)
        if hung:
            self.publisher.publish(ek.NVML_UNRESPONSIVE, "node", "an NVML call has not returned: the driver is "
                                   "unresponsive; the GPUs are UNKNOWN until it answers", {"probe": "nvml"})
        else:
            self.publisher.publish(ek.NVML_RESPONSIVE, "node", "the hung NVML call returned", {"probe": "nvml"})


class CanaryResults:
    """A canary round's results: evidence for this node's GPUs, findings journaled, per-GPU canary metrics."""

    def __init__(self, gpus: GpuRegistry, publisher: Publisher, gpu_metrics: GpuMetrics | None) -> None:
        self.gpus = gpus
        self.publisher = publisher
        self.gpu_metrics = gpu_metrics

    def on_result(self, report: Any, now: float) -> None:
        for uuid, evidence in report.evidence.items():
            if uuid in self.gpus.gpus:
                self.gpus.add_evidence(uuid, evidence, now)
        for finding in report.findings:
            self.publisher.publish_finding(finding)
        if report.suite is not None and self.gpu_metrics is not None:
            for uuid in report.evidence:
                ident = self.gpu_metrics.identity(uuid)
                if ident is None:
                    continue
                status, _ = report.suite.device_status(uuid)
                self.gpu_metrics.observe_canary(ident, status.name.lower())
