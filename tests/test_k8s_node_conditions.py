"""Node conditions and the FAILED taint through the agent's client (lightkube), against a recording
stand-in for the API server (tests/k8s_support.py) that speaks in the official `kubernetes` client's models
and refuses any body they refuse: what is sent, with which patch type, and when."""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from collections.abc import Iterator

import pytest
from deadlines import scaled
from k8s_support import MERGE, STRATEGIC, TOKEN, FakeApiServer, ModelError, checked
from kubernetes import client as k8s

from daemon.background import Background
from daemon.errors import ConfigError
from daemon.gpus import GpuRegistry
from daemon.k8s_nodes import NodeConditions, NodeReporter, build
from daemon.node_conditions import GPU_PROBLEM, SDC_SUSPECTED, KubernetesConfig, node_verdict
from sdcwatch.errors import FatalError
from sdcwatch.types import Evidence, State

NODE = "gpu-node-7"
KEY = "sdcwatch.io/gpu-failed"
OTHER = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.fixture()
def server() -> Iterator[FakeApiServer]:
    s = FakeApiServer(NODE, taints=[dict(OTHER)]).start()
    try:
        yield s
        assert s.invalid == [], "the agent sent a body the kubernetes client's models refuse"
    finally:
        s.stop()


def keys(server: FakeApiServer) -> list[str]:
    return [t.key for t in server.taints()]


def test_failed_gpu_sets_conditions_and_taint_and_evidence_clears_them(server: FakeApiServer) -> None:
    t0 = 1_700_000_000.0
    now = [t0]
    rep = NodeReporter(server.api(), NODE, taint_key=KEY, clock=lambda: now[0])
    failed = node_verdict([("GPU-a", State.FAILED, "XID 79: fell off the bus"), ("GPU-b", State.HEALTHY, "")])
    rep.push(failed)
    at = datetime.datetime.fromtimestamp(t0, datetime.timezone.utc)
    c = server.condition(GPU_PROBLEM)
    assert c is not None and (c.status, c.reason) == ("True", "GPUFailed")
    assert "GPU-a: XID 79: fell off the bus" in c.message and c.last_transition_time == at
    assert c.last_heartbeat_time == at
    assert server.condition(SDC_SUSPECTED).status == "False"
    assert server.condition("Ready").status == "True", "other conditions are left alone"
    assert keys(server) == ["nvidia.com/gpu", KEY], "other taints are kept"
    ours = server.taints()[1]
    assert (ours.effect, ours.value, ours.time_added) == ("NoSchedule", "true", at)
    status_patch, taint_patch = server.patches()
    # every body the agent sent is a V1Node the client's models accept (the fixture checks none was refused)
    assert status_patch.path == f"/api/v1/nodes/{NODE}/status" and status_patch.content_type == STRATEGIC
    assert set(status_patch.body) == {"status"} and set(status_patch.body["status"]) == {"conditions"}
    sent = status_patch.model.status.conditions
    assert all(isinstance(x, k8s.V1NodeCondition) for x in sent)
    assert {x.type for x in sent} == {GPU_PROBLEM, SDC_SUSPECTED}, "only our conditions, merged by type"
    assert taint_patch.path == f"/api/v1/nodes/{NODE}" and taint_patch.content_type == MERGE
    assert set(taint_patch.body) == {"metadata", "spec"} and set(taint_patch.body["spec"]) == {"taints"}
    assert taint_patch.body["metadata"] == {"resourceVersion": "2"}, "the version the status patch returned"
    assert [(t.key, t.effect) for t in taint_patch.model.spec.taints] == [
        ("nvidia.com/gpu", "NoSchedule"),
        (KEY, "NoSchedule"),
    ], "a merge patch replaces the list: it carries the other taints as they were"
    assert server.node.metadata.resource_version == "3"
    assert {r.authorization for r in server.requests} == {f"Bearer {TOKEN}"}
    # the same verdict again: read, nothing patched
    rep.push(failed)
    assert len(server.patches()) == 2
    # evidence clears the GPU (an operator's clear, a passing canary): condition False, our taint gone
    now[0] = t0 + 60
    rep.push(node_verdict([("GPU-a", State.HEALTHY, ""), ("GPU-b", State.SUSPECT, "canary mismatch")]))
    c = server.condition(GPU_PROBLEM)
    assert (c.status, c.reason) == ("False", "GPUsHealthy")
    assert c.last_transition_time == at + datetime.timedelta(seconds=60), "the status changed"
    sdc = server.condition(SDC_SUSPECTED)
    assert (sdc.status, sdc.reason) == ("True", "SDCSuspected") and "GPU-b: canary mismatch" in sdc.message
    assert server.taints() == [k8s.V1Taint(**OTHER)]
    clear_status, clear_taint = server.patches()[2:]
    assert (clear_status.content_type, clear_taint.content_type) == (STRATEGIC, MERGE)
    assert clear_taint.body["metadata"] == {"resourceVersion": "4"}
    assert clear_taint.model.spec.taints == [k8s.V1Taint(**OTHER)]
    assert [c.type for c in server.node.status.conditions] == ["Ready", GPU_PROBLEM, SDC_SUSPECTED]


