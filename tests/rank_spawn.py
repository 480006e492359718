"""`spawn(fn, args, nprocs)`: `torch.multiprocessing.spawn` for the suite's CPU ranks, forked from one
forkserver that has torch imported already instead of a fresh interpreter per rank (each would import torch
again: seconds of CPU per rank on the 2-core CI machine; test_monitor_gloo's ranks started in 44 s instead
of 117 s under load). Same contract as `mp.spawn(fn, args=args, nprocs=nprocs, join=True)`: `fn(rank,
*args)`, a rank's exception is raised here. The forkserver is the test session's (whichever test starts it
first sets what it preloads); a rank sees the environment the forkserver started with, so a test passes
what its ranks need in `args` (or sets it inside the rank), never through os.environ.

Ranks that talk to a real agent over gRPC (test_readme_loop, framework_support) still use `mp.spawn`: with
the forkserver one loaded run of each left checkpoints COMMITTED that spawn's ranks get VERIFIED, not
understood yet.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "grpc", "checksums.monitor", "checkpoint.client"]


def spawn(fn: Callable[..., None], args: Sequence[Any] = (), nprocs: int = 1) -> None:
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=True, start_method="forkserver")
