"""GPU health events to NVSentinel: the agent's sender against a PlatformConnector server generated from
the same proto (proto/nvsentinel/platformconnector.proto), on a unix socket; the wire pinned to NVIDIA's
published field numbers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from daemon.background import Background
from daemon.gpus import GpuRegistry
from daemon.nvsentinel import GPU_CHECK, SDC_CHECK, NvsentinelConfig, NvsentinelEvents
from proto.nvsentinel import platformconnector_pb2 as pc
from proto.nvsentinel import platformconnector_pb2_grpc as pc_grpc
from sdcwatch.types import Evidence, State
from deadlines import scaled


def test_the_wire_is_nvsentinels() -> None:
    """Names and numbers as in NVIDIA's protobufs/platformconnector.proto (commit 6f8b0fc): a change here
    breaks every connector."""
    fd = pc.DESCRIPTOR
    assert fd.package == "platformconnector"
    (svc,) = fd.services_by_name.values()
    assert svc.full_name == "platformconnector.PlatformConnector"
    m = svc.methods_by_name["HealthEventOccuredV1"]
    assert (m.input_type.full_name, m.output_type.full_name) == (
        "platformconnector.HealthEvents",
        "google.protobuf.Empty",
    )
    fields = {f.name: (f.number, f.type) for f in pc.HealthEvent.DESCRIPTOR.fields}
    T = pc.HealthEvent.DESCRIPTOR.fields_by_name["agent"].type  # string
    assert {k: v[0] for k, v in fields.items()} == {
        "version": 1,
        "agent": 2,
        "componentClass": 3,
        "checkName": 4,
        "isFatal": 5,
        "isHealthy": 6,
        "message": 7,
        "recommendedAction": 8,
        "errorCode": 9,
        "entitiesImpacted": 10,
        "metadata": 11,
        "generatedTimestamp": 12,
        "nodeName": 13,
    }
    assert fields["agent"][1] == T and fields["isFatal"][1] != T
    assert {f.name: f.number for f in pc.HealthEvents.DESCRIPTOR.fields} == {"version": 1, "events": 2}
    assert {f.name: f.number for f in pc.Entity.DESCRIPTOR.fields} == {"entityType": 1, "entityValue": 2}
    assert {v.name: v.number for v in pc.RecommenedAction.DESCRIPTOR.values} == {
        "NONE": 0,
        "COMPONENT_RESET": 2,
        "REPORT_ISSUE": 5,
        "RUN_FIELDDIAG": 6,
        "RESET_GPU": 20,
        "UNKNOWN": 99,
    }


class Recorder(pc_grpc.PlatformConnectorServicer):
    def __init__(self) -> None:
        self.batches: list[pc.HealthEvents] = []
        self.fail = 0

    async def HealthEventOccuredV1(self, request, context):  # noqa: N802 - the generated name
        if self.fail:
            self.fail -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connector restarting")
        self.batches.append(request)
        return empty_pb2.Empty()


def test_state_changes_reach_the_connector_and_a_failed_send_is_retried(tmp_path: Path) -> None:
    sock = tmp_path / "platform-connector.sock"

    async def scenario() -> None:
        server = grpc.aio.server()
        rec = Recorder()
        pc_grpc.add_PlatformConnectorServicer_to_server(rec, server)
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        gpus = GpuRegistry()
        now = time.time()
        for i, pci in enumerate(("00000000:19:00.0", "00000000:3B:00.0", "00000000:4C:00.0")):
            gpus.ensure(f"GPU-{i}", now, pci_bus_id=pci)
        sender = NvsentinelEvents(
            NvsentinelConfig(socket=str(sock), timeout_s=5), "gpu-node-7", gpus, retry_s=(0.05, 0.2)
        )
        gpus.on_transition = lambda *a: sender.notify()
        bg = Background()
        sender.start(bg)

        async def until(pred, what: str) -> None:
            deadline = time.monotonic() + scaled(30)
            while not pred():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.01)

        gpus.add_evidence(
            "GPU-0", [Evidence("nvml", "xid", "79", State.FAILED, "XID 79: fell off the bus", now)], now
        )
        gpus.add_evidence(
            "GPU-1", [Evidence("canary", "bf16", "mismatch", State.SUSPECT, "canary mismatch", now)], now
        )
        await until(
            lambda: {e.checkName for b in rec.batches for e in b.events} >= {GPU_CHECK, SDC_CHECK},
            "the FAILED and SUSPECT GPUs never reached NVSentinel",
        )
        events = {(e.entitiesImpacted[0].entityValue, e.checkName): e for b in rec.batches for e in b.events}
        failed = events[("GPU-0", GPU_CHECK)]
        assert failed.isFatal and not failed.isHealthy and failed.recommendedAction == pc.RESET_GPU
        assert (failed.agent, failed.componentClass, failed.nodeName) == ("sdcwatch", "GPU", "gpu-node-7")
        assert "XID 79" in failed.message and failed.generatedTimestamp.seconds >= int(now) - 1
        assert [(x.entityType, x.entityValue) for x in failed.entitiesImpacted] == [
            ("GPU_UUID", "GPU-0"),
            ("PCI", "00000000:19:00.0"),
        ]
        sdc = events[("GPU-1", SDC_CHECK)]
        assert not sdc.isFatal and sdc.recommendedAction == pc.RUN_FIELDDIAG
        assert "GPU-2" not in {k[0] for k in events}, "UNKNOWN: nothing sent without evidence"
        # the connector is down for a while: the change is kept and sent when it answers again
        rec.fail = 2
        gpus.clear("GPU-0", time.time(), by="test", why="replaced")
        gpus.add_evidence(
            "GPU-0", [Evidence("nvml", "poll", "ok", State.HEALTHY, "readable", time.time())], time.time()
        )
        await until(
            lambda: any(
                e.isHealthy and e.entitiesImpacted[0].entityValue == "GPU-0"
                for b in rec.batches
                for e in b.events
            ),
            "the recovery never reached NVSentinel",
        )
        assert sender.stats["failures"] == 2
        healthy = [e for e in rec.batches[-1].events if e.entitiesImpacted[0].entityValue == "GPU-0"]
        assert {e.checkName for e in healthy} == {GPU_CHECK, SDC_CHECK} and all(e.isHealthy for e in healthy)
        await bg.cancel()
        await server.stop(None)

    asyncio.run(scenario())
