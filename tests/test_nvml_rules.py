"""Pure NVML rules: deltas across resets, rate windows, thresholds."""
from __future__ import annotations

import pytest

from probes import nvml_rules as nr
from probes.nvml_rules import GpuReadings, RateWindow, RuleConfig, evaluate, make_readings, pcie_replay_threshold
from sdcwatch.types import State
from sdcwatch import event_kinds as ek

CFG = RuleConfig()


def reading(values: dict, prev: GpuReadings | None = None, now: float = 0.0, cfg: RuleConfig = CFG) -> GpuReadings:
    return make_readings("GPU-a", prev, values, frozenset(), {}, now, cfg)


def signals(prev: GpuReadings | None, cur: GpuReadings, now: float, cfg: RuleConfig = CFG) -> dict[str, State]:
    return {e.signal: e.implies for e in evaluate(prev, cur, now, cfg).evidence}


def test_deltas_first_reading_zero_then_difference() -> None:
    r0 = reading({"pcie.replay": 5, "ecc.corrected.volatile.total": 3})
    assert r0.deltas == {}
    r1 = reading({"pcie.replay": 9, "ecc.corrected.volatile.total": 3}, r0, 1)
    assert r1.deltas == {"pcie.replay": 4, "ecc.corrected.volatile.total": 0}
    assert r1.interval_s == 1 and not r1.reset_detected


def test_gpu_reset_counter_drop_is_a_reset_and_delta_never_negative() -> None:
    r0 = reading({"ecc.corrected.volatile.total": 10, "ecc.corrected.aggregate.total": 50})
    r1 = reading({"ecc.corrected.volatile.total": 2, "ecc.corrected.aggregate.total": 52}, r0, 1)
    assert r1.reset_detected
    assert r1.deltas["ecc.corrected.volatile.total"] == 2
    out = evaluate(r0, r1, 1, CFG)
    assert any(e.signal == "gpu_reset" for e in out.evidence)
    assert any(f.kind is ek.GPU_RESET_DETECTED for f in out.findings)


def test_reset_seen_through_recovery_action_going_back_to_none() -> None:
    r0 = reading({"recovery_action": 1})
    r1 = reading({"recovery_action": 0}, r0, 1)
    assert r1.reset_detected


def test_uncorrected_increase_is_degraded_and_critical_jump() -> None:
    r0 = reading({"ecc.uncorrected.volatile.total": 0})
    r1 = reading({"ecc.uncorrected.volatile.total": 1}, r0, 1)
    out = evaluate(r0, r1, 1, CFG)
    assert signals(r0, r1, 1)["ecc.uncorrected"] is State.DEGRADED
    assert [f.severity.name for f in out.findings if f.kind is ek.GPU_COUNTER_JUMP] == ["CRITICAL"]
    r2 = reading({"ecc.uncorrected.volatile.total": 1}, r1, 2)
    assert "ecc.uncorrected" not in signals(r1, r2, 2)


def test_uncorrected_falls_back_to_dram_plus_sram() -> None:
    r0 = reading({"ecc.uncorrected.volatile.dram": 0, "ecc.uncorrected.volatile.sram": 0})
    r1 = reading({"ecc.uncorrected.volatile.dram": 0, "ecc.uncorrected.volatile.sram": 2}, r0, 1)
    assert signals(r0, r1, 1)["ecc.uncorrected"] is State.DEGRADED


def test_sbe_storm_window_counts_and_expires() -> None:
    cfg = RuleConfig(sbe_storm_count=5, sbe_window_s=100)
    r = reading({"ecc.corrected.volatile.total": 0}, cfg=cfg)
    for t in range(1, 5):
        r = reading({"ecc.corrected.volatile.total": t}, r, t, cfg)
        assert "ecc.sbe_storm" not in signals(None, r, t, cfg)
    r = reading({"ecc.corrected.volatile.total": 5}, r, 5, cfg)
    storm = [e for e in evaluate(None, r, 5, cfg).evidence if e.signal == "ecc.sbe_storm"]
    assert storm and storm[0].implies is State.SUSPECT
    assert storm[0].expires == 101  # the first error leaves the window at 1 + 100
    r = reading({"ecc.corrected.volatile.total": 5}, r, 102, cfg)
    assert "ecc.sbe_storm" not in signals(None, r, 102, cfg)


def test_slow_trickle_is_not_a_storm() -> None:
    cfg = RuleConfig(sbe_storm_count=10, sbe_window_s=3600)
    r = reading({"ecc.corrected.volatile.total": 0}, cfg=cfg)
    for i in range(1, 30):  # one error every 1000 s
        r = reading({"ecc.corrected.volatile.total": i}, r, i * 1000, cfg)
        assert "ecc.sbe_storm" not in signals(None, r, i * 1000, cfg)


@pytest.mark.parametrize("gen,width,expected", [(5, 16, 7.68), (4, 16, 3.84), (5, 8, 3.84), (3, 16, 2.0),
                                                 (None, None, 7.68)])
def test_pcie_threshold_scales_with_link(gen, width, expected) -> None:
    assert pcie_replay_threshold(gen, width, 60, CFG) == pytest.approx(expected)


