"""The pre-reduction gradient summary of one bucket (issue 19): the fused Triton kernel against today's torch
path and against a plain read of the same bytes, measured side by side in one run.

For each bucket size and dtype (DDP's flat bucket buffer: one contiguous tensor), columns:

* ``fused``: `checksums.grad_summary_triton.GradSummaryPlan.run_async` with ``one_launch=False`` (one read
  of the buffer, 2 launches);
* ``fused1``: the same, one launch (the default: the last work item reduces the partials; its rows
  are checked equal to the two-launch rows over 100 back-to-back runs);
* ``torch``: `checksums.grad_checks.bucket_summary_torch` with a prepared fingerprint plan, as the DDP hook
  ran it before (vector_norm, abs + amax, stack/cat, the Triton fingerprint: about five passes);
* ``read``: ``buf.sum(dtype=torch.float32)``, one plain read of the bytes (the floor for any summary);
* ``copy``: ``dst.copy_(buf)`` (reads and writes the bytes: twice the traffic of a read);
* ``scaled``: the one-launch summary that also scales the buffer by 1/world in place (GradSummaries at world
  size > 1: DDP's pre-reduction scaling in the same pass); ``+mul_``: the summary, then ``buf.mul_`` (a
  second pass, what the hook did before).

Times are medians over batches of back-to-back calls between CUDA events, after warm-up; each call takes the
next of several buffers of the size (together more than twice the 60 MB L2 of an H200), so the bytes come
from HBM as they would in training. Also: host microseconds to enqueue one call, and the rows checked
(fingerprint words equal, statistics to float rounding). The last lines project the fused summary onto a
GPT-2-small step (124.4M parameters, DDP's 25 MB buckets) against the issue's target, 0.2% of 66 ms.

    python -m bench.bench_grad_summary --device cuda                 # 1, 25, 100, 500 MB; bf16 and fp32
    python -m bench.bench_grad_summary --device cpu                  # tiny sizes, the kernel interpreted
    python -m bench.bench_grad_summary --device cuda --sizes 25 --dtypes bf16 --json out.json
    python -m bench.bench_grad_summary --device cuda --sweep --json sweep.json   # the fastest launch config

``--sweep`` runs bench/grad_summary_sweep.py instead (its docstring says what it times): every BLOCK x
num_warps x items/SM x one-launch choice on 25 and 40 MB buckets, then the GPT-2 step's 13 buckets for the
default and the best three, then the SDCWATCH_GS_* settings that select the fastest; within
``--sweep-budget`` seconds (default 100; about 20 s more for the start and the GPT-2 step).

On the CPU the kernel runs under TRITON_INTERPRET=1 (set here before triton loads): the numbers only show
that everything runs; the ratios mean nothing there.
"""

from __future__ import annotations

import os
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is first imported

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from checksums.fingerprint import prepare_fingerprint
from checksums.grad_checks import bucket_summary_torch, stats_of
from checksums.grad_summary_triton import GradSummaryPlan

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
GPT2_PARAMS = 124_439_808          # GPT-2 small (tied embeddings)
STEP_S, TARGET = 0.066, 0.002      # the H200 DDP step of issue 19, and 0.2% of it
L2_BYTES = 60 << 20


