"""Host time of each piece of the compute checks' DDP hook, one bucket's worth at a time (issue 19).

On a host-bound step every host microsecond the hook spends is step time, and the hook runs 13 times a step
at GPT-2 small. This times, per call (median over batches of calls, the device synchronised between
batches, not inside them), what the hook does with one 25 MB fp32 bucket on NCCL at world 1: the stream and
event calls of its side stream, the reduction through the process group (bare, with its future, with the
`then` DDP needs) and the summary kernel's launch in its forms (the plan's launch, the compiled kernel's
runner, Triton's launcher object, its C launch with plain integer pointers).

    python -m bench.hook_host [--bucket-mb 25] [--calls 100] [--batches 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def per_call(fn: Callable[[], Any], calls: int, batches: int) -> float:
    """Median over `batches` of the mean host time of `calls` calls, in microseconds."""
    got = []
    for b in range(batches + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = (time.perf_counter() - t0) / calls
        if b >= 2:                        # two warm-up batches
            got.append(dt)
    torch.cuda.synchronize()
    return statistics.median(got) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--batches", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1,
                                device_id=dev)
        try:
            run(dev, args)
        finally:
            dist.destroy_process_group()


def run(dev: torch.device, args: argparse.Namespace) -> None:
    from checksums.grad_checks import BucketAllreduce, SpreadTracker, _CurrentStreams
    from checksums.grad_summary_triton import ONE_LAUNCH_TB, GradSummaryPlan, gs_partials_kernel

    buf = torch.randn(int(args.bucket_mb * 2**20 / 4), device=dev)
    out = torch.empty(4, dtype=torch.int64, device=dev)
    cur = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    pg = dist.group.WORLD
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    reduce = BucketAllreduce()

    def reduced(fut: Any) -> torch.Tensor:
        return fut.value()[0]

    plan = GradSummaryPlan(buf)
    plan.launch(buf, out)                 # compiles; later launches go direct
    off = buf.data_ptr() - plan._anchor_ptr
    kargs = (plan.anchor, plan._base_i32, plan._base_el, off, plan.nbytes, plan.nvec4, plan.items, plan.fpart,
             plan.spart, plan.counter, plan.n_items, plan.hdr, out, 1.0)
    consts = plan._constexprs[False]
    compiled = gs_partials_kernel[(plan.n_items,)](
        *kargs, BLOCK=plan.block, TAIL=16, DT=plan._dt, ES=plan._es, ONE_LAUNCH=plan._one, TB=ONE_LAUNCH_TB,
        SCALE=False, num_warps=plan.num_warps)
    runner = compiled[(plan.n_items, 1, 1)]
    launcher = compiled.run
    raw_stream = torch.cuda.current_stream(dev).cuda_stream
    ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in kargs)
    c_launch = getattr(launcher, "launch", None)
    scratch_free = getattr(launcher, "global_scratch_size", 1) == 0 and \
        getattr(launcher, "profile_scratch_size", 1) == 0
    direct = next(iter(plan._direct.values()))

    def stream_ctx() -> None:
        with torch.cuda.stream(side):
            pass

    def set_streams() -> None:
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(cur)

    sid, sdi, sdt = side.stream_id, side.device_index, side.device_type
    cid, cdi, cdt = cur.stream_id, cur.device_index, cur.device_type

    def set_streams_c() -> None:
        torch._C._cuda_setStream(stream_id=sid, device_index=sdi, device_type=sdt)
        torch._C._cuda_setStream(stream_id=cid, device_index=cdi, device_type=cdt)

    pieces: list[tuple[str, Callable[[], Any]]] = [
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
        ("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("event.record(stream)", lambda: ev.record(cur)),
        ("side.wait_event(event)", lambda: side.wait_event(ev)),
        ("side.wait_stream(cur) (an event a call)", lambda: side.wait_stream(cur)),
        ("with torch.cuda.stream(side): pass", stream_ctx),
        ("torch.cuda.set_stream(side), back", set_streams),
        ("torch._C._cuda_setStream(side), back", set_streams_c),
        ("pg.allreduce([buf], opts)", lambda: pg.allreduce([buf], opts)),
        ("  .get_future()", lambda: pg.allreduce([buf], opts).get_future()),
        ("  .get_future().then(value()[0]) (DDP's hook)", lambda: pg.allreduce([buf], opts).get_future().then(reduced)),
        ("BucketAllreduce()(buf)", lambda: reduce(buf)),
        ("dist.all_reduce(async_op).get_future().then", lambda: dist.all_reduce(buf, async_op=True).get_future().then(reduced)),
        ("plan.launch(buf, out)", lambda: plan.launch(buf, out)),
        ("_DirectLaunch(args, constexprs)", lambda: direct(kargs, consts)),
        ("compiled[grid](*args) runner", lambda: runner(*kargs, *consts)),
        ("runner(*args, stream=raw)", lambda: runner(*kargs, *consts, stream=raw_stream)),
        ("runner(*int pointers, stream=raw)", lambda: runner(*ints, *consts, stream=raw_stream)),
    ]
    bound = plan.bound(buf, out)
    if bound is not None:
        pieces.append(("plan.bound(buf, out)(stream) (the hook's launch)", lambda: bound(raw_stream)))
    streams = _CurrentStreams()
    pieces.append(("_CurrentStreams().get(0) (the hook's stream)", lambda: streams.get(0)))
    # the gate's host verdict a step (the previous step's rows): 2 ranks x 13 buckets, warmed, clean steps
    rng = torch.Generator().manual_seed(0)
    tracker = SpreadTracker(warmup=20)
    clean = [torch.exp(torch.randn(2, 13, 2, generator=rng, dtype=torch.float64) * 0.01) for _ in range(64)]
    for st in clean[:30]:
        tracker.assess(st)
    k = [0]

    def assess() -> None:
        k[0] = (k[0] + 1) % len(clean)
        tracker.assess(clean[k[0]])
    pieces.append(("SpreadTracker.assess (2 ranks x 13 buckets, clean)", assess))
    # the gate's all-gather of the rows a step (13 buckets), through the wrapper it uses and the group directly
    from checksums.collectives import all_gather_single
    rows = torch.zeros(13, 4, dtype=torch.int64, device=dev)
    gathered = torch.empty_like(rows)
    pieces.append(("all_gather_single(rows) (the gate's, a step)", lambda: all_gather_single(gathered, rows)))
    pieces.append(("  pg._allgather_base(out, rows).wait()", lambda: pg._allgather_base(gathered, rows).wait()))
    if c_launch is not None and scratch_free:
        head = (plan.n_items, 1, 1, raw_stream, compiled.function, launcher.launch_cooperative_grid,
                launcher.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
        pieces.append(("C launch(*int pointers)", lambda: c_launch(*head, *ints, *consts)))
        pieces.append(("C launch(*tensors)", lambda: c_launch(*head, *kargs, *consts)))
    print(f"bucket {buf.numel() * 4 / 2**20:.1f} MiB fp32, {plan.n_items} work items; us a call "
          f"(median of {args.batches} batches of {args.calls})")
    for name, fn in pieces:
        try:
            us = per_call(fn, args.calls, args.batches)
            print(f"  {name:50} {us:8.2f}")
        except Exception as exc:  # noqa: BLE001 (a piece this torch/Triton lacks: say so, time the rest)
            print(f"  {name:50} failed: {type(exc).__name__}: {str(exc)[:120]}")
    # the C launch's row must be the plan's
    ref = plan.launch(buf, out).clone()
    if c_launch is not None and scratch_free:
        out.zero_()
        c_launch(*head, *ints, *consts)
        torch.cuda.synchronize()
        print("C launch row equals the plan's:", bool(torch.equal(out, ref)))


if __name__ == "__main__":
    main()
