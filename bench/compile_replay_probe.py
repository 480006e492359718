"""What do the witness's replays cost on a `torch.compile`d model (issue 19)?

The two-rank witness replays a batch under modes the training step never runs under: the float32 replay
(`checksums.replay.full_precision`, a TorchFunctionMode turning autocast off per op, TF32 off) and the op
witness's trace (`checksums.op_witness.OpTrace`, a TorchDispatchMode). On a compiled model a mode can cost
a recompilation (a guard fails) or a fallback to eager. This probe compiles the harness's model (bf16
autocast, `bench.compute_faults`'s model and loss), times training steps, then each replay kind twice (the
first may compile; the second is what a repeat costs), the compiled graphs counted after each, and checks
the replays' gradients against the same replay of the uncompiled model (float32: close; the trace's:
equal to an untraced compiled step or not, said).

    PYTHONPATH=$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m bench.compile_replay_probe --device cuda
    PYTHONPATH=$PWD python -m bench.compile_replay_probe --model tiny-gpt          # CPU smoke
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench import compute_faults as cf
from checksums.op_witness import OpTrace
from checksums.replay_modes import full_precision


def graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["tiny-gpt", "gpt2"], default="gpt2")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.use_deterministic_algorithms(True)
    cf.MODEL.update(name=args.model, batch=args.batch, amp="bf16", bf16=True, ac="none", hsdp=0)
    eager, _ = cf.make_model(0)
    eager.to(dev)
    compiled = torch.compile(eager)
    batch = cf.batch_for(0, 1, dev)
    params = [q for q in eager.parameters() if q.requires_grad]

    def grad(model: torch.nn.Module) -> torch.Tensor:
        got = torch.autograd.grad(cf.loss_fn(model, batch), params, allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(q)).reshape(-1).float()
                          for g, q in zip(got, params)])

    def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    first, _ = timed(lambda: grad(compiled))
    steps = [timed(lambda: grad(compiled))[0] for _ in range(args.steps)]
    step_s = sorted(steps)[len(steps) // 2]
    print(f"model {args.model} batch {args.batch} on {dev.type}: first compiled step {first:.2f} s, then "
          f"{step_s * 1e3:.1f} ms a step; {graphs()} graph(s)")
    _, plain = timed(lambda: grad(compiled))

    def wide() -> torch.Tensor:
        with full_precision(dev.type):
            return grad(compiled)

    def traced() -> torch.Tensor:
        with OpTrace() as tr:
            g = grad(compiled)
        traced.ops = len(tr.names)      # type: ignore[attr-defined]
        return g
    with full_precision(dev.type):
        ref32 = grad(eager)
    rows = []
    for name, fn in (("float32 replay (full_precision)", wide), ("op trace (OpTrace)", traced)):
        for k in (1, 2):
            before = graphs()
            try:
                s, g = timed(fn)
            except Exception as exc:  # noqa: BLE001 (a mode the compiled model refuses: said)
                rows.append(f"{name:34} #{k}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
                break
            if name.startswith("float32"):
                err = float((g - ref32).norm() / ref32.norm())
                check = f"vs eager float32 rel {err:.1e}"
            else:
                check = (f"{traced.ops} ops traced; grad {'==' if torch.equal(g, plain) else '!='} "  # type: ignore[attr-defined]
                         "the compiled step's")
            rows.append(f"{name:34} #{k}: {s:7.3f} s ({s / step_s:6.1f} steps), +{graphs() - before} graph(s); "
                        f"{check}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
