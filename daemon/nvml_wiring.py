"""Connects the NVML probe to the agent: discovery, polling, XID events, GPU metrics.

(First version: discovery only; replaced by the full probe wiring.)
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.agent import Agent

log = logging.getLogger(__name__)


async def start(agent: "Agent") -> None:
    cfg = agent.config.nvml
    if not cfg.enabled:
        agent.gpus.nvml_available = False
        agent.gpus.nvml_reason = "NVML probe disabled by configuration (nvml.enabled = false)"
        return
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        agent.gpus.nvml_available = False
        agent.gpus.nvml_reason = f"NVML unavailable: {exc}"
        return
    agent.gpus.nvml_available = True
    agent.gpus.nvml_reason = ""
    import time

    for i in range(count):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        agent.gpus.ensure(pynvml.nvmlDeviceGetUUID(h), time.time(), index=i,
                          pci_bus_id=pynvml.nvmlDeviceGetPciInfo(h).busId, name=pynvml.nvmlDeviceGetName(h))
