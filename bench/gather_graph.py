"""An experiment, not the product: the compute gate's all-gather of the rows captured in the device verdict's
CUDA graph (issue 19, the host-bound step's largest piece of host time left).

On a host-bound GPT-2-small step the gate's eager all-gather of its 13 rows took ~300 us of host time a step
inside the step (`compute_faults --host-parts`), where a graph replay of the verdict takes ~40. This puts the
gather into the verdict's graph (ProcessGroupNCCL records a collective into a capture and leaves it out of
its watchdog), so a step replays one graph for both. `compute_faults --arms checks,checks-graph` times it
against the product's path in the same run. Not in the product: a captured collective must be captured in
the same step on every rank and fall back together, which needs the pair (two GPUs) to test; on one GPU it
measures what the change would save.

    patch(checks)        # ComputeChecks on CUDA with mask="device"; every step after the warm-up replays
"""
from __future__ import annotations

import types
from typing import Any

import torch

from checksums.collectives import all_gather_single
from checksums.device_verdict import device_flag
from checksums.grad_checks import stats_of


def patch(checks: Any) -> None:
    """Route `checks`' device path through one graph of gather + verdict once the spread is armed."""
    state: dict[str, Any] = {"key": None, "graph": None, "flag": None}

    def gathered_flag(self: Any, mine: torch.Tensor, inp: torch.Tensor, world: int,
                      spread: torch.Tensor) -> torch.Tensor:
        n = mine.shape[0]
        key = (mine.data_ptr(), n, inp.data_ptr(), spread.data_ptr(), tuple(spread.shape))
        if key != state["key"]:
            state["key"] = key
            current = torch.cuda.current_stream(mine.device)
            side = torch.cuda.Stream(mine.device)
            side.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                all_gather_single(inp, mine, group=self.summaries._group)        # eager: lazy set-up
                device_flag(stats_of(inp.view(world, n, -1)), spread, self.tracker.margin)
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    all_gather_single(inp, mine, group=self.summaries._group)
                    flag = device_flag(stats_of(inp.view(world, n, -1)), spread, self.tracker.margin)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
            state["graph"], state["flag"] = graph, flag
        state["graph"].replay()
        return state["flag"]

    def mask_on_device(self: Any, ctx: Any) -> None:
        mine = self.summaries.rows()                  # the hooks' side stream joined, eagerly
        n = mine.shape[0]
        inp = self._verdict.input(self.world * n, self.device)
        spread = self._spread_on(inp.device)
        armed = spread is not None and self.tracker.learned >= self.tracker.warmup
        if armed:
            flag = gathered_flag(self, mine, inp, self.world, spread)
            rows = inp.view(self.world, n, -1)
        else:
            rows = self.summaries.gather(out=inp)
            flag = self._verdict.flag(rows, None)
        self.summaries.clear()
        self._device_mask.add(ctx, flag)
        slot = self._host_slot(rows)
        slot.rows.copy_(rows, non_blocking=True)
        slot.flag.copy_(flag, non_blocking=True)
        slot.record()
        self._pending = (ctx.step, slot, armed, self.replayer.retained, self.guard.restores)

    checks._mask_on_device = types.MethodType(mask_on_device, checks)
