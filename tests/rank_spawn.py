"""`spawn(fn, args, nprocs)`: `torch.multiprocessing.spawn` for the suite's CPU ranks, forked from one
forkserver that has torch imported already instead of a fresh interpreter per rank (each would import torch
again: seconds of CPU per rank on the 2-core CI machine; test_monitor_gloo's ranks started in 44 s instead
of 117 s under load). Same contract as `mp.spawn(fn, args=args, nprocs=nprocs, join=True)`: `fn(rank,
*args)`, a rank's exception is raised here. The forkserver is the test session's (whichever test starts it
first sets what it preloads); a rank sees the environment the forkserver started with, so a test passes
what its ranks need in `args` (or sets it inside the rank), never through os.environ.

The framework tests' ranks (tests/framework_support.py: Hugging Face, Lightning, torchtitan, against a real
agent over gRPC) fork from it too (since 2026-12-03: each rank imported torch itself before, 3 of its 8-9 s
of CPU for the imports; the flip and clean runs passed alike, and their checks wait for the agent's
background verification, `settled_journal`). test_readme_loop's ranks too since 2026-12-05 (78 -> 23 s):
a loaded run with the forkserver had left checkpoints COMMITTED that `mp.spawn`'s slower ranks got VERIFIED:
saves faster than the agent's votes arrived, retention evicted each before its vote
(`checkpoint.policy.next_to_verify` keeps it now).
"""
from __future__ import annotations

import json
import multiprocessing.forkserver
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "grpc", "checksums.monitor", "checkpoint.client", "torch._dynamo",
           "bench.compute_faults"]
_preloaded: list[str] = []       # what the running forkserver imported (this process's), [] before it starts


def spawn(fn: Callable[..., None], args: Sequence[Any] = (), nprocs: int = 1,
          preload: Sequence[str] = ()) -> None:
    """`preload`: modules the ranks import beyond PRELOAD (a framework: Lightning, Hugging Face's Trainer,
    about 5 s of CPU a rank on the CI machine). A forkserver already running without them is stopped between
    spawns (every rank of the last one has exited: `join`) and started again with them added, so each rank
    of the files that need them forks with them imported; the set only grows, so a worker restarts it at
    most once a framework (the two framework files: 103 -> 54 s on two workers)."""
    wanted = list(dict.fromkeys([*PRELOAD, *_preloaded, *preload]))
    if _preloaded and wanted != _preloaded:
        multiprocessing.forkserver._forkserver._stop()   # (CPython's own tests stop it so)
    mp.set_forkserver_preload(wanted)
    _preloaded[:] = wanted
    mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=True, start_method="forkserver")


def rank_results(fn: Callable[..., None], nprocs: int, tmp: Path) -> list[Any]:
    """`fn(rank, nprocs, init, out)` on `nprocs` ranks (`spawn`; `init`: a file for `init_process_group`'s
    `file://`), each rank writing its result as JSON to `f"{out}.{rank}"`: the results in rank order."""
    out = str(tmp / "res")
    spawn(fn, (nprocs, str(tmp / "init"), out), nprocs=nprocs)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nprocs)]


def compute_faults(argv: list[str]) -> dict:
    """bench.compute_faults' `main(argv)` with its ranks forked from this forkserver (torch imported
    already): the results by case."""
    from bench import compute_faults as harness
    return harness.main(argv, start=spawn)
