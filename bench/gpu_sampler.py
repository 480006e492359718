"""The GPU's clocks, PCIe link, PCIe traffic, power and throttle reasons, sampled through NVML by a thread
while a bench runs, each sample tagged with the arm the bench says is running (`sampler.arm = name`).
Rows per arm: medians, and the throttle reasons seen. For issue 21's question of whether a slow mode's
device runs at other clocks or another PCIe link state than a fast one.

    with GpuSampler(0) as gs:
        gs.arm = "off"; ...; gs.arm = "every"; ...
    rows = gs.rows("tag")
"""
from __future__ import annotations

import statistics
import threading
from typing import Any

Row = tuple[str, float, str]

FIELDS = ("sm MHz", "mem MHz", "pcie gen", "pcie width", "pcie tx MB/s", "pcie rx MB/s", "power W", "temp C")


class GpuSampler:
    def __init__(self, index: int = 0, interval: float = 0.1) -> None:
        self.index, self.interval = index, interval
        self.arm = ""
        self.samples: dict[str, list[tuple[float, ...]]] = {}
        self.reasons: dict[str, int] = {}
        self.error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuSampler":
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv: Any = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as e:  # noqa: BLE001 - a bench without NVML says so in its rows and goes on
            self.error = f"NVML unavailable: {e}"
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._nv.nvmlShutdown()

    def _one(self) -> tuple[tuple[float, ...], int]:
        nv, h = self._nv, self._h
        vals = (
            float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
            float(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            float(nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
            nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) / 1e3,   # NVML: KB/s over 20 ms; here MB/s
            nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) / 1e3,
            nv.nvmlDeviceGetPowerUsage(h) / 1e3,
            float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        )
        return vals, int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            arm = self.arm
            if not arm:
                continue
            try:
                vals, reasons = self._one()
            except Exception as e:  # noqa: BLE001
                self.error = f"NVML sample failed: {e}"
                return
            self.samples.setdefault(arm, []).append(vals)
            self.reasons[arm] = self.reasons.get(arm, 0) | reasons

    def rows(self, tag: str) -> list[Row]:
        if self.error and not self.samples:
            return [(f"[{tag}] GPU clocks and PCIe (NVML)", float("nan"), self.error)]
        rows: list[Row] = []
        for arm, got in self.samples.items():
            med = [statistics.median(col) for col in zip(*got)]
            lo = [min(col) for col in zip(*got)]
            rows.append((f"[{tag}] GPU clocks and PCIe (NVML), '{arm}' arm, SM MHz (median)", med[0],
                         ", ".join(f"{k} {m:g} (min {n:g})" for k, m, n in zip(FIELDS, med, lo)) +
                         f"; throttle reasons seen {self.reasons.get(arm, 0):#x}; {len(got)} samples"))
        return rows
