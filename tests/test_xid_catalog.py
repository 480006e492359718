from __future__ import annotations

import re
from pathlib import Path

import pytest

from probes import xid_catalog
from sdcwatch.types import Severity, State
from probes.xid_catalog import REQUIRED_XIDS, RecoveryAction, XidAction, classify, lookup, recovery_action


@pytest.mark.parametrize("xid", REQUIRED_XIDS)
def test_required_xids_are_in_the_catalog(xid: int) -> None:
    e = lookup(xid)
    assert e is not None and e.known and e.xid == xid
    assert e.name and len(e.meaning) > 20
    assert isinstance(e.action, XidAction) and isinstance(e.severity, Severity)


def test_severities_and_actions_make_sense() -> None:
    for e in xid_catalog.CATALOG.values():
        if e.implies is State.HEALTHY:
            assert e.action in (XidAction.NONE, XidAction.RESTART_APP) and not e.needs_reset
        if e.implies in (State.DEGRADED, State.FAILED):
            assert e.severity is Severity.CRITICAL or e.action is not XidAction.NONE
    assert classify(79).implies is State.FAILED and classify(79).action is XidAction.REBOOT
    assert classify(48).action is XidAction.RESET_GPU and classify(48).implies is State.DEGRADED
    assert classify(13).implies is State.HEALTHY and classify(13).action is XidAction.RESTART_APP
    assert all(classify(x).implies is State.DEGRADED for x in range(144, 151))


#: The entries added for recent drivers (issue 23), one expectation each: (severity, action, implies,
#: needs_reset, solo).
NEW_ENTRIES = {
    151: (Severity.WARNING, XidAction.RESTART_APP, State.SUSPECT, False, True),
    152: (Severity.INFO, XidAction.NONE, State.HEALTHY, False, True),
    153: (Severity.WARNING, XidAction.RESTART_APP, State.HEALTHY, False, True),
    154: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, False),
    155: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, True),
    156: (Severity.WARNING, XidAction.RESET_GPU, State.DEGRADED, True, True),
    157: (Severity.CRITICAL, XidAction.CONTACT_SUPPORT, State.DEGRADED, True, True),
    158: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, True),
    159: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, True),
    160: (Severity.WARNING, XidAction.RESET_GPU, State.DEGRADED, True, True),
    161: (Severity.CRITICAL, XidAction.CONTACT_SUPPORT, State.DEGRADED, True, True),
    162: (Severity.INFO, XidAction.NONE, State.HEALTHY, False, True),
    163: (Severity.WARNING, XidAction.NONE, State.HEALTHY, False, True),
    164: (Severity.WARNING, XidAction.CONTACT_SUPPORT, State.SUSPECT, False, True),
    165: (Severity.WARNING, XidAction.CONTACT_SUPPORT, State.SUSPECT, False, True),
    166: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, True),
    167: (Severity.CRITICAL, XidAction.REBOOT, State.FAILED, True, True),
    168: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, True),
    169: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, True),
    170: (Severity.WARNING, XidAction.RESET_GPU, State.SUSPECT, True, True),
    171: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, False),
    172: (Severity.CRITICAL, XidAction.RESET_GPU, State.DEGRADED, True, False),
    185: (Severity.WARNING, XidAction.NONE, State.SUSPECT, False, True),
}


@pytest.mark.parametrize("xid", sorted(NEW_ENTRIES))
def test_recent_driver_entry(xid: int) -> None:
    e = lookup(xid)
    assert e is not None and e.known
    assert (e.severity, e.action, e.implies, e.needs_reset, e.solo) == NEW_ENTRIES[xid]


def test_non_solo_entries_name_what_they_follow() -> None:
    non_solo = {e.xid: e.follows for e in xid_catalog.CATALOG.values() if not e.solo}
    assert non_solo == {45: (), 154: (), 171: (48,), 172: (48,)}
    for follows in non_solo.values():
        assert all(lookup(x) is not None and lookup(x).solo for x in follows)
    assert all(e.follows == () for e in xid_catalog.CATALOG.values() if e.solo)


def test_docs_table_is_the_catalog() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "gpu-state-rules.md").read_text()
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"^\| (\d+) \| [^\n]*\|$", doc, re.M)
            if "| reset + canary |" in m.group(0) or "| window |" in m.group(0)}
    assert set(rows) == set(xid_catalog.CATALOG)
    for e in xid_catalog.CATALOG.values():
        cells = [c.strip() for c in rows[e.xid].strip("|").split("|")]
        solo = "yes" if e.solo else "no: follows " + (", ".join(map(str, e.follows)) or "any XID")
        assert cells == [str(e.xid), e.name, e.severity.name, e.action.value, e.implies.name,
                         "reset + canary" if e.needs_reset else "window", solo], e.xid


def test_unknown_xid_is_warning_and_still_an_entry() -> None:
    e = classify(4242)
    assert not e.known and e.name == "unknown XID" and e.severity is Severity.WARNING
    assert lookup(4242) is None


@pytest.mark.parametrize("value,name,action,state", [
    (0, "NONE", XidAction.NONE, State.HEALTHY),
    (1, "GPU_RESET", XidAction.RESET_GPU, State.DEGRADED),
    (2, "NODE_REBOOT", XidAction.REBOOT, State.FAILED),
    (3, "DRAIN_P2P", XidAction.DRAIN_NODE, State.DEGRADED),
    (4, "DRAIN_AND_RESET", XidAction.RESET_GPU, State.DEGRADED),
])
def test_recovery_action_mapping(value: int, name: str, action: XidAction, state: State) -> None:
    assert recovery_action(value) == (name, action, state)
    assert RecoveryAction[name].value == value


def test_unknown_recovery_action_is_suspect() -> None:
    name, _, state = recovery_action(99)
    assert name == "UNKNOWN(99)" and state is State.SUSPECT


def test_recovery_enum_matches_pynvml() -> None:
    import pynvml   # nvidia-ml-py, a core dependency
    for ra in RecoveryAction:
        assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{ra.name}") == ra.value
