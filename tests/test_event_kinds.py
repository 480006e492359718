"""The catalogue of event kinds (sdcwatch/event_kinds.py) against everything that names a kind: the
publishers (every member is emitted somewhere), the agent's alert policy, the Prometheus rules and the
dashboard (they name only members, and the alerts a member lists are the ones that select it), the runbooks,
and the docs' table (generated from the catalogue)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from daemon import alert_policy
from deploy_support import ROOT, RULES
from probes.loss_detector import EVENT_KINDS, LossDetector
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import EventKind, SubjectKind, UnknownEventKind
from sdcwatch.types import Finding, Severity

SOURCE_DIRS = ("daemon", "probes", "checkpoint", "checksums", "sdcwatch")
CATALOGUE_FILE = ROOT / "sdcwatch" / "event_kinds.py"
EVENT_METRICS = ("sdcwatch_events_total", "sdcwatch_job_events_total")
SAMPLE_SUBJECT = {SubjectKind.NODE: "node", SubjectKind.GPU: "gpu/GPU-1", SubjectKind.JOB: "job/j1",
                  SubjectKind.RANK: "job/j1/rank/0", SubjectKind.PROBE: "probe/nvml"}


def _constants() -> dict[str, EventKind]:
    return {name: v for name, v in vars(ek).items() if isinstance(v, EventKind)}


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py") if p != CATALOGUE_FILE}


def test_every_member_is_a_module_constant_once() -> None:
    consts = _constants()
    assert sorted(m.name for m in consts.values()) == sorted(m.name for m in ek.members())
    assert len({id(m) for m in consts.values()}) == len(consts)


def test_every_member_is_emitted_somewhere() -> None:
    """A kind nobody publishes is dead vocabulary (or a publisher that lost its kind)."""
    text = "\n".join(_sources().values())
    unused = [f"{const} ({m.name})" for const, m in _constants().items()
              if not re.search(rf"\bek\.{const}\b|\bevent_kinds\.{const}\b", text)]
    assert not unused, "catalogue members no source file publishes:\n" + "\n".join(unused)


def test_no_publisher_spells_a_kind_as_a_string() -> None:
    """Publishers pass members; a kind's wire name written as a string literal in a publish or Finding call
    is the bug this catalogue exists to prevent."""
    names = "|".join(re.escape(m.name) for m in ek.members())
    call = re.compile(rf"(?:publish\w*|Finding|emit)\(\s*f?\"(?:{names})\"")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p, src in _sources().items() for m in call.finditer(src)]
    assert not found, "\n".join(found)


def test_lookup_and_membership() -> None:
    assert ek.lookup("grad_norm.spike") is ek.GRAD_NORM_SPIKE
    with pytest.raises(UnknownEventKind, match="loss.grad_norm.spike"):
        ek.lookup("loss.grad_norm.spike")
    look_alike = EventKind("replica.mismatch", Severity.CRITICAL, (SubjectKind.JOB,), "not the member")
    assert ek.is_member(ek.REPLICA_MISMATCH) and not ek.is_member(look_alike)
    assert not ek.is_member("replica.mismatch")


def test_member_checks_severity_and_subject() -> None:
    ek.GPU_STATE.check(Severity.CRITICAL, "gpu/GPU-1")
    with pytest.raises(ValueError, match="severity INFO not allowed"):
        ek.REPLICA_MISMATCH.check(Severity.INFO, "job/j1")
    with pytest.raises(ValueError, match="not a job subject"):
        ek.REPLICA_MISMATCH.check(Severity.CRITICAL, "gpu/GPU-1")
    with pytest.raises(ValueError, match="not a job subject"):
        ek.REPLICA_MISMATCH.check(Severity.CRITICAL, "job/j1/rank/3")   # a rank is not the job
    ek.CANARY_FAIL.check(Severity.CRITICAL, "job/j1/rank/3")


def test_a_finding_carries_a_member() -> None:
    with pytest.raises(TypeError, match="not its name"):
        Finding("replica.mismatch", Severity.CRITICAL, "job/j1", "m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a gpu subject"):
        Finding(ek.GPU_XID, Severity.WARNING, "node", "m")
    assert Finding(ek.GPU_XID, Severity.WARNING, "gpu/GPU-1", "m").kind is ek.GPU_XID


def test_every_runbook_exists() -> None:
    missing = [f"{m.name}: {rb}" for m in ek.members() for rb in m.runbooks if not (ROOT / rb).is_file()]
    assert not missing, "\n".join(missing)


def test_loss_detector_kinds_map_to_members() -> None:
    """Every (signal, anomaly) the detector can report is journaled as its own member; the defect this
    catalogue fixed was `loss.grad_norm.spike`, a name no rule or alert knew."""
    assert set(EVENT_KINDS.values()) <= set(ek.members())
    assert EVENT_KINDS[("grad_norm", "spike")] is ek.GRAD_NORM_SPIKE
    assert EVENT_KINDS[("loss_scale", "loss_scale_collapse")] is ek.LOSS_SCALE_COLLAPSE
    det = LossDetector()
    events = []
    for step in range(200):
        grad = 50.0 if step in (150, 151) else 1.0 + 0.01 * (step % 3)   # two in a row: a spike
        scale = 65536.0 if step < 170 else 1.0
        events += det.update(step, 2.0 + 0.01 * (step % 5), grad, float(step), loss_scale=scale)
    kinds = {e.event_kind for e in events}
    assert {ek.GRAD_NORM_SPIKE, ek.LOSS_SCALE_COLLAPSE} <= kinds
    for e in events:
        e.event_kind.check(e.severity, "job/j1")


# ---- the alert policy -------------------------------------------------------------------------------------------

def test_alert_policy_names_only_members() -> None:
    for name in [*alert_policy.JOB_PULSES, *alert_policy.LOSS_ALERTS]:
        ek.lookup(name)
    src = (ROOT / "daemon" / "alert_policy.py").read_text()
    quoted = set(re.findall(r'"([a-z_]+\.[a-z_.]+)"', src))
    unknown = sorted(q for q in quoted if not q.endswith(".md") and q not in {m.name for m in ek.members()})
    assert not unknown, f"alert_policy.py names kinds the catalogue lacks: {unknown}"


def _agent_alerts(member: EventKind, severity: Severity) -> set[str]:
    subject = SAMPLE_SUBJECT[member.subjects[0]]
    details = {"to": "FAILED", "action": "REBOOT", "xid": 79, "job_id": "j1", "probe": "nvml"}
    sigs = alert_policy.signals_for_event(member.name, severity, subject, "m", details, node="n",
                                          runbook_base="rb")
    return {s.labels["alertname"] for s in sigs if s.op != "resolve"}


def test_the_alerts_a_member_lists_include_those_the_agent_pushes() -> None:
    wrong = []
    for m in ek.members():
        for sev in m.severities:
            pushed = _agent_alerts(m, sev)
            if not pushed <= set(m.alerts):
                wrong.append(f"{m.name} at {sev.name}: the agent pushes {sorted(pushed)}, the catalogue lists "
                             f"{list(m.alerts)}")
    assert not wrong, "\n".join(wrong)


def test_critical_members_raise_an_alert() -> None:
    """A CRITICAL event reaches on-call: through its own alert, or the catch-all."""
    silent = [m.name for m in ek.members() if Severity.CRITICAL in m.severities and m is not ek.GPU_LOST
              and not _agent_alerts(m, Severity.CRITICAL)]
    assert not silent, silent


@pytest.mark.parametrize("member, alert", [(ek.GRAD_NORM_SPIKE, "SDCWatchGradNormSpike"),
                                           (ek.LOSS_SCALE_COLLAPSE, "SDCWatchLossScaleCollapse"),
                                           (ek.GRAD_NORM_NONFINITE, "SDCWatchGradNormNonFinite")])
def test_grad_norm_and_loss_scale_have_their_own_alert(member: EventKind, alert: str) -> None:
    assert _agent_alerts(member, member.severity) == {alert}


# ---- the Prometheus rules and the dashboard -----------------------------------------------------------------------

def _kind_selectors(expr: str) -> list[tuple[str, str]]:
    """(op, value) of every `kind` matcher on an event counter in a PromQL expression."""
    metrics = "|".join(EVENT_METRICS)
    out = []
    for sel in re.finditer(rf"\b(?:{metrics})\{{([^}}]*)\}}", expr):
        out += re.findall(r'\bkind\s*(=~|!~|!=|=)\s*"([^"]*)"', sel.group(1))
    return out


def _kinds_selected(op: str, value: str) -> set[str]:
    names = {m.name for m in ek.members()}
    if op == "=":
        return {value} & names
    pattern = re.compile(value)
    return {n for n in names if pattern.fullmatch(n)}


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_rules_select_only_catalogue_kinds_and_the_catalogue_lists_their_alerts() -> None:
    problems = []
    for r in _rules():
        for op, value in _kind_selectors(r["expr"]):
            if op == "=" or op == "=~":
                for alt in value.split("|") if op == "=~" else [value]:
                    if not _kinds_selected("=~", alt):
                        problems.append(f"{r['alert']}: kind {alt!r} matches no catalogue member")
                for name in _kinds_selected(op, value):
                    if r["alert"] not in ek.lookup(name).alerts:
                        problems.append(f"{r['alert']} selects {name}, whose catalogue entry does not list it")
    assert not problems, "\n".join(problems)
    selected = {r["alert"] for r in _rules() if _kind_selectors(r["expr"])}
    assert {"SDCWatchGradNormSpike", "SDCWatchLossScaleCollapse", "SDCWatchGradNormNonFinite"} <= selected


def test_loss_rules_split_by_severity() -> None:
    """Warnings (a spike, a small level shift) do not page; a sustained excursion and divergence do; the
    gradient norm and the loss scale have their own rules."""
    def kinds(alert: str) -> tuple[set[str], str]:
        rule = next(r for r in _rules() if r["alert"] == alert)
        return set().union(*(_kinds_selected(op, v) for op, v in _kind_selectors(rule["expr"]))), \
            rule["labels"]["severity"]

    assert kinds("SDCWatchLossSpike") == ({"loss.spike", "loss.shift"}, "warning")
    assert kinds("SDCWatchLossSustained") == ({"loss.sustained", "loss.divergence"}, "critical")
    assert kinds("SDCWatchLossNonFinite") == ({"loss.nonfinite"}, "critical")
    for alert in ("SDCWatchLossSpike", "SDCWatchLossSustained"):
        for name in kinds(alert)[0]:
            assert ek.lookup(name).severity.name.lower() == kinds(alert)[1]


def test_dashboard_selects_only_catalogue_kinds() -> None:
    dash = (ROOT / "deploy" / "grafana" / "sdcwatch-dashboard.json").read_text()
    exprs = [p.get("expr", "") for p in _walk(json.loads(dash)) if isinstance(p, dict)]
    bad = []
    for expr in exprs:
        for op, value in _kind_selectors(expr):
            for alt in value.split("|"):
                if op in ("=", "=~") and not _kinds_selected("=~", alt):
                    bad.append(alt)
    assert not bad, bad


def _walk(node: object):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


# ---- the docs ------------------------------------------------------------------------------------------------------

def test_the_docs_table_is_the_catalogue() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    m = re.search(r"<!-- event-kinds:begin[^>]*-->\n(.*?)<!-- event-kinds:end -->", text, re.S)
    assert m, "docs/metrics.md: the event-kinds markers are missing"
    assert m.group(1) == ek.markdown_table(), "docs/metrics.md is stale: run python scripts/gen_event_kinds_doc.py"


def test_docs_name_only_catalogue_kinds() -> None:
    """`sdcwatch events --kind X` and event names in backquotes in the on-call docs and runbooks are members."""
    names = {m.name for m in ek.members()}
    prefixes = {n.split(".")[0] for n in names}
    docs = [ROOT / "docs" / "oncall.md", ROOT / "docs" / "loss-detector.md", ROOT / "docs" / "checkpoints.md",
            *sorted((ROOT / "docs" / "runbooks").glob("*.md"))]
    bad = []
    for path in docs:
        text = path.read_text()
        for kind in re.findall(r"--kind ([a-z_.]+)", text):
            if kind not in names and not any(n.startswith(kind) for n in names):
                bad.append(f"{path.name}: --kind {kind}")
        for kind in re.findall(r"`([a-z_]+\.[a-z_]+)(?: event)?`", text):
            module = ROOT / kind.split(".")[0] / f"{kind.split('.', 1)[1]}.py"   # `checkpoint.policy` is code
            if kind.split(".")[0] in prefixes and kind not in names and not module.exists():
                bad.append(f"{path.name}: `{kind}`")
    assert not bad, "\n".join(bad)
