"""Node conditions and the FAILED taint through the Kubernetes API (the `lightkube` client, the
`sdcwatch[k8s]` extra: about 8 MB installed with its HTTP stack, where the official `kubernetes` client
and what it pulls took about 100 MB of the agent image; bench/image_size.py). What to send is decided in
daemon/node_conditions.py; this module sends it.

Lifecycle: `build(config, node, gpus)` (daemon/compose.py, when `[kubernetes] node_conditions`) ->
NodeHealth starts it with the agent's background tasks and calls `notify()` after every health sync (a
GPU's state changed) -> `run()` reads the GPU table, and `NodeReporter.push` GETs the node, PATCHes its
status conditions when they changed or the heartbeat is due (strategic merge: conditions merge by type,
other controllers' stay), and, with `taint_failed`, PATCHes the taint list (a merge patch carrying the
node's resourceVersion: a concurrent change to the node makes it fail with 409 and the next try re-reads).
A failed push is logged and retried with backoff; it never stops the agent.

Credentials: in a pod, the ServiceAccount's token (read again from its file after a 401, so a rotated bound
token is used), its CA and KUBERNETES_SERVICE_HOST/PORT; otherwise `kubernetes.kubeconfig` (lightkube reads
kubeconfig files, exec plugins included).

RBAC (deploy/kubernetes/base/sdcwatch-agent.yaml, overlays/fleet-sentinel/rbac-taint.yaml): `get` on nodes,
`patch` on nodes/status, and `patch` on nodes only with the taint.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from daemon.background import Background
from daemon.gpus import GpuRegistry
from daemon.node_conditions import KubernetesConfig, NodeVerdict, condition_patch, node_verdict, taints_after
from daemon.pools import WorkPool
from sdcwatch.errors import FatalError

log = logging.getLogger(__name__)


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def client(config: Any, timeout_s: float, *, trust_env: bool = True) -> Any:
    """A `lightkube.Client` for `config` (a `lightkube.KubeConfig`) whose every request is bounded by
    `timeout_s` (connect, read, write and pool wait each)."""
    import lightkube

    return lightkube.Client(config, timeout=timeout_s, trust_env=trust_env)


class NodeReporter:
    """Blocking pushes of a verdict to one node. `api`: a `lightkube.Client` (`client()`; its timeout
    bounds each request); `taint_key` None keeps the taint alone; `heartbeat_s`: conditions are re-sent this
    often even when unchanged; `timeout_s` bounds a whole push in NodeConditions. A refused request raises
    `lightkube.ApiError` (its `.status.code`: 409 when the node changed under a taint patch)."""

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
        # the optional extra, imported where it is used (daemon/compose.py imports this module always)
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        now = self.clock()
        stamp = rfc3339(now)
        node = self.api.get(Node, self.node_name)
        status = node.status.conditions if node.status is not None else None
        previous = {c.type: c.status for c in status or []}
        due = self._sent is None or self._sent[0] != verdict or now - self._sent[1] >= self.heartbeat_s
        if due or any(previous.get(c.type) != c.status for c in verdict.conditions):
            # the patched node comes back with its new resourceVersion, which the taint patch must carry
            patch = condition_patch(verdict, previous, stamp)
            node = self.api.patch(Node.Status, self.node_name, patch, patch_type=PatchType.STRATEGIC)
            self.stats["condition_patches"] += 1
            self._sent = (verdict, now)
        if self.taint_key is not None:
            taints = node.spec.taints if node.spec is not None else None
            current = [t.to_dict() for t in taints or []]
            wanted = taints_after(current, verdict.taint, self.taint_key, stamp)
            if wanted is not None:
                self.api.patch(
                    Node,
                    self.node_name,
                    {
                        "metadata": {"resourceVersion": node.metadata.resourceVersion},
                        "spec": {"taints": wanted},
                    },
                    patch_type=PatchType.MERGE,
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
        # lightkube is the optional `sdcwatch[k8s]` extra: imported only for node conditions
        import lightkube
    except ImportError as e:
        raise FatalError(
            f"kubernetes.node_conditions needs the Kubernetes client: pip install 'sdcwatch[k8s]' ({e})"
        ) from e
    try:
        if config.kubeconfig:
            api = client(lightkube.KubeConfig.from_file(config.kubeconfig), config.timeout_s)
        else:
            # the pod's token (read again from its file after a 401: kubelet rotates it), its CA,
            # KUBERNETES_SERVICE_HOST/PORT; proxy variables are not followed to the API server (nor did the
            # official client follow them)
            api = client(lightkube.KubeConfig.from_service_account(), config.timeout_s, trust_env=False)
    except (lightkube.ConfigError, KeyError, OSError, ValueError) as e:
        raise FatalError(
            f"kubernetes.node_conditions: no API credentials ({type(e).__name__}: {e}); run in a pod with "
            "the sdcwatch ServiceAccount or set kubernetes.kubeconfig"
        ) from e
    reporter = NodeReporter(
        api,
        config.node_name or node_name,
        taint_key=config.taint_key if config.taint_failed else None,
        heartbeat_s=config.resync_s,
        timeout_s=config.timeout_s,
    )
    return NodeConditions(reporter, gpus, resync_s=config.resync_s)
