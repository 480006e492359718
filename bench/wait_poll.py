"""Does a stream that waits on the device for another stream's event read host memory while it waits
(issue 21: in a slow client the GPU receives 2.5-3.9 GB/s over PCIe for the whole step while the save's
fingerprint kernels are in use, and nothing of theirs reads host memory)?

    python bench/wait_poll.py [--ms 400] [--repeat 3]

Each case: stream A runs a device sleep of --ms; the case's waiter (if any) waits for an event recorded on A
after it, then runs a tiny kernel or a small device-to-host copy. NVML's PCIe counters (received / sent by
the GPU, MB/s over 20 ms windows) are sampled during the sleep; the medians of each case side by side with
the sleep alone (no waiter) and an idle GPU. CUDA only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any, Callable

import torch


def sampler(handle: Any, nv: Any, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        rx = nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES) / 1e3
        tx = nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_TX_BYTES) / 1e3
        out.append((rx, tx))
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=float, default=400.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = int(torch.cuda.get_device_properties(dev).clock_rate * 1e3 * args.ms / 1e3)
    a = torch.cuda.Stream(dev)
    b = torch.cuda.Stream(dev)
    hi = torch.cuda.Stream(dev, priority=-1)
    small = torch.ones(1 << 16, device=dev)
    host = torch.empty(1 << 16, pin_memory=True)

    def waiter(stream: Any, event: Callable[[], Any], then: str) -> Callable[[], None]:
        def go() -> None:
            e = event()
            e.record(a)
            stream.wait_event(e)
            with torch.cuda.stream(stream):
                if then == "kernel":
                    small.add_(1)
                else:
                    host.copy_(small, non_blocking=True)
        return go

    cases: list[tuple[str, Callable[[], None] | None, bool]] = [
        ("idle GPU", None, False),
        ("sleep alone", None, True),
        ("wait (default event) then kernel", waiter(b, lambda: torch.cuda.Event(), "kernel"), True),
        ("wait (blocking event) then kernel",
         waiter(b, lambda: torch.cuda.Event(blocking=True), "kernel"), True),
        ("wait (timing event) then kernel",
         waiter(b, lambda: torch.cuda.Event(enable_timing=True), "kernel"), True),
        ("wait (default event) then copy", waiter(b, lambda: torch.cuda.Event(), "copy"), True),
        ("wait (blocking event) then copy", waiter(b, lambda: torch.cuda.Event(blocking=True), "copy"), True),
        ("high-priority stream waits (blocking) then kernel",
         waiter(hi, lambda: torch.cuda.Event(blocking=True), "kernel"), True),
        ("training's stream waits (blocking) then kernel",
         waiter(torch.cuda.current_stream(dev), lambda: torch.cuda.Event(blocking=True), "kernel"), True),
    ]
    rows = []
    for name, go, sleep in cases:
        rx_all, tx_all = [], []
        for _ in range(args.repeat):
            torch.cuda.synchronize(dev)
            samples: list[tuple[float, float]] = []
            stop = threading.Event()
            t = threading.Thread(target=sampler, args=(h, nv, stop, samples), daemon=True)
            if sleep:
                with torch.cuda.stream(a):
                    torch.cuda._sleep(cycles)
            if go is not None:
                go()
            t.start()
            time.sleep(args.ms / 1e3 * 0.8)
            stop.set()
            t.join()
            torch.cuda.synchronize(dev)
            rx_all += [r for r, _ in samples[1:]]
            tx_all += [x for _, x in samples[1:]]
        rows.append((name, statistics.median(rx_all), max(rx_all), statistics.median(tx_all), len(rx_all)))
    print(f"{'case':52s} {'rx MB/s med':>12s} {'rx max':>8s} {'tx MB/s med':>12s} {'n':>4s}")
    for name, rx, rxm, tx, n in rows:
        print(f"{name:52s} {rx:12.1f} {rxm:8.1f} {tx:12.1f} {n:4d}")
    nv.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
