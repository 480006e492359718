"""Kubernetes manifests: valid against the Kubernetes schemas (kubernetes-validate, from PyPI, which ships
the JSON schemas), the DaemonSet has what the agent needs, and the PrometheusRule is generated from the
same rules file as Prometheus uses (and passes promtool)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy_support import ROOT, RULES

K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"
import kubernetes_validate as kv   # noqa: E402 - the test extra: pip install 'sdcwatch[test]'


sys.path.insert(0, str(K8S))
import gen_prometheusrule  # noqa: E402


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


MANIFESTS = ("base/sdcwatch-agent.yaml", "monitoring/servicemonitor.yaml", "monitoring/prometheusrule.yaml")


def _all_docs() -> list[dict[str, Any]]:
    return [d for name in MANIFESTS for d in _docs(name)]


def _by_kind(kind: str) -> dict[str, Any]:
    found = [d for d in _all_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_core_resources_validate_against_the_kubernetes_schemas() -> None:
    checked = 0
    for doc in _all_docs():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: checked below
        kv.validate(doc, K8S_VERSION, strict=True)   # raises ValidationError with the path on a mistake
        checked += 1
    assert checked >= 4


def test_the_validator_catches_mistakes() -> None:
    ds = _by_kind("DaemonSet")
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "health"  # not an int
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)
    typo = yaml.safe_load(yaml.safe_dump(ds))
    typo["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, K8S_VERSION, strict=True)


def test_daemonset_has_nvidia_runtime_hostpaths_limits_and_grpc_probes() -> None:
    ds = _by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    c = pod["containers"][0]
    args = c["args"]
    health_port = int(next(a for a in args if a.startswith("--health-listen=")).rsplit(":", 1)[1])
    metrics_port = int(next(a for a in args if a.startswith("--metrics-listen=")).rsplit(":", 1)[1])
    assert c["livenessProbe"]["grpc"] == {"port": health_port, "service": "sdcwatch.v1.Agent"}
    # readiness too follows the agent, never "" (the GPU verdict): a rollout must not stall on sick hardware
    assert c["readinessProbe"]["grpc"] == {"port": health_port, "service": "sdcwatch.v1.Agent"}
    assert c["startupProbe"]["grpc"]["port"] == health_port
    assert {p["containerPort"] for p in c["ports"]} == {health_port, metrics_port}
    for kind in ("requests", "limits"):
        assert set(c["resources"][kind]) == {"cpu", "memory"}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    socket = next(a for a in args if a.startswith("--socket=")).split("=", 1)[1]
    state = next(a for a in args if a.startswith("--state-dir=")).split("=", 1)[1]
    assert any(mounts[n] == str(Path(socket).parent) for n in host), "socket dir must be a hostPath"
    assert any(mounts[n] == state for n in host), "state dir must be a hostPath"
    # the token is mounted for the node conditions, and the ServiceAccount may do only that
    assert pod.get("automountServiceAccountToken") is True
    role = _by_kind("ClusterRole")
    assert sorted((tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]) == [
        (("nodes",), ("get",)), (("nodes/status",), ("patch",))]
    binding = _by_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": ds["metadata"]["namespace"]}]


def test_daemonset_flags_are_agent_flags() -> None:
    """Every flag in the DaemonSet's args is one `sdcwatch run` accepts."""
    import argparse

    from daemon import config

    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    args = _by_kind("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert set(flags) <= known, sorted(set(flags) - known)


def test_daemonset_environment_settings_are_agent_settings() -> None:
    """Every SDCWATCH_ variable the DaemonSet sets names a key of the config tree, and the agent reads it."""
    from daemon import config, config_tree

    env = _by_kind("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"]
    names = {e["name"] for e in env if e["name"].startswith("SDCWATCH_")}
    assert names == {"SDCWATCH_AGENT_HOSTNAME", "SDCWATCH_KUBERNETES_NODE_CONDITIONS"}
    assert names <= {k.env for k in config_tree.keys(config.Config)}
    import argparse

    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    cfg = config.build(parser.parse_args([]), {"SDCWATCH_AGENT_HOSTNAME": "gpu-node-7"})
    assert cfg.agent.hostname == "gpu-node-7"


_ENDPOINT = {"type": "object", "required": ["port"],
             "properties": {"port": {"type": "string"}, "interval": {"type": "string"},
                            "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"}}}
# The fields of the Prometheus Operator's ServiceMonitor CRD that we use (the CRD schemas are not on PyPI).
_SERVICEMONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {"spec": {"type": "object", "required": ["selector", "endpoints"], "properties": {
        "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
        "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}},
}


def test_servicemonitor_selects_the_agent_service() -> None:
    import jsonschema

    sm = _by_kind("ServiceMonitor")
    jsonschema.validate(sm, _SERVICEMONITOR_SCHEMA)
    svc = _by_kind("Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    ds = _by_kind("DaemonSet")
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_prometheusrule_is_generated_from_the_rules_file() -> None:
    committed = (K8S / "monitoring" / "prometheusrule.yaml").read_text()
    assert committed == gen_prometheusrule.render(gen_prometheusrule.build(RULES.read_text())), \
        "deploy/kubernetes/monitoring/prometheusrule.yaml is stale: run python deploy/kubernetes/gen_prometheusrule.py"
    pr = yaml.safe_load(committed)
    assert pr["kind"] == "PrometheusRule" and pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_prometheusrule_runbook_base_can_be_rewritten(tmp_path: Path) -> None:
    out = tmp_path / "pr.yaml"
    assert gen_prometheusrule.main(["--output", str(out), "--runbook-base", "https://wiki.example/rb/",
                                    "--label", "team=gpu", "--namespace", "monitoring"]) == 0
    pr = yaml.safe_load(out.read_text())
    urls = [r["annotations"]["runbook_url"] for g in pr["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith("https://wiki.example/rb/SDCWatch") and u.endswith(".md") for u in urls)
    assert pr["metadata"]["labels"]["team"] == "gpu" and pr["metadata"]["namespace"] == "monitoring"
    with pytest.raises(ValueError, match="groups"):
        gen_prometheusrule.build("rules: []")


def test_prometheusrule_groups_pass_promtool(tmp_path: Path) -> None:
    assert shutil.which("promtool"), "promtool not installed (Debian package 'prometheus'): bash scripts/setup.sh --test"
    pr = yaml.safe_load((K8S / "monitoring" / "prometheusrule.yaml").read_text())
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": pr["spec"]["groups"]}))
    out = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_node_problem_detector_plugin_runs_sdcwatch_status() -> None:
    """The alternative route to the node condition: node-problem-detector's custom plugin runs `sdcwatch
    status`, whose exit codes are NPD's (0 OK, 1 problem, other unknown), with flags that command accepts."""
    import json

    from daemon import cli

    npd = json.loads((ROOT / "deploy" / "node-problem-detector" / "sdcwatch-gpu.json").read_text())
    assert npd["plugin"] == "custom" and npd["pluginConfig"]["timeout"]
    (cond,) = npd["conditions"]
    (rule,) = npd["rules"]
    assert rule["type"] == "permanent" and rule["condition"] == cond["type"] == "SdcwatchGPUProblem"
    assert rule["path"].endswith("/sdcwatch") and rule["args"][0] == "status"
    assert cli.EXIT_OK == 0 and cli.EXIT_UNHEALTHY == 1 and cli.EXIT_UNKNOWN not in (0, 1)
    out = subprocess.run([sys.executable, "-m", "daemon.cli", *rule["args"], "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