def test_pcie_replay_rate_against_link_threshold() -> None:
    base = {"pcie.gen.current": 4, "pcie.width.current": 16, "pcie.width.max": 16}
    r = reading(dict(base, **{"pcie.replay": 0}))
    r = reading(dict(base, **{"pcie.replay": 3}), r, 10)
    assert "pcie.replay_rate" not in signals(None, r, 10)  # 3 <= 3.84 on Gen4 x16
    r = reading(dict(base, **{"pcie.replay": 5}), r, 20)
    assert signals(None, r, 20)["pcie.replay_rate"] is State.SUSPECT


def test_pcie_width_downtrained() -> None:
    r = reading({"pcie.width.current": 8, "pcie.width.max": 16})
    assert signals(None, r, 0)["pcie.link_width"] is State.SUSPECT
    r = reading({"pcie.width.current": 16, "pcie.width.max": 16})
    assert signals(None, r, 0)["pcie.link_width"] is State.HEALTHY


def test_nvlink_errors_and_link_down() -> None:
    v0 = {"nvlink.0.state": 1, "nvlink.1.state": 1, "nvlink.0.replay": 0, "nvlink.1.recovery": 0}
    r0 = reading(v0)
    assert signals(None, r0, 0)["nvlink.down"] is State.HEALTHY
    r1 = reading(dict(v0, **{"nvlink.1.recovery": 1}), r0, 1)
    ev = [e for e in evaluate(r0, r1, 1, CFG).evidence if e.signal == "nvlink.errors"]
    assert ev and "link 1 recovery 1" in ev[0].reason
    r2 = reading(dict(v0, **{"nvlink.1.state": 0, "nvlink.1.recovery": 1}), r1, 2)
    down = [e for e in evaluate(r1, r2, 2, CFG).evidence if e.signal == "nvlink.down"][0]
    assert down.implies is State.DEGRADED and "1" in down.value
    assert r2.nvlink_baseline == frozenset({0, 1})


def test_thermal_from_reasons_and_from_slowdown_time() -> None:
    r = reading({"clocks_event_reasons": nr.CLOCK_EVENT_BITS["hw_thermal_slowdown"], "temp.gpu": 91})
    ev = [e for e in evaluate(None, r, 0, CFG).evidence if e.signal == "thermal"][0]
    assert ev.implies is State.SUSPECT and "91 C" in ev.reason and ev.expires == CFG.throttle_hold_s
    r = reading({"clocks_event_reasons": nr.CLOCK_EVENT_BITS["sw_power_cap"]})
    assert "thermal" not in signals(None, r, 0)  # power capping under load is normal
    r0 = reading({"throttle_ns.hw_power_brake": 0})
    r1 = reading({"throttle_ns.hw_power_brake": 5e8}, r0, 1)
    assert signals(r0, r1, 1)["thermal"] is State.SUSPECT


def test_memory_repair_and_recovery_action() -> None:
    r = reading({"remap.failure": 1, "remap.pending": 0, "retired_pages.pending": 1, "recovery_action": 2})
    s = signals(None, r, 0)
    assert s == {"remap.failure": State.FAILED, "remap.pending": State.HEALTHY,
                 "retired_pages.pending": State.DEGRADED, "recovery_action": State.FAILED}


def test_unsupported_fields_give_no_evidence() -> None:
    r = make_readings("GPU-a", None, {"temp.gpu": 40}, frozenset({"remap.failure", "pcie.replay"}), {}, 0, CFG)
    assert signals(None, r, 0) == {}


def test_rate_window_is_immutable_and_bounded() -> None:
    w = RateWindow(10)
    w2 = w.add(0, 3).add(5, 2).add(20, 1)
    assert w.events == () and w2.total(20) == 1 and len(w2.events) == 1


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="throttle_fraction"):
        RuleConfig(throttle_fraction=2)
    with pytest.raises(ValueError, match="sbe_window_s"):
        RuleConfig(sbe_window_s=0)


def test_counters_read_in_rotation_use_the_span_since_their_own_last_read() -> None:
    """A counter the probe carries between reads does not move; when it is read again its delta covers the
    time since its previous read, not the last poll interval (else 30 s of throttle time would look like
    3000% of a 1 s poll)."""
    name = "throttle_ns.hw_power_brake"
    r = make_readings("GPU-a", None, {name: 0, "temp.gpu": 40}, frozenset(), {}, 0.0, CFG)
    for t in range(1, 30):  # carried: not fresh
        r = make_readings("GPU-a", r, {name: 0, "temp.gpu": 40}, frozenset(), {}, float(t), CFG,
                          fresh=frozenset({"temp.gpu"}))
        assert r.deltas[name] == 0 and r.read_time[name] == 0.0 and r.read_time["temp.gpu"] == t
    short = make_readings("GPU-a", r, {name: 2e9, "temp.gpu": 40}, frozenset(), {}, 30.0, CFG,
                          fresh=frozenset({name, "temp.gpu"}))
    assert short.deltas[name] == 2e9 and short.field_interval_s[name] == 30.0
    assert "thermal" not in signals(r, short, 30.0), "2 s of 30 s is under the 10% fraction"
    long = make_readings("GPU-a", r, {name: 15e9, "temp.gpu": 40}, frozenset(), {}, 30.0, CFG,
                         fresh=frozenset({name, "temp.gpu"}))
    ev = [e for e in evaluate(r, long, 30.0, CFG).evidence if e.signal == "thermal"]
    assert ev and ev[0].implies is State.SUSPECT and "50% of the last 30s" in ev[0].reason
