"""Can the CPU witness tell a faulty GPU from a good one when the GPUs train in bf16 (issue 19)?

Two ranks, a GPU computing wrong from the first step: each GPU repeats its own gradient, so only a third
opinion names one. The witness (`Replayer.witness`) recomputes rank 0's batch in float64 on the host and
projects it on the line from GPU 0's gradient to GPU 1's: t near 0 names GPU 1, near 1 GPU 0, and rounding
alone (two GPUs that differ only by rounding) should leave it near 0.5. This probe computes t on ONE GPU for
both situations: "fault" = the clean gradient against one with the fault case applied to block 0's MLP
output (bench.compute_faults's cases); "rounding" = the clean gradient against the same step with
scaled_dot_product_attention held to the math backend (a GPU that rounds differently, no fault). Each is
projected with several witnesses: the host in float64, the host in fp32, the host under bf16 autocast, and
"gpu-fp32": both GPU gradients recomputed as the witness does (`full_precision`: autocast and TF32 off),
against the host in float64. A witness works when every fault row is within 0.25 of 0 and every rounding row is not.

    PYTHONPATH=$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m bench.witness_probe --device cuda --batch 2
    PYTHONPATH=$PWD python -m bench.witness_probe --model tiny-gpt          # CPU smoke (the "GPU" is the CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import compute_faults as cf
from checksums.op_witness import witness_projection
from checksums.replay import witness_names
from checksums.replay_modes import full_precision


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flat, float64 on the host (zeros for a parameter without one)."""
    return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1).double().cpu()
                      for q in model.parameters()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["tiny-gpt", "gpt2"], default="gpt2")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--cases", default="mm one elem x1.01 persistent,mm x1.05 persistent,"
                                      "mm channel x2 persistent,bwd one elem x1.01 persistent")
    args = p.parse_args()
    if args.device == "cuda":
        torch.use_deterministic_algorithms(True)
    cf.MODEL.update(name=args.model, batch=args.batch, amp="bf16", bf16=True, ac="none", hsdp=0)
    dev = torch.device(args.device)
    model, target = cf.make_model(0)
    model.to(dev)
    x, y = cf.batch_for(0, 1, dev)
    t0 = time.perf_counter()

    def bf16_step() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return model(x, y)

    def grad_of(case: cf.Case | None = None, wide: bool = False) -> torch.Tensor:
        """The step's flat gradient, with `case` on block 0's MLP output (the harness's own injection,
        `fault_output`), in float32 as the witness replays (`full_precision`) when `wide`."""
        hook = target.register_forward_hook(lambda m, i, o: cf.fault_output(o, case) if case else None)
        try:
            model.zero_grad(set_to_none=True)
            with full_precision(dev.type) if wide else contextlib.nullcontext():
                bf16_step().backward()
        finally:
            hook.remove()
        return flat_grad(model)

    g_clean = grad_of()
    with sdpa_kernel([SDPBackend.MATH]):
        g_round = grad_of()
    g_clean32 = grad_of(wide=True)
    cases = [c for c in cf.CASES if c.name in args.cases.split(",")]
    faulty = {c.name: (grad_of(c), grad_of(c, wide=True)) for c in cases}
    t_dev = time.perf_counter() - t0

    host = copy.deepcopy(model).cpu()
    xc, yc = x.cpu(), y.cpu()
    refs = {}
    for name, dtype, amp in (("host-fp64", torch.float64, False), ("host-fp32", torch.float32, False),
                             ("host-bf16", torch.float32, True)):
        t1 = time.perf_counter()
        m = copy.deepcopy(host).to(dtype)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        m.zero_grad(set_to_none=True)
        with ctx:
            loss = m(xc, yc)
        loss.backward()
        refs[name] = flat_grad(m)
        print(f"{name}: {time.perf_counter() - t1:.1f} s", flush=True)

    print(f"{args.model}, batch {args.batch} x {x.shape[1]} tokens on {args.device}; GPU side {t_dev:.1f} s")
    print(f"{'situation':42s} {'witness':10s} {'t':>8s}  verdict (named GPU: 1 = the faulty one, 0 = wrong)")

    def row(situation: str, witness: str, ref: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, fault: bool):
        t = witness_projection(ref, g0, g1)
        named = witness_names(t)
        ok = (named == 1) if fault else (named is None)
        print(f"{situation:42s} {witness:10s} {t:8.3f}  named {named}  {'ok' if ok else 'WRONG'}")

    for name, (fb, f32) in faulty.items():
        for w in refs:
            row(f"fault: {name}", w, refs[w], g_clean, fb, True)
        row(f"fault: {name}", "gpu-fp32", refs["host-fp64"], g_clean32, f32, True)
    for w in refs:
        row("rounding: sdpa math vs default", w, refs[w], g_clean, g_round, False)


if __name__ == "__main__":
    main()
