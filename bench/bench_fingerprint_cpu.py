"""CPU tensors' fingerprints: the spec's host path (numpy sums, `fingerprint_tensors_host`, what
`fingerprint_tensors_async` takes for CPU tensors) against the torch-ops path (`fingerprint_tensors_torch`,
the previous CPU path and still the path of devices without Triton), side by side in one run.

CPU ranks (gloo: the suite, the fault harness, jobs without GPUs) fingerprint every step: each gradient
bucket in the compute checks' hook, every parameter in the Monitor's vote. Cases: the fault harness's two
DDP buckets (4,420 and 1,088 fp32), its MLP's six parameters as a list, one 1M-element fp32 tensor, one
DDP default bucket (25 MB fp32), and 16 bf16 tensors of 64K elements. Each case: both paths checked equal,
then timed in alternating rounds (median of each); the ratio is torch / host (above 1: the host path is
faster).

Run: ``python -m bench.bench_fingerprint_cpu [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from checksums.fingerprint import fingerprint_tensors_host, fingerprint_tensors_torch


def _cases() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    mlp = [torch.randn(s, generator=g) for s in ((64, 16), (64,), (64, 64), (64,), (4, 64), (4,))]
    return {
        "harness bucket 4,420 fp32": [torch.randn(4420, generator=g)],
        "harness bucket 1,088 fp32": [torch.randn(1088, generator=g)],
        "MLP's 6 parameters": mlp,
        "1M fp32": [torch.randn(1 << 20, generator=g)],
        "DDP bucket 25 MB fp32": [torch.randn(25 * (1 << 20) // 4, generator=g)],
        "16 x 64K bf16": [torch.randn(1 << 16, generator=g).to(torch.bfloat16) for _ in range(16)],
    }


def _time(fn: Callable[[], object], budget_s: float = 0.05) -> float:
    """Seconds per call: calls repeated for about `budget_s`."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= budget_s:
            return dt / n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds per case (median)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'case':28} {'host us':>10} {'torch us':>10} {'torch/host':>10}")
    for name, tensors in _cases().items():
        host, dev = fingerprint_tensors_host(tensors), fingerprint_tensors_torch(tensors)
        if not (torch.equal(host[0], dev[0]) and torch.equal(host[1], dev[1])):
            raise SystemExit(f"{name}: the two paths disagree")
        h, t = [], []
        for _ in range(args.rounds):
            h.append(_time(lambda ts=tensors: fingerprint_tensors_host(ts)))
            t.append(_time(lambda ts=tensors: fingerprint_tensors_torch(ts)))
        mh, mt = statistics.median(h), statistics.median(t)
        print(f"{name:28} {mh * 1e6:10.1f} {mt * 1e6:10.1f} {mt / mh:10.2f}")


if __name__ == "__main__":
    main()
