"""Canary benchmark (CUDA): suite wall time per GPU, canary GEMM TFLOP/s vs a plain bf16 matmul, in-job overhead.

    python bench/bench_canary.py [--gpus 0,1] [--steps 200]

Prints a short table last. Measured side by side in the same run: the plain bf16 8192^3 `torch.mm`
(the baseline) and the canary's large known-answer GEMMs; a GPT-2-small-like training step with and
without `InJobCanary` (bench/tiny_gpt.py when present, else 12 blocks of Linear layers of that size).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from checksums import canary_gemm as cg  # noqa: E402
from sdcwatch import canary as sc  # noqa: E402
from sdcwatch.canary import DeviceInfo, Status  # noqa: E402
from probes import canary_suite as cs  # noqa: E402


def plain_bf16_tflops(dev: torch.device, n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize(dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        torch.mm(a, b)
    e.record()
    e.synchronize()
    return 2 * n ** 3 / (s.elapsed_time(e) / 1e3 / reps) / 1e12


def canary_tflops(dev: DeviceInfo, dtype: str, n: int = 8192, reps: int = 20) -> float:
    spec = cg.KnownAnswerSpec(dtype, n, n, n, shape_name="large")
    r = cg.run_known_answer(spec, dev, repeats=reps)
    if r.status is not Status.PASS:
        print(f"  {spec.name}: {r.status.value} {r.why}")
    return r.tflops or 0.0


def _step_fn(dev: torch.device) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], str]:
    """A GPT-2-small training step: bench/tiny_gpt.TinyGPT (batch 8 x 1024 tokens), else Linear stacks."""
    try:
        from bench.tiny_gpt import GPTConfig, TinyGPT

        model = TinyGPT(GPTConfig()).to(dev)
        idx = torch.randint(0, 50257, (8, 1024), device=dev)
        return model, lambda m: m(idx, idx), "bench/tiny_gpt.py GPT-2 small, batch 8x1024"
    except Exception as exc:  # tiny_gpt missing or changed: a plain stack of that size
        layers: list[torch.nn.Module] = []
        for _ in range(12):
            layers += [torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768)]
        model = torch.nn.Sequential(*layers).to(dev)
        x = torch.randn(8 * 1024, 768, device=dev)
        return model, lambda m: m(x).float().pow(2).mean(), f"Linear stack (tiny_gpt unavailable: {exc})"


def train_steps(dev: torch.device, steps: int, canary: object | None) -> tuple[float, str]:
    model, loss_fn, what = _step_fn(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    last = 0.0
    for s in range(steps + 10):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if canary is not None:
            canary.maybe_run(s, last)  # type: ignore[attr-defined]
        torch.cuda.synchronize(dev)    # the benchmark's own timing sync, not the canary's
        last = time.perf_counter() - t0
        if s >= 10:
            times.append(last)
    times.sort()
    trim = len(times) // 10
    kept = times[trim: len(times) - trim] or times
    return sum(kept) / len(kept), what


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default=None)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_canary: needs CUDA")
        return 2
    gpus = [int(x) for x in args.gpus.split(",")] if args.gpus else None
    devs, _ = cs.discover_devices(gpus)
    rows = []
    for level in ("quick", "full"):
        t0 = time.perf_counter()
        rep = cs.run_suite(devs, sc.SuiteConfig(level=level))
        wall = time.perf_counter() - t0
        bad = [(r.name, r.status.value, r.why) for r in rep.results if r.status is not Status.PASS]
        rows.append((f"{level} suite wall time per GPU", f"{wall / len(devs):.2f} s",
                     f"{rep.status.value}, {len(rep.results)} checks, {len(devs)} GPU(s)"))
        for b in bad[:10]:
            print("  not PASS:", b)
    dev = devs[0]
    base = plain_bf16_tflops(torch.device(dev.device))
    rows.append(("plain bf16 8192^3 torch.mm", f"{base:.0f} TFLOP/s", "baseline"))
    for dt in ("bf16", "fp16", "fp8_e4m3", "tf32"):
        if dt in cg.supported_dtypes(torch.device(dev.device))[0]:
            t = canary_tflops(dev, dt)
            rows.append((f"canary {dt} 8192^3 known-answer", f"{t:.0f} TFLOP/s", f"{t / base:.0%} of plain bf16"))
    from checksums.canary_budget import InJobBudget
    from checksums.canary_injob import InJobCanary

    plain, what = train_steps(torch.device(dev.device), args.steps, None)
    canary = InJobCanary(torch.device(dev.device), budget=InJobBudget(budget_fraction=0.005, warmup_steps=5,
                                                               min_steps_between=1))
    with_c, _ = train_steps(torch.device(dev.device), args.steps, canary)
    rows.append(("GPT-2-small training step", f"{plain * 1e3:.1f} ms", f"no canary; {what}"))
    rows.append(("  with InJobCanary (budget 0.5%)", f"{with_c * 1e3:.1f} ms",
                 f"{(with_c / plain - 1):+.2%} measured; canary's own accounted share "
                 f"{canary.overhead_fraction:.3%}, {canary.runs} runs, {canary.failures} failures"))
    w = max(len(r[0]) for r in rows)
    print("\n| measurement | value | note |\n|---|---|---|")
    for name, val, note in rows:
        print(f"| {name.ljust(w)} | {val} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
