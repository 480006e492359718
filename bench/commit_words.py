"""The rank's CPU to commit one source-checksummed shard (issue 21): the manifest rendered on the rank and sent
as JSON (`commit_shard`), against the layout sent once and the pieces' words per save, the agent rendering
(`commit_words`, checkpoint/shard_layout.py). Side by side in one run, against the real agent's checkpoint
service in a process of its own (bench/ckpt_agent_proc.py), as in production.

    python bench/commit_words.py                    # GPT-2 small's layout: 594 tensors, ~700 pieces
    python bench/commit_words.py --commits 50       # fewer

The layout is GPT-2 small with AdamW (the model's 148 tensors, exp_avg and exp_avg_sq for each, a step per
parameter) at 1/1024 of its bytes with 1/1024 of the default chunk size: the same tensors, chunks and pieces
(what rendering costs), without writing 1.65 GB a commit. The words are random: the agent's later scrub
finds the bytes do not match them, which this run does not wait for. What the background thread of a save
spends under the training process's GIL here is what it spends there for these two steps.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ckpt_overlap import Node  # noqa: E402
from bench.tiny_gpt import GPTConfig, TinyGPT  # noqa: E402
from checkpoint.agent_link import GrpcAgentLink  # noqa: E402
from checkpoint.chunks import DEFAULT_CHUNK_BYTES  # noqa: E402
from checkpoint.locations import dir_store_for  # noqa: E402
from checkpoint.shard_layout import ShardLayout  # noqa: E402
from checkpoint.snapshot import layout  # noqa: E402
from checkpoint.state_tree import dtype_name, flatten  # noqa: E402

SCALE = 1024


def gpt2_layout(job: str) -> ShardLayout:
    """GPT-2 small + AdamW's state as a rank lays it out (state_tree, snapshot.layout), every tensor 1/SCALE
    of its elements (its shape made 1-D)."""
    with torch.device("meta"):
        model = TinyGPT(GPTConfig())

    def small(p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(max(1, p.numel() // SCALE))

    params = list(model.named_parameters())
    state = {"model": {k: small(v) for k, v in model.state_dict().items()},
             "optim": {"state": {i: {"step": torch.zeros(()), "exp_avg": small(p), "exp_avg_sq": small(p)}
                                 for i, (_, p) in enumerate(params)},
                       "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                         "params": list(range(len(params)))}]}}
    tree, named = flatten(state)
    offsets, total = layout([t for _, t in named])
    entries = [(path, dtype_name(t.dtype), tuple(t.shape), off, t.numel() * t.element_size())
               for (path, t), off in zip(named, offsets)]
    return ShardLayout(job, 0, 1, total, DEFAULT_CHUNK_BYTES // SCALE, entries, tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=200, help="per mode, interleaved")
    args = ap.parse_args(argv)
    job = f"cw-{time.time_ns()}"
    layout = gpt2_layout(job)
    rng = np.random.default_rng(0)
    node = Node(layout.nbytes, "cw")
    link = GrpcAgentLink.connect(node.target, deadline_s=60)
    cpu: dict[str, list[float]] = {"json": [], "words": []}
    wall: dict[str, list[float]] = {"json": [], "words": []}
    sizes: dict[str, int] = {}
    try:
        zeros = bytes(layout.nbytes)
        step = 0
        for k in range(2 * args.commits + 4):
            mode = ("json", "words")[k % 2]
            step += 1
            begin = link.begin(job, step, 0, 1)
            dir_store_for(begin.location).put(begin.blob_key, [zeros])
            words = rng.integers(-2**62, 2**62, size=(layout.n_pieces, 2), dtype=np.int64)
            c0, w0 = time.thread_time(), time.perf_counter()
            if mode == "json":
                text = layout.render(step, begin.blob_key, words, time.time())
                res = link.commit_shard(job, step, 0, 1, text)
                sizes["json"] = len(text)
            else:
                res = link.commit_words(job, step, 0, 1, layout, words, time.time(), blob=begin.blob_key)
                sizes["words"] = 16 * layout.n_pieces
            c1, w1 = time.thread_time(), time.perf_counter()
            assert res.state in ("COMMITTED", "VERIFIED"), res
            if k >= 4:                      # the first of each: the layout sent, plans built
                cpu[mode].append(c1 - c0)
                wall[mode].append(w1 - w0)
    finally:
        link.close()
        node.close()
    print(f"\nlayout: {len(layout.entries)} tensors, {layout.n_pieces} pieces, {len(layout.plan.ranges)} chunks "
          f"(GPT-2 small + AdamW at 1/{SCALE}); {args.commits} commits a mode, interleaved; "
          + time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))
    print(f"{'mode':<44} {'CPU ms':>8} {'wall ms':>8}  sent a commit")
    for mode, name in (("json", "manifest rendered on the rank (commit_shard)"),
                       ("words", "layout once + words (commit_words)")):
        print(f"{name:<44} {1e3 * statistics.median(cpu[mode]):8.3f} {1e3 * statistics.median(wall[mode]):8.3f}"
              f"  {sizes[mode]} bytes")
    ratio = statistics.median(cpu["words"]) / statistics.median(cpu["json"])
    print(f"words / json, the rank's CPU a commit (median): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
