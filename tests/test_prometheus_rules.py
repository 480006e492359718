"""The Prometheus alert rules: promtool accepts them, promtool's unit tests pass, and every alert is tested
(fires, stays silent, resolves), documented (runbook) and written against metrics the agent exports.

promtool comes from Debian's `prometheus` package (`bash scripts/setup.sh --test` installs it).
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from typing import Any

import yaml

from daemon import alert_policy
from deploy_support import (
    PENDING_METRICS,
    PROMETHEUS_METRICS,
    ROOT,
    RULES,
    RULES_TEST,
    RUNBOOKS,
    exported_metric_names,
    metric_names_in,
)
from probes import xid_catalog

PROMTOOL = shutil.which("promtool")


def needs_promtool(test: Any) -> Any:
    """The test fails (never skips) where promtool is missing: the suite needs it."""
    def run(*args: Any, **kwargs: Any) -> Any:
        assert PROMTOOL, "promtool not installed (Debian package 'prometheus'): bash scripts/setup.sh --test"
        return test(*args, **kwargs)

    return functools.wraps(test)(run)


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"] if "alert" in r]


def _alert_names() -> list[str]:
    return [r["alert"] for r in _rules()]


@needs_promtool
def test_promtool_check_rules() -> None:
    out = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])   # alerts and recording rules
    assert f"SUCCESS: {n} rules found" in out.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run([PROMTOOL, "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                         timeout=120, cwd=RULES_TEST.parent)
    assert out.returncode == 0, (out.stdout + out.stderr)[-8000:]
    assert "SUCCESS" in out.stdout


def test_every_alert_fires_stays_silent_and_resolves_in_the_unit_tests() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    checks: dict[str, list[tuple[int, bool]]] = {}
    for t in tests:
        for a in t.get("alert_rule_test", []):
            minutes = _minutes(a["eval_time"])
            checks.setdefault(a["alertname"], []).append((minutes, bool(a.get("exp_alerts"))))
    missing = []
    for name in _alert_names():
        seq = sorted(checks.get(name, []))
        fired = [t for t, firing in seq if firing]
        if not fired:
            missing.append(f"{name}: never fires")
            continue
        if not any(not firing and t < fired[0] for t, firing in seq):
            missing.append(f"{name}: no silent check before it fires")
        if not any(not firing and t > fired[-1] for t, firing in seq):
            missing.append(f"{name}: no check that it resolves")
    assert not missing, "\n".join(missing)


def _minutes(value: str) -> int:
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?", str(value))
    assert m, f"eval_time {value!r}: use h/m"
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def test_alerts_have_severity_summary_description_and_runbook() -> None:
    problems = []
    names = _alert_names()
    assert len(names) == len(set(names)), "duplicate alert names"
    for r in _rules():
        name = r["alert"]
        if not re.fullmatch(r"SDCWatch[A-Z][A-Za-z]+", name):
            problems.append(f"{name}: name should be SDCWatch<CamelCase>")
        if r.get("labels", {}).get("severity") not in ("critical", "warning"):
            problems.append(f"{name}: severity must be critical or warning")
        ann = r.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            if not ann.get(key):
                problems.append(f"{name}: missing annotation {key}")
        if not ann.get("runbook_url", "").endswith(f"/docs/runbooks/{name}.md"):
            problems.append(f"{name}: runbook_url should end with /docs/runbooks/{name}.md")
    assert not problems, "\n".join(problems)


def _runbook_names_for_agent_alerts() -> set[str]:
    names = set(alert_policy.GPU_STATE_ALERTS.values())
    src = (ROOT / "daemon" / "alert_policy.py").read_text()
    names |= set(re.findall(r'name = "(SDCWatch\w+)"', src))
    return names


def test_every_runbook_url_points_at_an_existing_runbook() -> None:
    missing = []
    for r in _rules():
        path = ROOT / r["annotations"]["runbook_url"].split("/blob/main/", 1)[-1]
        if not path.is_file():
            missing.append(f"{r['alert']}: {path.relative_to(ROOT)} does not exist")
    # the alerts the agent pushes itself (daemon/alert_policy.py) link to runbooks too
    for name in _runbook_names_for_agent_alerts():
        if not (RUNBOOKS / f"{name}.md").is_file():
            missing.append(f"agent alert {name}: docs/runbooks/{name}.md does not exist")
    assert not missing, "\n".join(missing)


def test_runbooks_say_what_it_means_how_to_confirm_and_what_to_do() -> None:
    for path in sorted(RUNBOOKS.glob("*.md")):
        text = path.read_text()
        assert text.startswith(f"# {path.stem}\n"), f"{path.name}: first line should be '# {path.stem}'"
        for heading in ("## What it means", "## How to confirm", "## What to do"):
            assert heading in text, f"{path.name}: missing '{heading}'"


def test_rules_use_only_metrics_the_agent_exports() -> None:
    exported = exported_metric_names()
    unknown = []
    for r in _rules():
        for name in metric_names_in(r["expr"]):
            if name not in exported and name not in PENDING_METRICS and name not in PROMETHEUS_METRICS:
                unknown.append(f"{r['alert']}: {name}")
    assert not unknown, "metric names not exported by the agent (typo?):\n" + "\n".join(unknown)


def test_metric_name_extraction() -> None:
    expr = ('max by (instance, uuid) (increase(sdcwatch_gpu_xid_events_total{xid=~"79"}[30m]) > 0 or '
            '(sdcwatch_gpu_xid_events_total > 0 unless sdcwatch_gpu_xid_events_total offset 30m)) '
            'and on (instance) up{job="x"} == 1')
    assert metric_names_in(expr) == {"sdcwatch_gpu_xid_events_total", "up"}


def test_xid_rules_match_the_catalog_action_classes() -> None:
    """The XID alerts select XIDs by regex; the lists must be the catalog's action classes."""
    by_action: dict[str, set[str]] = {}
    for e in xid_catalog.CATALOG.values():
        by_action.setdefault(e.action.value, set()).add(str(e.xid))
    rules = {r["alert"]: r for r in _rules()}

    def xids(alert: str, op: str) -> set[str]:
        found = re.findall(r'xid%s"([0-9|]+)"' % re.escape(op), rules[alert]["expr"])
        assert found, f"{alert}: no xid{op} selector"
        sets = [set(f.split("|")) for f in found]
        assert all(s == sets[0] for s in sets), f"{alert}: the xid lists in its expression differ"
        return sets[0]

    assert xids("SDCWatchGPUXidReboot", "=~") == by_action["REBOOT"]
    assert xids("SDCWatchGPUXidResetRequired", "=~") == by_action["RESET_GPU"]
    assert xids("SDCWatchGPUXidContactSupport", "=~") == by_action["CONTACT_SUPPORT"]
    assert xids("SDCWatchGPUXidAppRepeats", "=~") == by_action["RESTART_APP"]
    assert xids("SDCWatchGPUXidUnknown", "!~") == {str(x) for x in xid_catalog.CATALOG}
    assert set(by_action) <= {"REBOOT", "RESET_GPU", "CONTACT_SUPPORT", "RESTART_APP", "NONE"}, \
        "a new XID action class needs its own alert"
    for alert in ("SDCWatchGPUXidReboot", "SDCWatchGPUXidResetRequired", "SDCWatchGPUXidContactSupport",
                  "SDCWatchGPUXidAppRepeats"):
        assert rules[alert]["labels"]["action"] in by_action


def test_agent_pushed_alert_names_match_the_rules_where_shared() -> None:
    """The agent's own alerts reuse the rules' names for the same condition, so Alertmanager routes,
    silences and inhibitions written for one apply to the other."""
    rules = set(_alert_names())
    agent = _runbook_names_for_agent_alerts()
    # the watchdog's and the driver's: the agent knows at once (Prometheus sees a stale loop only as a missing
    # scrape, and a hung NVML call as SDCWatchProbeHung two minutes later)
    agent_only = {"SDCWatchGPUXid", "SDCWatchCriticalEvent", "SDCWatchAgentLoopStale", "SDCWatchDriverUnresponsive"}
    assert agent - agent_only <= rules, sorted(agent - agent_only - rules)
