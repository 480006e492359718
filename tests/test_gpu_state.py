"""The GPU state rule table (probes.gpu_state.RULES), row by row."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from probes.gpu_state import RULES, Clears, GpuEvidenceStore, GpuStateConfig, derive_state, rule_for
from sdcwatch.types import Evidence, State

ROOT = Path(__file__).resolve().parents[1]


def ev(signal: str, implies: State, t: float, source: str = "nvml", expires: float | None = None,
       reason: str | None = None) -> Evidence:
    return Evidence(source, signal, "v", implies, reason or f"{signal} says {implies.name}", t, expires=expires)


def xid(n: int, t: float) -> Evidence:
    return Evidence("nvml", f"xid.{n}", str(n), State.HEALTHY, f"XID {n}", t)


def reset(t: float) -> Evidence:
    return ev("gpu_reset", State.HEALTHY, t)


def canary_pass(t: float) -> Evidence:
    return Evidence("canary", "pass", "pass", State.HEALTHY, "canary passed", t)


def readable(t: float) -> Evidence:
    return ev("readable", State.HEALTHY, t)


def state(store: GpuEvidenceStore, now: float) -> State:
    return store.derive(now)[0]


# -- one test per row ------------------------------------------------------------------------------------------


def test_row_no_evidence() -> None:
    assert GpuEvidenceStore().derive(0) == (State.UNKNOWN, "no evidence yet")
    assert derive_state([readable(0)], 1) == (State.HEALTHY, "all signals normal")


def test_row_unreadable() -> None:
    s = GpuEvidenceStore()
    s.put_all("nvml", [ev("readable", State.UNKNOWN, 0, reason="no field readable")])
    assert s.derive(1) == (State.UNKNOWN, "no field readable")
    s.put_all("nvml", [readable(2)])
    assert state(s, 2) is State.HEALTHY


def test_row_hung() -> None:
    s = GpuEvidenceStore()
    s.put(readable(0))
    s.put(ev("hung", State.UNKNOWN, 1, reason="nvml poll hung for 30s"))
    assert s.derive(2) == (State.UNKNOWN, "nvml poll hung for 30s")
    s.put(ev("hung", State.HEALTHY, 3))
    assert state(s, 3) is State.HEALTHY


def _reset_and_canary_row(bad: Evidence, expected: State) -> None:
    s = GpuEvidenceStore()
    s.put(readable(0))
    s.put(bad)
    assert state(s, bad.time + 1) is expected
    s.put(canary_pass(bad.time + 2))  # a pass without a reset does not clear it
    assert state(s, bad.time + 3) is expected
    s.put(reset(bad.time + 4))
    st, why = s.derive(bad.time + 5)
    assert st is (State.SUSPECT if expected.badness > State.SUSPECT.badness else expected)
    assert "awaiting a passing canary" in why or expected is State.SUSPECT
    s.put(canary_pass(bad.time + 6))
    assert state(s, bad.time + 7) is State.HEALTHY


def test_row_gpu_lost() -> None:
    _reset_and_canary_row(ev("gpu_lost", State.FAILED, 10), State.FAILED)


def test_row_xid_app() -> None:
    cfg = GpuStateConfig(app_xid_window_s=60, app_xid_repeat=3)
    s = GpuEvidenceStore(cfg)
    s.put(readable(0))
    s.put(xid(13, 1))
    s.put(xid(13, 2))
    assert state(s, 3) is State.HEALTHY  # counted, not enough
    assert s.xid_counts(3, 60) == {13: (2, 2)}
    s.put(xid(13, 3))
    st, why = s.derive(4)
    assert st is State.SUSPECT and "XID 13" in why and "x3" in why
    assert state(s, 62) is State.HEALTHY  # the window passed: not latched
    assert s.xid_counts(62, 3600)[13] == (3, 3)  # still counted by last-seen time


def test_row_xid_app_unknown_xid_counted() -> None:
    s = GpuEvidenceStore(GpuStateConfig(app_xid_repeat=2))
    s.put(readable(0))
    s.put(xid(4242, 1))
    assert state(s, 2) is State.HEALTHY
    s.put(xid(4242, 2))
    st, why = s.derive(3)
    assert st is State.SUSPECT and "unknown XID" in why


def test_row_xid_app_non_solo_xid45_never_escalates() -> None:
    s = GpuEvidenceStore(GpuStateConfig(app_xid_window_s=3600, app_xid_repeat=3))
    s.put(readable(0))
    for t in range(1, 673):  # 672 XID 45s in three hours: one fault's cleanup, not 672 faults
        s.put(xid(45, t * 16))
    assert state(s, 672 * 16 + 1) is State.HEALTHY
    assert s.xid_counts(672 * 16 + 1, 86400)[45][0] == 256  # still counted (history_max per XID)
    s.put(xid(13, 20000))
    s.put(xid(13, 20001))
    s.put(xid(13, 20002))  # a solo application XID repeating still makes it SUSPECT
    assert state(s, 20003) is State.SUSPECT


def test_row_xid_hw_needs_reset() -> None:
    _reset_and_canary_row(xid(48, 10), State.DEGRADED)
    _reset_and_canary_row(xid(79, 10), State.FAILED)


def test_row_xid_hw_without_reset_ages_out() -> None:
    s = GpuEvidenceStore(GpuStateConfig(xid_hold_s=100))
    s.put(readable(0))
    s.put(xid(92, 10))  # high SBE rate: SUSPECT, not a reset condition
    assert state(s, 50) is State.SUSPECT
    assert state(s, 111) is State.HEALTHY


def test_row_xid_repeat_not_for_non_solo_details() -> None:
    s = GpuEvidenceStore(GpuStateConfig(hw_xid_window_s=1000, hw_xid_escalate=3))
    s.put(readable(0))
    for t in (10, 20, 30):
        s.put(xid(171, t))  # the DRAM detail of XID 48: its own state, the 48s carry the escalation
    assert state(s, 31) is State.DEGRADED
    for t in (11, 21, 31):
        s.put(xid(48, t))
    st, why = s.derive(32)
    assert st is State.FAILED and "XID 48" in why and "repeated x3" in why


def test_row_xid_repeat_escalates_to_failed() -> None:
    s = GpuEvidenceStore(GpuStateConfig(hw_xid_window_s=1000, hw_xid_escalate=3))
    s.put(readable(0))
    for t in (10, 20):
        s.put(xid(48, t))
    assert state(s, 21) is State.DEGRADED
    s.put(xid(48, 30))
    st, why = s.derive(31)
    assert st is State.FAILED and "repeated x3" in why
    s.put(reset(40))
    s.put(canary_pass(41))
    assert state(s, 42) is State.HEALTHY


def test_row_ecc_uncorrected() -> None:
    _reset_and_canary_row(ev("ecc.uncorrected", State.DEGRADED, 10), State.DEGRADED)


def _window_row(signal: str) -> None:
    s = GpuEvidenceStore()
    s.put_all("nvml", [readable(0), ev(signal, State.SUSPECT, 1, expires=61)])
    assert state(s, 30) is State.SUSPECT
    s.put_all("nvml", [readable(30)])  # not re-emitted: still held by its window
    assert state(s, 60) is State.SUSPECT
    assert state(s, 61) is State.HEALTHY
    assert rule_for(ev(signal, State.SUSPECT, 0)).clears is Clears.WINDOW


def test_row_sbe_storm() -> None:
    _window_row("ecc.sbe_storm")


def _reading_row(signal: str, bad: State) -> None:
    s = GpuEvidenceStore()
    s.put_all("nvml", [readable(0), ev(signal, bad, 0)])
    assert state(s, 1) is bad
    s.put_all("nvml", [readable(2), ev(signal, State.HEALTHY, 2)])
    assert state(s, 3) is State.HEALTHY
    s.put_all("nvml", [readable(4), ev(signal, bad, 4)])
    s.put_all("nvml", [readable(5)])  # field unsupported/unreadable now: the stale reading is dropped
    assert state(s, 6) is State.HEALTHY
    assert rule_for(ev(signal, bad, 0)).clears is Clears.READING


def test_row_remap_failure() -> None:
    _reading_row("remap.failure", State.FAILED)
    s = GpuEvidenceStore()
    s.put_all("nvml", [readable(0), ev("remap.failure", State.FAILED, 0)])
    removed = s.clear(1, by="alice", why="replaced DIMM? no: test")
    assert [e.signal for e in removed] == ["remap.failure"]
    assert state(s, 1) is State.HEALTHY
    s.put_all("nvml", [readable(2), ev("remap.failure", State.FAILED, 2)])  # evidence comes back
    assert state(s, 2) is State.FAILED


def test_row_remap_pending() -> None:
    _reading_row("remap.pending", State.DEGRADED)


def test_row_retired_pending() -> None:
    _reading_row("retired_pages.pending", State.DEGRADED)


def test_row_recovery_action() -> None:
    _reading_row("recovery_action", State.DEGRADED)
    _reading_row("recovery_action", State.FAILED)


def test_row_pcie_replay() -> None:
    _window_row("pcie.replay_rate")


def test_row_pcie_width() -> None:
    _reading_row("pcie.link_width", State.SUSPECT)


def test_row_nvlink_errors() -> None:
    _window_row("nvlink.errors")


def test_row_nvlink_down() -> None:
    _reading_row("nvlink.down", State.DEGRADED)


def test_row_thermal() -> None:
    _window_row("thermal")


def test_row_gpu_reset() -> None:
    s = GpuEvidenceStore()
    s.put(readable(0))
    s.put(reset(5))
    assert state(s, 6) is State.HEALTHY and s.last_reset() == 5


def test_row_canary_pass() -> None:
    s = GpuEvidenceStore()
    s.put(canary_pass(1))
    assert state(s, 2) is State.HEALTHY


def test_row_canary_other() -> None:
    _reset_and_canary_row(Evidence("canary", "fail", "bf16", State.FAILED, "canary bf16 mismatch", 10),
                          State.FAILED)


def test_row_other_source() -> None:
    s = GpuEvidenceStore()
    s.put(readable(0))
    s.put(ev("mismatch", State.SUSPECT, 1, source="replica_vote"))
    s.put(reset(2))
    s.put(canary_pass(3))
    assert state(s, 4) is State.SUSPECT  # only its own source, expiry or an operator clears it
    s.put(ev("mismatch", State.SUSPECT, 5, source="replica_vote", expires=10))
    assert state(s, 10) is State.HEALTHY
    s.put(ev("mismatch", State.DEGRADED, 11, source="replica_vote"))
    s.clear(12)
    assert state(s, 12) is State.HEALTHY


# -- the table itself ------------------------------------------------------------------------------------------


def test_every_row_has_a_test() -> None:
    names = {n for n in globals() if n.startswith("test_row_")}
    for rule in RULES:
        stem = f"test_row_{rule.id}"
        assert any(n == stem or n.startswith(stem + "_") for n in names), f"rule {rule.id} has no row test"


def test_table_is_documented() -> None:
    doc = (ROOT / "docs" / "gpu-state-rules.md").read_text()
    for rule in RULES:
        assert re.search(rf"`{rule.id}`", doc), f"rule {rule.id} missing from docs/gpu-state-rules.md"


def test_worst_state_wins_and_reason_lists_its_evidence() -> None:
    s = GpuEvidenceStore()
    s.put_all("nvml", [readable(0), ev("remap.pending", State.DEGRADED, 0, reason="A"),
                       ev("pcie.link_width", State.SUSPECT, 0, reason="B"), ev("nvlink.down", State.DEGRADED, 0,
                                                                              reason="C")])
    assert s.derive(1) == (State.DEGRADED, "A; C")


def test_operator_clear_journals_who_and_why() -> None:
    s = GpuEvidenceStore()
    s.put(xid(79, 1))
    s.clear(2, by="alice", why="reseated")
    assert s.xid_counts(3, 1e9) == {}
    ops = [e for e in s.current(3) if e.source == "operator"]
    assert ops and "alice" in ops[0].reason and "reseated" in ops[0].reason


def test_history_is_bounded() -> None:
    s = GpuEvidenceStore(GpuStateConfig(history_max=8))
    for t in range(100):
        s.put(xid(13, t))
        s.put(reset(t))
    assert s.xid_counts(100, 1e9)[13][0] == 8 and len(s._resets) == 8


def test_bad_config_and_bad_xid_signal() -> None:
    with pytest.raises(ValueError, match="app_xid_repeat"):
        GpuStateConfig(app_xid_repeat=0)
    with pytest.raises(ValueError, match="xid.<number>"):
        GpuEvidenceStore().put(Evidence("nvml", "xid.abc", "", State.HEALTHY, "", 0))
