"""The NVML event inbox: a flood of single events from the listener thread reaches the event loop folded, in
few callbacks, with every repeat counted (issue 23: on the H200 host one callback per event starved health)."""
from __future__ import annotations

import asyncio
import threading

from daemon.nvml_wiring import EventInbox
from probes.nvml_probe import XidEvent


def test_a_flood_of_single_events_costs_the_loop_few_calls_and_loses_no_count() -> None:
    delivered: list[list[XidEvent]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        inbox = EventInbox(loop, delivered.append)
        ev13 = XidEvent(uuid="GPU-0", pci_bus_id="0", xid=13, time=1.0)
        ev31 = XidEvent(uuid="GPU-1", pci_bus_id="1", xid=31, time=1.0)

        def flood() -> None:
            for i in range(100_000):
                inbox.put([ev13 if i % 10 else ev31])

        t = threading.Thread(target=flood)
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.001)
        t.join()
        for _ in range(3):
            await asyncio.sleep(0)     # the last pending drain

    asyncio.run(main())
    counts: dict[tuple[str, int], int] = {}
    for batch in delivered:
        for ev in batch:
            counts[(ev.uuid, ev.xid)] = counts.get((ev.uuid, ev.xid), 0) + ev.count
    assert counts == {("GPU-0", 13): 90_000, ("GPU-1", 31): 10_000}
    assert len(delivered) < 10_000, f"{len(delivered)} loop callbacks for 100,000 events"
    assert all(len(batch) <= 2 for batch in delivered), "folded: at most one entry per distinct event"
