"""Fault-injection harness for the compute checks (issue 19): fault x detector -> caught, steps, rank named.

Runs a tiny MLP under DDP on W ranks (gloo on CPU by default; NCCL on CUDA with --device cuda), with the
compute gate (checksums.compute_gate: pre-reduction statistics every step, replay audits every
--audit-every steps) and the Monitor's replica vote, and injects one fault per case on rank --fault-rank
at step --fault-step: matmul outputs (one element, a tile, a warp-periodic chunk, zeroed values; from one
ulp to an exponent flip), gradients before the reduction, Adam's exp_avg, a weight; transient (one step)
or persistent (every step from there). Prints the table and, with --clean N, N clean steps: suspicions
and the measured clean cross-rank spread.

    PYTHONPATH=$PWD python bench/compute_faults.py --world 3                 # the CPU matrix (gloo)
    PYTHONPATH=$PWD python bench/compute_faults.py --world 3 --clean 10000 --cases none
    PYTHONPATH=$PWD torchrun --nproc-per-node 2 bench/compute_faults.py --device cuda --cases h200
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import struct
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from checksums.compute_gate import ComputeChecks
from checksums.monitor import Monitor
from checksums.reporter import ReporterStats, StepReport


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    where: str            # mm | grad | opt | weight
    how: str              # elem | tile | warp | zero | ulp | expflip | scale | channel | set
    value: float = 0.0
    persistent: bool = False


CASES = [
    Case("mm one elem =1e4", "mm", "set", 1e4),
    Case("mm one elem =10", "mm", "set", 10.0),
    Case("mm one elem exp-flip", "mm", "expflip"),
    Case("mm one elem ulp", "mm", "ulp"),
    Case("mm one elem x1.01 persistent", "mm", "scale", 1.01, True),
    Case("mm channel x2 persistent", "mm", "channel", 2.0, True),
    Case("mm tile 4x8 x2", "mm", "tile", 2.0),
    Case("mm warp-periodic chunk x4", "mm", "warp", 4.0),
    Case("mm zeroed column", "mm", "zero"),
    Case("mm x1.05 persistent", "mm", "scale", 1.05, True),
    Case("grad elem =100", "grad", "set", 100.0),
    Case("grad elem =0.01", "grad", "set", 0.01),
    Case("grad elem ulp persistent", "grad", "ulp", 0.0, True),
    Case("grad elem NaN", "grad", "set", float("nan")),
    Case("adam exp_avg exp-flip", "opt", "expflip"),
    Case("weight exp-flip", "weight", "expflip"),
]
H200 = ["mm one elem =1e4", "mm one elem =10", "mm one elem x1.01 persistent", "mm channel x2 persistent",
        "grad elem =100", "grad elem =0.01", "mm one elem ulp", "mm zeroed column", "adam exp_avg exp-flip",
        "weight exp-flip", "mm tile 4x8 x2", "grad elem NaN"]


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of element `index` of a float32 tensor in place."""
    flat = t.detach().view(-1)
    v = struct.unpack("<I", struct.pack("<f", float(flat[index])))[0] ^ (1 << bit)
    flat[index] = struct.unpack("<f", struct.pack("<I", v))[0]


def corrupt(t: torch.Tensor, case: Case) -> None:
    """Apply `case` to tensor t (2-D activations [batch, features] or any flat tensor) in place."""
    with torch.no_grad():
        flat = t.view(-1)
        if case.how == "set":
            flat[3] = case.value
        elif case.how == "scale":
            flat[3] *= case.value
        elif case.how == "ulp":
            flip_bit(t, 3, 0)
        elif case.how == "expflip":
            flip_bit(t, 3, 30 if abs(float(flat[3])) < 1.0 else 29)
        elif case.how == "channel":
            t[:, 5] *= case.value
        elif case.how == "tile":
            t[:4, :8] *= case.value
        elif case.how == "warp":
            flat[::32] *= case.value
        elif case.how == "zero":
            t[:, 3] = 0.0


