from __future__ import annotations

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
    pynvml = pytest.importorskip("pynvml")
    for ra in RecoveryAction:
        assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{ra.name}") == ra.value
