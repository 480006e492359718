"""Overhead of the framework integrations (integrations/hf.py, integrations/lightning.py) on a
GPT-2-small-sized model built from a config (no download: HF_HUB_OFFLINE=1), against the same training
without sdcwatch.

For each framework, runs of the same Trainer setup alternate, the order rotated each round so drift hits
both modes:
  off       the framework's own training loop (bf16 autocast on CUDA, AdamW);
  sdcwatch  + the framework callback: Monitor (fused fingerprint of every parameter each step, the vote on
            a multi-GPU run, read a step later), ReplicaRecovery's gate, the loss tap, agreed directives;
            checkpoints off unless --save-every (their cost: bench/bench_checkpoint.py), reports to the
            agent off unless --agent-socket.
Each run takes --warmup untimed steps, then --steps timed between two device synchronisations (no sync in
between); a mode's figure is the median over rounds of its ms/step. Prints both side by side and the
overhead ratio (target: under 1%).

  python -m bench.bench_frameworks                                  # one GPU: HF and Lightning
  python -m bench.bench_frameworks --framework hf --rounds 5
  python -m bench.bench_frameworks --device cpu --layers 1 --width 32 --heads 2 --vocab 64 --seq 16 \
      --batch 2 --steps 3 --warmup 1 --rounds 1                     # smoke run without a GPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("hf", "lightning", "both"), default="both")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of every run")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs both modes once")
    p.add_argument("--device", default="cuda")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint through the agent (needs one)")
    p.add_argument("--agent-socket", default=None, help="report to the agent on this socket")
    return p.parse_args(argv)


def gpt2(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                     n_positions=args.seq, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock:
    """Times steps warmup+1 .. warmup+steps between two device synchronisations."""

    def __init__(self, warmup: int, device: str) -> None:
        self.warmup, self.device = warmup, device
        self.n = 0
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def begin(self) -> None:
        if self.n == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()

    def end(self) -> None:
        self.n += 1

    def ms_per_step(self) -> float:
        self._sync()
        t1 = time.perf_counter()
        return (t1 - self.t0) * 1e3 / max(1, self.n - self.warmup)


def _sdc_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    monitor = {"reporter": False} if args.agent_socket is None else {"agent_socket": args.agent_socket}
    return {"save_every": args.save_every, "checkpoints": bool(args.save_every), "monitor_kwargs": monitor}


def run_hf(args: argparse.Namespace, model: Any, data: Any, sdc: bool, out: str) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from integrations.hf import SdcwatchCallback

    clock = Clock(args.warmup, args.device)

    class Timing(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.end()

    callbacks: list[Any] = [Timing()]
    if sdc:
        callbacks.append(SdcwatchCallback(job_id="bench-hf", **_sdc_kwargs(args)))
    cuda = args.device.startswith("cuda")
    targs = TrainingArguments(output_dir=out, max_steps=args.warmup + args.steps,
                              per_device_train_batch_size=args.batch, learning_rate=1e-4, bf16=cuda,
                              use_cpu=not cuda, logging_steps=10**9, save_strategy="no", report_to="none",
                              disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=cuda,
                              max_grad_norm=1.0, seed=0)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks).train()
    return clock.ms_per_step()


def run_lightning(args: argparse.Namespace, model: Any, data: Any, sdc: bool, out: str) -> float:
    import lightning as L

    from integrations.lightning import SdcwatchCallback

    clock = Clock(args.warmup, args.device)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.gpt(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timing(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            clock.begin()

        def on_train_batch_end(self, *a: Any) -> None:
            clock.end()

    callbacks: list[Any] = [Timing()]
    if sdc:
        callbacks.append(SdcwatchCallback(job_id="bench-lightning", **_sdc_kwargs(args)))
    cuda = args.device.startswith("cuda")
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False, pin_memory=cuda)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-mixed" if cuda else "32", max_steps=args.warmup + args.steps,
                        callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, default_root_dir=out)
    trainer.fit(Module(), loader)
    return clock.ms_per_step()


RUNNERS: dict[str, Callable[..., float]] = {"hf": run_hf, "lightning": run_lightning}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    frameworks = ["hf", "lightning"] if args.framework == "both" else [args.framework]
    model = gpt2(args)
    n_params = sum(p.numel() for p in model.parameters())
    data = Tokens(args.batch * (args.warmup + args.steps), args.seq, args.vocab)
    dev = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"model: GPT-2 from config, {args.layers} layers x {args.width}, {n_params / 1e6:.1f}M params; "
          f"batch {args.batch} x {args.seq}; device {dev}; torch {torch.__version__}")
    print(f"runs: {args.rounds} rounds x 2 modes, each {args.warmup} untimed + {args.steps} timed steps; "
          f"checkpoints {'every %d' % args.save_every if args.save_every else 'off'}; "
          f"agent reports {'on' if args.agent_socket else 'off'}")
    with tempfile.TemporaryDirectory(prefix="sdcw-bench-fw-") as out:
        for fw in frameworks:
            times: dict[str, list[float]] = {"off": [], "sdcwatch": []}
            for r in range(args.rounds):
                order = ["off", "sdcwatch"] if r % 2 == 0 else ["sdcwatch", "off"]
                for mode in order:
                    times[mode].append(RUNNERS[fw](args, model, data, mode == "sdcwatch", out))
            off, on = statistics.median(times["off"]), statistics.median(times["sdcwatch"])
            print(f"\n{fw}: {'mode':<10}{'median ms/step':>16}{'min':>10}{'max':>10}{'vs off':>10}")
            for mode, xs in times.items():
                med = statistics.median(xs)
                print(f"{'':<{len(fw) + 2}}{mode:<10}{med:>16.3f}{min(xs):>10.3f}{max(xs):>10.3f}"
                      f"{(med / off - 1) * 100:>+9.2f}%")
            print(f"{fw}: overhead {(on / off - 1) * 100:+.2f}% (target < 1%)")


if __name__ == "__main__":
    main()
