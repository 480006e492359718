"""Pre-reduction gradient checks: each rank summarises its own gradient before the all-reduce averages it.

The replica vote cannot see a fault in one rank's forward or backward: the all-reduce averages the wrong
gradient into every replica and the replicas stay bit-identical. So each rank summarises its *local*
gradient, per DDP bucket, before the reduction, and the ranks compare the summaries:

    summaries = GradSummaries.attach(ddp_model)      # a DDP communication hook: stats, then allreduce
    ...                                              # forward, backward: the hook fills one row per bucket
    rows = summaries.gather()                        # [world, buckets, 4] int64, every rank's rows
    verdict = spread.judge(stats_of(rows))           # the robust cross-rank comparison (pure)

A bucket's summary (`bucket_summary`) is four int64 words computed on the gradient's device with no host
synchronisation: the L2 norm and the max-abs (float64 bit patterns) and the exact fingerprint of the
bucket's gradients (checksums.fingerprint: two words). On CUDA with Triton one fused kernel reads the
bucket once for all four (checksums.grad_summary_triton); elsewhere torch ops, with the same words.
The norm and max-abs find outliers; the fingerprint lets a replay (checksums.replay) compare a recomputed
gradient bit for bit.

Ranks see different data, so their gradients differ; the comparison is over distributions, not values.
For each bucket and statistic, the log of each rank's value is compared with the median over ranks; the
distance is divided by the clean cross-rank spread of that bucket and statistic (`SpreadTracker`: the
largest distance seen on clean steps, floored), and a rank whose distance exceeds `margin` times the spread
is an outlier. A non-finite value names its rank at once. With fewer than 3 ranks the median does not
single out one rank: an outlier then makes both ranks suspects, and the replay decides (checksums.replay).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from checksums.collectives import all_gather_single
from checksums.fingerprint import DTENSOR, fingerprint_tensors_async, prepare_fingerprint, triton_available
from sdcwatch.arguments import above, count

logger = logging.getLogger(__name__)

ROW_WORDS = 4          # norm bits, max-abs bits, fingerprint word 0, fingerprint word 1
_TINY = 1e-30          # log of a zero statistic: far from any live gradient, finite


def bucket_summary(grads: Sequence[torch.Tensor], plan: Any = None, scale: float = 1.0,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [4] on the gradients' device: norm and max-abs (float64 bit patterns), fingerprint (2 words).

    No host synchronisation. Non-finite values make the norm non-finite, so they travel in the same row
    (both statistics NaN). On CUDA with Triton, a one-tensor list (a bucket's flat buffer) of fp32, bf16 or
    fp16, contiguous and 16-byte aligned, goes through the fused kernel (checksums.grad_summary_triton: one
    read of the buffer, one launch); anything else through torch ops (`bucket_summary_torch`). The two
    agree: the fingerprint exactly, the statistics to float rounding.
    `plan`: from `summary_plan` on the same kind of list (held per bucket by the hooks), so the hot path
    does no planning; without one, a cached plan is used.
    `scale` != 1 (a one-tensor list): after the row is taken, the buffer is multiplied by `scale` in place,
    as `mul_` does (DDP's pre-reduction 1/world); the fused kernel does it in the same pass.
    `out` (int64 [4] on the device): the row is written there (and returned), not in a new tensor.
    """
    if scale != 1.0 and len(grads) != 1:
        raise ValueError(f"scale applies to a one-tensor list (a bucket's buffer), got {len(grads)} tensors")
    if plan is not None and getattr(plan, "summarises", False):
        if len(grads) == 1 and _FUSED and not _BROKEN and plan.matches(grads[0]):
            return _run_fused(plan, grads[0], checked=True, scale=scale, out=out)
        plan = None
    elif plan is None and len(grads) == 1 and fusable(grads[0]):
        return _run_fused(None, grads[0], scale=scale, out=out)
    return _torch_scaled(grads, plan, scale, out)


