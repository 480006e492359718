"""Fingerprint bandwidth on CUDA against a plain bf16 ``sum`` of the same bytes, measured in the same run.

Cases: (a) one 4 GB bf16 tensor; (b) a Llama-3-8B tensor-parallel-8 shard's parameters (291 tensors, 8 KB
norms to 131 MB embedding shards, 2.0 GB); (c) GPT-2 small's 148 parameters (249 MB in bf16).

Columns: the fused Triton fingerprint through a prepared plan (``prepare_fingerprint``) and through the
cached public call (``fingerprint_tensors_async``); baselines: ``sum`` of one flat bf16 tensor of the same
byte count (single pass, the bandwidth reference), ``sum`` of each tensor (one launch each), and the naive
fingerprint (int16 view, int64 sum, one call per tensor). Times are medians over batches of back-to-back
calls between CUDA events, after warm-up; every case is larger than the 60 MB L2.

Run: ``python bench/bench_fingerprint.py [--sweep] [--quick]``; writes a log under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checksums.fingerprint import (  # noqa: E402
    fingerprint_list_from_parts,
    fingerprint_tensors_async,
    fingerprint_tensors_torch,
    fingerprint_words_to_ints,
    prepare_fingerprint,
)
from checksums.fingerprint_triton import TritonFingerprintPlan  # noqa: E402

LINES: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def gpu_time(fn: Callable[[], object], target_ms: float = 25.0, outer: int = 15) -> float:
    """Median seconds per call over batches of back-to-back calls timed with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(200, int(target_ms / 1e3 / one)))
    times = []
    for _ in range(outer):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Host microseconds to enqueue one call (GPU kept busy so launches do not block)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def llama3_8b_tp8_shapes() -> list[tuple[int, ...]]:
    hidden, inter, vocab, kv, tp = 4096, 14336, 128256, 1024, 8
    shapes: list[tuple[int, ...]] = [(vocab // tp, hidden)]
    for _ in range(32):
        shapes += [(hidden,), (hidden // tp, hidden), (kv // tp, hidden), (kv // tp, hidden), (hidden, hidden // tp),
                   (hidden,), (inter // tp, hidden), (inter // tp, hidden), (hidden, inter // tp)]
    shapes += [(hidden,), (vocab // tp, hidden)]
    return shapes


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    d, v, ctx = 768, 50257, 1024
    shapes: list[tuple[int, ...]] = [(v, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def make(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.empty(s, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1) for s in shapes]


def check(tensors: list[torch.Tensor], name: str, host_check: bool) -> bool:
    fused = fingerprint_words_to_ints(fingerprint_tensors_async(tensors))
    ref_words, ref_per = fingerprint_tensors_torch(tensors)
    ok = fused == fingerprint_words_to_ints(ref_words)
    if host_check:
        from checksums.fingerprint import fingerprint_bytes

        parts = [fingerprint_bytes(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes(), "bfloat16",
                                   tuple(t.shape)) for t in tensors]
        ok = ok and fused == fingerprint_list_from_parts(parts)
    say(f"check {name}: fused == torch{' == numpy' if host_check else ''}: {ok}")
    return ok


def run_case(name: str, tensors: list[torch.Tensor], sweep: list[tuple[int, int]]) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    res: dict = {"case": name, "tensors": len(tensors), "bytes": nbytes}
    res["sum_flat"] = gpu_time(lambda: flat.sum())
    res["sum_each"] = gpu_time(lambda: [t.sum() for t in tensors])
    res["naive"] = gpu_time(lambda: [t.view(torch.int16).sum(dtype=torch.int64) for t in tensors])
    plan = prepare_fingerprint(tensors)
    res["fused_plan"] = gpu_time(plan.run_async)
    res["fused_api"] = gpu_time(lambda: fingerprint_tensors_async(tensors))
    res["host_us_plan"] = host_us(plan.run_async)
    res["host_us_api"] = host_us(lambda: fingerprint_tensors_async(tensors))
    res["items"] = plan.n_items
    ref = fingerprint_words_to_ints(plan.run_async())
    for block, warps, per_sm in sweep:
        p = TritonFingerprintPlan(tensors, block=block, num_warps=warps, items_per_sm=per_sm)
        same = fingerprint_words_to_ints(p.run_async()) == ref
        t = gpu_time(p.run_async)
        res[f"sweep_{block}x{warps}x{per_sm}"] = t
        say(f"  sweep {name} BLOCK={block} warps={warps} items/SM={per_sm} ({p.n_items} items): {t * 1e6:9.1f} us {nbytes / t / 1e12:6.3f} TB/s "
            f"same_words={same}")
    del flat
    tb = nbytes / res["fused_plan"] / 1e12
    say(f"{name}: {len(tensors)} tensors {nbytes / 1e6:.1f} MB items={plan.n_items} fused {res['fused_plan'] * 1e6:.1f} us "
        f"({tb:.3f} TB/s) api {res['fused_api'] * 1e6:.1f} us; sum_flat {res['sum_flat'] * 1e6:.1f} us; sum_each "
        f"{res['sum_each'] * 1e6:.1f} us; naive {res['naive'] * 1e6:.1f} us; host enqueue plan "
        f"{res['host_us_plan']:.1f} us api {res['host_us_api']:.1f} us")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other BLOCK x num_warps choices")
    ap.add_argument("--quick", action="store_true", help="1 GB instead of 4 GB for case (a)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    sweep = ([(1024, 4, 16), (2048, 8, 16), (4096, 8, 16), (2048, 8, 4), (2048, 8, 8), (2048, 8, 32), (2048, 8, 64),
              (1024, 4, 32), (4096, 16, 16)] if args.sweep else [])
    props = torch.cuda.get_device_properties(0)
    import triton

    say(f"device {props.name} SMs={props.multi_processor_count} torch {torch.__version__} triton {triton.__version__}"
        f" date {time.strftime('%Y-%m-%d %H:%M')}")
    results = []
    c = make(gpt2_small_shapes())
    check(c, "c", host_check=True)
    results.append(run_case("(c) gpt2-small 148", c, sweep))
    del c
    b = make(llama3_8b_tp8_shapes())
    check(b, "b", host_check=False)
    results.append(run_case("(b) llama3-8b tp8 shard", b, sweep))
    del b
    numel = (1 << 29) if args.quick else (1 << 31)
    a = [torch.empty(numel, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)]
    check(a, "a", host_check=False)
    results.append(run_case("(a) one bf16 tensor", a, sweep))
    del a
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_fingerprint.json").write_text(json.dumps(results, indent=1))
    say("")
    say(f"{'case':26} {'tensors':>7} {'MB':>8} {'fp us':>9} {'TB/s':>6} {'sum TB/s':>8} {'vs sum':>6} "
        f"{'vs sum_each':>11} {'vs naive':>8}")
    for r in results:
        mb, t = r["bytes"] / 1e6, r["fused_plan"]
        say(f"{r['case']:26} {r['tensors']:7d} {mb:8.1f} {t * 1e6:9.1f} {r['bytes'] / t / 1e12:6.3f} "
            f"{r['bytes'] / r['sum_flat'] / 1e12:8.3f} {r['sum_flat'] / t:6.3f} {r['sum_each'] / t:11.2f} "
            f"{r['naive'] / t:8.2f}")
    if out:
        Path(out, "bench_fingerprint.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
