"""The real NVML backend on a GPU: reads every field once and records which the GPU supports."""
from __future__ import annotations

import pytest

from probes.nvml_backend import FieldNotSupported, NvmlError, NvmlUnavailable, PynvmlBackend
from probes.nvml_fields import field_specs
from probes.nvml_probe import NvmlProbe

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    try:
        b = PynvmlBackend()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML: {exc}")
    if b.device_count() == 0:
        b.close()
        pytest.skip("NVML has no GPUs")
    yield b
    b.close()


def test_reads_every_field_once(backend, record_property) -> None:
    for index in range(backend.device_count()):
        ident = backend.identity(index)
        assert ident.uuid.startswith(("GPU-", "MIG-")) and ident.pci_bus_id
        links = backend.read_fields(index, ["nvlink.count"]).get("nvlink.count")
        names = list(field_specs(int(links) if isinstance(links, (int, float)) else 0))
        values = backend.read_fields(index, names)
        assert set(values) == set(names)
        supported = sorted(n for n, v in values.items() if not isinstance(v, NvmlError))
        unsupported = sorted(n for n, v in values.items() if isinstance(v, FieldNotSupported))
        errors = {n: str(v) for n, v in values.items() if isinstance(v, NvmlError) and not isinstance(v, FieldNotSupported)}
        record_property(f"gpu{index}_supported", ",".join(supported))
        record_property(f"gpu{index}_unsupported", ",".join(unsupported))
        print(f"GPU {index} {ident.name} {ident.uuid}: {len(supported)} supported, {len(unsupported)} unsupported, "
              f"errors {errors}")
        print("  unsupported:", ", ".join(unsupported))
        assert "temp.gpu" in supported and "ecc.enabled" in supported


def test_probe_polls_and_listens(backend) -> None:
    import threading

    probe = NvmlProbe(backend)
    ids = probe.discover()
    res = probe.poll(now=0.0)
    res = probe.poll(now=1.0)
    for ident in ids:
        assert res.readings[ident.uuid] is not None
        assert any(e.signal == "readable" and e.implies.name == "HEALTHY" for e in res.evidence[ident.uuid])
    stop = threading.Event()
    th = threading.Thread(target=probe.run_xid_listener, args=(lambda ev: None, stop), daemon=True)
    th.start()
    stop.wait(1.0)
    stop.set()
    th.join(5)
    assert not th.is_alive()
