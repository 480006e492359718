"""The Grafana dashboard: valid JSON, node and job views, every query uses metrics the agent exports."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

from deploy_support import PROMETHEUS_METRICS, ROOT, exported_metric_names, metric_names_in

DASHBOARD = ROOT / "deploy" / "grafana" / "sdcwatch-dashboard.json"


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for a in dash.get("annotations", {}).get("list", []):
        if "expr" in a:
            yield f"annotation {a['name']}", a["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", q)
            assert m, f"variable {v['name']}: unexpected query {q!r}"
            yield f"variable {v['name']}", m.group(1)


def test_dashboard_is_valid_and_has_node_and_job_views() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"]
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert "Node" in rows and "Job" in rows and "Checkpoints" in rows
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "job"} <= variables
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"], f"panel {p['title']!r} has no query"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"panel {p['title']!r} overflows the grid"
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), f"unbalanced parentheses in {p['title']!r}"


def test_every_query_references_existing_metrics() -> None:
    exported = exported_metric_names() | PROMETHEUS_METRICS
    unknown = []
    count = 0
    for where, expr in _exprs(_dashboard()):
        names = metric_names_in(expr) if "(" in expr or "{" in expr else {expr}
        assert names, f"{where}: no metric in {expr!r}"
        count += 1
        unknown += [f"{where}: {n}" for n in names if n not in exported]
    assert count > 20
    assert not unknown, "\n".join(unknown)


def test_node_panels_filter_by_the_instance_variable() -> None:
    """Panels about GPUs and probes follow the Node picker (a dashboard for one node at a time)."""
    for where, expr in _exprs(_dashboard()):
        if "sdcwatch_gpu_" in expr or "sdcwatch_probe_" in expr:
            assert '$instance' in expr, f"{where} ignores the Node variable"
