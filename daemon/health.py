"""`NodeHealth`: the agent's grpc.health.v1 answers and the node-state gauge, derived from the GPU table.

Names (docs: DESIGN.md "Health names"): `sdcwatch.v1.Agent` is SERVING while the agent is serving (ready, not
stopping), none of its loops is stale (daemon/watchdog.py: `stale_loops` says why) and none of its service
pools is wedged (`check_pools`, daemon/pools.py); `""` (the node) also
needs no FAILED GPU; `gpu/<UUID>` follows that GPU. `sync()` sets them all;
after a GPU's state changed (daemon/gpu_transitions.py sets `changed`) the task started by `start()` syncs.
`followers` (e.g. daemon/k8s_nodes.py's node conditions) are started with it and notified after each sync.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol, Sequence

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from daemon.background import Background
from daemon.gpus import GpuRegistry
from daemon.metrics import AgentMetrics
from daemon.pools import WorkPool
from sdcwatch.types import State

AGENT_SERVICE = "sdcwatch.v1.Agent"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = logging.getLogger(__name__)


class AgentHealthServicer(HealthServicer):
    """grpc's asyncio health servicer, with `List` (newer stubs declare it; this grpcio-health-checking's
    servicer leaves it unimplemented, so a client calling it got UNKNOWN and the agent logged a traceback)."""

    async def List(self, request: health_pb2.HealthListRequest, context: object) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)   # the parent's table (name -> status), the one Check reads
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=st) for name, st in statuses.items()})


class HealthFollower(Protocol):
    def start(self, background: Background) -> None: ...
    def notify(self) -> None: ...


class NodeHealth:
    def __init__(self, servicer: HealthServicer, gpus: GpuRegistry, metrics: AgentMetrics,
                 changed: asyncio.Event, pools: Sequence[WorkPool] = (),
                 followers: Sequence[HealthFollower] = ()) -> None:
        self.servicer = servicer
        self.followers = tuple(followers)
        self.pools = tuple(pools)
        self.wedged: list[str] = []   # the wedged pools' descriptions
        self.gpus = gpus
        self.metrics = metrics
        self.changed = changed
        self.serving = False
        self.stale_loops: dict[str, str] = {}   # loop -> why (the watchdog's)

    def set_stale_loops(self, stale: dict[str, str]) -> None:
        """The watchdog's verdict; the follow task re-syncs the answers."""
        self.stale_loops = dict(stale)
        self.changed.set()

    def start(self, background: Background) -> None:
        background.start(self._follow(), name="health")
        for f in self.followers:
            f.start(background)

    async def _follow(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            await self.sync()

    async def not_serving(self) -> None:
        """While starting: every name NOT_SERVING."""
        await self.servicer.set("", NOT_SERVING)
        await self.servicer.set(AGENT_SERVICE, NOT_SERVING)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        await self.sync()

    async def sync(self) -> None:
        serving = self.serving
        node_state, _ = self.gpus.node_state()
        await self.servicer.set("", SERVING if serving and node_state is not State.FAILED else NOT_SERVING)
        await self.servicer.set(AGENT_SERVICE, SERVING if serving and not self.stale_loops and not self.wedged
                                else NOT_SERVING)
        for rec in list(self.gpus.gpus.values()):
            ok = serving and rec.state is not State.FAILED
            await self.servicer.set(f"gpu/{rec.uuid}", SERVING if ok else NOT_SERVING)
        self.update_node_metrics()
        for f in self.followers:
            f.notify()

    async def check_pools(self, now: float) -> None:
        """Re-check the service pools (each second, from the agent's housekeeping); sync on a change."""
        wedged = [p.describe() for p in self.pools if p.wedged(now)]
        if bool(wedged) != bool(self.wedged):
            if wedged:
                log.error("wedged: %s; the agent's health is NOT_SERVING until calls finish", "; ".join(wedged))
            else:
                log.warning("the service pools make progress again; the agent's health follows its state")
            self.wedged = wedged
            await self.sync()
        self.wedged = wedged

    def update_node_metrics(self) -> None:
        node_state, _ = self.gpus.node_state()
        for s in State:
            self.metrics.node_state.labels(s.name).set(1 if s is node_state else 0)
