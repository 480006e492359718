"""How a bench starts its ranks: `start_ranks(fn, args, nprocs)` runs `fn(rank, *args)` in `nprocs` processes,
joined, a rank's exception raised here (torch's `start_processes`), forked from a forkserver.

Not the "spawn" start method: a spawned rank ends with the interpreter's finalization, and torch's gloo worker
threads may still be releasing the last collective's work then (its tensors own Python objects); the thread's
take of the GIL during finalization ends it by a forced unwind through a noexcept frame: std::terminate, the
rank dies of SIGABRT after its work is done ("terminate called without an active exception"; seen with
bench.verify_cost under load, about 1 run in 40; the core: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork ->
decref_pyobject -> take_gil -> pthread_exit, while the main thread was in Py_FinalizeEx). A forked rank leaves
by os._exit once its function returned, with no finalization. The forkserver is a fresh interpreter that
never touched CUDA, so its ranks may use the GPU.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def start_ranks(fn: Callable[..., None], args: Sequence[Any], nprocs: int) -> None:
    mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=True, start_method="forkserver")
