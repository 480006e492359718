"""The compute gate's verdict on the device, every step, as one CUDA graph replay.

    verdict = DeviceVerdict(margin=3.0)
    inp = verdict.input(world * buckets, device)       # a fixed buffer: the step's all-gather lands here
    rows = summaries.gather(out=inp)                    # int64 [world, buckets, 4]
    flag = verdict.flag(rows, spread)                   # 0-d float32 on the device: 1.0 masks the update

`device_flag` is the rule (the same as `SpreadTracker.judge`'s on the host): a rank with a non-finite
statistic, or (with the learned clean spread) a rank more than `margin` spreads from the median of a
bucket's statistic. In eager torch ops it is about fifteen tiny launches a step; on a host-bound step
(GPT-2 small on the H200: the host sets the pace) each launch's host time is step time. So once the spread
is armed, `flag` captures the rule once as a CUDA graph over the fixed input buffer and the spread's device
buffer (updated in place by the gate) and replays it: one launch a step. A new input shape or a new spread
buffer (DDP rebuilt its buckets) captures again. Where a capture fails (a torch or driver that will not
capture one of the ops), the eager ops run, said once in the log; SDCWATCH_GATE_GRAPH=0 keeps them always.

No host synchronisation: the capture runs on a side stream that waits for the current one (no
`torch.cuda.synchronize`, no `empty_cache`: torch.cuda.graph's entry does both), in thread-local capture
mode (other threads' CUDA calls, NCCL's watchdog for one, go on during it).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from checksums.grad_checks import ROW_WORDS, deviations, stats_of

logger = logging.getLogger(__name__)

GRAPHS = os.environ.get("SDCWATCH_GATE_GRAPH", "1") != "0"


def device_flag(stats: torch.Tensor, spread: torch.Tensor | None, margin: float) -> torch.Tensor:
    """0-d float32 on the stats' device: 1.0 when a rank has a non-finite statistic or (with `spread`) is
    more than `margin` spreads from the median; the same rule as `SpreadTracker.judge`, no host sync.
    `spread`: the tracker's `signed_spread` (a negative row: a bucket that can be zero on a rank, whose
    zeros `deviations` leaves out)."""
    bad = ~torch.isfinite(stats).all()
    if spread is not None:
        bad = bad | ((deviations(stats, spread[:, 0] < 0) / spread.abs()) > margin).any()
    return bad.float()


class DeviceVerdict:
    """See the module docstring."""

    def __init__(self, margin: float, graphs: bool | None = None) -> None:
        self.margin = margin
        self.graphs = GRAPHS if graphs is None else graphs
        self._in: torch.Tensor | None = None
        self._key: tuple | None = None
        self._graph: Any = None
        self._flag: torch.Tensor | None = None
        self.captures = 0

    def input(self, n: int, device: torch.device) -> torch.Tensor:
        """The fixed int64 [n, 4] buffer the step's all-gather writes (made again only when n changes)."""
        buf = self._in
        if buf is None or buf.shape[0] != n or buf.device != device:
            buf = self._in = torch.empty(n, ROW_WORDS, dtype=torch.int64, device=device)
        return buf

    def flag(self, rows: torch.Tensor, spread: torch.Tensor | None) -> torch.Tensor:
        """`device_flag(stats_of(rows), spread, margin)`: replayed from a graph on CUDA once `spread` is
        given (the graph's output tensor: valid until the next call, in stream order)."""
        if spread is None or not self.graphs or rows.device.type != "cuda":
            return device_flag(stats_of(rows), spread, self.margin)
        key = (rows.data_ptr(), tuple(rows.shape), spread.data_ptr(), tuple(spread.shape), rows.device)
        if key != self._key:
            self._key = key
            self._graph, self._flag = self._capture(rows, spread)
        if self._graph is None:
            return device_flag(stats_of(rows), spread, self.margin)
        self._graph.replay()
        assert self._flag is not None
        return self._flag

    def exec_handle(self) -> int:
        """The captured graph's instantiated form (cudaGraphExec_t, an integer; 0 with no graph or a torch
        without `raw_cuda_graph_exec`): what the C++ comm hook launches itself (`GradSummaries.arm_finish`).
        Valid until the next capture."""
        graph = self._graph
        if graph is None or not hasattr(graph, "raw_cuda_graph_exec"):
            return 0
        return int(graph.raw_cuda_graph_exec())

    def _capture(self, rows: torch.Tensor, spread: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
        device = rows.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                device_flag(stats_of(rows), spread, self.margin)   # lazy initialisations, outside the capture
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    flag = device_flag(stats_of(rows), spread, self.margin)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
        except Exception as exc:  # noqa: BLE001 (any capture failure: the eager ops, never a broken step)
            current.wait_stream(side)
            self.graphs = False
            logger.warning("sdcwatch: the compute gate's verdict could not be captured as a CUDA graph "
                           "(%s: %s); it runs as eager ops", type(exc).__name__, str(exc)[:200])
            return None, None
        self.captures += 1
        return graph, flag


__all__ = ["DeviceVerdict", "device_flag"]
