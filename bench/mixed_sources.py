"""The compute checks' statistics where the ranks' batches differ in kind (issue 19): false suspicions in clean
steps, and the faults caught on their step with `deviations`' plain columns alone against all four.

    python -m bench.mixed_sources [--data mixed|padded|packed] [--clean 400] [--per-fault 20]

Three ranks of a tiny GPT (2 blocks, width 64, byte vocabulary: 7 DDP-sized buckets) in one process, each
with its own batch of text-like tokens (16 topics, each a sparse Markov chain with Zipf-like next-token
preferences). `--data mixed`: each rank's batch on each step comes from one source: long documents filling
the 64-token rows (60%), short chat-like ones of 5-20 tokens padded (38%), or 2-3 tokens (2%); the loss is
over the real tokens only. `padded`: documents of lognormal lengths, padded; `packed`: full rows. A rank's
gradient is the same code as the hook's on the CPU (`bucket_stats`), judged by the gate's `SpreadTracker`
(warm-up 20, margin 3) every step; the mean gradient is applied with AdamW.

After the clean steps, a fault on rank 1's first block's MLP output in the forward (an element set to a
value, an output channel scaled, the whole output scaled) on `--per-fault` steps each (every faulty step is
judged, then a clean step trained, so the spread is the clean run's): the share caught on its step when the
score uses the plain distance from the other ranks (columns norm, maxabs: the rule before 2026-12-06) and
when it also uses the distance relative to the rank's own buckets (all four: the rule now)."""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.compute_faults import ddp_buckets
from checksums.grad_checks import SpreadTracker, bucket_stats, deviations
from demo.model import GPT, GPTConfig

WORLD, BATCH, CONTEXT, VOCAB = 3, 8, 64, 256
FAULTS = [("element =", 1e2), ("element =", 1e4), ("channel x", 5.0), ("channel x", 20.0),
          ("channel x", 100.0), ("whole x", 1.5), ("whole x", 3.0), ("whole x", 10.0)]


class Sources:
    """Per-rank batches of text-like tokens (see the module docstring)."""

    def __init__(self, data: str, seed: int = 1) -> None:
        self.data, self.rng = data, np.random.default_rng(seed)
        chains = []
        for _ in range(16):
            m = self.rng.zipf(1.5, size=(VOCAB, VOCAB)).astype(np.float64)
            m = m * (self.rng.random((VOCAB, VOCAB)) < 0.05) + 1e-3
            chains.append(np.cumsum(m / m.sum(1, keepdims=True), 1))
        self.chains = chains

    def _document(self, n: int) -> np.ndarray:
        chain = self.chains[self.rng.integers(len(self.chains))]
        x = np.empty(n + 1, np.int64)
        x[0] = self.rng.integers(VOCAB)
        for i, u in enumerate(self.rng.random(n)):
            x[i + 1] = min(int(np.searchsorted(chain[x[i]], u)), VOCAB - 1)
        return x

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = np.zeros((BATCH, CONTEXT), np.int64), np.full((BATCH, CONTEXT), -100, np.int64)
        source = self.rng.random()
        for b in range(BATCH):
            if self.data == "packed":
                n = CONTEXT
            elif self.data == "padded":
                n = int(min(CONTEXT, max(2, self.rng.lognormal(3.0, 0.9))))
            else:
                n = (CONTEXT if source < 0.6 else int(self.rng.integers(5, 21)) if source < 0.98
                     else int(self.rng.integers(2, 4)))
            d = self._document(n)
            xs[b, :n], ys[b, :n] = d[:-1], d[1:]
        return torch.from_numpy(xs), torch.from_numpy(ys)


def run(data: str, clean: int, per_fault: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, context=CONTEXT, layers=2, heads=4, width=64))
    params = list(model.parameters())
    buckets = ddp_buckets(params, 25_000 / 2**20)     # 7 buckets of the tiny GPT
    opt = torch.optim.AdamW(params, lr=3e-4)
    sources = Sources(data)
    fault: dict[str, Any] = {"now": None}

    def corrupt(_mod: Any, _inp: Any, out: torch.Tensor) -> torch.Tensor:
        if fault["now"] is None:
            return out
        kind, value = fault["now"]
        out = out.clone()
        if kind == "element =":
            out[0, 3, 5] = value
        elif kind == "channel x":
            out[..., 7] *= value
        else:
            out *= value
        return out

    model.blocks[0].fc.register_forward_hook(corrupt)

    def grads(faulty: Any = None) -> list[tuple[torch.Tensor, ...]]:
        out = []
        for rank in range(WORLD):
            x, y = sources.batch()
            fault["now"] = faulty if rank == 1 else None
            logits, _ = model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
            out.append(torch.autograd.grad(loss, params))
        fault["now"] = None
        return out

    def stats(gs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        rows = []
        for g in gs:
            by = dict(zip(params, g))
            rows.append(torch.stack([bucket_stats([torch.cat([by[p].reshape(-1) for p in b])]) for b in buckets]))
        return torch.stack(rows)

    def train(gs: list[tuple[torch.Tensor, ...]]) -> None:
        for p, *g in zip(params, *gs):
            p.grad = torch.stack(g).mean(0)
        opt.step()

    tracker = SpreadTracker()
    suspicions = []
    for step in range(tracker.warmup + clean):
        gs = grads()
        if tracker.judge(stats(gs)).suspects:
            suspicions.append(step)
        train(gs)
    assert tracker.spread is not None             # learnt in the warm-up
    caught = {}
    for kind, value in FAULTS:
        plain = both = 0
        for _ in range(per_fault):
            ratio = (deviations(stats(grads((kind, value))))[1] / tracker.spread).numpy()   # rank 1's
            plain += int(ratio[:, :2].max() > tracker.margin)
            both += int(ratio.max() > tracker.margin)
            gs = grads()
            if tracker.judge(stats(gs)).suspects:
                suspicions.append(-1)
            train(gs)
        caught[f"{kind}{value:g}"] = (plain, both)
    spread = tracker.spread.numpy()
    return {"data": data, "buckets": len(buckets), "clean": clean + len(FAULTS) * per_fault,
            "suspicions": len(suspicions), "max_score_clean": tracker.max_score_clean,
            "spread_plain": [float(spread[:, :2].min()), float(spread[:, :2].max())],
            "spread_relative": [float(spread[:, 2:].min()), float(spread[:, 2:].max())],
            "caught": caught, "per_fault": per_fault}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=["mixed", "padded", "packed"], default="mixed")
    p.add_argument("--clean", type=int, default=400, help="clean steps after the warm-up")
    p.add_argument("--per-fault", type=int, default=20, help="faulty steps per fault")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    r = run(args.data, args.clean, args.per_fault)
    print(f"{r['data']} data, {WORLD} ranks, {r['buckets']} buckets: {r['clean']} clean steps judged, "
          f"{r['suspicions']} suspicions, largest clean score {r['max_score_clean']:.2f} of margin 3")
    print(f"clean spread (log units), plain columns {r['spread_plain'][0]:.2f}-{r['spread_plain'][1]:.2f}, "
          f"relative columns {r['spread_relative'][0]:.2f}-{r['spread_relative'][1]:.2f}")
    print(f"{'fault on rank 1 (block 0 MLP output)':38s} caught on its step: plain columns / all four")
    for name, (plain, both) in r["caught"].items():
        print(f"  {name:36s} {plain:3d}/{r['per_fault']} {both:8d}/{r['per_fault']}")
    return r


if __name__ == "__main__":
    main()