def _torch_scaled(grads: Sequence[torch.Tensor], plan: Any, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    row = bucket_summary_torch(grads, plan)
    if scale != 1.0:
        grads[0].mul_(scale)
    return row if out is None else out.copy_(row)


def _run_fused(plan: Any, t: torch.Tensor, checked: bool = False, scale: float = 1.0,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel (`checked`: the caller saw `plan.matches(t)`); if it cannot be built or launched here
    (a Triton or driver that will not compile it), say so once and keep the torch path for the rest of the
    process: the checks must not stop."""
    global _BROKEN
    try:
        if checked:
            return plan.launch(t, out, scale=scale)
        return (plan if plan is not None else _cached_summary_plan(t)).run_async(t, out, scale=scale)
    except Exception as exc:  # noqa: BLE001 (any compile or launch error: fall back, never break training)
        _BROKEN = True
        logger.warning("sdcwatch: the fused gradient summary failed (%s: %s); using torch ops",
                       type(exc).__name__, str(exc)[:300])
        return _torch_scaled([t], None, scale, out)


def bucket_summary_torch(grads: Sequence[torch.Tensor], plan: Any = None) -> torch.Tensor:
    """`bucket_summary` in torch ops (several passes over the memory); `plan`: a fingerprint plan of
    exactly these tensors (checksums.fingerprint's `prepare_fingerprint`) or None."""
    device = grads[0].device
    fp = plan.run_async() if plan is not None else fingerprint_tensors_async(list(grads))
    return torch.cat([bucket_stats(grads).view(torch.int64), fp.to(device)])


def bucket_stats(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The statistics of `bucket_summary_torch`'s row alone, float64 [2] (norm, max-abs) on the gradients'
    device: what `stats_of` reads from the row, without the fingerprint (a host-side reference that needs
    only what the comparison judges, e.g. the suite's 10,000 clean steps)."""
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=_norm_dtype(g)).float() for g in grads])
    amax = torch.stack([g.detach().abs().amax().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                        for g in grads])
    stats = torch.stack([torch.linalg.vector_norm(norms), amax.amax()]).double()
    # a NaN in a gradient makes its norm NaN but amax may skip it on some backends: carry it in both
    return stats + (norms.sum() * 0).double()


def _norm_dtype(g: torch.Tensor) -> torch.dtype:
    return torch.float64 if g.dtype == torch.float64 else torch.float32   # (fp32 from fp64 would narrow)


# the fused kernel on CUDA with Triton; SDCWATCH_GS_FUSED=0 keeps the torch path (benchmarks compare them)
_FUSED = os.environ.get("SDCWATCH_GS_FUSED", "1") != "0"
# SDCWATCH_GS_SIDE=0: GradSummaries' default for `side_stream` off (the summary and the bucket's reduction
# on the backward's own stream; bench/compute_faults.py's "checks-inline" arm). On by default: on the H200,
# GPT-2 small at 32k tokens a step, the checks cost +0.30% inline and -0.13% [-0.24, -0.01] beside it
_SIDE_DEFAULT = os.environ.get("SDCWATCH_GS_SIDE", "1") != "0"
_BROKEN = False        # the fused kernel failed to build or launch in this process: torch ops from then on
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_DEVICES = ("cuda",)   # tests add "cpu" in a process that runs Triton interpreted (TRITON_INTERPRET=1)
_cache_lock = threading.Lock()
_summary_plans: OrderedDict[tuple, Any] = OrderedDict()
_SUMMARY_PLAN_CACHE = 64   # > the buckets of a model (each size its own plan): no LRU thrash


def set_fused(on: bool) -> None:
    """Use the fused kernel where it applies (the default) or torch ops everywhere (benchmarks compare the
    two in one process; SDCWATCH_GS_FUSED=0 sets the default off)."""
    global _FUSED
    _FUSED = bool(on)


def summary_paths(summaries: Any) -> dict[str, int]:
    """How a GradSummaries/FsdpGradSummaries summarised its buckets last: buckets per path ("fused":
    the Triton kernel, "torch+fingerprint": torch ops with the Triton fingerprint, "torch": torch ops)."""
    out: dict[str, int] = {}
    groups = set(range(len(getattr(summaries, "groups", ()))))          # FSDP2: one row per group
    for idx in sorted(set(summaries._plans) | set(summaries.layout) | set(summaries._rows) | groups):
        held = summaries._plans.get(idx)
        plan = held[1] if held is not None else None
        path = ("torch" if plan is None or _BROKEN else
                "fused" if getattr(plan, "summarises", False) and _FUSED else "torch+fingerprint")
        out[path] = out.get(path, 0) + 1
    return out


def fusable(t: torch.Tensor) -> bool:
    """Whether `bucket_summary([t])` runs the fused kernel: CUDA, Triton, fp32/bf16/fp16, contiguous,
    16-byte aligned (a plain tensor, not a DTensor)."""
    return (_FUSED and not _BROKEN and t.device.type in _FUSED_DEVICES and t.dtype in _FUSED_DTYPES
            and t.is_contiguous() and t.data_ptr() % 16 == 0
            and (type(t) is torch.Tensor or type(t) is nn.Parameter)
            and triton_available())


def summary_plan(grads: Sequence[torch.Tensor]) -> Any:
    """A plan for `bucket_summary` of lists like this one: the fused kernel's (its tables depend on the
    buffer's size and dtype only, so a bucket that moves keeps it), else a fingerprint plan of exactly
    these tensors (CUDA with Triton), else None (torch ops)."""
    if len(grads) == 1 and fusable(grads[0]):
        from checksums.grad_summary_triton import GradSummaryPlan  # triton is optional: loaded on first use
        return GradSummaryPlan(grads[0].detach())
    if not grads or grads[0].device.type != "cuda" or not triton_available():
        return None
    return prepare_fingerprint(list(grads))


def _plan_key(grads: Sequence[torch.Tensor]) -> tuple:
    """What `summary_plan`'s plan depends on."""
    g = grads[0]
    if len(grads) == 1 and fusable(g):
        return ("fused", g.device, g.dtype, tuple(g.shape))
    return ("fingerprint", g.data_ptr(), len(grads), grads[-1].data_ptr())


def _cached_summary_plan(t: torch.Tensor) -> Any:
    """A fused plan shared by calls without one, per size, dtype, device and stream (runs of one plan
    must be stream-ordered)."""
    stream = torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0
    key = (t.device, t.dtype, tuple(t.shape), stream)
    with _cache_lock:
        plan = _summary_plans.get(key)
        if plan is not None:
            _summary_plans.move_to_end(key)
            return plan
    plan = summary_plan([t])
    with _cache_lock:
        _summary_plans[key] = plan
        while len(_summary_plans) > _SUMMARY_PLAN_CACHE:
            _summary_plans.popitem(last=False)
    return plan


def _held_plan(plans: dict[int, tuple[tuple, Any]], idx: int, grads: Sequence[torch.Tensor]) -> Any:
    """The plan of bucket `idx`, kept while it fits the bucket's buffer (so no bucket count thrashes a
    shared cache); None off CUDA/Triton (torch ops)."""
    if not grads or not (grads[0].device.type == "cuda" and triton_available()
                         or len(grads) == 1 and fusable(grads[0])):
        return None
    key = _plan_key(grads)
    held = plans.get(idx)
    if held is None or held[0] != key:
        held = (key, summary_plan(grads))
        plans[idx] = held
    return held[1]


def stats_of(rows: torch.Tensor) -> torch.Tensor:
    """float64 [..., 2] (norm, max-abs) from summary rows int64 [..., 4]."""
    return rows[..., :2].contiguous().view(torch.float64)


def fingerprints_of(rows: torch.Tensor) -> torch.Tensor:
    """int64 [..., 2] fingerprints from summary rows int64 [..., 4]."""
    return rows[..., 2:4]


_LAYOUT_CALLS = 3    # hook calls a bucket that take its layout (DDP rebuilds its buckets once, after step 1)
# eager gathers of one bucket count before the C++ hook gathers the rows itself (DDP's rebuild behind);
# SDCWATCH_HOOK_GATHER=0 on any rank keeps every rank's gather in the step guard (they agree on it)
_GATHER_ARM_AFTER = 3
_HOOK_GATHER = os.environ.get("SDCWATCH_HOOK_GATHER", "1") != "0"


def _reduced(fut: Any) -> torch.Tensor:
    return fut.value()[0]


class BucketAllreduce:
    """What DDP does with a bucket when no hook is registered, bit for bit: scale by 1 / the group's size
    (DDP multiplies by the reciprocal as it copies each gradient in; torch's `allreduce_hook` divides
    instead, which differs in the last bit), all-reduce (sum), hand DDP a future of the bucket. So the
    checks leave the training's numbers as they were without them (tests/test_compute_checks.py). With less
    host work than `allreduce_hook`: the process group is called directly (`dist.all_reduce`'s Python
    wrapper cost 84 us a bucket against 27 us on the 2-core VM, docs/BENCHMARKS.md); GradSummaries has the
    summary kernel scale the bucket in its one pass (`bucket_summary(scale=)`), so no second pass over the
    gradient; at world size 1 nothing is scaled (x * 1 == x).
    `group`: DDP's own process group (None: the default group)."""

    def __init__(self, group: Any = None) -> None:
        self._group = group
        self._pg: Any = None
        self._scale = 1.0
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.SUM

    def _resolve(self) -> Any:      # on first use: the default group may be made after the model
        self._pg = self._group if self._group is not None else dist.group.WORLD
        size = self._pg.size()
        self._scale = 1.0 / size if size > 1 else 1.0
        return self._pg

    @property
    def process_group(self) -> Any:
        """The group it reduces over (DDP's own, else the default group)."""
        return self._pg if self._pg is not None else self._resolve()

    @property
    def scale(self) -> float:
        """What each bucket is multiplied by before the sum: 1 / the group's size (1.0 for one rank)."""
        if self._pg is None:
            self._resolve()
        return self._scale

    def __call__(self, buf: torch.Tensor, scaled: bool = False) -> Any:
        """All-reduce `buf` (`scaled`: the caller already multiplied it by `scale`)."""
        pg = self._pg if self._pg is not None else self._resolve()
        if not scaled and self._scale != 1.0:
            buf.mul_(self._scale)
        return pg.allreduce([buf], self._opts).get_future().then(_reduced)


def _register_native(ddp: nn.Module, reduce: BucketAllreduce, fallback: Callable[..., None],
                     prepare: Callable[[int], None], side_on: bool) -> Any:
    """The C++ comm hook registered on DDP's reducer (its handle), or None where it is not built or DDP has
    no C++ reducer (the Python hook then)."""
    from checksums import native_hook

    module = native_hook.load()
    reducer = getattr(ddp, "reducer", None)
    if module is None or reducer is None:
        return None
    try:
        return module.register(reducer, reduce.process_group, fallback, prepare, side_on)
    except Exception as exc:  # noqa: BLE001 (a reducer or group it cannot take: the Python hook)
        logger.warning("sdcwatch: the C++ comm hook could not be registered (%s): the Python hook is used",
                       exc)
        return None


class _BoundBucket:
    """A bucket's summary launch bound to its buffer (address, size) and row, on device `dev`."""

    __slots__ = ("ptr", "numel", "dev", "launch", "row")

    def __init__(self, ptr: int, numel: int, dev: int, launch: Callable[[int], bool], row: torch.Tensor) -> None:
        self.ptr, self.numel, self.dev, self.launch, self.row = ptr, numel, dev, launch, row


try:     # the raw handle of a device's current stream, as Triton's driver reads it (no Stream object made)
    from torch._C import _cuda_getCurrentRawStream as _raw_current_stream
except ImportError:  # a torch without it
    def _raw_current_stream(dev: int) -> int:
        return torch.cuda.current_stream(dev).cuda_stream


class _CurrentStreams:
    """Each device's current stream as (raw handle, Stream), the Stream made again only when the handle
    changes (a job that switches streams): `torch.cuda.current_stream()` makes a Python object a call."""

    def __init__(self) -> None:
        self._by_dev: dict[int, tuple[int, Any]] = {}

    def get(self, dev: int) -> tuple[int, Any]:
        raw = _raw_current_stream(dev)
        got = self._by_dev.get(dev)
        if got is None or got[0] != raw:
            stream = torch.cuda.current_stream(dev)
            got = self._by_dev[dev] = (stream.cuda_stream, stream)
        return got


class GradSummaries:
    """The DDP communication hook that summarises each bucket's local gradient, then all-reduces it.

    One row per bucket per step, kept on the device; `rows()` stacks them, `gather()` all-gathers them.
    `layout` maps each bucket index to the indices (into `params`) of its parameters, in bucket order:
    a replay summarises a recomputed gradient bucket by bucket with the same layout, so the fingerprints
    compare exactly. DDP rebuilds its buckets after the first step; the layout follows. One micro-batch
    per optimizer step: under `no_sync()` accumulation the hook sees the sum of the micro-batches.

    DDP takes one comm hook. A job that reduces through its own (`bf16_compress_hook`, PowerSGD, ...) passes
    it here instead of registering it: `comm_hook=` (and its `comm_state=`) then reduces each bucket after
    the summary, which is of the local gradient as the backward left it. A DDP model that already has a
    hook is refused with a message saying so.

    `side_stream` (CUDA; default on, SDCWATCH_GS_SIDE=0 sets it off): each bucket's summary and its
    reduction are enqueued on a stream of the hooks' own that first waits for the backward's stream, so the
    summary's read of the bucket runs beside the backward's remaining kernels instead of between them (on
    the H200 the checks' +0.30% of a device-bound step became -0.13%, docs/BENCHMARKS.md); `rows()` makes
    the caller's stream wait for it. The rows and the reduced gradients are the same either way.

    `native` (default: on where it builds; SDCWATCH_NATIVE_HOOK=0 sets it off): the hook registered on DDP
    is the C++ one of checksums/native_hook.py, which does this hook's work for a bucket whose summary
    launch is bound (its layout settled) without entering Python, and calls this class for the others (the
    first calls, the CPU, fault injection). Not with `comm_hook=` (the job's hook is Python). False: this
    Python hook always. The rows, the gradients and the summaries' paths are the same either way. Once
    every rank has it, the C++ hook also issues the rows' all-gather after its last bucket (`gather`).
    """

    def __init__(self, ddp: nn.Module, *, group: Any = None, inject: Any = None,
                 comm_hook: Callable[[Any, Any], Any] | None = None, comm_state: Any = None,
                 side_stream: bool | None = None, native: bool | None = None) -> None:
        if not hasattr(ddp, "register_comm_hook") or not hasattr(ddp, "module"):
            composable = hasattr(ddp, "register_comm_hook")   # torch's composable replicate() (torchtitan's
            raise TypeError(                                  # DDP): its DDP is made at the first forward
                f"GradSummaries needs a DistributedDataParallel model, got {type(ddp).__name__}"
                + (" (torch's composable replicate(): pass the DDP it keeps, "
                   "checksums.composable_ddp.inner_ddp(model); ComputeChecks does)" if composable else ""))
        if getattr(ddp, "_use_python_reducer", False):
            raise ValueError("this DDP model reduces through compiled autograd's Python reducer "
                             "(torch._dynamo.config.optimize_ddp = 'python_reducer'), which calls a comm hook "
                             "a parameter at a time, not a bucket: the compute checks summarise DDP's buckets; "
                             "build the model with another optimize_ddp mode (the default, 'ddp_optimizer')")
        registered = getattr(ddp, "_comm_hooks", None)
        if registered:
            name = getattr(registered[0][0], "__qualname__", repr(registered[0][0]))
            raise ValueError(f"this DDP model already has a communication hook ({name}), and DDP takes one: "
                             "pass it as comm_hook= (and comm_state=) to ComputeChecks.attach (or "
                             "GradSummaries) instead of registering it; the checks summarise each bucket, "
                             "then call it")
        if comm_hook is not None and not callable(comm_hook):
            raise TypeError(f"comm_hook must be a DDP communication hook (state, bucket) -> Future, got "
                            f"{type(comm_hook).__name__}")
        self._comm_hook, self._comm_state = comm_hook, comm_state
        self._group = group
        named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        self.params: list[torch.Tensor] = [p for _, p in named]
        self.names: list[str] = [n for n, _ in named]     # each parameter's qualified name, in `params` order
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._rows: dict[int, torch.Tensor] = {}
        # the rows are written into one buffer (a view a bucket, made once): `rows()` is a slice of it, not
        # a stack of a new tensor a bucket (two host allocations and launches a step fewer); the next
        # step's hooks overwrite it in stream order after this step's gather read it
        self._buf: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._plans: dict[int, tuple[tuple, Any]] = {}
        self.layout: dict[int, tuple[int, ...]] = {}
        self._seen: dict[int, tuple[int, int, bool, int]] = {}   # bucket -> (address, numel, fused, calls)
        self._py_calls = 0
        self._inject = inject           # fault injection (bench/): called with the bucket's flat buffer
        self._reduce = BucketAllreduce(getattr(ddp, "process_group", None))
        self._side_on = _SIDE_DEFAULT if side_stream is None else bool(side_stream)
        # device index -> the hooks' stream (side_stream) and two events kept with it, recorded again each
        # bucket / step (`wait_stream` makes an event a call: a host allocation a bucket in the step): one
        # the side stream waits on for the backward's stream (the hooks of a device run on one autograd
        # thread, one after another), one the caller's stream waits on for the side stream (`rows()`)
        self._sides: dict[int, tuple[Any, Any, Any]] = {}
        self._fast: dict[int, _BoundBucket] = {}     # bucket -> its bound summary (`_fast_path`)
        self._current = _CurrentStreams()
        self._world = 0                  # the group's size, read at the first gather
        # the rows' all-gather moved into the C++ hook (`_arm_hook_gather`): (its output, its bucket count,
        # the output as [world, n, 4], what `gather` returns for it)
        # while armed; the eager gathers of this bucket count so far; whether every rank can (None: not
        # asked yet; asked once, through a collective every rank makes at the same gather)
        self._hook_gather: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._eager_gathers = 0
        self._hook_gather_ok: bool | None = None
        self.hook_gathers = 0            # steps whose rows the C++ hook gathered
        # the gate's verdict replayed by the C++ hook after its gather (`arm_finish`): the host slot it
        # copied this step's rows and flag to (-1: it did not), and the steps it did so
        self.finished = -1
        self.hook_finishes = 0
        # the C++ hook (checksums/native_hook.py) where it builds, and no job's own hook is to be called:
        # the same work without Python a bucket once its launch is bound; else this Python hook
        self._native: Any = None
        self._unbindable: set[int] = set()       # buckets the C++ hook refused to bind (said once)
        if comm_hook is None and native is not False:
            self._native = _register_native(ddp, self._reduce, self._native_fallback, self._native_prepare,
                                            self._side_on)
        if self._native is None:
            ddp.register_comm_hook(None, self._hook)
        else:       # DDP's own record of its hook (a second registration is refused with its name)
            ddp._comm_hooks.append((self._hook, None))

    @classmethod
    def attach(cls, ddp: nn.Module, **kwargs: Any) -> GradSummaries:
        return cls(ddp, **kwargs)

    @property
    def hook_calls(self) -> int:
        """Buckets summarised and reduced by the hook so far (either hook)."""
        return self._py_calls + (self._native.native_calls() if self._native is not None else 0)

    @property
    def native(self) -> bool:
        """Whether the C++ hook reduces the buckets (False: this Python hook; `native_hook.why()` says
        why)."""
        return self._native is not None

    def _native_prepare(self, dev: int) -> None:
        """The C++ hook's first bucket on a device: the hooks' side stream there, made and handed to it."""
        side = self._side(dev)[0]
        self._native.set_side(dev, side.stream_id, side.device_type)

    def _native_fallback(self, idx: int, buf: torch.Tensor, params: list[torch.Tensor]) -> None:
        """The C++ hook's bucket without a bound launch: summarised here, on the current stream (the side
        stream, which the C++ hook made current), bound when it can be; the C++ hook reduces it."""
        if self._inject is not None:
            self._inject(idx, buf)
        self._summarise(buf, idx, params)

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]  (DDP checks these annotations)
        buf = bucket.buffer()
        idx = bucket.index()
        if self._inject is not None:
            self._inject(idx, buf)
        fast = self._fast.get(idx)
        if fast is not None and fast.ptr == buf.data_ptr() and fast.numel == buf.numel() and _FUSED \
                and not _BROKEN:
            got = self._fast_path(fast, idx, state, bucket, buf)
            if got is not None:
                return got
            self._fast.pop(idx, None)          # the bound launch was refused: the general path from now on
        if self._side_on and buf.is_cuda:
            side, ready, _ = self._side(buf.device.index)
            ready.record(torch.cuda.current_stream(buf.device))   # the bucket's gradients are ready there
            side.wait_event(ready)
            with torch.cuda.stream(side):    # the collective waits for the side stream, not the backward's
                self._summarise(buf, idx, None, bucket)
                return self._reduced(state, bucket, buf)
        self._summarise(buf, idx, None, bucket)
        return self._reduced(state, bucket, buf)

    def _side(self, dev: int) -> tuple[Any, Any, Any]:
        got = self._sides.get(dev)
        if got is None:
            got = self._sides[dev] = (torch.cuda.Stream(dev), torch.cuda.Event(), torch.cuda.Event())
        return got

    def _fast_path(self, fast: _BoundBucket, idx: int, state: Any, bucket: Any, buf: torch.Tensor) -> Any:
        """A bucket seen at this address for more than `_LAYOUT_CALLS` calls, with its summary bound
        (GradSummaryPlan.bound): the launch with its arguments made once, the streams without Python stream
        objects made a call (`torch.cuda.stream()` and `current_stream()` cost ~25 us of host time a bucket
        on the H200's host, bench/hook_host.py). None when the launch was refused (nothing was launched)."""
        cur_raw, cur = self._current.get(fast.dev)
        side = None
        if self._side_on:
            side, ready, _ = self._side(fast.dev)
            ready.record(cur)                  # the bucket's gradients are ready on the backward's stream
            side.wait_event(ready)
        if not fast.launch(cur_raw if side is None else side.cuda_stream):
            return None
        self._rows[idx] = fast.row
        self._py_calls += 1
        if side is None:
            return self._reduced(state, bucket, buf)
        torch.cuda.set_stream(side)            # the collective waits for the side stream, not the backward's
        try:
            return self._reduced(state, bucket, buf)
        finally:
            torch.cuda.set_stream(cur)

    def _reduced(self, state: Any, bucket: Any, buf: torch.Tensor) -> Any:
        """The bucket's reduction (its summary already enqueued, and the buffer scaled by it): the job's own
        comm hook, or the default all-reduce."""
        if self._comm_hook is not None:
            return self._comm_hook(self._comm_state, bucket)
        return self._reduce(buf, scaled=True)

    def _summarise(self, buf: torch.Tensor, idx: int, params: list[torch.Tensor] | None,
                   bucket: Any = None) -> None:
        """Bucket `idx`'s row (`params`: its parameters, else `bucket.parameters()`), leaving the buffer
        scaled for the sum; its launch bound once its layout settled."""
        # the bucket's flat buffer (its gradients are views into it, in order): one fused read of it on
        # CUDA with Triton (checksums.grad_summary_triton), torch ops elsewhere; not two kernels a parameter
        # (+34% of a GPT-2-small step on the H200)
        # the same buffer as the bucket's last call (its address, size, and the path in force): its plan
        # holds without re-checking it (`_plan` checks a few properties and builds a key: microseconds a
        # bucket, on the host, in the step)
        key = (buf.data_ptr(), buf.numel(), _FUSED and not _BROKEN)
        seen = self._seen.get(idx)
        same = seen is not None and seen[:3] == key
        held = self._plans.get(idx) if same else None
        # the default reduction's 1/world scaling in the summary's pass; a job's own hook does its own
        scale = self._reduce.scale if self._comm_hook is None else 1.0
        plan = held[1] if held is not None else None
        if plan is not None and idx < len(self._views) and getattr(plan, "summarises", False):
            # the fused plan this very buffer ran last step: straight to the launch (bucket_summary would
            # check the plan against the buffer again: microseconds a bucket in a host-bound step)
            self._rows[idx] = _run_fused(plan, buf, checked=True, scale=scale, out=self._views[idx])
        else:
            self._rows[idx] = bucket_summary([buf], plan if plan is not None else self._plan(idx, [buf]),
                                             scale=scale, out=self._row_slot(idx, buf.device))
        # (the summary leaves the buffer scaled for the sum)
        # the layout, taken while DDP may still rebuild: its rebuild after the first step may keep a
        # bucket's parameter count and reorder them (the order gradients became ready), and a stale layout
        # would make every replay's fingerprint differ. DDP rebuilds once; a bucket whose buffer moved or
        # resized is taken again. Afterwards the hook skips it (bucket.parameters() builds a list a call)
        calls = seen[3] + 1 if same else 1
        if calls <= _LAYOUT_CALLS or idx not in self.layout:
            self.layout[idx] = tuple(self._index[id(p)] for p in (params if params is not None
                                                                   else bucket.parameters()))
        elif plan is not None and buf.is_cuda and getattr(plan, "summarises", False):
            # the layout settled and the kernel compiled: the next calls on this buffer launch it bound
            if self._native is not None:
                self._bind_native(idx, plan, buf, scale)
            else:                                 # `_fast_path`
                bound = plan.bound(buf, self._views[idx], scale)
                if bound is not None:
                    self._fast[idx] = _BoundBucket(buf.data_ptr(), buf.numel(), buf.device.index, bound,
                                                   self._views[idx])
        self._seen[idx] = (*key, calls)
        self._py_calls += 1

    def _bind_native(self, idx: int, plan: Any, buf: torch.Tensor, scale: float) -> None:
        """Bucket `idx`'s launch handed to the C++ hook (not under fault injection, which runs here every
        call); a refusal is said once and the bucket stays on the fallback."""
        if self._inject is not None or idx in self._unbindable:
            return
        spec = plan.native_launch(buf, self._views[idx], scale)
        try:
            why = ("the kernel needs Triton's own launcher" if spec is None else
                   self._native.bind(idx, buf.data_ptr(), buf.numel(), spec.function, list(spec.grid),
                                     spec.block, spec.shared, list(spec.params)))
        except Exception as exc:  # noqa: BLE001 (an argument the C++ side cannot take: the fallback stays)
            why = f"{type(exc).__name__}: {exc}"
        if why:
            self._unbindable.add(idx)
            logger.info("sdcwatch: bucket %d's summary is launched through Python, not the C++ hook: %s",
                        idx, why)

    def _plan(self, idx: int, grads: Sequence[torch.Tensor]) -> Any:
        """CUDA with Triton: the bucket's own plan (`summary_plan`), kept while it fits the buffer
        (DDP rebuilds its buckets once, after the first step). Elsewhere None (torch ops)."""
        return _held_plan(self._plans, idx, grads)

    def _row_slot(self, idx: int, device: torch.device) -> torch.Tensor:
        """Bucket `idx`'s row in the row buffer (grown, with the rows already written this step, when a
        bucket index is new: the first steps only)."""
        views = self._views
        if idx < len(views) and views[idx].device == device:
            return views[idx]
        old = self._buf
        cap = max(16, 2 * (idx + 1))
        self._buf = torch.zeros(cap, ROW_WORDS, dtype=torch.int64, device=device)
        self._fast.clear()                     # their launches write the old buffer's rows
        if self._native is not None:
            self._native.unbind_all()
        self._unbindable.clear()
        if old is not None and old.device == device:
            self._buf[:old.shape[0]].copy_(old)
        self._views = list(self._buf.unbind(0))
        for i in self._rows:
            if i < cap:
                self._rows[i] = self._views[i]
        return self._views[idx]

    def settled_layout(self) -> dict[int, tuple[int, ...]] | None:
        """`layout` once every bucket has kept its buffer for more than `_LAYOUT_CALLS` calls (DDP's one
        rebuild behind it), else None."""
        if not self._seen or any(seen[3] <= _LAYOUT_CALLS for seen in self._seen.values()):
            return None
        return dict(self.layout)

    def _reduced_buckets(self) -> set[int]:
        """The buckets reduced since the last `clear`."""
        if self._native is not None:
            return set(self._native.reduced())
        return set(self._rows)

    def bucket_count(self) -> int:
        """The buckets reduced since the last `clear` (every index below it must have been)."""
        if self._native is not None:
            return self._native.reduced_count()      # one call, no set (every step of the device path)
        done = self._reduced_buckets()
        return max(done) + 1 if done else 0

    def rows(self) -> torch.Tensor:
        """This rank's rows of the last backward, int64 [buckets, 4] (device), ordered by bucket index. A
        view of the row buffer that the next backward overwrites: use it (gather, copy) in this step. With
        `side_stream`, the current stream is made to wait for the hooks' stream first."""
        n = self._check_rows()
        assert self._buf is not None      # every hook call wrote its row there (`_row_slot`)
        if self._sides and self._buf.is_cuda:
            dev = self._buf.device.index
            got = self._sides.get(dev)
            if got is not None:
                side, _, done = got
                done.record(side)
                self._current.get(dev)[1].wait_event(done)
        return self._buf[:n]

    def _check_rows(self) -> int:
        done = self._reduced_buckets()
        if not done:
            raise RuntimeError("no gradient bucket was reduced since the last step (no backward?)")
        n = max(done) + 1
        if len(done) != n:
            raise RuntimeError(f"buckets {sorted(set(range(n)) - done)} were not reduced")
        return n

    def clear(self) -> None:
        self._rows.clear()
        if self._native is not None:
            self._native.clear()

    def pending(self) -> bool:
        """Rows of a synchronised backward that no step took (`clear` not called since)."""
        return self.bucket_count() > 0

    def gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's rows, int64 [world, buckets, 4], on the rows' device (a collective: all ranks call).
        `out`: int64 [world * buckets, 4] on that device to gather into (the compute gate's static input).

        With the C++ hook, once every rank has gathered rows of one bucket count a few times, the hook
        gathers them itself (`_arm_hook_gather`) into the `out` of that gather (the gate's static input):
        then this only waits for it (and copies it where another `out`, or none, is given)."""
        armed = self._hook_gather
        self.finished = -1
        if armed is not None:
            got = self._hook_gathered(armed, out)
            if got is not None:
                return got
        rows = self._gather_eager(out)
        if self._hook_gather_ok is not False:
            self._eager_gathers += 1
            if self._eager_gathers >= _GATHER_ARM_AFTER:   # into the caller's static `out`, else our own
                self._arm_hook_gather(out if out is not None
                                      else torch.empty_like(rows).view(-1, ROW_WORDS), rows.shape[1])
        return rows

    def _gather_eager(self, out: torch.Tensor | None, mine: torch.Tensor | None = None) -> torch.Tensor:
        """`gather` by one all-gather call here (FsdpGradSummaries' too; `mine`: the rows to send, else
        `rows()`)."""
        mine = self.rows() if mine is None else mine
        if not self._world:
            self._world = dist.get_world_size(self._group)
        world = self._world
        if out is None:
            out = mine.new_empty((world * mine.shape[0], *mine.shape[1:]))   # the concatenated form (gloo's)
        all_gather_single(out, mine, group=self._group)    # one call and no stack, whatever the world
        return out.view(world, *mine.shape)

    def _hook_gathered(self, armed: tuple[torch.Tensor, int, torch.Tensor],
                       out: torch.Tensor | None) -> torch.Tensor | None:
        """The rows the C++ hook gathered this step (the caller's stream, or the host on gloo, waits for
        them), or None when it did not gather them or gathered another bucket count (DDP rebuilt its
        buckets: every rank alike): disarmed then, and the caller gathers eagerly, as every rank does."""
        target, n, view = armed
        done = self._native.wait_gather()   # -2: not over buckets 0..n-1 exactly; -1: gathered; k: finished
        if done == -2:
            self._native.disarm_gather()        # (and its `arm_finish`)
            self._hook_gather, self._eager_gathers = None, 0
            return None
        if done >= 0:
            self.finished = done
            self.hook_finishes += 1
        self.hook_gathers += 1
        if out is target:                  # the gate's static input, the armed one (every step)
            return view
        if out is None:
            target = target.clone()        # the caller's own, as an eager gather's (the next backward
        elif out.data_ptr() != target.data_ptr() or out.shape != target.shape:   # overwrites the hook's)
            out.copy_(target)              # another output than the armed one (not the gate's: it keeps one)
            target = out
        return target.view(self._world, n, ROW_WORDS)

    def _arm_hook_gather(self, out: torch.Tensor, n: int) -> None:
        """From the next backward, the C++ hook all-gathers the rows into `out` itself, right after its last
        bucket's all-reduce, so the step guard's pre-update stage issues no collective (the call took
        ~0.2-0.3 ms of host time inside a host-bound GPT-2-small step, docs/BENCHMARKS.md). A collective
        moved between ranks' Python and C++ must move on all of them at once, or a job's own collective
        between backward and step (a loss all-reduce for logging) would pair with another rank's gather:
        every rank arms at the same eager gather (their count is the same everywhere: each is a
        collective), and only when every rank can (asked once with one all-reduce there: a rank on the
        Python hook, its C++ hook not built, makes every rank keep the eager gather)."""
        if self._hook_gather_ok is None:
            mine = self._native is not None and _HOOK_GATHER
            can = torch.tensor([1 if mine else 0], dtype=torch.int64, device=out.device)
            dist.all_reduce(can, op=dist.ReduceOp.MIN, group=self._group)
            self._hook_gather_ok = bool(can.item())       # once a job: one host sync
            logger.info("sdcwatch: %s", "the C++ comm hook all-gathers the gradient bucket rows from the "
                        "next backward on (every rank alike; SDCWATCH_HOOK_GATHER=0 keeps it in the step "
                        "guard)" if self._hook_gather_ok else "the rows' all-gather stays in the step guard: "
                        "a rank has no C++ hook (or set SDCWATCH_HOOK_GATHER=0)")
        if not self._hook_gather_ok:
            return
        assert self._buf is not None
        group = self._group if self._group is not None else dist.distributed_c10d._get_default_group()
        self._native.arm_gather(group, out, self._buf[:n], n)
        self._hook_gather = (out, n, out.view(-1, n, ROW_WORDS))

    def arm_finish(self, exec_handle: int, flag: torch.Tensor, keep: Sequence[torch.Tensor],
                   slots: Sequence[Any], start: int) -> str:
        """From the next backward, the C++ hook also replays the compute gate's verdict (the CUDA graph
        `exec_handle`, reading the armed gather's output and `keep`, writing `flag`) right after its gather,
        and copies the rows and the flag into `slots` (pinned `HostSlot`s, whose events it records), from
        slot `start` on in turn; `finished` then names the slot of each step. "" when armed, else why not.
        Needs the gather in the hook (`_arm_hook_gather`) into the gate's static input: the graph's."""
        if self._native is None or self._hook_gather is None:
            return "the rows' gather is not in the C++ hook"
        return self._native.arm_finish(exec_handle, self._hook_gather[0], flag, list(keep),
                                       [s.rows.view(-1, ROW_WORDS) for s in slots], [s.flag for s in slots],
                                       [s.done.cuda_event for s in slots], start)

    def disarm_finish(self) -> None:
        if self._native is not None:
            self._native.disarm_finish()

    @property
    def gathers_in_hook(self) -> bool:
        """The C++ hook all-gathers the rows (`_arm_hook_gather`): `arm_finish` can follow."""
        return self._hook_gather is not None

    def bucket_grads(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Summary rows int64 [buckets, 4] of a gradient given per parameter (a replay's), in this layout."""
        rows = []
        for b in range(len(self.layout)):
            gs = []
            for i in self.layout[b]:
                g = grads[i]
                gs.append(torch.zeros_like(self.params[i]) if g is None else g)
            rows.append(bucket_summary([torch.cat([g.reshape(-1) for g in gs])]))   # the hook's flat layout
        return torch.stack(rows)


class FsdpGradSummaries:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`): the same rows, one per FSDP parameter group, taken
    before the reduce-scatter.

    Each FSDP module's reduce-scatter is replaced (`FSDPModule.set_custom_reduce_scatter`) by one that
    summarises its input, the rank's whole local unsharded gradient of that group (flattened, padded,
    laid out for the reduce-scatter exactly as FSDP hands it to the collective; pre-divided by FSDP's
    factor when it pre-divides, the same on every rank), on the device, then runs the default
    reduce-scatter. On CUDA the summary runs on FSDP's reduce-scatter stream; `gather` makes the current
    stream wait for it. Under `set_requires_gradient_sync(False)` accumulation FSDP reduces once, on the
    last micro-batch, with the accumulated gradient: the rows cover it. The rows, `gather` and the
    comparison are GradSummaries'.

    Replays (checksums.fsdp_replay): inside `capturing()` the reduce-scatter summarises its input into the
    capture (not the step's rows) and does not reduce: the output is zeroed and nothing travels, so a
    replay's gradient never reaches the reduce-scatter's output (its sharded `.grad` the replayer discards).
    Every rank replays at once (the forward's all-gathers pair up), so every rank skips alike.
    """

    # no C++ hook here (GradSummaries' methods it borrows see none; the gate's verdict is never replayed by one)
    _native: Any = None
    finished = -1

    def __init__(self, root: nn.Module, *, group: Any = None, inject: Any = None, lanes: Any = None) -> None:
        from torch.distributed.fsdp import FSDPModule
        mods = [m for m in root.modules() if isinstance(m, FSDPModule)]
        if not mods:
            raise TypeError("FsdpGradSummaries needs a model sharded with fully_shard, got "
                            f"{type(root).__name__}")
        self.lanes = lanes             # tensor parallelism (checksums.tp_lanes.Lanes): the whole mesh's rows
        self._group = None if lanes is not None else group
        self.params: list[torch.Tensor] = [p for p in root.parameters() if p.requires_grad]
        self._rows: dict[int, torch.Tensor] = {}
        self._streams: set[Any] = set()
        self._plans: dict[int, tuple[tuple, Any]] = {}
        self.layout: dict[int, tuple[int, ...]] = {}
        self.hook_calls = 0
        self._world = 0                  # the group's size, read at the first gather
        self._inject = inject
        self._capture: dict[int, torch.Tensor] | None = None
        self._keep_flat: dict[int, torch.Tensor] | None = None   # a witness replay's whole inputs (2 ranks)
        comm_cls = _summarising_reduce_scatter()
        # the FSDP modules with a parameter group (a root that wraps unsharded children owns their
        # parameters, though it has none of its own), in the order of their rows
        self.groups: list[list[Any]] = []
        for m in mods:
            fsdp_params = fsdp_group_params(m)
            if not fsdp_params:
                continue
            m.set_custom_reduce_scatter(comm_cls(self, len(self.groups)))  # type: ignore[operator]
            self.groups.append(fsdp_params)

    def _summarise(self, idx: int, flat: torch.Tensor) -> bool:
        """Summarise one group's reduce-scatter input; True when it is a replay's (captured: not reduced).
        A replay is not injected (the harness's gradient faults hit the step's own buffer, as DDP's)."""
        capture = self._capture
        if capture is None and self._inject is not None:
            self._inject(idx, flat)
        row = bucket_summary([flat], _held_plan(self._plans, idx, [flat]))
        if flat.device.type == "cuda":
            self._streams.add(torch.cuda.current_stream(flat.device))
        if capture is not None:
            capture[idx] = row
            if self._keep_flat is not None:
                self._keep_flat[idx] = flat.detach().clone()
            return True
        self._rows[idx] = row
        self.hook_calls += 1
        return False

    @contextlib.contextmanager
    def capturing(self, flats: dict[int, torch.Tensor] | None = None) -> Iterator[dict[int, torch.Tensor]]:
        """While open, each reduce-scatter summarises its input into the yielded dict (group -> row) and
        skips the collective (a collective replay: every rank opens it around the same backward); with
        `flats`, a copy of each group's whole input goes there too (the two-rank witness)."""
        saved, self._capture = self._capture, {}
        saved_flat, self._keep_flat = self._keep_flat, flats
        try:
            yield self._capture
        finally:
            self._capture, self._keep_flat = saved, saved_flat

    def rows_of(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """A capture's rows int64 [groups, 4] (device), ordered like `rows()`."""
        self._wait_streams()
        if not captured or len(captured) != max(captured) + 1:
            raise RuntimeError(f"a replay reduced groups {sorted(captured)}: not every FSDP group")
        return torch.stack([captured[i] for i in range(len(captured))])

    def _wait_streams(self) -> None:
        for stream in self._streams:
            torch.cuda.current_stream(stream.device).wait_stream(stream)

    def _reduced_buckets(self) -> set[int]:
        return set(self._rows)

    def rows(self) -> torch.Tensor:
        self._wait_streams()
        n = GradSummaries._check_rows(self)  # type: ignore[arg-type]
        return torch.stack([self._rows[i] for i in range(n)])

    def bucket_count(self) -> int:
        return GradSummaries.bucket_count(self)  # type: ignore[arg-type]

    def clear(self) -> None:
        self._rows.clear()

    def pending(self) -> bool:
        return GradSummaries.pending(self)  # type: ignore[arg-type]

    def gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """`GradSummaries.gather`'s rows; under tensor parallelism every rank's rows of the mesh, a tp group's
        lanes side by side as one data-parallel rank's: [dp, lanes * groups, 4] (into `out` when given)."""
        if self.lanes is None:
            return GradSummaries._gather_eager(self, out)  # type: ignore[arg-type]
        rows = self.lanes.merge(GradSummaries._gather_eager(  # type: ignore[arg-type]
            self, None, self.lanes.pad(self.rows())))
        if out is None:
            return rows
        view = out.view(rows.shape)
        view.copy_(rows)
        return view


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules of `model`: [model] for a `fully_shard` module; each part for a container
    of them (a rank's model parts: an interleaved pipeline's virtual stages) whose every parameter one of
    them holds; [] otherwise (DDP, a plain module)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:              # pragma: no cover - torch without FSDP2
        return []
    if isinstance(model, FSDPModule):
        return [model]
    roots: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, FSDPModule):
                roots.append(child)
            else:
                walk(child)
    walk(model)
    held = {id(p) for r in roots for p in r.parameters()}
    if not roots or any(id(p) not in held for p in model.parameters()):
        return []
    return roots


def fsdp_shard_size(module: nn.Module) -> int:
    """The fewest ranks any of `module`'s FSDP2 parameters is sharded over (`FSDPParam.mesh_info`, FSDP2
    internals): 1 where one is not sharded (`replicate()` built on FSDP2, a shard group of one rank), so its
    gradient is not reduce-scattered; 0 where none can be read."""
    sizes = [int(getattr(getattr(fp, "mesh_info", None), "shard_mesh_size", 1))
             for fp in _fsdp_params(module)]
    return min(sizes) if sizes else 0


def fsdp_group_params(module: nn.Module) -> list[Any]:
    """The FSDPParams of an FSDP module's parameter group(s) (FSDP2 internals: not public API), [] when
    it has none."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return [fp for g in groups for fp in g.fsdp_params]


def fsdp_mesh(module: nn.Module) -> Any:
    """FSDP2's own mesh of `module` (`FSDPParam.mesh_info.mesh`, FSDP2 internals; the first FSDP module's,
    in module order: the root's, or its first layer's), None where it cannot be read."""
    return next((mesh for _, mesh in _fsdp_param_meshes(module)), None)


def _fsdp_params(module: nn.Module) -> Iterator[Any]:
    """The FSDPParams of every FSDP module in `module`, in module order (FSDP2 internals; none where they
    cannot be read)."""
    for sub in module.modules():
        if hasattr(sub, "_get_fsdp_state"):
            try:
                yield from fsdp_group_params(sub)
            except (AttributeError, RuntimeError, TypeError):
                continue


def _fsdp_param_meshes(module: nn.Module) -> Iterator[tuple[Any, Any]]:
    """(sharded parameter, the mesh FSDP2 shards it over) of every FSDP module in `module`, in module order
    (FSDP2 internals; nothing where they cannot be read)."""
    for fp in _fsdp_params(module):
        mesh = getattr(getattr(fp, "mesh_info", None), "mesh", None)
        if mesh is not None:
            yield getattr(fp, "sharded_param", None), mesh


def model_parallel_dims(module: nn.Module, fsdp: bool) -> list[str]:
    """The mesh dims `module`'s parameters are split over besides data parallelism (tensor, sequence or
    context parallelism through DTensor), by name where the mesh names them; [] for none. DDP: every dim a
    DTensor parameter is not replicated on. FSDP2: each parameter's mesh dims beyond the mesh FSDP shards
    it over (`FSDPParam.mesh_info.mesh`, FSDP2 internals: where they cannot be read, []; an MoE's experts
    may be sharded over other ranks than the rest, torchtitan's `efsdp`)."""
    if DTENSOR is None:
        return []
    if not fsdp:          # DDP over a tensor-parallel module whose DTensors were made local for DDP
        hooked = _meshes_in_hooks(module)   # (torch's `_pre_dp_module_transform`): its hooks hold the mesh
        if hooked:
            return hooked
    root: Any = None
    own: dict[int, Any] = {}
    if fsdp:
        root = fsdp_mesh(module)
        if root is None:
            return []
        own = {id(p): mesh for p, mesh in _fsdp_param_meshes(module) if p is not None}
    out: list[str] = []
    for p in module.parameters():
        if not isinstance(p, DTENSOR):
            continue
        dp = own.get(id(p), root)
        mesh = p.device_mesh
        names = _dim_names(mesh)
        for d, placement in enumerate(p.placements):
            if mesh.size(d) == 1:                  # over one rank: nothing split
                continue
            if dp is None:
                extra = not placement.is_replicate()
            elif mesh.mesh_dim_names and dp.mesh_dim_names:
                extra = names[d] not in dp.mesh_dim_names
            else:                                  # FSDP2's mesh first, then the model's own dims
                extra = d >= dp.ndim
            if extra and names[d] not in out:
                out.append(names[d])
    return out


def _meshes_in_hooks(module: nn.Module) -> list[str]:
    """The dims (by name) of more than one rank of the device meshes `module`'s forward hooks hold:
    `distribute_module` (tensor parallelism's styles) registers hooks closing over the mesh they lay the
    inputs and outputs out on."""
    from torch.distributed.device_mesh import DeviceMesh
    out: list[str] = []
    for sub in module.modules():
        for hook in (*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()):
            for mesh in _held(hook):
                if isinstance(mesh, DeviceMesh):
                    out += [n for d, n in enumerate(_dim_names(mesh)) if mesh.size(d) > 1 and n not in out]
    return out


def _held(fn: Any) -> list[Any]:
    """What a callable holds: a partial's arguments, a closure's cells (an empty cell left out)."""
    held = [*getattr(fn, "args", ()), *getattr(fn, "keywords", {}).values()]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:
            pass
    return held


def _dim_names(mesh: Any) -> tuple[str, ...]:
    """A device mesh's dim names, or "mesh dim D" where it has none."""
    return tuple(mesh.mesh_dim_names or (f"mesh dim {d}" for d in range(mesh.ndim)))


def _summarising_reduce_scatter() -> type:
    """FSDP2's default reduce-scatter with our summary first (FSDP2's comm classes are not public API)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class SummarisingReduceScatter(DefaultReduceScatter):  # type: ignore[misc]
        def __init__(self, owner: FsdpGradSummaries, idx: int) -> None:
            super().__init__()
            self._owner, self._idx = owner, idx

        def __call__(self, output_tensor, input_tensor, group, op,  # type: ignore[no-untyped-def]
                     async_op=False):
            if self._owner._summarise(self._idx, input_tensor):     # a replay: summarised, not reduced
                output_tensor.zero_()
                return None
            return super().__call__(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                                    op=op, async_op=async_op)

    return SummarisingReduceScatter


# ---- the cross-rank comparison (pure: tensors in, verdict out) -------------------------------------------


def deviations(stats: torch.Tensor, zeroable: torch.Tensor | None = None) -> torch.Tensor:
    """Each rank's distance from the others per bucket and statistic, in log units: float64 [world, buckets,
    4]. Columns 0-1 (norm, max-abs): |d| with d = log(x_r) - median_r log(x), the rank against the other
    ranks on that bucket. Columns 2-3 (`relative`): |d - median_b d|, the same less the rank's own median d
    over its buckets (per statistic): what the rank's data moves in every bucket alike (a batch of short
    documents, another source's text: each of its buckets' norms up together) is taken out, so where the
    ranks' batches differ in kind the spread learnt there stays narrow, and a fault, which moves the buckets
    its op feeds and not the others alike, stands out against it (3 ranks on mixed-source batches,
    `bench.mixed_sources`: plain spreads of 1.5-3.0 log units, so a statistic had to move 90x or more, and
    relative ones from 0.15; a whole layer's output x3 caught on its step, before not even x10). A rank's
    fault that moves all its buckets alike is still seen by columns 0-1.

    Non-finite values are counted as zero here (their rank is named by `SpreadTracker.judge`). The medians
    are torch.median's (the lower of the two middle values for an even count), taken from a sort: `median(
    dim=)` on CUDA has no deterministic implementation, so under `torch.use_deterministic_algorithms(True)`
    (jobs that want reproducible runs, and exact replays of cuDNN attention) it raises; a sort does not.
    `zeroable` (bool [buckets], on the stats' device): buckets whose gradient can be exactly zero on a rank
    (an MoE expert no token of that rank chose: `SpreadTracker` learns them); there a zero statistic is left
    out of both medians, its distances 0. Fixed shapes, no host sync (the device verdict's graph runs it)."""
    x = torch.nan_to_num(stats, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(_TINY).log()
    if zeroable is None:
        d = x - x.sort(dim=0, stable=True).values[(x.shape[0] - 1) // 2]
        kb = (x.shape[1] - 1) // 2
        shift = d.sort(dim=1, stable=True).values[:, kb:kb + 1]
        return torch.cat([d.abs(), (d - shift).abs()], dim=-1)
    out = (x <= _LOG_TINY) & zeroable.view(1, -1, 1)
    ordered = torch.where(out, math.inf, x).sort(dim=0, stable=True).values
    k = ((~out).sum(dim=0) - 1).clamp_min(0) // 2
    d = x - ordered.gather(0, k.unsqueeze(0))
    by_bucket = torch.where(out, math.inf, d).sort(dim=1, stable=True).values
    kb = ((~out).sum(dim=1, keepdim=True) - 1).clamp_min(0) // 2
    shift = by_bucket.gather(1, kb)
    return torch.where(torch.cat([out, out], dim=-1), 0.0, torch.cat([d.abs(), (d - shift).abs()], dim=-1))


@dataclasses.dataclass(frozen=True, slots=True)
class StatsVerdict:
    """One step's cross-rank comparison. `scores[r]`: rank r's largest distance over buckets and statistics,
    in units of the clean spread; `outliers`: ranks over the margin; `nonfinite`: ranks with NaN/Inf;
    `bucket`/`stat`: where the worst outlier's distance was largest; `warming`: the spread is still
    being learned (only non-finite values count)."""

    scores: tuple[float, ...]
    outliers: tuple[int, ...]
    nonfinite: tuple[int, ...]
    bucket: int = -1
    stat: str = ""
    warming: bool = False

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.outliers) | set(self.nonfinite)))


STAT_NAMES = ("norm", "maxabs", "relative norm", "relative maxabs")   # `deviations`' columns


class SpreadTracker:
    """The clean cross-rank spread per bucket and statistic, and the verdict against it.

    `spread[b, s]` is the largest distance from the median (in log units) seen on a clean step, floored at
    `floor` (log(1.05) by default), for each of `deviations`' four columns (s: norm, max-abs, and the two
    relative to the rank's other buckets: STAT_NAMES); a step is clean when no rank exceeded `margin` spreads,
    or when a replay cleared it (`learn`). The first `warmup` steps only learn (non-finite values still
    count). Pure: the caller passes the gathered statistics; nothing here reads a clock or a GPU.

    It runs on the host every step (the device path judges the previous step's rows), on arrays of world x
    buckets x 2 statistics: in numpy, as one call each, not torch ops on tiny CPU tensors (about 10x fewer
    host microseconds a step; `python -m bench.hook_host` times `assess`). The rule is `deviations`' (torch's
    lower median), so the host verdict and the device's `device_flag` agree.
    """

    def __init__(self, *, margin: float = 3.0, warmup: int = 20, floor: float = math.log(1.05)) -> None:
        self.margin = above("margin", margin, "the detection margin in units of the clean spread", 1.0)
        self.warmup = count("warmup", warmup, "a number of clean steps")
        self.floor = above("floor", floor, "the smallest spread (log units)", 0.0)
        self._spread: np.ndarray | None = None
        self.spread_version = 0           # moves only when the spread's values change (the device copy's cue)
        self.learned = 0
        self.max_score_clean = 0.0        # the largest score of a step judged clean after warm-up
        # each rank's own history (the two-rank tie-break, `jumps`): log statistics of the last clean step,
        # and the clean step-to-step spread per bucket and statistic
        self._last: np.ndarray | None = None
        self._tspread: np.ndarray | None = None
        # buckets whose gradient was exactly zero on some rank and not on another, on a step learnt as
        # clean (an MoE expert no token of that rank chose): a zero there is the data's, left out of the
        # comparison (`deviations`), never widening the spread
        self._zeroable: np.ndarray | None = None
        self._signed: np.ndarray | None = None
        self._declared: np.ndarray | None = None    # zeroable by the model's own word (`declare_zeroable`)

    @property
    def spread(self) -> torch.Tensor | None:
        """float64 [buckets, 4], `deviations`' columns (a view of the tracker's array; replaced, never changed
        in place)."""
        return None if self._spread is None else torch.from_numpy(self._spread)

    @property
    def zeroable(self) -> tuple[int, ...]:
        """The buckets learnt to be exactly zero on a rank in clean training (see `deviations`)."""
        return () if self._zeroable is None else tuple(int(b) for b in np.flatnonzero(self._zeroable))

    @property
    def signed_spread(self) -> torch.Tensor | None:
        """`spread` with the zeroable buckets' rows negated: the one tensor the device verdict reads
        (`device_flag`), moving with `spread_version` as `spread` does."""
        return None if self._signed is None else torch.from_numpy(self._signed)

    def declare_zeroable(self, buckets: Sequence[int], count: int) -> tuple[int, ...]:
        """Buckets whose gradient the model says can be exactly zero on a rank (an MoE expert's parameters
        only: `ComputeChecks`' `experts=`), of a layout of `count` buckets: zeroable from now on (and in a
        spread learnt anew for `count` buckets), as if learnt on a clean step, so the first step an expert
        gets no token on some rank is not a suspicion (under the device gate: a lost update). Returns the
        buckets newly marked."""
        marks = np.zeros(count, dtype=bool)
        marks[[b for b in buckets if 0 <= b < count]] = True
        self._declared = marks
        if self._spread is None or self._zeroable is None or self._spread.shape[0] != count:
            return tuple(int(b) for b in np.flatnonzero(marks))
        new = marks & ~self._zeroable
        if new.any():
            self._set(self._spread, self._zeroable | new)
        return tuple(int(b) for b in np.flatnonzero(new))

    def _set(self, spread: np.ndarray, zeroable: np.ndarray) -> None:
        """New spread values or zeroable buckets (never changed in place: views handed out stay as they
        were); the signed copy made here, once, not every step."""
        self._spread, self._zeroable = spread, zeroable
        self._signed = np.where(zeroable[:, None], -spread, spread) if zeroable.any() else spread
        self.spread_version += 1

    def assess(self, stats: torch.Tensor) -> tuple[tuple[float, ...], StatsVerdict]:
        """`jumps(stats)` (before this step is learnt) and `judge(stats)`, from one host copy of the
        statistics and one log of them: what the gate runs every step. The jumps are taken only for a step
        with suspects (the replays' tie-break reads them then, nothing else does); zeros otherwise. The
        same numbers: `_judge` learns a step exactly when it has no suspects, so a step with suspects
        leaves the history the jumps compare with as it was."""
        x = _host_array(stats)
        fin = np.isfinite(x)
        lx, nonfinite = _log_np(x, fin), _nonfinite_ranks_np(x, fin)
        verdict = self._judge(x, lx, nonfinite)
        if not verdict.suspects:
            return (0.0,) * x.shape[0], verdict
        return self._jumps(x, lx, nonfinite), verdict

    def learn_clean(self, steps: np.ndarray) -> StatsVerdict | None:
        """Consecutive steps' statistics, float64 numpy [k, world, buckets, 2], judged and learnt at once when
        every one is clean: what `assess` on each in turn would do (the same spread, history, count and
        clean maximum, each step judged against the spread as the steps before it left it), in one pass of
        array operations instead of k (the device path learns its unmasked steps a batch at a time: on a
        host-bound step each numpy call is step time). Returns the last step's verdict; None, with nothing
        learnt, when the batch is not plain (a non-finite or zero statistic, a rank over the margin, still
        warming up, no history, other buckets or ranks than the spread's): the caller then runs `assess` on
        each step. Pure."""
        k, world, nb = steps.shape[0], steps.shape[1], steps.shape[2]
        spread, last = self._spread, self._last
        if (k == 0 or self.learned < self.warmup or spread is None or spread.shape[0] != nb or last is None
                or last.shape != steps.shape[1:]):
            return None
        fin = np.isfinite(steps)
        if not fin.all():
            return None
        lx = _log_np(steps, fin)
        if (lx <= _LOG_TINY).any():     # a zero statistic: `_learn`'s zeroable buckets
            return None
        dev = _deviations_of_log(lx.swapaxes(0, 1)).swapaxes(0, 1)      # [k, world, buckets, 2]
        worst = dev.max(axis=1)                                         # [k, buckets, 2]
        # the spread each step was judged against: the one before the batch, widened by the steps before it
        seen = np.maximum.accumulate(np.concatenate([spread[None], worst[:-1]]), axis=0)
        scores = (dev / seen[:, None]).reshape(k, world, -1).max(axis=2)   # [k, world]
        if world >= 2 and (scores > self.margin).any():
            return None
        wider = np.maximum(seen[-1], worst[-1])
        if not np.array_equal(wider, spread):
            assert self._zeroable is not None             # set with the spread (`_set`)
            self._set(wider, self._zeroable)
        moves = _moves(lx, np.concatenate([last[None], lx[:-1]])).max(axis=(0, 1))
        base = self._tspread if self._tspread is not None else np.full_like(moves, self.floor)
        self._tspread = np.maximum(base, moves)
        self._last = lx[-1]
        self.learned += k
        if world < 2:
            return StatsVerdict(scores=(0.0,) * world, outliers=(), nonfinite=(), warming=True)
        self.max_score_clean = max(self.max_score_clean, float(scores.max()))
        return StatsVerdict(scores=tuple(scores[-1].tolist()), outliers=(), nonfinite=())

    def judge(self, stats: torch.Tensor) -> StatsVerdict:
        """The verdict on one step's gathered statistics float64 [world, buckets, 2] (host or device)."""
        x = _host_array(stats)
        return self._judge(x, _log_np(x), _nonfinite_ranks_np(x))

    def _judge(self, x: np.ndarray, lx: np.ndarray, nonfinite: tuple[int, ...]) -> StatsVerdict:
        world, nb = x.shape[0], x.shape[1]
        if self._spread is None or self._spread.shape[0] != nb:   # DDP rebuilt its buckets: learn anew
            declared = self._declared
            self._set(np.full((nb, 4), self.floor, dtype=np.float64),
                      declared.copy() if declared is not None and declared.shape[0] == nb
                      else np.zeros(nb, dtype=bool))
            self.learned = 0
        dev = _deviations_of_log(lx, self._zeroable)
        if self.learned < self.warmup or world < 2:
            if not nonfinite:
                self._learn(dev, nonfinite, lx)
            return StatsVerdict(scores=(0.0,) * world, outliers=(), nonfinite=nonfinite, warming=True)
        ratio = dev / self._spread
        scores = ratio.reshape(world, -1).max(axis=1).tolist()
        over = [r for r in range(world) if r not in nonfinite and scores[r] > self.margin]
        if world == 2 and over:
            over = [0, 1]                   # two ranks: the median is their midpoint, both are suspects
        bucket, stat = -1, ""
        if over:
            worst = max(over, key=lambda r: scores[r])
            flat = int(ratio[worst].reshape(-1).argmax())
            bucket, stat = flat // 4, STAT_NAMES[flat % 4]
        elif not nonfinite:
            self.max_score_clean = max(self.max_score_clean, max(scores))
            self._learn(dev, nonfinite, lx)
        return StatsVerdict(scores=tuple(scores), outliers=tuple(over), nonfinite=nonfinite,
                            bucket=bucket, stat=stat)

    def learn(self, stats: torch.Tensor) -> None:
        """A step a replay cleared (its values were the data's): widen the spread to include it."""
        x = _host_array(stats)
        if self._spread is not None and self._spread.shape[0] == x.shape[1]:
            lx = _log_np(x)
            self._learn(_deviations_of_log(lx, self._zeroable), _nonfinite_ranks_np(x), lx)

    def jumps(self, stats: torch.Tensor) -> tuple[float, ...]:
        """Each rank's largest move from its own last clean step (log units over the clean step-to-step
        spread, floored like the spread); inf for a rank with a non-finite statistic, 0 with no history.
        Two ranks have no median: this is the third witness (checksums.replay.classify_pair_replays)."""
        x = _host_array(stats)
        return self._jumps(x, _log_np(x), _nonfinite_ranks_np(x))

    def _jumps(self, x: np.ndarray, lx: np.ndarray, nonfinite: tuple[int, ...]) -> tuple[float, ...]:
        world = x.shape[0]
        out = [0.0] * world
        if self._last is not None and self._last.shape == x.shape and self._tspread is not None:
            ratio = _moves(lx, self._last) / self._tspread
            out = ratio.reshape(world, -1).max(axis=1).tolist()
        for r in nonfinite:
            out[r] = math.inf
        return tuple(out)

    def _learn(self, dev: np.ndarray, nonfinite: Sequence[int], lx: np.ndarray) -> None:
        """`lx`: the step's `_log_np` (its history's log statistics; a step with a non-finite value is
        never learnt into the history)."""
        assert self._spread is not None and self._zeroable is not None
        keep = [r for r in range(dev.shape[0]) if r not in nonfinite]
        if keep:
            zero = lx[keep, :, 0] <= _LOG_TINY                   # [kept ranks, buckets]: a zero norm
            new = zero.any(axis=0) & ~zero.all(axis=0) & ~self._zeroable   # newly seen zero on some ranks only
            if new.any():
                logger.info("sdcwatch: gradient bucket(s) %s exactly zero on some ranks only, on a step learnt "
                            "as clean (step %d of the comparison): their zeros are the data's (an MoE expert no "
                            "token chose) and are left out of the comparison from now on",
                            np.flatnonzero(new).tolist(), self.learned + 1)
                self._set(self._spread, self._zeroable | new)
                dev = _deviations_of_log(lx, self._zeroable)     # its zeros left out: no wider spread
            wider = np.maximum(self._spread, dev[keep].max(axis=0))
            if not np.array_equal(wider, self._spread):      # after warm-up, rarely
                self._set(wider, self._zeroable)
            self.learned += 1
        if not nonfinite:
            if self._last is not None and self._last.shape == lx.shape:
                step = _moves(lx, self._last).max(axis=0)
                base = self._tspread if self._tspread is not None else np.full_like(step, self.floor)
                self._tspread = np.maximum(base, step)
            else:       # the first step, or other buckets (DDP rebuilt them) or ranks: a history anew
                self._tspread = None
            self._last = lx


_LOG_TINY = math.log(_TINY) + 1e-6      # a log at or below this is a zero statistic's (any log's rounding)


def _moves(lx: np.ndarray, last: np.ndarray) -> np.ndarray:
    """|lx - last| (log statistics), 0 where either is a zero statistic: a bucket whose gradient is exactly
    zero on a rank one step and not the next (an MoE expert no token of that rank chose) moved by the data,
    by some 70 log units, and would name that rank in the two-rank tie-break or numb its history. Pure."""
    return np.where((lx <= _LOG_TINY) | (last <= _LOG_TINY), 0.0, np.abs(lx - last))


def _host_array(stats: torch.Tensor) -> np.ndarray:
    """float64 numpy [world, buckets, 2] of gathered statistics on any device (a copy: never a view the
    caller's next step could overwrite)."""
    return np.array(stats.detach().to(device="cpu", dtype=torch.float64).numpy(), dtype=np.float64)


def _log_np(x: np.ndarray, fin: np.ndarray | None = None) -> np.ndarray:
    """`deviations`' log: non-finite values counted as zero, zeros as _TINY (np.where, not np.nan_to_num:
    the same values at a fraction of its host time, in the gate's every step). `fin`: np.isfinite(x), if
    the caller has it; on an all-finite step (every clean one) nothing is masked."""
    fin = np.isfinite(x) if fin is None else fin
    return np.log(np.maximum(x if fin.all() else np.where(fin, x, 0.0), _TINY))


def _deviations_of_log(lx: np.ndarray, zeroable: np.ndarray | None = None) -> np.ndarray:
    """`deviations` in numpy from `_log_np`'s logs [world, ..., buckets, 2] (ranks first, buckets second to
    last): the same rule, torch's lower median (the middle value for an odd count, the lower of the two
    middle ones for an even count), zeros of `zeroable` buckets left out ([world, buckets, 2] then)."""
    if zeroable is not None and zeroable.any():
        out = (lx <= _LOG_TINY) & zeroable[None, :, None]
        if out.any():
            ordered = np.sort(np.where(out, np.inf, lx), axis=0)
            k = np.maximum((~out).sum(axis=0) - 1, 0) // 2
            with np.errstate(invalid="ignore"):
                d = lx - np.take_along_axis(ordered, k[None], axis=0)[0]
                by_bucket = np.sort(np.where(out, np.inf, d), axis=1)
                kb = np.maximum((~out).sum(axis=1, keepdims=True) - 1, 0) // 2
                rel = np.abs(d - np.take_along_axis(by_bucket, kb, axis=1))
                return np.where(np.concatenate([out, out], axis=-1), 0.0,
                                np.concatenate([np.abs(d), rel], axis=-1))
    k = (lx.shape[0] - 1) // 2
    d = lx - np.partition(lx, k, axis=0)[k]
    kb = (lx.shape[-2] - 1) // 2
    shift = np.partition(d, kb, axis=-2)[..., kb:kb + 1, :]
    return np.concatenate([np.abs(d), np.abs(d - shift)], axis=-1)


def _nonfinite_ranks_np(x: np.ndarray, fin: np.ndarray | None = None) -> tuple[int, ...]:
    """The ranks (first axis) with a non-finite statistic; `fin` as in `_log_np`."""
    fin = np.isfinite(x) if fin is None else fin
    if fin.all():
        return ()
    bad = ~fin.reshape(fin.shape[0], -1).all(axis=1)
    return tuple(int(r) for r in np.flatnonzero(bad))
