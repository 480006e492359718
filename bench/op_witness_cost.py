"""What the op witness's decision costs on a large matmul, the whole op against the rows that differ.

The op witness (checksums/op_witness.py) recomputes the first op where two GPUs part on rank 0's CPU in
float64 while the other rank waits in a collective. For a large model's MLP matmul that op is large: this
bench builds one (tokens x width @ width x 4 width, bf16), two "GPUs'" outputs (one with a fault: one
element x1.05, or a channel x2 where every row differs), and times `decide` side by side: the whole op
(`limit=None`, the baseline) and at most `ROWS` rows (the default). It prints both times, the ratio, both
verdicts (they must agree), and what the other rank sends rank 0 (before: its arguments and outputs; now:
a digest of its arguments and its outputs).

    PYTHONPATH=$PWD python -m bench.op_witness_cost                      # 4096 x 2048 @ 2048 x 8192
    PYTHONPATH=$PWD python -m bench.op_witness_cost --tokens 8192 --width 4096
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from checksums.op_witness import ROWS, decide, digest
from checksums.replay import witness_names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(args.tokens, args.width, generator=g).to(torch.bfloat16)
    b = (torch.randn(args.width, 4 * args.width, generator=g) / args.width ** 0.5).to(torch.bfloat16)
    func = torch.ops.aten.mm.default
    good = func(a, b)
    print(f"aten.mm bf16 [{args.tokens} x {args.width}] @ [{args.width} x {4 * args.width}], "
          f"{torch.get_num_threads()} threads")
    for name, how in (("one element x1.05", "elem"), ("channel x2", "channel")):
        bad = good.clone()
        if how == "elem":
            bad.view(-1)[12345] *= 1.05
        else:
            bad[:, 5] *= 2.0
        theirs = (digest(((a, b), {})), bad)
        times, verdicts = {}, {}
        for label, limit in (("whole op", None), (f"<= {ROWS} rows", ROWS)):
            t0 = time.perf_counter()
            t, why = decide(0, 1, func, [((a, b), {}, good), theirs], limit=limit)
            times[label] = time.perf_counter() - t0
            verdicts[label] = (witness_names(t), round(t, 3))
        before = len(pickle.dumps(((a, b), {}, bad)))
        after = len(pickle.dumps(theirs))
        (l0, s0), (l1, s1) = times.items()
        print(f"  {name:18}: {l0} {s0:7.2f} s, {l1} {s1:7.3f} s (x{s0 / s1:,.0f} faster); verdicts "
              f"{verdicts[l0]} / {verdicts[l1]}; sent to rank 0 {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
