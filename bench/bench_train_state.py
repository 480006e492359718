"""The cost of the non-tensor part of a training state on the save path (issue 21 item 2), side by side.

    python bench/bench_train_state.py            # GPT-2-small-shaped state (148 parameters), CPU
    python bench/bench_train_state.py --smoke    # fewer repeats, for the test suite (no claims)

What `save` does with a state before any copy is `checkpoint.state_tree.flatten`: walk the state dict, list
its tensors, and now encode every non-tensor part (plain values as JSON, bytes raw) into small uint8 tensors.
Measured on the host, no copy (tensor sizes do not matter to the walk, so the parameters are tiny tensors of
GPT-2 small's count and names), interleaved in shuffled order, median of --repeats:
  baseline   flatten of {"model", "optim": {"state"}} only: tensors, no values;
  state      flatten of the whole training state: model, torch's AdamW state_dict (param_groups with 148
             param ids), StepLR, a loader state, a 64 KiB BytesIO (torchtitan-style);
  dcp        the same state's non-tensor DCP items encoded as `SdcwStorageWriter.write_data` does
             (`plain_values.encode_item` per item: DCP flattens param groups into one item per key).
Prints times and the ratio to the baseline, and the bytes the values add to the shard.
"""
from __future__ import annotations

import argparse
import io
import random
import statistics
import time

import torch


def gpt2_small_shaped() -> torch.nn.Module:
    layers = []
    for _ in range(12):
        layers += [torch.nn.LayerNorm(4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                   torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    return torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Embedding(8, 4), *layers, torch.nn.LayerNorm(4))


def states() -> tuple[dict, dict]:
    model = gpt2_small_shaped()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    sched.step()
    osd = opt.state_dict()
    base = {"model": model.state_dict(), "optim": {"state": osd["state"]}}
    full = {"model": model.state_dict(), "optim": osd, "sched": sched.state_dict(),
            "loader": {"epoch": 1, "pos": 123456, "seed": 1234, "order": (3, 1, 2)},
            "train": {"losses": io.BytesIO(bytes(64 << 10)), "step": 1}}
    return base, full


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.smoke else args.repeats

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from checkpoint.plain_values import encode_item
    from checkpoint.state_tree import flatten

    base, full = states()
    planner = DefaultSavePlanner()
    planner.set_up_planner(full, None, True)
    items = [i for i in planner.create_local_plan().items if i.type == WriteItemType.BYTE_IO]

    def dcp_encode() -> list:
        return [encode_item(planner.lookup_object(i.index), i.index.fqn) for i in items]

    runs = {"baseline": lambda: flatten(base), "state": lambda: flatten(full), "dcp": dcp_encode}
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for _ in range(repeats):   # interleaved, in a new order each round (a fixed order lets GC land on one)
        random.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    _, named_base = flatten(base)
    _, named_full = flatten(full)
    values = [t for p, t in named_full if t.dtype == torch.uint8 and t.dim() == 1 and p not in dict(named_base)]
    value_bytes = sum(t.numel() for t in values)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"{'what':<10} {'median us':>10} {'x baseline':>11}")
    for k, v in med.items():
        print(f"{k:<10} {v:>10.1f} {v / med['baseline']:>11.2f}")
    print(f"values: {len(values)} entries, {value_bytes} bytes in the shard (BytesIO 65536 of them); "
          f"DCP items: {len(items)}, {sum(len(p) for _, p in dcp_encode())} bytes")


if __name__ == "__main__":
    main()
