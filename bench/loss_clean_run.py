"""A clean training run from scratch through the loss detector: no event may come out (issue 22: the agent
warned about grad-norm spikes at steps 10 and 15 of clean GPU runs, during warm-up).

    python -m bench.loss_clean_run [--device cuda] [--steps 600] [--layers 12 --width 768 --seq 1024 --batch 8]

Trains `bench/tiny_gpt.py`'s GPT from scratch (AdamW, linear LR warm-up then cosine, grad clipping at 1.0)
on a learnable synthetic token stream (each token a fixed function of the previous one, 10% noise), feeds
each step's loss and gradient norm (the one `clip_grad_norm_` returns) to `probes.loss_detector` with its
defaults, prints every event, then one summary line. Exit 1 if any event (warning or critical) was raised.
The CPU test runs a small model (tests/test_loss_clean_run.py); the H200 runs GPT-2 small.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from bench.tiny_gpt import GPTConfig, TinyGPT
from probes.loss_detector import LossDetector
from sdcwatch.types import Severity


def batches(vocab: int, batch: int, seq: int, device: str, seed: int = 0):
    """An endless stream of (input, target) batches: token i+1 = (7 * token i + 3) % vocab, 10% random."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    while True:
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for i in range(seq):
            x[:, i + 1] = (7 * x[:, i] + 3) % vocab
        noise = torch.rand(batch, seq + 1, generator=gen) < 0.1
        x[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
        x = x.to(device)
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


def run(steps: int, device: str, cfg: GPTConfig, batch: int, warmup: int, lr: float, csv: str = "") -> int:
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    det = LossDetector()
    data = batches(cfg.vocab, batch, cfg.seq, device)
    events = []
    series: list[tuple[int, float, float]] = []
    t0 = time.perf_counter()
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.startswith("cuda") else None
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        x, y = next(data)
        if autocast is not None:
            with autocast:
                loss = model(x, y)
        else:
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        series.append((step, loss.item(), gnorm.item()))
        for ev in det.update(step, series[-1][1], series[-1][2], time.perf_counter() - t0):
            events.append(ev)
            print(f"step {ev.step}: {ev.severity.name.lower()} {ev.signal} {ev.kind}: {ev.message}")
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.4f} grad norm {gnorm.item():.3f}")
    if csv:     # the series, to replay through the detector elsewhere (`sdcwatch spikes` reads this CSV)
        with open(csv, "w") as f:
            f.write("step,loss,grad_norm\n")
            f.writelines(f"{st},{lo!r},{gn!r}\n" for st, lo, gn in series)
    raised = [e for e in events if e.severity >= Severity.WARNING]
    print(f"clean run on {device}: {steps} steps, {len(raised)} warnings or critical events "
          f"({sum(1 for e in raised if e.critical)} critical), {time.perf_counter() - t0:.0f} s")
    return 1 if raised else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--csv", default="", help="write step,loss,grad_norm of every step to this file")
    a = ap.parse_args(argv)
    cfg = GPTConfig(layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, seq=a.seq)
    return run(a.steps, a.device, cfg, a.batch, a.warmup, a.lr, a.csv)


if __name__ == "__main__":
    sys.exit(main())
