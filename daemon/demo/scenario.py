"""The demo's NVML scenario on machines without GPUs: one fake GPU per rank (so the agent has GPUs to
mark SUSPECT or FAILED), optionally an XID at a chosen time."""
from __future__ import annotations

import json
from pathlib import Path


def fake_uuid(i: int) -> str:
    return f"GPU-de300000-0000-4000-8000-{i:012d}"


def write_scenario(path: Path, gpus: int, xid: int | None = None, xid_gpu: int = 0, xid_at: float = 0.0) -> list[str]:
    uuids = [fake_uuid(i) for i in range(gpus)]
    data = {"description": "sdcwatch demo: one simulated GPU per rank",
            "gpus": [{"uuid": u, "pci_bus_id": f"00000000:{0x19 + 0x20 * i:02x}:00.0", "name": "Simulated GPU"}
                     for i, u in enumerate(uuids)],
            "timeline": [{"at": xid_at, "gpu": xid_gpu, "xid": xid}] if xid else []}
    path.write_text(json.dumps(data, indent=1))
    return uuids
