"""Node conditions and the FAILED taint through the agent's client (lightkube), against a recording
stand-in for the API server (tests/k8s_support.py): what is sent, with which patch type, and when."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from deadlines import scaled
from k8s_support import TOKEN, FakeApiServer

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
    finally:
        s.stop()


def test_failed_gpu_sets_conditions_and_taint_and_evidence_clears_them(server: FakeApiServer) -> None:
    rep = NodeReporter(server.api(), NODE, taint_key=KEY, clock=lambda: 1_700_000_000.0)
    rep.push(
        node_verdict([("GPU-a", State.FAILED, "XID 79: fell off the bus"), ("GPU-b", State.HEALTHY, "")])
    )
    c = server.condition(GPU_PROBLEM)
    assert c is not None and (c["status"], c["reason"]) == ("True", "GPUFailed")
    assert (
        "GPU-a: XID 79: fell off the bus" in c["message"]
        and c["lastTransitionTime"] == "2023-11-14T22:13:20Z"
    )
    assert server.condition(SDC_SUSPECTED)["status"] == "False"
    assert server.condition("Ready")["status"] == "True", "other conditions are left alone"
    assert [t["key"] for t in server.taints()] == ["nvidia.com/gpu", KEY], "other taints are kept"
    status_patch, taint_patch = server.patches()
    assert status_patch.path == f"/api/v1/nodes/{NODE}/status"
    assert status_patch.content_type == "application/strategic-merge-patch+json"
    assert taint_patch.content_type == "application/merge-patch+json"
    assert taint_patch.body["metadata"]["resourceVersion"] == "2", "the version the status patch returned"
    assert {r.authorization for r in server.requests} == {f"Bearer {TOKEN}"}
    # the same verdict again: read, nothing patched
    rep.push(
        node_verdict([("GPU-a", State.FAILED, "XID 79: fell off the bus"), ("GPU-b", State.HEALTHY, "")])
    )
    assert len(server.patches()) == 2
    # evidence clears the GPU (an operator's clear, a passing canary): condition False, our taint gone
    rep.push(node_verdict([("GPU-a", State.HEALTHY, ""), ("GPU-b", State.SUSPECT, "canary mismatch")]))
    assert (server.condition(GPU_PROBLEM)["status"], server.condition(GPU_PROBLEM)["reason"]) == (
        "False",
        "GPUsHealthy",
    )
    sdc = server.condition(SDC_SUSPECTED)
    assert (sdc["status"], sdc["reason"]) == ("True", "SDCSuspected") and "GPU-b: canary mismatch" in sdc[
        "message"
    ]
    assert server.taints() == [OTHER]


def test_no_evidence_is_unknown_and_no_taint_without_the_option(server: FakeApiServer) -> None:
    rep = NodeReporter(server.api(), NODE)
    rep.push(node_verdict([("GPU-a", State.UNKNOWN, "NVML not readable")]))
    c = server.condition(GPU_PROBLEM)
    assert (c["status"], c["reason"]) == ("Unknown", "GPUsUnknown") and "NVML not readable" in c["message"]
    rep.push(node_verdict([("GPU-a", State.FAILED, "ECC DBE")]))
    assert server.condition(GPU_PROBLEM)["status"] == "True"
    assert server.taints() == [OTHER] and all(r.path.endswith("/status") for r in server.patches())


def test_a_concurrent_taint_change_conflicts_and_the_next_push_applies_it(server: FakeApiServer) -> None:
    import lightkube

    rep = NodeReporter(server.api(), NODE, taint_key=KEY)
    server.conflict_next = 1
    with pytest.raises(lightkube.ApiError) as err:
        rep.push(node_verdict([("GPU-a", State.FAILED, "x")]))
    assert err.value.status.code == 409 and server.taints() == [OTHER]
    rep.push(node_verdict([("GPU-a", State.FAILED, "x")]))
    assert [t["key"] for t in server.taints()] == ["nvidia.com/gpu", KEY]


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
        while (server.condition(GPU_PROBLEM) or {}).get("status") != "True" or KEY not in [
            t["key"] for t in server.taints()
        ]:
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
    assert server.condition(GPU_PROBLEM)["status"] == "True" and KEY in [t["key"] for t in server.taints()]
    assert {r.authorization for r in server.requests} == {f"Bearer {TOKEN}"}
    with pytest.raises(FatalError, match="kubeconfig"):
        missing = str(tmp_path / "missing")
        build(KubernetesConfig(node_conditions=True, kubeconfig=missing), NODE, GpuRegistry())
