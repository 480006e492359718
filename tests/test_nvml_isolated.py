"""The NVML backend in child processes: same answers as in-process, and a child that dies (as NVML's heap
corruption killed the agent on an H200) costs one failed call, not the agent."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from probes.nvml_backend import FieldNotSupported, NvmlError, NvmlUnavailable
from probes.nvml_fields import field_specs
from probes.nvml_fake import ScenarioBackend
from probes.nvml_isolated import IsolatedBackend

ROOT = Path(__file__).resolve().parent.parent
SCEN = ROOT / "tests" / "scenarios" / "not_supported.json"


@pytest.fixture()
def isolated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SDCWATCH_NVML_CHILD_SCENARIO", str(SCEN))
    b = IsolatedBackend(call_timeout_s=10)
    try:
        yield b
    finally:
        b.close()


def test_answers_match_the_in_process_backend(isolated: IsolatedBackend) -> None:
    local = ScenarioBackend.from_file(str(SCEN))
    assert isolated.device_count() == local.device_count()
    for i in range(local.device_count()):
        assert isolated.identity(i) == local.identity(i)
        names = list(field_specs(2))
        got, want = isolated.read_fields(i, names), local.read_fields(i, names)
        assert set(got) == set(want)
        for k in names:
            if isinstance(want[k], NvmlError):
                assert type(got[k]) is type(want[k])
            else:
                assert got[k] == want[k]
        assert any(isinstance(v, FieldNotSupported) for v in got.values())


def test_read_many_is_one_round_trip_with_each_gpus_answer_or_error(isolated: IsolatedBackend) -> None:
    """A poll reads every GPU in one call to the child; a failing GPU fails its own entry, not the others'."""
    from probes.nvml_backend import read_many

    names = list(field_specs(2))
    n = isolated.device_count()
    sent = isolated._poll.next_id
    got = read_many(isolated, [(i, names) for i in range(n)] + [(99, names)])
    assert isolated._poll.next_id == sent + 1, "one round trip"
    assert len(got) == n + 1
    for i in range(n):
        one = isolated.read_fields(i, names)
        assert isinstance(got[i], dict) and set(got[i]) == set(one)
        assert all(type(got[i][k]) is type(one[k]) if isinstance(one[k], NvmlError) else got[i][k] == one[k]
                   for k in names)
    assert isinstance(got[n], NvmlError) and "no GPU at index 99" in str(got[n])
    local = ScenarioBackend.from_file(str(SCEN))  # the same helper over a backend without read_many
    plain = read_many(local, [(0, names), (99, names)])
    assert isinstance(plain[0], dict) and isinstance(plain[1], NvmlError)


def test_a_dead_child_costs_one_call_then_restarts(isolated: IsolatedBackend) -> None:
    assert isolated.device_count() >= 1
    with pytest.raises(NvmlError) as err:  # the child aborts inside a call, as glibc does on heap corruption
        isolated._poll.call("__abort__")
    assert err.value.transient and "died" in str(err.value)
    assert isolated.device_count() >= 1, "the next call starts a new child"
    proc = isolated._poll.proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)  # dead between calls: noticed before the next call, restarted
    proc.wait()
    assert isolated.device_count() >= 1
    assert isolated.restarts == 1


def test_xid_events_come_through_their_own_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scen = tmp_path / "x.json"
    scen.write_text(json.dumps({"gpus": [{"uuid": "GPU-00000000-0000-4000-8000-0000000000b0",
                                          "pci_bus_id": "00000000:19:00.0", "name": "NVIDIA H200"}],
                                "timeline": [{"at": 0, "gpu": 0, "xid": 48},
                                             {"at": 0.5, "gpu": 0, "event": "sbe_storm"}]}))
    monkeypatch.setenv("SDCWATCH_NVML_CHILD_SCENARIO", str(scen))
    b = IsolatedBackend(call_timeout_s=10)
    try:
        opened = b.xid_open()
        assert list(opened) == [0] and {"xid", "sbe_storm", "recovery_action"} <= set(opened[0])
        ev = None
        for _ in range(50):
            ev = b.xid_wait(100)
            if ev is not None:
                break
        assert ev is not None and ev.xid == 48 and ev.uuid == "GPU-00000000-0000-4000-8000-0000000000b0"
        assert ev.event == "xid"
        ev = None
        for _ in range(50):
            ev = b.xid_wait(100)
            if ev is not None:
                break
        assert ev is not None and ev.event == "sbe_storm"   # a non-XID event crosses the child's pipe too
        b.xid_close()
    finally:
        b.close()


def test_no_nvml_library_is_unavailable_and_leaves_no_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SDCWATCH_NVML_CHILD_SCENARIO", raising=False)
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML is present here")
    except Exception:
        pass
    with pytest.raises(NvmlUnavailable):
        IsolatedBackend(call_timeout_s=10)
