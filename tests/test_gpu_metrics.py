from __future__ import annotations

from prometheus_client import CollectorRegistry

from daemon.gpu_metrics import GpuMetrics
from probes.nvml_backend import GpuIdentity
from probes.nvml_rules import RuleConfig, make_readings
from sdcwatch.types import State

ID = GpuIdentity("GPU-a", "00000000:19:00.0", "NVIDIA H200", 0, "123", "550.90.07")
LBL = {"uuid": "GPU-a", "pci_bus_id": "00000000:19:00.0", "model": "NVIDIA H200"}


def val(reg: CollectorRegistry, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, dict(LBL, **labels))


def test_counters_follow_deltas_and_survive_a_gpu_reset() -> None:
    reg = CollectorRegistry()
    m = GpuMetrics(reg)
    seq = [{"ecc.corrected.volatile.total": 5, "pcie.replay": 1, "nvlink.2.replay": 0, "nvlink.2.state": 1},
           {"ecc.corrected.volatile.total": 8, "pcie.replay": 4, "nvlink.2.replay": 2, "nvlink.2.state": 1},
           {"ecc.corrected.volatile.total": 1, "pcie.replay": 0, "nvlink.2.replay": 0, "nvlink.2.state": 0}]  # reset
    prev = None
    for t, v in enumerate(seq):
        prev = make_readings("GPU-a", prev, v, frozenset(), {}, t, RuleConfig())
        m.update(ID, prev, State.HEALTHY)
    assert val(reg, "sdcwatch_gpu_ecc_errors_total", type="corrected", location="total") == 3 + 1
    assert val(reg, "sdcwatch_gpu_pcie_replays_total") == 3
    assert val(reg, "sdcwatch_gpu_nvlink_errors_total", link="2", kind="replay") == 2
    assert val(reg, "sdcwatch_gpu_nvlink_link_up", link="2") == 0
    assert val(reg, "sdcwatch_gpu_resets_detected_total") == 1


def test_state_one_hot_xid_and_gauges() -> None:
    reg = CollectorRegistry()
    m = GpuMetrics(reg)
    r = make_readings("GPU-a", None, {"temp.gpu": 71, "power.usage_w": 512.5, "clock.sm_mhz": 1980,
                                      "remap.pending": 1, "recovery_action": 1, "clocks_event_reasons": 0x40},
                      frozenset({"retired_pages.sbe"}), {}, 0, RuleConfig())
    m.update(ID, r, State.DEGRADED)
    m.observe_xid(ID, 79)
    m.observe_xid(ID, 79)
    assert val(reg, "sdcwatch_gpu_state", state="DEGRADED") == 1
    assert val(reg, "sdcwatch_gpu_state", state="HEALTHY") == 0
    assert val(reg, "sdcwatch_gpu_xid_events_total", xid="79") == 2
    assert val(reg, "sdcwatch_gpu_temperature_celsius", sensor="gpu") == 71
    assert val(reg, "sdcwatch_gpu_power_watts") == 512.5
    assert val(reg, "sdcwatch_gpu_clock_hertz", clock="sm") == 1.98e9
    assert val(reg, "sdcwatch_gpu_remapped_rows", kind="pending") == 1
    assert val(reg, "sdcwatch_gpu_recovery_action", action="GPU_RESET") == 1
    assert val(reg, "sdcwatch_gpu_clock_event_active", reason="hw_thermal_slowdown") == 1
    assert val(reg, "sdcwatch_gpu_unsupported_fields") == 1
    assert val(reg, "sdcwatch_gpu_readable") == 1


def test_unreadable_gpu_and_forget() -> None:
    reg = CollectorRegistry()
    m = GpuMetrics(reg)
    m.update(ID, None, State.UNKNOWN)
    assert val(reg, "sdcwatch_gpu_readable") == 0
    assert val(reg, "sdcwatch_gpu_state", state="UNKNOWN") == 1
    m.forget(ID)
    assert val(reg, "sdcwatch_gpu_state", state="UNKNOWN") is None


def test_throttle_seconds_from_ns() -> None:
    reg = CollectorRegistry()
    m = GpuMetrics(reg)
    r0 = make_readings("GPU-a", None, {"throttle_ns.hw_thermal": 0}, frozenset(), {}, 0, RuleConfig())
    r1 = make_readings("GPU-a", r0, {"throttle_ns.hw_thermal": 2.5e9}, frozenset(), {}, 5, RuleConfig())
    m.update(ID, r0, State.HEALTHY)
    m.update(ID, r1, State.SUSPECT)
    assert val(reg, "sdcwatch_gpu_throttle_seconds_total", reason="hw_thermal") == 2.5