class _Sink:
    """A StepSink that keeps the compute findings the Monitor's reports carry (no agent in the bench)."""

    def __init__(self) -> None:
        self.compute: list[Any] = []

    def submit(self, report: StepReport) -> bool:
        self.compute.extend(report.compute)
        return True

    def take_directives(self) -> list[Any]:
        return []

    def stats(self) -> ReporterStats:
        return ReporterStats()


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def batch_for(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(32, 16, generator=g)
    y = torch.sin(x[:, :4] * 1.3) + 0.1 * torch.randn(32, 4, generator=g)
    return x.to(device), y.to(device)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def run_case(case: Case | None, *, rank: int, world: int, device: torch.device, steps: int, fault_step: int,
             fault_rank: int, audit_every: int, warmup: int, margin: float, mask: str = "auto") -> dict[str, Any]:
    model = make_model(0).to(device)
    active = {"on": False}

    def mm_hook(mod: nn.Module, inp: Any, out: torch.Tensor) -> None:
        if active["on"] and case is not None and case.where == "mm" and torch.is_grad_enabled():
            corrupt(out, case)

    def grad_inject(idx: int, buf: torch.Tensor) -> None:
        if active["on"] and case is not None and case.where == "grad" and idx == 0:
            corrupt(buf, case)

    model[2].register_forward_hook(mm_hook)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.01)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=mask == "device" or device.type == "cuda")
    sink = _Sink()
    monitor = Monitor.attach(ddp, opt, job_id="compute-faults", reporter=sink, gpu_uuid=f"GPU-fake-{rank}")
    checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, audit_every=audit_every, warmup=warmup,
                                  margin=margin, gpu_uuid=f"GPU-fake-{rank}", monitor=monitor, mask=mask,
                                  inject_bucket=grad_inject if rank == fault_rank else None)
    caught: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    unchanged = None
    for step in range(1, steps + 1):
        on = case is not None and rank == fault_rank and (
            step == fault_step or (case.persistent and step >= fault_step))
        # the forward and gradient faults hit this step's backward; a persistent one also hits the replays
        # this rank runs in the gate (the same GPU computes wrong again), a transient one does not
        active["on"] = on and case is not None and case.where in ("mm", "grad")
        batch = batch_for(rank, step, device)
        checks.retain(batch)
        loss_fn(ddp, batch).backward()
        if case is None or not case.persistent:
            active["on"] = False
        before = [p.detach().clone() for p in model.parameters()] if step == fault_step else None
        opt.step()
        if before is not None:      # did the fault's step change the weights? (masked: no)
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.zero_grad(set_to_none=True)
        if on and case is not None and case.where == "opt":
            st = opt.state[model[2].weight]
            corrupt(st["exp_avg"], case)
        if on and case is not None and case.where == "weight":
            corrupt(model[2].weight.data, case)
        monitor.step()
        for f in checks.findings:
            if f.step >= fault_step and "compute" not in caught:
                caught["compute:" + f.detector] = {"step": f.step, "named": list(f.faulty), "cause": f.cause,
                                                   "dropped": f.dropped}
                caught["compute"] = caught["compute:" + f.detector]
        checks.findings.clear()
        for ev in monitor.events:
            if ev.kind == "replica.mismatch" and ev.step >= fault_step and "vote" not in caught:
                caught["vote"] = {"step": ev.step, "named": [s["rank"] for s in ev.details["suspects"]]}
        if caught and step > fault_step + 2 and (case is None or not case.persistent or step > fault_step + 10):
            break
    elapsed = time.perf_counter() - t0
    st = checks.status()
    monitor.close()
    checks.close()
    reported = [(f.step, f.detector, f.cause, [list(w) for w in f.where]) for f in sink.compute]
    return {"caught": caught, "steps": step, "elapsed_s": elapsed, "status": dataclasses.asdict(st),
            "reported": reported, "fault_step_unchanged": unchanged,
            "spread": checks.tracker.spread.tolist() if checks.tracker.spread is not None else []}


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
    if init:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", init_method=f"file://{init}",
                                rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    torch.set_num_threads(1)
    results = {}
    names = {"all": [c.name for c in CASES], "h200": H200, "none": []}.get(args.cases, args.cases.split(","))
    for case in [c for c in CASES if c.name in names]:
        results[case.name] = run_case(case, rank=rank, world=world, device=device, steps=args.fault_step + 30,
                                      fault_step=args.fault_step, fault_rank=args.fault_rank,
                                      audit_every=args.audit_every, warmup=args.warmup, margin=args.margin,
                                      mask=args.mask)
    if args.clean:
        results["clean"] = run_case(None, rank=rank, world=world, device=device, steps=args.clean,
                                    fault_step=args.clean + 1, fault_rank=-1, audit_every=args.audit_every,
                                    warmup=args.warmup, margin=args.margin, mask=args.mask)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def table(results: dict[str, Any], fault_step: int, fault_rank: int) -> str:
    head = f"fault (rank {fault_rank}, step {fault_step})"
    lines = [f"{head:34} {'detector':17} {'caught':6} {'steps':5} {'rank named':10} {'cause':11} update"]
    for name, r in results.items():
        if name == "clean":
            continue
        c = r["caught"]
        det = next((k for k in c if k.startswith("compute:")), None) or ("vote" if "vote" in c else None)
        if det is None:
            lines.append(f"{name:34} {'-':17} {'no':6}")
            continue
        hit = c[det]
        named = hit["named"]
        lines.append(f"{name:34} {det:17} {'yes':6} {hit['step'] - fault_step:<5} "
                     f"{('yes ' if named == [fault_rank] else 'NO ') + str(named):10} "
                     f"{hit.get('cause', '-'):11} {('dropped' if hit.get('dropped') else 'applied') if 'cause' in hit else '-'}"
                     + (f"   (vote also, +{c['vote']['step'] - fault_step})" if det != "vote" and "vote" in c else ""))
    if "clean" in results:
        r = results["clean"]
        st = r["status"]
        lines.append(f"clean: {r['steps']} steps, {st['suspicions']} suspicions, {st['dropped']} dropped, "
                     f"{st['audits']} audits, exact={st['exact']}, largest clean spread "
                     f"{st['spread_max']:.3f} (log units, x{2.718281828 ** st['spread_max']:.3f}), largest "
                     f"clean score {st['max_score_clean']:.2f} of margin {st['margin']}, {r['elapsed_s']:.1f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cases", default="all", help="all | h200 | none | comma-separated case names")
    p.add_argument("--fault-step", type=int, default=40)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--audit-every", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--margin", type=float, default=3.0)
    p.add_argument("--clean", type=int, default=0, help="also run this many clean steps")
    p.add_argument("--mask", choices=["auto", "host", "device"], default="auto",
                   help="how a suspect update is masked: host veto, or the device found_inf flag (fused Adam)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        if "RANK" in os.environ:        # torchrun
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "", args, out)
            if int(os.environ["RANK"]) != 0:
                return {}
        else:
            mp.start_processes(worker, args=(args.world, os.path.join(tmp, "init"), args, out),
                               nprocs=args.world, join=True, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
    print(table(results, args.fault_step, args.fault_rank))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