def test_no_evidence_is_unknown_and_no_taint_without_the_option(server: FakeApiServer) -> None:
    rep = NodeReporter(server.api(), NODE)
    rep.push(node_verdict([("GPU-a", State.UNKNOWN, "NVML not readable")]))
    c = server.condition(GPU_PROBLEM)
    assert (c.status, c.reason) == ("Unknown", "GPUsUnknown") and "NVML not readable" in c.message
    rep.push(node_verdict([("GPU-a", State.FAILED, "ECC DBE")]))
    assert server.condition(GPU_PROBLEM).status == "True"
    assert server.taints() == [k8s.V1Taint(**OTHER)]
    assert all(r.path.endswith("/status") and r.content_type == STRATEGIC for r in server.patches())


def test_a_concurrent_taint_change_conflicts_and_the_next_push_applies_it(server: FakeApiServer) -> None:
    import lightkube
    from lightkube.resources.core_v1 import Node
    from lightkube.types import PatchType

    rep = NodeReporter(server.api(), NODE, taint_key=KEY)
    server.conflict_next = 1
    with pytest.raises(lightkube.ApiError) as err:
        rep.push(node_verdict([("GPU-a", State.FAILED, "x")]))
    assert err.value.status.code == 409 and err.value.status.reason == "Conflict"
    assert server.taints() == [k8s.V1Taint(**OTHER)]
    rep.push(node_verdict([("GPU-a", State.FAILED, "x")]))
    assert keys(server) == ["nvidia.com/gpu", KEY]
    # a stale resourceVersion (another writer moved the node on) is refused as the API server does
    with pytest.raises(lightkube.ApiError) as err:
        stale = {"metadata": {"resourceVersion": "1"}, "spec": {"taints": []}}
        server.api().patch(Node, NODE, stale, patch_type=PatchType.MERGE)
    assert err.value.status.code == 409 and keys(server) == ["nvidia.com/gpu", KEY]


def test_the_recording_server_refuses_what_the_client_models_refuse(server: FakeApiServer) -> None:
    """The check every request goes through is the client's models, strictly: an unknown field, a
    mistyped one, a bad date-time and a missing required field are each refused (and listed)."""
    good = {"type": GPU_PROBLEM, "status": "True", "lastHeartbeatTime": "2026-12-01T00:00:00Z"}
    assert checked({"status": {"conditions": [good]}}, "V1Node").status.conditions[0].type == GPU_PROBLEM
    bad = [
        {"status": {"conditions": [dict(good, lastHeartbeatTme="2026-12-01T00:00:00Z")]}},
        {"status": {"conditions": [dict(good, status=True)]}},
        {"status": {"conditions": [dict(good, lastHeartbeatTime=1764547200)]}},
        {"status": {"conditions": [dict(good, lastHeartbeatTime="yesterday")]}},
        {"status": {"conditions": [{"type": GPU_PROBLEM}]}},
        {"spec": {"taints": [{"key": KEY, "value": "true"}]}},
        {"metadata": {"resourceVersion": 2}, "spec": {"taints": []}},
    ]
    for body in bad:
        with pytest.raises(ModelError):
            checked(body, "V1Node")
    import httpx

    r = httpx.patch(
        f"{server.url}/api/v1/nodes/{NODE}/status",
        content=json.dumps(bad[0]),
        headers={"Content-Type": STRATEGIC},
    )
    assert r.status_code == 400 and "lastHeartbeatTme" in r.json()["message"]
    assert len(server.invalid) == 1 and server.condition(GPU_PROBLEM) is None
    r = httpx.patch(f"{server.url}/api/v1/nodes/{NODE}/status", json={"status": {}})
    assert r.status_code == 415, "a status patch is a strategic merge patch"
    server.invalid.clear()


