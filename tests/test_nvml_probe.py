"""The NVML probe over the ScenarioBackend: every scenario file, NotSupported, a GPU reset, a hang, no NVML."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from daemon.event_fold import Occurrence, RepeatFolder
from probes.gpu_state import GpuEvidenceStore
from probes.nvml_backend import GpuLost, NvmlBackend, NvmlUnavailable, PynvmlBackend, open_backend
from probes.nvml_fake import ScenarioBackend
from probes.nvml_probe import NvmlProbe, NvmlProbeConfig, XidEvent, fold_batch
from sdcwatch.types import Evidence, Severity, State
from sdcwatch import event_kinds as ek

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "tests" / "scenarios").glob("*.json")) + [ROOT / "deploy/scenarios/demo-xid79.json"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Harness:
    """Drives a scenario second by second: poll, drain XIDs, feed one evidence store per GPU."""

    def __init__(self, scenario: dict | Path) -> None:
        self.clock = Clock()
        self.t0 = self.clock.t
        data = json.loads(Path(scenario).read_text()) if isinstance(scenario, Path) else scenario
        self.backend = ScenarioBackend(data, clock=self.clock)
        self.backend.release_hangs()
        self.probe = NvmlProbe(self.backend, NvmlProbeConfig(), clock=lambda: self.clock.t - self.t0)
        self.ids = self.probe.discover()
        self.backend.xid_open()
        self.stores = {i.uuid: GpuEvidenceStore() for i in self.ids}
        self.findings: list = []
        self.timed: list = []   # (scenario second, finding)
        self.last = None

    def uuid(self, ref: int | str) -> str:
        return self.ids[ref].uuid if isinstance(ref, int) else ref

    def step(self, t: float) -> None:
        self.clock.t = self.t0 + t
        res = self.probe.poll(now=t)
        self.last = res
        self.findings.extend(res.findings)
        self.timed.extend((t, f) for f in res.findings)
        for uuid, evs in res.evidence.items():
            self.stores[uuid].put_all("nvml", evs)
        batch = []
        while (ev := self.probe.xid_step(0)) is not None:
            batch.append(ev)
        for ev in fold_batch(batch):   # as the agent's listener hands them over
            evidence, finding = self.probe.event_evidence(ev)
            self.findings.append(finding)
            self.timed.append((t, finding))
            self.stores[ev.uuid].put(evidence)

    def state(self, ref: int | str, t: float) -> tuple[State, str]:
        return self.stores[self.uuid(ref)].derive(t)


def _run_expectations(path: Path) -> Harness:
    data = json.loads(path.read_text())
    h = Harness(data)
    expects = sorted(data.get("expect", []), key=lambda e: e["at"])
    assert expects, f"{path.name} has no expectations"
    end = expects[-1]["at"]
    t = 0
    for e in expects:
        while t <= e["at"]:
            h.step(t)
            t += 1
        uuid = h.uuid(e["gpu"])
        if "canary" in e:
            h.stores[uuid].put(Evidence("canary", e["canary"], e["canary"],
                                        State.HEALTHY if e["canary"] == "pass" else State.FAILED,
                                        f"canary {e['canary']}", e["at"]))
        elif e.get("operator_clear"):
            h.stores[uuid].clear(e["at"], by="test", why="scenario")
        else:
            # "within": the verdict may come up to that many seconds later (fields read in rotation)
            state, reason = h.state(uuid, e["at"])
            while state.name != e["state"] and t <= e["at"] + e.get("within", 0):
                h.step(t)
                state, reason = h.state(uuid, t)
                t += 1
            assert state.name == e["state"], f"{path.name} t={e['at']} gpu={e['gpu']}: {state.name} ({reason})"
            assert e.get("reason", "") in reason, f"{path.name} t={e['at']}: {reason!r}"
    assert t > end
    return h


@pytest.mark.parametrize("path", [p for p in SCENARIOS if p.stem != "unavailable"], ids=lambda p: p.stem)
def test_scenario_expectations(path: Path) -> None:
    _run_expectations(path)


def test_backends_implement_the_protocol() -> None:
    b = ScenarioBackend(json.loads((ROOT / "tests/scenarios/clean.json").read_text()))
    assert isinstance(b, NvmlBackend)
    assert issubclass(PynvmlBackend, object) and all(
        hasattr(PynvmlBackend, m) for m in ("device_count", "identity", "read_fields", "xid_open", "xid_wait",
                                            "xid_close", "close"))


def test_no_nvml_library_scenario_raises_unavailable_with_reason() -> None:
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.1"):
        open_backend(str(ROOT / "tests/scenarios/unavailable.json"))


def test_real_backend_without_nvml_fails_cleanly() -> None:
    try:
        b = PynvmlBackend()
    except NvmlUnavailable as exc:
        assert "NVML" in str(exc)
        return
    b.close()
    pytest.skip("NVML is present on this machine")


def test_bad_scenario_gives_clear_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        ScenarioBackend.from_file(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="unknown field 'ecc.bogus'"):
        ScenarioBackend({"gpus": [{"uuid": "GPU-a", "pci_bus_id": "0:1", "fields": {"ecc.bogus": 1}}]})
    with pytest.raises(ValueError, match="'gpu' must be an index or a UUID"):
        ScenarioBackend({"gpus": [{"uuid": "GPU-a", "pci_bus_id": "0:1"}], "timeline": [{"at": 1, "gpu": 5, "xid": 79}]})
    with pytest.raises(ValueError, match="duplicate GPU UUIDs"):
        ScenarioBackend({"gpus": [{"uuid": "GPU-a", "pci_bus_id": "0:1"}, {"uuid": "GPU-a", "pci_bus_id": "0:2"}]})


def test_not_supported_fields_are_recorded_not_errors_not_healthy() -> None:
    h = Harness(ROOT / "tests/scenarios/not_supported.json")
    h.step(0)
    u0, u1 = h.ids[0].uuid, h.ids[1].uuid
    res = h.last
    assert {"remap.pending", "remap.failure", "pcie.replay", "ecc.corrected.volatile.dram"} <= res.unsupported[u0]
    assert not res.errors[u0]
    signals = {e.signal for e in res.evidence[u0]}
    assert "remap.pending" not in signals and "remap.failure" not in signals
    assert res.readings[u0] is not None and "remap.pending" not in res.readings[u0].values
    # GPU 1 can read nothing: no HEALTHY evidence at all, UNKNOWN with the reason
    assert res.readings[u1] is None
    assert all(e.implies is not State.HEALTHY for e in res.evidence[u1])
    assert h.state(1, 0)[0] is State.UNKNOWN


def test_gpu_reset_recognised_and_counters_keep_growing() -> None:
    h = Harness(ROOT / "tests/scenarios/gpu_reset.json")
    for t in range(0, 22):
        h.step(t)
    assert any(f.kind is ek.GPU_RESET_DETECTED for f in h.findings)
    r = h.last.readings[h.ids[0].uuid]
    assert r is not None and not r.reset_detected  # seen once, at t=20
    deltas = [f for f in h.findings if f.kind is ek.GPU_COUNTER_JUMP]
    assert any(f.details["field"] == "ecc.uncorrected.volatile.dram" and f.severity is Severity.CRITICAL for f in deltas)
    assert all(f.details["delta"] > 0 for f in deltas)


def test_xid_event_evidence_and_finding_use_catalog_action() -> None:
    ev = XidEvent(uuid="GPU-x", pci_bus_id="00000000:19:00.0", xid=79, time=5.0)
    evidence, finding = NvmlProbe.xid_evidence(ev)
    assert evidence.key == ("nvml", "xid.79") and evidence.implies is State.FAILED
    assert finding.severity is Severity.CRITICAL and finding.details["action"] == "REBOOT"
    assert finding.subject == "gpu/GPU-x"
    unknown, f2 = NvmlProbe.xid_evidence(XidEvent("GPU-x", "b", 4242, 1.0))
    assert "unknown XID" in f2.message and f2.severity is Severity.WARNING and unknown.implies is State.HEALTHY


def test_xid_listener_thread_delivers_events_and_stops() -> None:
    clock = Clock()
    data = {"gpus": [{"uuid": "GPU-a", "pci_bus_id": "00000000:19:00.0"}],
            "timeline": [{"at": 1, "gpu": 0, "xid": 13}, {"at": 1, "gpu": 0, "xid": 79}]}
    probe = NvmlProbe(ScenarioBackend(data, clock=clock), NvmlProbeConfig(xid_wait_ms=20))
    probe.discover()
    got: list[XidEvent] = []
    done = threading.Event()

    def on_event(ev: XidEvent) -> None:
        got.append(ev)
        if len(got) == 2:
            done.set()
        raise RuntimeError("a failing handler must not kill the listener")

    stop = threading.Event()
    th = threading.Thread(target=probe.run_xid_listener, args=(on_event, stop), daemon=True)
    th.start()
    clock.t += 2  # the XIDs happen after the listener registered
    assert done.wait(5)
    stop.set()
    th.join(5)
    assert not th.is_alive()
    assert [(e.uuid, e.pci_bus_id, e.xid) for e in got] == [("GPU-a", "00000000:19:00.0", 13),
                                                            ("GPU-a", "00000000:19:00.0", 79)]


def test_hang_in_one_call_blocks_poll_reproducibly_and_only_once() -> None:
    clock = Clock()
    data = json.loads((ROOT / "tests/scenarios/hang.json").read_text())
    backend = ScenarioBackend(data, clock=clock)
    probe = NvmlProbe(backend, NvmlProbeConfig())
    probe.discover()
    t0 = clock.t
    probe.poll(now=0)  # before the hang is due: returns
    clock.t = t0 + 3
    result: list = []
    th = threading.Thread(target=lambda: result.append(probe.poll(now=3)), daemon=True)
    th.start()
    th.join(0.3)
    assert th.is_alive(), "the poll should be stuck in nvmlDeviceGetRemappedRows"
    # meanwhile another thread's NVML calls still answer
    assert backend.device_count() == 2
    backend.release_hangs()
    th.join(5)
    assert not th.is_alive() and result
    clock.t = t0 + 4
    done: list = []
    th2 = threading.Thread(target=lambda: done.append(probe.poll(now=4)), daemon=True)
    th2.start()
    th2.join(2)
    assert done, "the hang was 'times': 1; the next poll returns"


def test_hang_ends_by_itself_after_its_seconds() -> None:
    clock = Clock()
    data = {"gpus": [{"uuid": "GPU-a", "pci_bus_id": "0:1"}],
            "timeline": [{"at": 0, "hang": {"call": "nvmlDeviceGetPcieReplayCounter", "seconds": 0.2}}]}
    probe = NvmlProbe(ScenarioBackend(data, clock=clock), NvmlProbeConfig())
    probe.discover()
    res = probe.poll(now=0)
    assert res.poll_seconds["GPU-a"] >= 0.2


def test_gpu_lost_gives_failed_and_one_finding() -> None:
    h = Harness(ROOT / "tests/scenarios/xid79.json")
    for t in range(0, 14):
        h.step(t)
    u1 = h.ids[1].uuid
    assert sum(1 for f in h.findings if f.kind is ek.GPU_LOST) == 1
    assert any(f.kind is ek.GPU_XID and f.details["xid"] == 79 for f in h.findings)
    assert h.last.readings[u1] is None
    with pytest.raises(GpuLost):
        h.backend.read_fields(1, ["temp.gpu"])


def test_signal_change_findings_are_emitted_once_per_change() -> None:
    h = Harness(ROOT / "tests/scenarios/remap_pending.json")
    for t in range(0, 22):
        h.step(t)
    changes = [f for f in h.findings if f.kind is ek.GPU_SIGNAL and f.details["signal"] == "remap.pending"]
    assert [f.details["implies"] for f in changes] == ["DEGRADED", "HEALTHY"]


def test_rediscovery_keys_by_uuid() -> None:
    h = Harness(ROOT / "tests/scenarios/clean.json")
    h.step(0)
    ids = h.probe.discover()
    assert [i.uuid for i in ids] == [i.uuid for i in h.ids]
    assert all(i.pci_bus_id for i in ids)


# -- PynvmlBackend over a stub pynvml module (the real NVML runs in tests/test_nvml_real.py on a GPU) --------


class _StubNvml:
    """Just enough of nvidia-ml-py's surface to run PynvmlBackend's decoding and error mapping."""

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.shutdown = False

    def __getattr__(self, name: str):
        if name.startswith("nvmlDevice"):
            return lambda *a: self.calls.append(name) or 3
        raise AttributeError(name)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h: str) -> str:
        return "GPU-stub"

    def nvmlDeviceGetPciInfo(self, h: str):
        import types
        return types.SimpleNamespace(busId=b"00000000:19:00.0")

    def nvmlDeviceGetName(self, h: str) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetSerial(self, h: str) -> str:
        raise self.NVMLError(3)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.90.07"

    def nvmlDeviceGetMemoryErrorCounter(self, h, err, counter, loc):
        if loc == 7:
            raise self.NVMLError(3)  # SRAM not split on this driver
        return 2

    def nvmlDeviceGetRemappedRows(self, h):
        self.calls.append("nvmlDeviceGetRemappedRows")
        return (1, 0, 1, 0)

    def nvmlDeviceGetPcieReplayCounter(self, h):
        raise self.NVMLError(15)  # GPU is lost mid-poll

    def nvmlDeviceGetFieldValues(self, h, ids):
        import types
        out = []
        for fid, scope in ids:
            if fid in (74, 75, 76, 77, 78, 79, 269, 270, 271):
                out.append(types.SimpleNamespace(nvmlReturn=3, valueType=3, value=None))
                continue
            val = {91: 2, 165: 1, 161: 5, 162: 0, 163: 7, 230: 0, 82: 50, 83: 123456}.get(fid, 0)
            out.append(types.SimpleNamespace(nvmlReturn=0, valueType=3, value=types.SimpleNamespace(ullVal=val)))
        return out


def test_pynvml_backend_decodes_groups_and_maps_errors() -> None:
    from probes.nvml_backend import FieldNotSupported
    from probes.nvml_fields import field_specs

    stub = _StubNvml()
    b = PynvmlBackend(stub)
    ident = b.identity(0)
    assert (ident.uuid, ident.pci_bus_id, ident.serial, ident.driver_version) == (
        "GPU-stub", "00000000:19:00.0", None, "550.90.07")
    names = [n for n in field_specs(2) if n != "pcie.replay"]
    v = b.read_fields(0, names)
    assert v["nvlink.count"] == 2 and v["nvlink.1.crc"] == 7 and v["nvlink.0.state"] == 1
    assert v["energy.total_j"] == pytest.approx(123.456)
    assert v["temp.memory"] == 50 and v["recovery_action"] == 0
    assert isinstance(v["throttle_ns.hw_thermal"], FieldNotSupported)
    assert isinstance(v["ecc.corrected.volatile.sram"], FieldNotSupported)
    assert v["ecc.corrected.volatile.dram"] == 2
    assert (v["remap.correctable"], v["remap.pending"]) == (1, 1)
    assert stub.calls.count("nvmlDeviceGetRemappedRows") == 1  # one NVML call serves four fields
    assert v["clocks_event_reasons"] == 3
    with pytest.raises(GpuLost):
        b.read_fields(0, ["pcie.replay"])
    b.close()
    assert stub.shutdown


def test_pynvml_backend_init_failure_is_unavailable() -> None:
    stub = _StubNvml()

    def fail() -> None:
        raise stub.NVMLError(12)

    stub.nvmlInit = fail  # type: ignore[method-assign]
    with pytest.raises(NvmlUnavailable, match="NVML unavailable"):
        PynvmlBackend(stub)


def _counting_probe(scenario: str, clock=lambda: 0.0, **cfg):
    from probes.nvml_fake import ScenarioBackend
    from probes.nvml_probe import NvmlProbe, NvmlProbeConfig

    backend = ScenarioBackend.from_file(str(ROOT / "tests" / "scenarios" / scenario), clock=clock)
    asked: list[list[str]] = []
    real = backend.read_fields

    def counting(index, names):
        asked.append(list(names))
        return real(index, names)

    backend.read_fields = counting  # type: ignore[method-assign]
    probe = NvmlProbe(backend, NvmlProbeConfig(**cfg))
    probe.discover()
    asked.clear()
    return probe, asked


def test_fields_are_read_fast_rotated_or_static_and_carried_between() -> None:
    """A poll reads the fast fields, the next rotated unit, and (first poll only) everything: per-poll cost
    is bounded by the costliest unit, not the sum of all fields. NVLink error counters are never read inside a
    poll after the first: the sweep reads them (its own read_fields calls)."""
    from probes.nvml_probe import poll_class, rotation_unit

    probe, asked = _counting_probe("clean.json")
    results = [probe.poll(float(t)) for t in range(100)]
    polls = [names for names in asked if any(poll_class(n) != "sweep" for n in names)]
    per_gpu = len(probe.identities())
    first_gpu = [polls[i] for i in range(0, len(polls), per_gpu)]
    everything = set(first_gpu[0])
    assert {poll_class(n) for n in everything} == {"fast", "rotate", "static", "sweep"}
    fast = {n for n in everything if poll_class(n) == "fast"}
    units = {rotation_unit(n) for n in everything if poll_class(n) == "rotate"}
    assert len(units) >= 3
    later = first_gpu[1:]
    for names in later:
        assert fast <= set(names), "fast fields every poll"
        assert not any(poll_class(n) in ("static", "sweep") for n in names), "static fields only on the first poll"
        assert len({rotation_unit(n) for n in names if poll_class(n) == "rotate"}) == 1, "one unit per poll"
    seen = [next(rotation_unit(n) for n in names if poll_class(n) == "rotate") for names in later]
    assert set(seen[:len(units)]) == units, "every unit within one rotation"
    assert seen[:len(units)] == seen[len(units):2 * len(units)], "a fixed cycle"
    uuid = probe.identities()[0].uuid
    r = results[3].readings[uuid]
    assert r is not None and "pcie.width.max" in r.values, "static fields carried between reads"
    assert r.read_time["pcie.width.max"] == 0.0 and r.read_time["temp.gpu"] == 3.0
    assert results[3].evidence[uuid] and all(e.implies.name == "HEALTHY" for e in results[3].evidence[uuid])


def test_nvlink_counters_are_swept_after_polls_staggered_and_judged_by_the_next_poll() -> None:
    """The costly fields (NVLink, three throttle counters) in one read per GPU every sweep_s, outside the poll's
    own read and timing, the GPUs spread over the interval; what a sweep reads is fresh for the next poll."""
    from probes.nvml_probe import poll_class

    now = [0.0]
    probe, asked = _counting_probe("nvlink_errors.json", clock=lambda: now[0], sweep_s=20.0)
    gpus = [i.uuid for i in probe.identities()]
    sweeps: dict[str, list[int]] = {u: [] for u in gpus}
    states: dict[int, dict[str, str]] = {}
    all_swept: list[list[str]] = []
    for t in range(0, 62):
        now[0] = float(t)
        asked.clear()
        res = probe.poll(float(t))
        swept = [names for names in asked if all(poll_class(n) == "sweep" for n in names)]
        assert len(swept) == len(res.sweep_seconds), "one read per swept GPU"
        all_swept += swept
        for uuid in res.sweep_seconds:
            sweeps[uuid].append(t)
        assert set(res.poll_seconds) == set(gpus)
        states[t] = {u: max((e.implies.name for e in res.evidence[u] if e.signal == "nvlink.errors"),
                            default="-") for u in gpus}
    assert sweeps[gpus[0]] == [10, 30, 50] and sweeps[gpus[1]] == [20, 40, 60], sweeps
    every_sweep = [set(names) for names in all_swept]
    assert len(every_sweep) == 6 and all(names == every_sweep[0] for names in every_sweep)
    assert {n for n in every_sweep[0] if not n.startswith("nvlink.")} == {
        "throttle_ns.thermal", "throttle_ns.hw_thermal", "throttle_ns.hw_power_brake"}
    assert {"nvlink.3.replay", "nvlink.5.state"} <= every_sweep[0]
    # 50 replays on GPU 0's link 3 at t=10: the sweep at t=10 reads them, the poll at t=11 judges them
    assert states[10][gpus[0]] != "SUSPECT" and states[11][gpus[0]] == "SUSPECT", (states[10], states[11])


def test_rotate_per_poll_and_skip_fields() -> None:
    from probes.nvml_probe import poll_class, rotation_unit

    probe, asked = _counting_probe("clean.json", rotate_per_poll=2, skip_fields=("throttle_ns.*", "temp.memory"))
    probe.poll(0.0)
    probe.poll(1.0)
    per_gpu = len(probe.identities())
    assert not any(n.startswith("throttle_ns.") or n == "temp.memory" for n in asked[0])
    second = asked[per_gpu]
    assert len({rotation_unit(n) for n in second if poll_class(n) == "rotate"}) == 2


def test_a_failed_first_poll_reads_every_field_again() -> None:
    """The first successful read of a GPU reads every field (static ones included), even when the very
    first poll failed: a GPU must never be left with its static fields unread."""
    from probes.nvml_backend import NvmlError
    from probes.nvml_probe import poll_class

    probe, asked = _counting_probe("clean.json")
    backend = probe.backend
    real = backend.read_fields
    fail = {"left": 2}

    def flaky(index, names):
        if fail["left"] > 0:
            fail["left"] -= 1
            asked.append(list(names))
            raise NvmlError("driver busy", transient=True)
        return real(index, names)

    backend.read_fields = flaky  # type: ignore[method-assign]
    first = probe.poll(0.0)
    uuid = probe.identities()[0].uuid
    assert first.readings[uuid] is None
    second = probe.poll(1.0)
    r = second.readings[uuid]
    assert r is not None and "pcie.width.max" in r.values and "clock.sm_max_mhz" in r.values
    statics = [n for n in asked[-1] if poll_class(n) == "static"]
    assert statics, "the read after the failures asked for the static fields"


def _fold(h: Harness) -> list:
    """The harness's findings through the bus's real repeat folder, at their times; the summaries flushed."""
    folder, out = RepeatFolder(), []
    for t, f in h.timed:
        out += folder.offer(Occurrence(f.kind, f.severity, f.subject, f.message, f.details), float(t))
    return out + folder.flush()


def test_xid_flood_is_counted_and_folded_and_never_hides_another_xid() -> None:
    h = _run_expectations(ROOT / "tests/scenarios/xid_flood.json")
    xid13 = [f for f in h.findings if f.kind is ek.GPU_XID and f.details["xid"] == 13]
    assert sum(f.details.get("repeats", 1) for f in xid13) == 800_000
    assert len(xid13) <= 25, "one finding per drained batch, not per XID"
    published = _fold(h)
    p13 = [o for o in published if o.kind is ek.GPU_XID and o.details["xid"] == 13]
    assert len(p13) == 2 and sum(o.details.get("repeats", 1) for o in p13) == 800_000   # first + one summary
    p79 = [o for o in published if o.kind is ek.GPU_XID and o.details["xid"] == 79]
    assert len(p79) == 1 and p79[0].subject.endswith("0001"), "XID 79 published at once, not folded into 13s"
    assert h.stores[h.uuid(0)].xid_counts(30, 3600)[13][0] == 256   # bounded history, counted


def test_ecc_storm_20k_per_second_is_one_event_per_kind_and_window() -> None:
    h = _run_expectations(ROOT / "tests/scenarios/ecc_storm_20k.json")
    storms = [f for f in h.findings if f.kind is ek.GPU_ECC_STORM]
    assert {f.details.get("event", f.details.get("signal")) for f in storms} == {"sbe_storm", "ecc.sbe_storm"}
    published = _fold(h)
    by_kind: dict = {}
    for o in published:
        by_kind.setdefault((o.kind.name, o.subject, o.details.get("field", "")), []).append(o)
    assert len(by_kind[("gpu.ecc_storm", f"gpu/{h.uuid(0)}", "")]) <= 2
    jumps = [k for k in by_kind if k[0] == "gpu_counter_jump"]
    assert jumps and all(len(by_kind[k]) <= 2 for k in jumps), {k: len(by_kind[k]) for k in jumps}


def test_every_nvml_event_kind_and_not_supported_recorded() -> None:
    h = _run_expectations(ROOT / "tests/scenarios/nvml_events.json")
    events = {f.details["event"]: f for f in h.findings if f.kind in (ek.GPU_NVML_EVENT, ek.GPU_ECC_STORM)
              and "event" in f.details}
    assert set(events) == {"poison_nonfatal", "dram_retirement", "recovery_action", "dram_retirement_failure",
                           "poison_fatal", "gpu_unavailable"}, "GPU 1 does not deliver sbe_storm"
    assert events["poison_fatal"].severity is Severity.CRITICAL and events["recovery_action"].details["data"] == 1
    registered = h.backend.xid_open()
    assert "sbe_storm" in registered[0] and "sbe_storm" not in registered[1] and "xid" in registered[1]


class _FloodBackend:
    """Every wait finds an XID and every drain 500 more: a flood that never pauses."""

    def __init__(self) -> None:
        self.waits = 0

    def xid_open(self) -> dict[int, list[str]]:
        return {0: ["xid"]}

    def xid_wait(self, timeout_ms: int):
        from probes.nvml_types import RawXid
        self.waits += 1
        return RawXid("GPU-0", 13)

    def xid_drain(self, max_events: int):
        from probes.nvml_types import RawXid
        return [RawXid("GPU-0", 13, count=500)]

    def xid_close(self) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def identity(self, index: int):
        raise NotImplementedError

    def read_fields(self, index: int, names):
        return {}

    def close(self) -> None:
        pass


def test_a_flood_is_read_in_paced_batches_and_every_xid_counted() -> None:
    """Under a flood the listener pauses between reads (20 ms, doubling to 100 ms): a fast host read a few
    XIDs per wait and spent 31% of a core on the H200; every XID still arrives in the counts."""
    backend = _FloodBackend()
    probe = NvmlProbe(backend, NvmlProbeConfig())   # type: ignore[arg-type]
    got: list[int] = []
    stop = threading.Event()
    t = threading.Thread(target=probe.run_xid_listener, args=(lambda ev: None, stop),
                         kwargs={"on_batch": lambda batch: got.append(sum(ev.count for ev in batch))})
    t.start()
    stop.wait(1.0)
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert 2 <= backend.waits <= 20, f"{backend.waits} reads in 1 s of flood"
    assert got == [501] * len(got) and len(got) == backend.waits
