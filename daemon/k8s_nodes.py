"""Node conditions and the FAILED taint through the Kubernetes API (the official `kubernetes` client, the
`sdcwatch[k8s]` extra). What to send is decided in daemon/node_conditions.py; this module sends it.

Lifecycle: `build(config, node, gpus)` (daemon/compose.py, when `[kubernetes] node_conditions`) ->
NodeHealth starts it with the agent's background tasks and calls `notify()` after every health sync (a
GPU's state changed) -> `run()` reads the GPU table, and `NodeReporter.push` GETs the node, PATCHes its
status conditions when they changed or the heartbeat is due (strategic merge: conditions merge by type,
other controllers' stay), and, with `taint_failed`, PATCHes the taint list (a merge patch carrying the
node's resourceVersion: a concurrent change to the node makes it fail with 409 and the next try re-reads).
A failed push is logged and retried with backoff; it never stops the agent.

RBAC (deploy/kubernetes/base/sdcwatch-agent.yaml, overlays/fleet-sentinel/rbac-taint.yaml): `get` on nodes, `patch` on nodes/status, and `patch` on nodes only
with the taint.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any, Callable

from daemon.background import Background
from daemon.gpus import GpuRegistry
from sdcwatch.errors import FatalError
from daemon.node_conditions import KubernetesConfig, NodeVerdict, condition_patch, node_verdict, taints_after
from daemon.pools import WorkPool

log = logging.getLogger(__name__)

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeReporter:
    """Blocking pushes of a verdict to one node. `api`: a `kubernetes.client.CoreV1Api`; `taint_key` None
    keeps the taint alone; `heartbeat_s`: conditions are re-sent this often even when unchanged."""

    def __init__(
        self,
        api: Any,
        node_name: str,
        *,
        taint_key: str | None = None,
        heartbeat_s: float = 300.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.taint_key = taint_key
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._sent: tuple[NodeVerdict, float] | None = None
        self.stats = {"pushes": 0, "condition_patches": 0, "taint_patches": 0, "failures": 0}

    def push(self, verdict: NodeVerdict) -> None:
        now = self.clock()
        stamp = rfc3339(now)
        node = self.api.read_node(self.node_name, _request_timeout=self.timeout_s)
        status = node.status.conditions if node.status is not None else None
        previous = {c.type: c.status for c in status or []}
        due = self._sent is None or self._sent[0] != verdict or now - self._sent[1] >= self.heartbeat_s
        if due or any(previous.get(c.type) != c.status for c in verdict.conditions):
            # the patched node comes back with its new resourceVersion, which the taint patch must carry
            node = self.api.patch_node_status(
                self.node_name,
                condition_patch(verdict, previous, stamp),
                _content_type=STRATEGIC,
                _request_timeout=self.timeout_s,
            )
            self.stats["condition_patches"] += 1
            self._sent = (verdict, now)
        if self.taint_key is not None:
            current = [self.api.api_client.sanitize_for_serialization(t) for t in (node.spec.taints or [])]
            wanted = taints_after(current, verdict.taint, self.taint_key, stamp)
            if wanted is not None:
                self.api.patch_node(
                    self.node_name,
                    {
                        "metadata": {"resourceVersion": node.metadata.resource_version},
                        "spec": {"taints": wanted},
                    },
                    _content_type=MERGE,
                    _request_timeout=self.timeout_s,
                )
                self.stats["taint_patches"] += 1
        self.stats["pushes"] += 1


class NodeConditions:
    """The agent side: `notify()` after a GPU state change (NodeHealth calls it), `start(background)` runs the
    loop that pushes the GPU table's verdict (also every `resync_s`, and again after a failure)."""

    def __init__(
        self,
        reporter: NodeReporter,
        gpus: GpuRegistry,
        *,
        resync_s: float = 300.0,
        retry_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self.reporter = reporter
        self.gpus = gpus
        self.resync_s = resync_s
        self.retry_s = retry_s
        self.changed = asyncio.Event()
        self.last_error = ""
        # the API calls block: their own pool (never asyncio's shared default executor), each bounded below
        self.pool = WorkPool("kubernetes", workers=1)

    def notify(self) -> None:
        self.changed.set()

    def start(self, background: Background) -> None:
        background.start(self.run(), name="k8s-node-conditions")

    def verdict(self) -> NodeVerdict:
        return node_verdict((r.uuid, r.state, r.reason) for r in list(self.gpus.gpus.values()))

    async def run(self) -> None:
        delay = 0.0
        while True:
            try:
                await asyncio.wait_for(self.changed.wait(), delay or self.resync_s)
            except asyncio.TimeoutError:
                pass
            self.changed.clear()
            try:
                await asyncio.wait_for(
                    self.pool.run(self.reporter.push, self.verdict()), self.reporter.timeout_s * 3
                )
                delay, self.last_error = 0.0, ""
            except Exception as e:  # noqa: BLE001 - the API being down must not stop the agent
                self.reporter.stats["failures"] += 1
                delay = min(self.retry_s[1], max(self.retry_s[0], delay * 2))
                if str(e) != self.last_error:
                    log.warning(
                        "setting node %s's conditions failed (retry in %.1f s): %s",
                        self.reporter.node_name,
                        delay,
                        e,
                    )
                self.last_error = str(e)


def build(config: KubernetesConfig, node_name: str, gpus: GpuRegistry) -> NodeConditions:
    """The production reporter: the in-cluster ServiceAccount (or `config.kubeconfig`)."""
    try:
        # the `kubernetes` client is the optional `sdcwatch[k8s]` extra: imported only for node conditions
        import kubernetes.client
        import kubernetes.config
    except ImportError as e:
        raise FatalError(
            f"kubernetes.node_conditions needs the Kubernetes client: pip install 'sdcwatch[k8s]' ({e})"
        ) from e
    try:
        if config.kubeconfig:
            api_client = kubernetes.config.new_client_from_config(config_file=config.kubeconfig)
        else:
            kubernetes.config.load_incluster_config()
            api_client = kubernetes.client.ApiClient()
    except kubernetes.config.ConfigException as e:
        raise FatalError(
            f"kubernetes.node_conditions: no API credentials ({e}); run in a pod with the "
            "sdcwatch ServiceAccount or set kubernetes.kubeconfig"
        ) from e
    reporter = NodeReporter(
        kubernetes.client.CoreV1Api(api_client),
        config.node_name or node_name,
        taint_key=config.taint_key if config.taint_failed else None,
        heartbeat_s=config.resync_s,
        timeout_s=config.timeout_s,
    )
    return NodeConditions(reporter, gpus, resync_s=config.resync_s)
