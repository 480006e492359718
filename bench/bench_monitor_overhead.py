"""Training-step overhead of the Monitor on a GPT-2-small-sized model, measured side by side in one run.

Modes, interleaved in blocks of --block steps, the order rotated each round so drift hits every mode:
  off      plain training step (bf16 autocast, fp32 parameters, AdamW);
  monitor  + Monitor.step(loss) every step: fused fingerprint of all parameters, the replica vote
           (all_gather over the world with torchrun; skipped on one GPU: a one-rank group has nothing
           to compare, so only the fingerprint, the D2H copy and the host read run), read a step later;
  naive    + per-tensor integer sums of every parameter every step, gathered to the host (a sync).
Each block is timed between two device synchronisations; a mode's figure is the median over rounds of
its per-step block mean. Reports to the agent are off unless --agent-socket is given.

  python bench/bench_monitor_overhead.py                         # one GPU, GPT-2 small, batch 8 x 1024
  torchrun --nproc-per-node 2 bench/bench_monitor_overhead.py    # DDP with the real vote
  python bench/bench_monitor_overhead.py --device cpu --layers 2 --width 64 --heads 4 --vocab 512 \
      --seq 64 --batch 2 --block 3 --rounds 2 --warmup 2           # smoke run without a GPU
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.tiny_gpt import GPTConfig, TinyGPT  # noqa: E402
from checksums.monitor import Monitor  # noqa: E402

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs one block of every mode")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps of every mode first")
    p.add_argument("--modes", default="off,monitor,naive")
    p.add_argument("--device", default="cuda")
    p.add_argument("--agent-socket", default=None, help="also report to an agent on this socket")
    p.add_argument("--check-grads", action="store_true", help="also fingerprint gradients (monitor mode)")
    args = p.parse_args()
    if min(args.block, args.rounds) < 1 or args.warmup < 0:
        p.error("--block and --rounds must be >= 1, --warmup >= 0")
    unknown = set(args.modes.split(",")) - {"off", "monitor", "naive"}
    if unknown:
        p.error(f"unknown modes: {sorted(unknown)}")
    return args


def naive_check(params: list[torch.Tensor]) -> list[int]:
    """The baseline: one integer sum per tensor, gathered to the host every step (syncs)."""
    sums = [p.detach().view(_INT_VIEW[p.element_size()]).to(torch.int64).sum() for p in params]
    return torch.stack(sums).cpu().tolist()


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu (with a small model) for a smoke run")
    if distributed:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if args.device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else \
        torch.device("cpu")
    cfg = GPTConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq)
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(cfg).to(device)
    params = [p for p in model.parameters()]
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                    else None)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(params, lr=1e-4, **fused)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device, generator=gen)
    tgt = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device, generator=gen)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    monitor = Monitor.attach(model, opt, job_id="bench", check_grads=args.check_grads,
                             reporter=None if args.agent_socket else False, agent_socket=args.agent_socket)

    def train_step() -> torch.Tensor:
        with autocast:
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        return loss.detach()

    def step_off() -> None:
        train_step()
        opt.zero_grad(set_to_none=True)

    def step_monitor() -> None:
        loss = train_step()
        monitor.step(loss)
        opt.zero_grad(set_to_none=True)

    def step_naive() -> None:
        train_step()
        naive_check(params)
        opt.zero_grad(set_to_none=True)

    runners: dict[str, Callable[[], None]] = {"off": step_off, "monitor": step_monitor, "naive": step_naive}
    modes = args.modes.split(",")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if distributed:
            dist.barrier()

    def block(mode: str, steps: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            runners[mode]()
        if mode == "monitor":
            monitor.flush()
        sync()
        return (time.perf_counter() - t0) / steps

    for mode in modes:
        block(mode, args.warmup)
    per_step: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            per_step[mode].append(block(mode, args.block))
    monitor.close()

    if rank == 0:
        nbytes = sum(p.numel() * p.element_size() for p in params)
        vote = (f"all_gather over {world} ranks (NCCL, async)" if world > 1 and monitor.replica_group_name
                else "skipped (one rank: nothing to compare)")
        print(f"model: {len(params)} parameter tensors, {sum(p.numel() for p in params) / 1e6:.1f}M params, "
              f"{nbytes / 1e6:.0f} MB fp32; batch {args.batch} x {cfg.seq}; device {device}; world {world}")
        print(f"vote: {vote}; checks run: {monitor.stats.checks_run}; mismatches: {monitor.stats.mismatches}; "
              f"events: {len(monitor.events)}")
        print(f"blocks: {args.rounds} rounds x {args.block} steps per mode, interleaved, rotated order")
        base = statistics.median(per_step["off"]) if "off" in per_step else None
        print(f"{'mode':<10}{'median ms/step':>16}{'min':>10}{'max':>10}{'overhead':>11}")
        for mode in modes:
            xs = per_step[mode]
            med = statistics.median(xs)
            over = f"{(med / base - 1) * 100:+.2f}%" if base else "-"
            print(f"{mode:<10}{med * 1e3:>16.3f}{min(xs) * 1e3:>10.3f}{max(xs) * 1e3:>10.3f}{over:>11}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
