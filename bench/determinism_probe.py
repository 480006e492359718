"""Is one step's gradient bit-for-bit repeatable on this GPU, and under which settings (issue 19)?

The compute checks' replays compare exact fingerprints only when a step recomputed on the same weights and
batch gives the same bits; otherwise (`classify_start`) they fall back to a rounding bound, where a small
persistent fault hides. This probe runs the harness's GPT-2 small (bf16 autocast, `bench.compute_faults`'s
model and loss) forward and backward on one batch REPEATS times under each setting and prints, for each:
whether every gradient was bit identical to the first, the largest relative difference of a parameter's
gradient norm, the ms per step, and an error if the setting refused an op.

Settings: `warn` = torch.use_deterministic_algorithms(True, warn_only=True) (the harness before);
`strict` = the same with warn_only=False (what docs/compute-checks.md tells a user to set); `math` /
`flash` / `efficient` / `cudnn` = warn_only=True with scaled_dot_product_attention held to that backend.

    PYTHONPATH=$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m bench.determinism_probe --device cuda
    PYTHONPATH=$PWD python -m bench.determinism_probe --model tiny-gpt --settings warn,math   # CPU smoke
    PYTHONPATH=$PWD python -m bench.determinism_probe --model demo --settings strict          # the demo's GPT
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import compute_faults as cf

BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


LOSS = {"fn": cf.loss_fn}      # --model demo: the demo's own loss (demo.worker.gpt_loss)


def grads(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    LOSS["fn"](model, batch).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def probe(setting: str, model: torch.nn.Module, batch, repeats: int) -> str:
    torch.use_deterministic_algorithms(True, warn_only=setting != "strict")
    ctx = sdpa_kernel([BACKENDS[setting]]) if setting in BACKENDS else contextlib.nullcontext()
    try:
        with ctx:
            first = grads(model, batch)
            worst, same = 0.0, True
            sync = torch.cuda.synchronize if batch[0].is_cuda else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(repeats - 1):
                again = grads(model, batch)
                for a, b in zip(first, again):
                    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):   # bit for bit
                        same = False
                        na, nb = a.float().norm().item(), b.float().norm().item()
                        worst = max(worst, abs(na - nb) / max(na, 1e-30))
            sync()
            ms = (time.perf_counter() - t0) / max(repeats - 1, 1) * 1e3
    except Exception as e:  # noqa: BLE001 - a setting that refuses an op is a result
        return f"{setting:10s} error: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    return f"{setting:10s} bit-identical={same!s:5s} largest norm diff {worst:.2e}  {ms:8.1f} ms/step"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["tiny-gpt", "gpt2", "demo"], default="gpt2",
                   help="demo: `sdcwatch demo`'s GPT (float32, its default size) with its loss")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--settings", default="warn,strict,math,flash,efficient,cudnn")
    args = p.parse_args()
    cf.MODEL.update(name=args.model, batch=args.batch, amp="bf16", bf16=False, ac="none", hsdp=0)
    device = torch.device(args.device)
    if args.model == "demo":
        from demo.model import GPT, GPTConfig
        from demo.worker import gpt_loss
        cfg = GPTConfig()
        torch.manual_seed(0)
        model: torch.nn.Module = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context + 1), generator=torch.Generator().manual_seed(1))
        batch = (idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device))
        LOSS["fn"] = gpt_loss
    else:
        model, _ = cf.make_model(0)
        batch = cf.batch_for(0, 1, device)
    model.to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} on {name}, torch {torch.__version__}, batch {args.batch}, {args.repeats} repeats")
    for s in args.settings.split(","):
        print(probe(s, model, batch, args.repeats), flush=True)


if __name__ == "__main__":
    main()
