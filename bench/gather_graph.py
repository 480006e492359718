"""An experiment, not the product: the compute gate's all-gather of the rows captured in the device verdict's
CUDA graph (issue 19, the host-bound step's largest piece of host time left).

On a host-bound GPT-2-small step the gate's eager all-gather of its 13 rows took ~300 us of host time a step
inside the step (`compute_faults --host-parts`), where a graph replay of the verdict takes ~40. This puts the
gather into the verdict's graph (ProcessGroupNCCL records a collective into a capture and leaves it out of
its watchdog), so a step replays one graph for both. `compute_faults --arms checks,checks-graph` times it
against the product's path in the same run. Not in the product: a captured collective must be captured in
the same step on every rank and fall back together, which needs the pair (two GPUs) to test; on one GPU it
measures what the change would save.

    patch(checks)        # ComputeChecks with mask="device": its own device path, the gather moved

The gate's device path (`ComputeChecks._mask_on_device`) runs as it is; only two of its calls change. The
gather into the verdict's input buffer is put off (the rows' view is handed back unfilled) and done by the
verdict's `flag`: inside its graph once the spread is armed on CUDA, eagerly before the eager rule
otherwise (the warm-up; CPU). Every other gather (the host path's) is the summaries' own.
"""
from __future__ import annotations

from typing import Any

import torch

from checksums.collectives import all_gather_single
from checksums.device_verdict import device_flag
from checksums.grad_checks import stats_of


def patch(checks: Any) -> None:
    """Route `checks`' device-path gather through its verdict (see the module docstring)."""
    summaries, verdict = checks.summaries, checks._verdict
    real_gather, real_flag = summaries.gather, verdict.flag
    state: dict[str, Any] = {"mine": None, "key": None, "graph": None, "flag": None}

    def gather(out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None or out is not verdict._in:       # the host path's gather: as it was
            return real_gather(out=out)
        mine = state["mine"] = summaries.rows()         # the hooks' side stream joined, eagerly
        return out.view(-1, *mine.shape)                # filled by `flag`, before anything reads it

    def flag(rows: torch.Tensor, spread: torch.Tensor | None) -> torch.Tensor:
        mine, state["mine"] = state["mine"], None
        inp = verdict._in
        if mine is None:
            return real_flag(rows, spread)
        if spread is None or rows.device.type != "cuda":
            all_gather_single(inp, mine, group=summaries._group)
            return real_flag(rows, spread)
        key = (mine.data_ptr(), tuple(mine.shape), inp.data_ptr(), spread.data_ptr(), tuple(spread.shape))
        if key != state["key"]:
            state["key"] = key
            current = torch.cuda.current_stream(rows.device)
            side = torch.cuda.Stream(rows.device)
            side.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                all_gather_single(inp, mine, group=summaries._group)        # eager: lazy set-up
                device_flag(stats_of(rows), spread, verdict.margin)
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    all_gather_single(inp, mine, group=summaries._group)
                    out = device_flag(stats_of(rows), spread, verdict.margin)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
            state["graph"], state["flag"] = graph, out
        state["graph"].replay()
        return state["flag"]

    summaries.gather = gather
    verdict.flag = flag
