"""Connects the NVML probe to the agent: backend, discovery, polling, XID events, GPU metrics.

Every NVML call runs on the probe's own worker thread (discovery and polls) or the XID thread, never on
the event loop. With no NVML the GPUs stay UNKNOWN and GetStatus says why.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from sdcwatch import event_kinds as ek
from sdcwatch.types import Evidence, State

if TYPE_CHECKING:
    from daemon.agent import Agent

log = logging.getLogger(__name__)


async def start(agent: "Agent") -> None:
    cfg = agent.config.nvml
    if not cfg.enabled:
        agent.gpus.nvml_available = False
        agent.gpus.nvml_reason = "NVML probe disabled by configuration (nvml.enabled = false)"
        agent.static_probes = {"nvml": ("DISABLED", agent.gpus.nvml_reason)}
        return
    from daemon.gpu_metrics import GpuMetrics
    from daemon.probe_runner import ProbeRunner
    from probes.nvml_backend import NvmlUnavailable, open_backend
    from probes.nvml_probe import NvmlProbe, NvmlProbeConfig

    wiring = NvmlWiring(agent, GpuMetrics(agent.metrics.registry))
    runner = ProbeRunner("nvml", lambda now: None, interval_s=cfg.poll_interval_s, timeout_s=cfg.timeout_s,
                         on_result=wiring.on_poll, publish=agent.bus.publish, observe=agent.metrics.observe_probe,
                         on_hung=wiring.on_hung)
    try:
        backend = await runner.call(lambda: open_backend(cfg.scenario or None, clock=time.monotonic))
        probe = NvmlProbe(backend, NvmlProbeConfig(skip_fields=cfg.skip_list(), rotate_per_poll=cfg.rotate_per_poll,
                                                   sweep_s=cfg.sweep_s))
        identities = await runner.call(probe.discover)
    except NvmlUnavailable as exc:
        runner.stop()
        agent.gpus.nvml_available = False
        agent.gpus.nvml_reason = str(exc)
        agent.static_probes = {"nvml": ("DISABLED", str(exc))}
        log.warning("%s: GPUs stay UNKNOWN", exc)
        return
    except Exception as exc:  # a bad scenario file, a driver error at start: run without GPU probes
        runner.stop()
        agent.gpus.nvml_available = False
        agent.gpus.nvml_reason = f"NVML probe could not start: {type(exc).__name__}: {exc}"
        agent.static_probes = {"nvml": ("FAILING", agent.gpus.nvml_reason)}
        log.error("%s", agent.gpus.nvml_reason)
        return
    agent.gpus.nvml_available = True
    agent.gpus.nvml_reason = ""
    if identities and identities[0].driver_version:
        agent.extra_versions["driver"] = identities[0].driver_version
    now = time.time()
    for ident in identities:
        wiring.register(ident, now)
    runner.fn = probe.poll
    wiring.probe = probe
    agent.add_probe(runner)
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    thread = threading.Thread(target=probe.run_xid_listener, name="sdcwatch-xid", daemon=True,
                              args=(lambda ev: loop.call_soon_threadsafe(wiring.on_xid, ev), stop))
    thread.start()
    agent.gpu_state_hook = wiring.on_state
    agent.closers += [stop.set, probe.close]
    if agent.config.canary.enabled:
        start_canary(agent, wiring)
    agent.bus.publish(ek.NVML_DISCOVERED, "node",
                      f"{len(identities)} GPU(s): " + ", ".join(f"{i.uuid} ({i.pci_bus_id})" for i in identities),
                      {"gpus": [{"uuid": i.uuid, "pci_bus_id": i.pci_bus_id, "name": i.name, "index": i.index}
                                for i in identities]})


class NvmlWiring:
    def __init__(self, agent: "Agent", metrics: Any) -> None:
        self.agent = agent
        self.metrics = metrics
        self.identities: dict[str, Any] = {}
        self.probe: Any = None

    def register(self, ident: Any, now: float) -> None:
        self.identities[ident.uuid] = ident
        self.agent.gpus.ensure(ident.uuid, now, pci_bus_id=ident.pci_bus_id, name=ident.name, index=ident.index,
                               discovered_by="nvml")

    def on_poll(self, result: Any, now: float) -> None:
        gpus = self.agent.gpus
        for uuid, ident in result.identities.items():
            if uuid not in gpus.gpus:
                self.register(ident, now)
            self.identities[uuid] = ident
        for uuid, evidence in result.evidence.items():
            if uuid in gpus.gpus:
                gpus.replace_source(uuid, "nvml", evidence, now)
        for uuid, fields in result.unsupported.items():
            if uuid in gpus.gpus:
                gpus.set_unsupported(uuid, fields)
        for finding in result.findings:
            self.agent.bus.publish_finding(finding)
        for uuid, readings in result.readings.items():
            ident = self.identities.get(uuid)
            if ident is not None and uuid in gpus.gpus:
                self.metrics.update(ident, readings, gpus.gpus[uuid].state)

    def on_xid(self, ev: Any) -> None:
        from probes.nvml_probe import NvmlProbe

        evidence, finding = NvmlProbe.xid_evidence(ev)
        now = time.time()
        if ev.uuid not in self.agent.gpus.gpus:
            self.agent.gpus.ensure(ev.uuid, now, pci_bus_id=ev.pci_bus_id)
        ident = self.identities.get(ev.uuid)
        if ident is not None:
            self.metrics.observe_xid(ident, ev.xid)
        self.agent.bus.publish_finding(finding)
        self.agent.gpus.add_evidence(ev.uuid, [evidence], now)

    def on_hung(self, hung: bool) -> None:
        now = time.time()
        for uuid in list(self.agent.gpus.gpus):
            if self.agent.gpus.gpus[uuid].discovered_by != "nvml":
                continue
            ev = Evidence(source="nvml", signal="hung", value="1" if hung else "0",
                          implies=State.UNKNOWN if hung else State.HEALTHY,
                          reason=("an NVML call is hung: no fresh readings" if hung else "NVML answers again"),
                          time=now)
            self.agent.gpus.add_evidence(uuid, [ev], now)
        self.agent.metrics.probe_hung.labels("nvml").set(1 if hung else 0)

    def on_state(self, rec: Any) -> None:
        ident = self.identities.get(rec.uuid)
        if ident is not None:
            self.metrics.set_state(ident, rec.state)


def start_canary(agent: "Agent", wiring: "NvmlWiring") -> None:
    """The agent's canary: idle GPUs only, one at a time, memory capped, each round in a child process that
    is killed a little before the runner would mark the probe HUNG (a crash or overrun is `canary.unknown`)."""
    from daemon.probe_runner import ProbeRunner
    from probes.canary_agent import AgentCanaryProbe

    cfg = agent.config.canary
    probe = AgentCanaryProbe(level=cfg.level, evidence_dir=agent.state_dir / "canary",
                             nvml_scenario=agent.config.nvml.scenario or None, timeout_s=0.9 * cfg.timeout_s)

    def on_result(report: Any, now: float) -> None:
        for uuid, evidence in report.evidence.items():
            if uuid in agent.gpus.gpus:
                agent.gpus.add_evidence(uuid, evidence, now)
        for finding in report.findings:
            agent.bus.publish_finding(finding)
        if report.suite is not None:
            for uuid in report.evidence:
                ident = wiring.identities.get(uuid)
                if ident is None:
                    continue
                status, _ = report.suite.device_status(uuid)
                wiring.metrics.observe_canary(ident, status.name.lower())

    agent.add_probe(ProbeRunner("canary", probe.run_once, interval_s=cfg.interval_s, timeout_s=cfg.timeout_s,
                                on_result=on_result, publish=agent.bus.publish,
                                observe=agent.metrics.observe_probe))
