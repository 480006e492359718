"""Helpers for the tests of deploy/: the metric names the agent really exports, PromQL name extraction."""
from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "sdcwatch-rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "sdcwatch-rules.test.yml"
RUNBOOKS = ROOT / "docs" / "runbooks"

# Metrics the rules and the dashboard use that no component exports yet (asked of the lead; see
# docs/oncall.md). A name here that starts being exported is fine; a name used but neither exported nor
# listed here is a typo and fails the tests.
PENDING_METRICS: frozenset[str] = frozenset()
PROMETHEUS_METRICS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_KEYWORDS = {"sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring", "group_left",
             "group_right", "and", "or", "unless", "offset", "bool", "rate", "irate", "increase", "time",
             "topk", "bottomk",
             "max_over_time", "min_over_time", "avg_over_time", "histogram_quantile", "label_replace",
             "clamp_min", "clamp_max", "abs", "delta", "deriv", "changes", "resets", "vector", "scalar",
             "sort", "sort_desc", "absent", "present_over_time", "last_over_time", "count_over_time",
             "sum_over_time", "quantile_over_time", "stddev_over_time", "timestamp", "le", "inf", "nan"}


def metric_names_in(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (names followed by a selector, range or operator;
    label names inside {...} and by(...) lists are removed first)."""
    text = re.sub(r"\{[^}]*\}", "{}", expr)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = re.sub(r'"[^"]*"', '""', text)
    text = re.sub(r"\$\w+", " ", text)   # Grafana variables such as $__rate_interval
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = m.group(0)
        end = m.end()
        if word in _KEYWORDS:
            continue
        nxt = text[end:end + 1]
        if nxt == "(":
            continue   # a function
        if re.fullmatch(r"\d+[smhdwy]?", word):
            continue
        names.add(word)
    return {n for n in names if n.startswith("sdcwatch_") or n in PROMETHEUS_METRICS}


def exported_metric_names() -> set[str]:
    """Every sample name the agent's registries can produce (agent, GPU and alert metrics)."""
    from daemon.alerts import AlertMetrics
    from daemon.checkpoint_metrics import CheckpointMetrics
    from daemon.gpu_metrics import GpuMetrics
    from daemon.jobs import JobTracker
    from daemon.metrics import AgentMetrics

    agent_metrics = AgentMetrics(jobs=JobTracker())
    reg = CollectorRegistry()
    GpuMetrics(reg)
    AlertMetrics(reg)
    CheckpointMetrics(reg)
    names: set[str] = set()
    for r in (agent_metrics.registry, reg):
        for mf in r.collect():
            names.add(mf.name)
            if mf.type == "counter":
                names.add(mf.name + "_total")
            elif mf.type == "info":
                names.add(mf.name + "_info")
            elif mf.type == "histogram":
                names.update({mf.name + "_bucket", mf.name + "_sum", mf.name + "_count"})
    return names
