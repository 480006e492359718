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

`same_on_every_rank(tensors)`: whether every rank holds the same bytes, compared through the process group's
rendezvous store (a digest per rank), not a collective. A run's closing check of its replicas was an
all-gather a few milliseconds before the rank exited, the very window of the abort above, in every rank that
is still spawned (the tests whose ranks talk to the agent, torchtitan's trainer bench); through the store no
gloo worker thread holds a tensor at exit.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_calls = itertools.count()


def start_ranks(fn: Callable[..., None], args: Sequence[Any], nprocs: int) -> None:
    mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=True, start_method="forkserver")


def same_on_every_rank(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every rank of the default group passed tensors with the same bytes (in order); collective in
    the sense that every rank must call it, the n-th call of each rank compared with the others' n-th."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    mine = digest.hexdigest()
    store = dist.distributed_c10d._get_default_store()
    n, rank = next(_calls), dist.get_rank()
    store.set(f"sdcwatch-same/{n}/{rank}", mine)
    return all(store.get(f"sdcwatch-same/{n}/{r}").decode() == mine for r in range(dist.get_world_size()))
