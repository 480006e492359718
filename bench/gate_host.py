"""Host time of the compute checks' per-bucket reduction and per-step judge (issue 19), side by side with
their baselines in one run.

On a host-bound step (the H200's GPT-2-small step: the device works 41 ms of 52, docs/BENCHMARKS.md) every
host microsecond the checks add lands in the step. Two parts are measured here, on the CPU:

* ``reduce``: DDP step time of a model with many small buckets and a near-empty backward, world 1 on gloo,
  in interleaved blocks: DDP's built-in reduction (no hook: the floor), torch's ``allreduce_hook`` (what
  GradSummaries called before), and ``BucketAllreduce`` (what it calls now). The printed cost is the extra
  host time per bucket over the built-in, and the ratio of ours to allreduce_hook's.
* ``judge``: ``SpreadTracker.assess`` (the jumps, then the verdict) on one step's gathered statistics (world x buckets x 2),
  against the same rule in torch ops on CPU tensors (``deviations`` plus the non-finite test and the
  maxima: the form the tracker had before).

    python -m bench.gate_host                 # 13 buckets, world 8 statistics
    python -m bench.gate_host --buckets 40 --world 64 --rounds 20

Only the Python and dispatch part of the reduction is comparable across machines: gloo's all-reduce is not
NCCL's. The GPU numbers come from ``bench.compute_faults --overhead --profile`` (ONLY=computeprof).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from checksums.grad_checks import BucketAllreduce, SpreadTracker, deviations


def _reduce(buckets: int, rounds: int, block: int) -> dict[str, float]:
    width = 64
    layers = buckets * 4                      # four Linear(64, 64) a bucket of 0.066 MB
    x = torch.randn(4, width)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    ours = BucketAllreduce()

    def bucket_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads these names)
        return ours(bucket.buffer())

    arms: dict[str, nn.Module] = {}
    for name in ("builtin", "allreduce_hook", "BucketAllreduce"):
        ddp = DDP(model(), bucket_cap_mb=4 * width * (width + 1) * 4 / 2**20 * 1.01)
        if name == "allreduce_hook":
            ddp.register_comm_hook(None, allreduce_hook)
        elif name == "BucketAllreduce":
            ddp.register_comm_hook(None, bucket_hook)
        arms[name] = ddp
    times: dict[str, list[float]] = {n: [] for n in arms}
    for r in range(rounds + 2):
        order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
        for name in order:
            ddp = arms[name]
            t = time.perf_counter()
            for _ in range(block):
                ddp(x).sum().backward()
            if r >= 2:                              # two untimed rounds: DDP rebuilds its buckets
                times[name].append((time.perf_counter() - t) / block)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"buckets": buckets, **{f"{k}_ms": v * 1e3 for k, v in med.items()}}


def _judge(world: int, buckets: int, steps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    xs = [(1.0 + 0.01 * torch.rand(world, buckets, 2, generator=g)).double() for _ in range(steps)]

    def torch_rule(stats: torch.Tensor, spread: torch.Tensor) -> tuple[list[float], list[int]]:
        stats = stats.detach().double().cpu()
        bad = ~torch.isfinite(stats).reshape(stats.shape[0], -1).all(dim=1)
        nonfinite = [int(r) for r in torch.nonzero(bad).reshape(-1).tolist()]
        ratio = deviations(stats) / spread
        scores = ratio.reshape(stats.shape[0], -1).amax(dim=1)
        return [float(s) for s in scores], nonfinite

    tracker = SpreadTracker(warmup=5)
    spread = torch.full((buckets, 4), math.log(1.05), dtype=torch.float64)   # deviations' four columns
    for x in xs[:20]:
        tracker.assess(x)
        torch_rule(x, spread)
        torch_rule(x, spread)
    out: dict[str, list[float]] = {"numpy": [], "torch": []}
    for _ in range(5):
        t = time.perf_counter()
        for x in xs:
            tracker.assess(x)                  # the gate's every step: the jumps, then the verdict
        out["numpy"].append((time.perf_counter() - t) / len(xs))
        t = time.perf_counter()
        for x in xs:                   # jumps and judge each evaluated the rule once: twice here
            torch_rule(x, spread)
            torch_rule(x, spread)
        out["torch"].append((time.perf_counter() - t) / len(xs))
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", type=int, default=13, help="DDP buckets (GPT-2 small has 13 of 25 MB)")
    p.add_argument("--world", type=int, default=8, help="ranks in the judged statistics")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--steps", type=int, default=200, help="judged steps per timing")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    red = _reduce(args.buckets, args.rounds, args.block)
    jud = _judge(args.world, args.buckets, args.steps)
    nb = red["buckets"]
    base = red["builtin_ms"]
    extra_stock = (red["allreduce_hook_ms"] - base) / nb * 1e3
    extra_ours = (red["BucketAllreduce_ms"] - base) / nb * 1e3
    print(f"reduce, world 1 gloo, {nb} buckets, median of {args.rounds} interleaved blocks of {args.block} "
          f"steps (ms/step): built-in {base:.3f}, allreduce_hook {red['allreduce_hook_ms']:.3f}, "
          f"BucketAllreduce {red['BucketAllreduce_ms']:.3f}")
    print(f"  extra host time per bucket over the built-in: allreduce_hook {extra_stock:.1f} us, "
          f"BucketAllreduce {extra_ours:.1f} us; ratio ours/allreduce_hook "
          f"{extra_ours / extra_stock if extra_stock > 0 else float('nan'):.2f}")
    print(f"judge, world {args.world} x {args.buckets} buckets: SpreadTracker (numpy) {jud['numpy']:.1f} us a "
          f"step, the same rule in torch ops {jud['torch']:.1f} us; ratio {jud['numpy'] / jud['torch']:.2f}")
    dist.destroy_process_group()
    return {"reduce": red, "judge": jud}


if __name__ == "__main__":
    main()