def timed(fn: Callable[[int], object], device: torch.device, target_s: float = 0.02,
          outer: int = 11) -> float:
    """Median seconds per call of fn(i) (i: the call's index, to rotate buffers)."""
    if device.type != "cuda":
        fn(0)
        ts = []
        for i in range(3):
            t0 = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    inner = max(4, min(400, int(target_s / one)))
    times = []
    for _ in range(outer):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(inner):
            fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def host_us(fn: Callable[[int], object], device: torch.device, n: int = 200) -> float:
    """Host microseconds to enqueue one call (CUDA: launches are asynchronous)."""
    if device.type != "cuda":
        return float("nan")
    fn(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def run_case(mb: float, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    es = torch.empty(0, dtype=dtype).element_size()
    numel = max(1, int(mb * 1e6) // es) + 3          # an odd tail, like a real bucket's end
    nbytes = numel * es
    nbuf = max(1, math.ceil(2.2 * L2_BYTES / nbytes)) if device.type == "cuda" else 1
    bufs = [(torch.randn(numel, generator=gen, device=device) * 1e-3).to(dtype) for _ in range(nbuf)]
    dst = torch.empty_like(bufs[0])
    plan = GradSummaryPlan(bufs[0], one_launch=False)
    fplans = [prepare_fingerprint([b]) for b in bufs] if device.type == "cuda" else [None] * nbuf
    res: dict = {"dtype": str(dtype).replace("torch.", ""), "mb": nbytes / 1e6, "buffers": nbuf,
                 "items": plan.n_items}
    # the rows agree: fingerprint exactly, statistics to float rounding; and the fused row repeats exactly
    fused_row, torch_row = plan.run_async(bufs[0]), bucket_summary_torch([bufs[0]], fplans[0])
    fs, ts = stats_of(fused_row.cpu()).tolist(), stats_of(torch_row.cpu()).tolist()
    res["fp_equal"] = torch.equal(fused_row[2:].cpu(), torch_row[2:].cpu())
    res["norm_rel"] = abs(fs[0] - ts[0]) / max(ts[0], 1e-300)
    res["amax_equal"] = fs[1] == ts[1]
    res["repeat_equal"] = torch.equal(plan.run_async(bufs[0]).cpu(), fused_row.cpu())
    plan1 = GradSummaryPlan(bufs[0], one_launch=True)
    reps = 100 if device.type == "cuda" else 2
    rows1 = torch.stack([plan1.run_async(bufs[0]) for _ in range(reps)])
    res["one_launch_equal"] = torch.equal(rows1.cpu(), fused_row.cpu().expand(reps, -1))

    def fused(i: int) -> object:
        return plan.run_async(bufs[i % nbuf])

    def fused1(i: int) -> object:
        return plan1.run_async(bufs[i % nbuf])

    def torch_path(i: int) -> object:
        return bucket_summary_torch([bufs[i % nbuf]], fplans[i % nbuf])

    def read(i: int) -> object:
        return bufs[i % nbuf].sum(dtype=torch.float32)

    def copy(i: int) -> object:
        return dst.copy_(bufs[i % nbuf])

    # DDP at world size > 1 scales each bucket by 1/world before the sum: in the summary's own pass
    # (`scaled`: one launch, the buffer read once and written once) against the summary then torch's mul_
    # (`then_mul`: what a separate scaling pass costs). Both change the buffers: timed last
    def scaled(i: int) -> object:
        return plan1.launch(bufs[i % nbuf], scale=0.5)

    def then_mul(i: int) -> object:
        row = plan1.run_async(bufs[i % nbuf])
        bufs[i % nbuf].mul_(0.5)
        return row

    for name, fn in (("fused", fused), ("fused1", fused1), ("torch", torch_path), ("read", read),
                     ("copy", copy), ("scaled", scaled), ("then_mul", then_mul)):
        res[name + "_s"] = timed(fn, device)
    res["fused_host_us"] = host_us(fused, device)
    res["fused1_host_us"] = host_us(fused1, device)
    res["torch_host_us"] = host_us(torch_path, device)
    return res


def _ok(r: dict) -> bool:
    """The fused row agrees with the torch path's, repeats exactly, and the one-launch form gives it too."""
    return (r["fp_equal"] and r["amax_equal"] and r["repeat_equal"] and r["one_launch_equal"]
            and r["norm_rel"] < 1e-4)


def main(argv: list[str] | None = None) -> list[dict] | dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--sizes", default="", help="bucket sizes in MB, comma-separated (default: cuda "
                   "1,25,100,500; cpu 0.001,0.01,0.05)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32, fp16")
    p.add_argument("--sweep", action="store_true", help="instead: find the fastest BLOCK x num_warps x "
                   "items/SM x one-launch choice (bench/grad_summary_sweep.py; SDCWATCH_GS_BLOCK, _WARPS, "
                   "_ITEMS_PER_SM, _ONE_LAUNCH set the defaults); --sizes default 25,40 there")
    p.add_argument("--sweep-budget", type=float, default=100.0, metavar="SECONDS",
                   help="--sweep: skip (and count) the combinations left after this long (default 100)")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu for the interpreted kernel)")
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",")]
    import triton

    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
    where = (f"{torch.cuda.get_device_name(device)} SMs={sms}" if cuda
             else "CPU, TRITON_INTERPRET=1 (timings meaningless)")
    print(f"bench_grad_summary: {where}; torch {torch.__version__} triton {triton.__version__} "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC", flush=True)
    if args.sweep:
        from bench.grad_summary_sweep import run_sweep   # it imports this module's constants

        return run_sweep(device, dtypes, [float(s) for s in args.sizes.split(",")] if args.sizes else None,
                         args.sweep_budget, args.json)
    sizes = [float(s) for s in (args.sizes or ("1,25,100,500" if device.type == "cuda"
                                               else "0.001,0.01,0.05")).split(",")]
    gen = torch.Generator(device=device).manual_seed(19)
    results = [run_case(mb, dt, device, gen) for dt in dtypes for mb in sizes]
    print(f"{'dtype':9} {'MB':>8} {'items':>6} {'fused us':>9} {'fused1 us':>9} {'torch us':>9} "
          f"{'read us':>9} {'copy us':>9} "
          f"{'scaled us':>9} {'+mul_ us':>9} "
          f"{'fused TB/s':>10} {'fused/read':>10} {'torch/fused':>11} {'host us f/f1/t':>16}  check")
    for r in results:
        tbs = r["mb"] * 1e6 / r["fused_s"] / 1e12
        ok = _ok(r)
        us = {k: r[k + "_s"] * 1e6 for k in ("fused", "fused1", "torch", "read", "copy", "scaled", "then_mul")}
        print(f"{r['dtype']:9} {r['mb']:8.3f} {r['items']:6d} {us['fused']:9.1f} {us['fused1']:9.1f} "
              f"{us['torch']:9.1f} "
              f"{us['read']:9.1f} {us['copy']:9.1f} {us['scaled']:9.1f} {us['then_mul']:9.1f} "
              f"{tbs:10.3f} {r['fused_s'] / r['read_s']:10.3f} "
              f"{r['torch_s'] / r['fused_s']:11.2f} "
              f"{r['fused_host_us']:5.1f}/{r['fused1_host_us']:.1f}/{r['torch_host_us']:<6.1f}  "
              f"{'ok' if ok else 'MISMATCH'} (norm rel {r['norm_rel']:.1e})")
    # GPT-2 small under DDP: ~25 MB buckets; project the per-byte cost of the 25 MB case (or the nearest)
    kinds = dict.fromkeys(x["dtype"] for x in results) if cuda else {}
    for r in [min((x for x in results if x["dtype"] == d), key=lambda x: abs(x["mb"] - 25.0)) for d in kinds]:
        es = torch.empty(0, dtype=getattr(torch, r["dtype"])).element_size()
        total = GPT2_PARAMS * es
        fused_s = r["fused_s"] * total / (r["mb"] * 1e6)
        torch_s = r["torch_s"] * total / (r["mb"] * 1e6)
        print(f"GPT-2 small gradient in {r['dtype']} ({total / 1e6:.0f} MB, from the {r['mb']:.1f} MB case): "
              f"fused {fused_s * 1e3:.3f} ms = {fused_s / STEP_S * 100:.3f}% of a {STEP_S * 1e3:.0f} ms step "
              f"(target "
              f"{TARGET * 100:.1f}%: {'met' if fused_s <= TARGET * STEP_S else 'NOT met'}); torch path "
              f"{torch_s * 1e3:.3f} ms = {torch_s / STEP_S * 100:.3f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if not _ok(r)]
    if bad:
        raise SystemExit(f"{len(bad)} case(s) where the fused row disagrees with the torch path")
    return results


if __name__ == "__main__":
    main()