def test_the_agent_loop_follows_the_gpu_table_and_survives_an_api_outage(server: FakeApiServer) -> None:
    async def scenario() -> None:
        gpus = GpuRegistry()
        gpus.ensure("GPU-a", time.time())
        live = NodeConditions(
            NodeReporter(server.api(2.0), NODE, taint_key=KEY, timeout_s=2.0),
            gpus,
            resync_s=60.0,
            retry_s=(0.05, 0.2),
        )
        gpus.on_transition = lambda *a: live.notify()
        bg = Background()
        live.start(bg)
        gpus.add_evidence(
            "GPU-a", [Evidence("nvml", "xid", "79", State.FAILED, "XID 79", time.time())], time.time()
        )
        deadline = time.monotonic() + scaled(30)
        # the status patch comes first, the taint patch right after it in the same push
        while getattr(server.condition(GPU_PROBLEM), "status", None) != "True" or KEY not in keys(server):
            assert time.monotonic() < deadline, "the FAILED GPU never became a node condition and taint"
            await asyncio.sleep(0.01)
        server.stop()  # the API goes away: pushes fail, are retried, the loop lives on
        gpus.clear("GPU-a", time.time(), by="test", why="replaced")
        await asyncio.sleep(0.5)
        assert live.reporter.stats["failures"] >= 1 and live.last_error
        await bg.cancel()

    asyncio.run(scenario())


def test_config_and_credentials_are_checked() -> None:
    with pytest.raises(ConfigError, match="kubernetes.taint_failed"):
        KubernetesConfig(taint_failed=True).validate()
    with pytest.raises(ConfigError, match="kubernetes.taint_key"):
        KubernetesConfig(node_conditions=True, taint_key="not a key").validate()
    with pytest.raises(FatalError, match="ServiceAccount|kubeconfig"):
        build(KubernetesConfig(node_conditions=True), NODE, GpuRegistry())  # not in a pod, no kubeconfig


def test_build_from_a_kubeconfig_pushes_to_its_server(server: FakeApiServer, tmp_path) -> None:
    """The production constructor end to end: a kubeconfig file (server, bearer token) -> lightkube ->
    the recording server."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters:\n- name: k\n  cluster:\n    server: {server.url}\n"
        f"users:\n- name: u\n  user:\n    token: {TOKEN}\n"
        "contexts:\n- name: c\n  context:\n    cluster: k\n    user: u\n"
    )
    live = build(
        KubernetesConfig(node_conditions=True, taint_failed=True, kubeconfig=str(kubeconfig)),
        NODE,
        GpuRegistry(),
    )
    assert live.reporter.taint_key == KEY and live.reporter.node_name == NODE
    live.reporter.push(node_verdict([("GPU-a", State.FAILED, "XID 79")]))
    assert server.condition(GPU_PROBLEM).status == "True" and KEY in keys(server)
    assert {r.authorization for r in server.requests} == {f"Bearer {TOKEN}"}
    with pytest.raises(FatalError, match="kubeconfig"):
        missing = str(tmp_path / "missing")
        build(KubernetesConfig(node_conditions=True, kubeconfig=missing), NODE, GpuRegistry())
