"""What the scheduler should learn about this node from its GPUs: Kubernetes node conditions and a taint.

Pure: `node_verdict(gpus)` turns the GPU table's states into a `NodeVerdict`; `condition_patch` and
`taints_after` turn a verdict into the body of a node-status patch and a node's new taint list.
daemon/k8s_nodes.py sends them (the `[kubernetes]` section, `KubernetesConfig`, says whether and how).

Conditions (status "True" means the problem is present, as node-problem-detector's do):
  SdcwatchGPUProblem     a GPU is FAILED (reason GPUFailed) or DEGRADED (GPUDegraded); "False" with
                         GPUsHealthy; "Unknown" (GPUsUnknown) when no GPU has evidence either way
  SdcwatchSDCSuspected   a GPU is SUSPECT of silent data corruption (SDCSuspected); "False" otherwise
The message names each GPU concerned and the evidence's reason. The taint (`taint_key`, NoSchedule) is
wanted while a GPU is FAILED and the operator enabled it; it goes when no GPU is FAILED any more (an
operator's `sdcwatch clear`, or evidence that heals it), never before.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Sequence

from daemon.errors import ConfigError
from sdcwatch.settings import setting
from sdcwatch.types import State

GPU_PROBLEM = "SdcwatchGPUProblem"
SDC_SUSPECTED = "SdcwatchSDCSuspected"
CONDITION_TYPES = (GPU_PROBLEM, SDC_SUSPECTED)
_MAX_MESSAGE = 1024
_TAINT_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


@dataclasses.dataclass(kw_only=True, slots=True)
class KubernetesConfig:
    """`[kubernetes]`: node conditions (and optionally a taint) on this node through the Kubernetes API."""

    node_conditions: bool = setting(
        False, "set the SdcwatchGPUProblem and SdcwatchSDCSuspected node conditions"
    )
    node_name: str = setting(
        "",
        "this node's Kubernetes name (default: [agent] hostname, which the DaemonSet "
        "sets from spec.nodeName)",
    )
    taint_failed: bool = setting(
        False, "also taint the node NoSchedule while a GPU is FAILED (RBAC: nodes patch)"
    )
    taint_key: str = setting("sdcwatch.io/gpu-failed", "the taint's key")
    kubeconfig: str = setting("", "a kubeconfig file (default: the in-cluster ServiceAccount)")
    timeout_s: float = setting(5.0, "seconds per API request")
    resync_s: float = setting(300.0, "conditions are re-sent this often even without a change (heartbeat)")

    def validate(self) -> None:
        if self.taint_failed and not self.node_conditions:
            raise ConfigError("kubernetes.taint_failed", "needs kubernetes.node_conditions = true")
        if not _TAINT_KEY.match(self.taint_key):
            raise ConfigError(
                "kubernetes.taint_key",
                f"{self.taint_key!r} is not a Kubernetes key ([prefix/]name, e.g. sdcwatch.io/gpu-failed)",
            )
        for key, value in (("kubernetes.timeout_s", self.timeout_s), ("kubernetes.resync_s", self.resync_s)):
            if not value > 0:
                raise ConfigError(key, f"must be positive, got {value}")


@dataclasses.dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str  # "True" (the problem is present), "False" or "Unknown"
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class NodeVerdict:
    conditions: tuple[Condition, ...]
    taint: bool  # a GPU is FAILED

    def statuses(self) -> dict[str, str]:
        return {c.type: c.status for c in self.conditions}


def node_verdict(gpus: Iterable[tuple[str, State, str]]) -> NodeVerdict:
    """`gpus`: (uuid, state, reason) of each GPU the agent knows."""
    by: dict[State, list[str]] = {}
    for uuid, state, reason in sorted(gpus):
        by.setdefault(state, []).append(f"{uuid}: {reason}" if reason else uuid)

    def listed(state: State) -> str:
        return "; ".join(by.get(state, []))

    if by.get(State.FAILED):
        problem = Condition(GPU_PROBLEM, "True", "GPUFailed", _cap(f"FAILED: {listed(State.FAILED)}"))
    elif by.get(State.DEGRADED):
        problem = Condition(GPU_PROBLEM, "True", "GPUDegraded", _cap(f"DEGRADED: {listed(State.DEGRADED)}"))
    elif any(s in by for s in (State.HEALTHY, State.SUSPECT)):
        problem = Condition(
            GPU_PROBLEM,
            "False",
            "GPUsHealthy",
            _cap(f"{sum(len(v) for v in by.values())} GPU(s), none FAILED or DEGRADED"),
        )
    else:
        problem = Condition(
            GPU_PROBLEM,
            "Unknown",
            "GPUsUnknown",
            _cap(f"no GPU evidence yet: {listed(State.UNKNOWN)}" if by else "no GPU found"),
        )
    if by.get(State.SUSPECT):
        sdc = Condition(SDC_SUSPECTED, "True", "SDCSuspected", _cap(f"SUSPECT: {listed(State.SUSPECT)}"))
    else:
        sdc = Condition(
            SDC_SUSPECTED, "False", "NoSDCSuspected", "no GPU is suspected of silent data corruption"
        )
    return NodeVerdict((problem, sdc), bool(by.get(State.FAILED)))


def condition_patch(verdict: NodeVerdict, previous: Mapping[str, str], now: str) -> dict[str, Any]:
    """A strategic-merge patch of the node's status (conditions merge by `type`). `previous`: type -> status
    as the node has it now (lastTransitionTime moves only when the status changes); `now`: RFC 3339."""
    conditions = []
    for c in verdict.conditions:
        entry = {
            "type": c.type,
            "status": c.status,
            "reason": c.reason,
            "message": c.message,
            "lastHeartbeatTime": now,
        }
        if previous.get(c.type) != c.status:
            entry["lastTransitionTime"] = now
        conditions.append(entry)
    return {"status": {"conditions": conditions}}


def taints_after(
    current: Sequence[Mapping[str, Any]], want: bool, key: str, now: str
) -> list[dict[str, Any]] | None:
    """The node's taint list with ours added (`want`) or removed; None when it is already so. Other
    controllers' taints are kept as they are."""
    ours = [t for t in current if t.get("key") == key and t.get("effect") == "NoSchedule"]
    if bool(ours) == want:
        return None
    kept = [dict(t) for t in current if not (t.get("key") == key and t.get("effect") == "NoSchedule")]
    if want:
        kept.append({"key": key, "value": "true", "effect": "NoSchedule", "timeAdded": now})
    return kept


def _cap(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."
