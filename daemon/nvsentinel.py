"""GPU health events to NVIDIA NVSentinel over its platform connector's gRPC API (a unix socket).

`[nvsentinel] socket` set: after each health sync (NodeHealth notifies it, like the node conditions) the
GPUs whose state changed since the last send go to `PlatformConnector.HealthEventOccuredV1` in one
`HealthEvents` (proto/nvsentinel/platformconnector.proto). A GPU's event:

  state     checkName                     isFatal  isHealthy  recommendedAction
  FAILED    SdcwatchGPUHealth             true     false      RESET_GPU (NVSentinel's remediation decides more)
  DEGRADED  SdcwatchGPUHealth             false    false      REPORT_ISSUE
  SUSPECT   SdcwatchSilentDataCorruption  false    false      RUN_FIELDDIAG (field diagnostics settle it)
  HEALTHY   both checks                   false    true       NONE (clears what the two checks raised)
  UNKNOWN   nothing is sent (no verdict without evidence)

with agent "sdcwatch", componentClass "GPU", the GPU's UUID as entity GPU_UUID (and PCI bus id as PCI), the
evidence's reason as the message, the node's name and the time. A failed send is retried with backoff,
the unsent changes kept; it never stops the agent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Iterable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from daemon.background import Background
from daemon.errors import ConfigError
from daemon.gpus import GpuRegistry
from proto.nvsentinel import platformconnector_pb2 as pc
from proto.nvsentinel import platformconnector_pb2_grpc as pc_grpc
from sdcwatch.channels import unix_aio_channel
from sdcwatch.settings import setting
from sdcwatch.types import State

log = logging.getLogger(__name__)

AGENT = "sdcwatch"
GPU_CHECK = "SdcwatchGPUHealth"
SDC_CHECK = "SdcwatchSilentDataCorruption"


@dataclasses.dataclass(kw_only=True, slots=True)
class NvsentinelConfig:
    """`[nvsentinel]`: GPU health events to NVSentinel's platform connector."""

    socket: str = setting(
        "",
        "the platform connector's unix socket, e.g. /var/run/nvsentinel/platform-connector.sock (empty: off)",
    )
    timeout_s: float = setting(5.0, "seconds per send")

    def validate(self) -> None:
        if self.socket and not self.socket.startswith("/"):
            raise ConfigError("nvsentinel.socket", f"expected an absolute path, got {self.socket!r}")
        if not self.timeout_s > 0:
            raise ConfigError("nvsentinel.timeout_s", f"must be positive, got {self.timeout_s}")


def events_for(gpus: Iterable[tuple[str, str, State, str]], node: str, now: float) -> list[Any]:
    """HealthEvent messages for (uuid, pci_bus_id, state, reason) of GPUs whose state changed (pure)."""
    out = []
    ts = Timestamp()
    ts.FromNanoseconds(int(now * 1e9))
    for uuid, pci, state, reason in gpus:
        entities = [pc.Entity(entityType="GPU_UUID", entityValue=uuid)]
        if pci:
            entities.append(pc.Entity(entityType="PCI", entityValue=pci))

        def event(check: str, fatal: bool, healthy: bool, action: int, message: str) -> Any:
            return pc.HealthEvent(
                version=1,
                agent=AGENT,
                componentClass="GPU",
                checkName=check,
                isFatal=fatal,
                isHealthy=healthy,
                message=message[:1000],
                recommendedAction=action,
                errorCode=[state.name],
                entitiesImpacted=entities,
                metadata={"sdcwatch_state": state.name},
                generatedTimestamp=ts,
                nodeName=node,
            )

        text = f"GPU {uuid} is {state.name}: {reason}" if reason else f"GPU {uuid} is {state.name}"
        if state is State.FAILED:
            out.append(event(GPU_CHECK, True, False, pc.RESET_GPU, text))
        elif state is State.DEGRADED:
            out.append(event(GPU_CHECK, False, False, pc.REPORT_ISSUE, text))
        elif state is State.SUSPECT:
            out.append(event(SDC_CHECK, False, False, pc.RUN_FIELDDIAG, text))
        elif state is State.HEALTHY:
            out.append(event(GPU_CHECK, False, True, pc.NONE, text))
            out.append(event(SDC_CHECK, False, True, pc.NONE, text))
    return out


class NvsentinelEvents:
    """A NodeHealth follower: `notify()` after a sync; `start(background)` runs the sender."""

    def __init__(
        self,
        config: NvsentinelConfig,
        node: str,
        gpus: GpuRegistry,
        *,
        clock: Callable[[], float] = time.time,
        retry_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self.config = config
        self.node = node
        self.gpus = gpus
        self.clock = clock
        self.retry_s = retry_s
        self.changed = asyncio.Event()
        self.sent: dict[str, State] = {}  # uuid -> the state NVSentinel last heard
        self.stats = {"sends": 0, "events": 0, "failures": 0}
        self._channel: grpc.aio.Channel | None = None

    def notify(self) -> None:
        self.changed.set()

    def start(self, background: Background) -> None:
        background.start(self.run(), name="nvsentinel")

    def pending(self) -> list[tuple[str, str, State, str]]:
        return [
            (r.uuid, r.pci_bus_id, r.state, r.reason)
            for r in list(self.gpus.gpus.values())
            if r.state is not State.UNKNOWN and self.sent.get(r.uuid) is not r.state
        ]

    async def send_once(self) -> int:
        """Send the pending changes; returns how many events went. Raises grpc.aio.AioRpcError on failure."""
        todo = self.pending()
        if not todo:
            return 0
        events = events_for(todo, self.node, self.clock())
        if self._channel is None:
            self._channel = unix_aio_channel(self.config.socket)
        stub = pc_grpc.PlatformConnectorStub(self._channel)
        await stub.HealthEventOccuredV1(
            pc.HealthEvents(version=1, events=events), timeout=self.config.timeout_s
        )
        for uuid, _, state, _ in todo:
            self.sent[uuid] = state
        self.stats["sends"] += 1
        self.stats["events"] += len(events)
        return len(events)

    async def run(self) -> None:
        delay = 0.0
        try:
            while True:
                if delay:
                    try:
                        await asyncio.wait_for(self.changed.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await self.changed.wait()
                self.changed.clear()
                try:
                    await self.send_once()
                    delay = 0.0
                except grpc.aio.AioRpcError as e:
                    self.stats["failures"] += 1
                    delay = min(self.retry_s[1], max(self.retry_s[0], delay * 2))
                    log.warning(
                        "NVSentinel at %s did not take the health events (retry in %.1f s): %s %s",
                        self.config.socket,
                        delay,
                        e.code().name,
                        e.details(),
                    )
        finally:
            if self._channel is not None:
                await self._channel.close()
