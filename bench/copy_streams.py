"""Issue 21: does the stream a save copies on decide how fast its device-to-host copies run?

`bench/ckpt_overlap.py` part b reads every-step checkpoints at batch 16 as +0.8% or +2.2% by a mode's place
in the process, and in a slow mode a large copy ran at 49.7 GB/s against 54.7 GB/s in a fast one (ckpt22),
while `bench/pinned_placement.py` (one side stream throughout) never saw a slow copy into any buffer. Each
mode makes its streams anew, and torch hands streams out of a pool round-robin (32 a priority), each pool
stream on one of the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), each queue's
copies on one of the copy engines. This bench takes streams from the pool one after another and, per
stream, times the state's copies (GPT-2 small, 594 tensors, 1.65 GB) into one pinned buffer alone and
beside forward+backward, and one large copy's rate.

    python bench/copy_streams.py --streams 40 --repeat 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pinned_placement import copy_beside_training, copy_into, timed, training_on_gpu  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=40, help="pool streams taken one after another (default 40)")
    ap.add_argument("--high", type=int, default=4, help="then this many high-priority pool streams (default 4)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="timings per stream (median)")
    ap.add_argument("--large-mib", type=int, default=256, help="the one large copy (MiB)")
    ap.add_argument("--lead-ms", type=float, default=90.0)
    args = ap.parse_args(argv)
    if args.streams < 1 or args.high < 0 or args.repeat < 1 or args.large_mib < 1:
        ap.error("--streams, --repeat and --large-mib must be >= 1, --high >= 0")
    tr = training_on_gpu(args.batch, args.lead_ms)
    if tr is None:
        return 2
    dev = torch.device("cuda")
    fwd_bwd, srcs, nbytes, main_s, cycles = tr.fwd_bwd, tr.srcs, tr.nbytes, tr.main_s, tr.cycles
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    big = torch.empty(args.large_mib << 20, dtype=torch.uint8, device=dev)
    big_host = torch.empty_like(big, device="cpu", pin_memory=True)
    copy = copy_into(srcs, buf)
    _, lo_prio = torch.cuda.Stream.priority_range()   # (least, greatest): lo_prio is the high priority
    kinds = [0] * args.streams + [lo_prio] * args.high
    print(f"{'#':>3} {'prio':>4} {'stream_id':>10} {'copy ms':>8} {'GB/s':>6} {'large GB/s':>10} {'f+b ms':>7} "
          f"{'f+b+copy':>9} {'slower':>7} {'cp beside':>9}")
    rates = []
    for i, prio in enumerate(kinds):
        side = torch.cuda.Stream(priority=prio)
        large = statistics.median(timed(lambda: big_host.copy_(big, non_blocking=True), side)
                                  for _ in range(args.repeat))
        cp, fb, both, cpb = copy_beside_training(copy, fwd_bwd, side, main_s, cycles, args.repeat)
        gbs = big.numel() / large / 1e6
        rates.append(gbs)
        print(f"{i:>3} {prio:>4} {side.stream_id:>10} {cp:>8.2f} {nbytes / cp / 1e6:>6.1f} {gbs:>10.1f} "
              f"{fb:>7.2f} {both:>9.2f} {both - fb:>+7.2f} {cpb:>9.2f}", flush=True)
    print(f"large copy rate over {len(rates)} streams: {min(rates):.1f}-{max(rates):.1f} GB/s "
          f"(median {statistics.median(rates):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
