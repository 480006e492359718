"""Compute checks on ONE GPU (issue 19): the smallest fault the pre-reduction statistics catch on its step,
a named subset of at most 12 fault cases, and sdcguard's ABFT check on the same faults.

One GPU has no second rank, so the cross-rank comparison runs over K virtual ranks in one process: each step
every virtual rank computes the gradient of its own batch on the same weights (what DDP ranks do before the
all-reduce), each gradient is summarised bucket by bucket (`checksums.grad_checks.bucket_summary`, DDP's
bucket layout: parameters in reverse order, 25 MB buckets) and the rows [K, buckets, 4] go through the same
`SpreadTracker` the gate uses; the model trains on the mean gradient with fused Adam. After `--warmup` clean
steps the state is kept, and each fault case starts from it: the fault hits virtual rank 1 on one step
(matmul output of block 0's MLP fc, or one element of its gradient's first bucket) and the verdict says
whether rank 1 alone was named on that step. The sweep finds the smallest size of each fault kind caught.

With --sdcguard, sdcguard's ABFT check (its default dispatch mode: every bf16/fp16 matmul, forward and
backward) runs on the faulty rank's step, the fault injected inside the matmul (bench.compute_faults's
MatmulFault) so both detectors see the same wrong output; sdcguard checks 1 step in EVERY, so a transient
fault is caught with probability 1/EVERY and a persistent one within EVERY steps: the table says whether
it is caught when that step is checked. The overhead of the checks and audits against the same training
without them, interleaved, is `bench.compute_faults --world 1 --overhead` (DDP on one GPU: real comm hooks).

    PYTHONPATH=$PWD python -m bench.compute_gpu1 --device cuda --model gpt2 --sdcguard 20     # one H200
    PYTHONPATH=$PWD python -m bench.compute_gpu1 --device cuda --model gpt2 --sdcguard 20 --quick   # ~90 s
    PYTHONPATH=$PWD python -m bench.compute_gpu1 --model tiny-gpt --clean 100                 # CPU smoke

--quick: the same table in less time (one device session): warm-up 12 steps, 40 clean steps (unless --warmup
or --clean say otherwise), and each sweep over every other size (the smallest and largest kept). Each
phase's seconds are printed with the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from typing import Any

import torch
from torch import nn

from bench import compute_faults as cf
from checksums.grad_checks import SpreadTracker, bucket_summary, stats_of

SUBSET = [  # at most 12 named cases (one device session): name, where, how, value
    ("mm one elem =1e4", "mm", "set", 1e4),
    ("mm one elem =10", "mm", "set", 10.0),
    ("mm one elem exp-flip", "mm", "expflip", 0.0),
    ("mm one elem x1.01", "mm", "scale", 1.01),
    ("mm channel x2", "mm", "channel", 2.0),
    ("mm tile 4x8 x2", "mm", "tile", 2.0),
    ("mm warp-periodic chunk x4", "mm", "warp", 4.0),
    ("mm zeroed column", "mm", "zero", 0.0),
    ("grad elem =100", "grad", "set", 100.0),
    ("grad elem =0.01", "grad", "set", 0.01),
    ("grad elem NaN", "grad", "set", float("nan")),
    ("mm one elem ulp", "mm", "ulp", 0.0),
]
SWEEPS = {  # fault kind -> sizes tried, smallest first
    "mm one elem = v": ("mm", "set", [0.5, 1, 2, 5, 10, 20, 50, 100, 300, 1e3, 1e4]),
    "mm one elem x f": ("mm", "scale", [1.01, 1.1, 2, 5, 10, 100, 1e3, 1e4]),
    "mm channel x f": ("mm", "channel", [1.01, 1.1, 1.5, 2, 4, 10, 100]),
    "grad elem = v": ("grad", "set", [1e-3, 1e-2, 0.1, 1, 10, 100, 1e3]),
}


def buckets_of(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """DDP's layout, roughly: parameters in reverse order, cut into buckets of at most `cap_bytes`."""
    out: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


class Virtual:
    """K virtual ranks on one device: per-rank gradients of their own batches on the same weights."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        cf.MODEL["name"] = args.model
        cf.MODEL["bf16"] = bool(args.sdcguard)
        self.model, self.target = cf.make_model(0)
        self.model.to(device)
        self.device = device
        self.k = args.ranks
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.layout = buckets_of(self.params, args.bucket_mb << 20)
        self.opt = torch.optim.Adam(
            self.params, lr=1e-4 if args.model == "gpt2" else 1e-3, fused=device.type == "cuda"
        )
        self.tracker = SpreadTracker(margin=args.margin, warmup=args.warmup)
        self.case: tuple[str, str, float] | None = None
        self.faulty = False
        self.mode: Any = None
        self.target.register_forward_hook(self._hook)
        self.guard: Any = None
        if args.sdcguard:
            self.active = {"on": False}
            self.mode = cf.MatmulFault(self.target, None, self.active)
            self.guard = cf._sdcguard(1, self.model)  # protect(): checked whenever asked (the fault's step)

    def _hook(self, mod: nn.Module, inp: Any, out: torch.Tensor) -> None:
        if self.faulty and self.case is not None and self.case[0] == "mm" and self.mode is None:
            cf.corrupt(out, cf.Case("x", *self.case))

    def step(self, step: int, *, fault_rank: int = -1, check_rank: int = -1) -> dict[str, Any]:
        """One training step over the K virtual ranks; the verdict of the statistics, and sdcguard's."""
        rows, total = [], None
        sg_alerts = 0
        for r in range(self.k):
            self.faulty = r == fault_rank
            batch = cf.batch_for(r, step, self.device)
            if self.mode is not None:
                self.mode.case = cf.Case("x", *self.case) if self.case is not None else None
                self.active["on"] = self.faulty
            seen = len(self.guard.log.events) if self.guard is not None else 0
            grads = self._grads(batch, sdc=self.guard is not None and r == check_rank, step=step)
            if self.guard is not None and r == check_rank:
                sg_alerts = len(self.guard.log.events) - seen
            if self.faulty and self.case is not None and self.case[0] == "grad":
                flat = grads[self.layout[0][0]].view(-1)
                cf.corrupt(flat, cf.Case("x", *self.case))
            # each bucket flat, as DDP's hook sees it: one fused read on CUDA, a plan reused every step
            rows.append(torch.stack([bucket_summary([torch.cat([grads[i].reshape(-1) for i in b])])
                                     for b in self.layout]))
            total = [g.clone() for g in grads] if total is None else [a.add_(g) for a, g in zip(total, grads)]
            self.faulty = False
        verdict = self.tracker.judge(stats_of(torch.stack(rows)))
        finite = all(bool(torch.isfinite(t).all()) for t in total) if verdict.nonfinite == () else False
        if not verdict.suspects and finite:
            for p, g in zip(self.params, total):
                p.grad = g.div_(self.k)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return {"verdict": verdict, "sdcguard_alerts": sg_alerts}

    def _grads(self, batch: Any, *, sdc: bool, step: int) -> list[torch.Tensor]:
        def run() -> list[torch.Tensor]:
            loss = cf.loss_fn(self.model, batch)
            return list(torch.autograd.grad(loss, self.params))

        if self.mode is None:
            return run()
        with self.mode:
            if sdc:
                with self.guard.at_step(step):
                    return run()
            return run()

    def keep(self) -> Any:
        return copy.deepcopy((self.model.state_dict(), self.opt.state_dict(), self.tracker.__dict__))

    def restore(self, kept: Any) -> None:
        model_sd, opt_sd, tracker = copy.deepcopy(kept)
        self.model.load_state_dict(model_sd)
        self.opt.load_state_dict(opt_sd)
        self.tracker.__dict__.update(tracker)


def caught_on_its_step(
    v: Virtual, kept: Any, step: int, case: tuple[str, str, float], *, check: bool = False
) -> dict[str, Any]:
    v.restore(kept)
    v.case = case
    out = v.step(step, fault_rank=1, check_rank=1 if check else -1)
    v.case = None
    verdict = out["verdict"]
    named = list(verdict.suspects)
    return {
        "caught": bool(named),
        "named": named,
        "right": named == [1],
        "score": verdict.scores[1] if len(verdict.scores) > 1 else 0.0,
        "sdcguard": out["sdcguard_alerts"] > 0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["mlp", "tiny-gpt", "gpt2"], default="tiny-gpt")
    p.add_argument("--ranks", type=int, default=3, help="virtual ranks (3+: the median names one rank)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 20; --quick 12)")
    p.add_argument("--margin", type=float, default=3.0)
    p.add_argument("--bucket-mb", type=int, default=25)
    p.add_argument(
        "--clean", type=int, default=None,
        help="clean steps after warm-up: suspicions (none expected; default 0, --quick 40)"
    )
    p.add_argument("--cases", default="all", help="all (the 12-case subset) | none | comma-separated names")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument(
        "--sdcguard",
        type=int,
        default=0,
        metavar="EVERY",
        help="also run sdcguard's ABFT check on the fault's step (it checks 1 step in EVERY)",
    )
    p.add_argument("--quick", action="store_true", help="the same table in about 90 s on one H200: warm-up "
                   "12, clean 40 (unless given), every other sweep size")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup = 12 if args.warmup is None else args.warmup
        args.clean = 40 if args.clean is None else args.clean
    args.warmup = 20 if args.warmup is None else args.warmup
    args.clean = 0 if args.clean is None else args.clean
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    phases: dict[str, float] = {}
    v = Virtual(args, device)
    phases["setup"] = time.perf_counter() - start
    t0 = time.perf_counter()
    step = 0
    for step in range(1, args.warmup + 1):
        v.step(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    warm_s = phases["warm-up"] = time.perf_counter() - t0
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "model": args.model,
        "ranks": args.ranks,
        "buckets": len(v.layout),
        "step_s": warm_s / max(1, args.warmup),
    }
    suspicions = 0
    t0 = time.perf_counter()
    for k, step in enumerate(range(args.warmup + 1, args.warmup + 1 + args.clean), 1):
        suspicions += bool(v.step(step)["verdict"].suspects)
        if k % 250 == 0:     # progress, so a run cut short by its time limit still says how far it got
            print(f"clean: {k} steps, {suspicions} suspicions, largest clean score "
                  f"{v.tracker.max_score_clean:.3f}, {time.perf_counter() - t0:.1f} s", flush=True)
    results["clean"] = {
        "steps": args.clean,
        "suspicions": suspicions,
        "max_score": v.tracker.max_score_clean,
        "s": time.perf_counter() - t0,
    }
    phases["clean"] = results["clean"]["s"]
    t0 = time.perf_counter()
    sp = v.tracker.spread
    results["spread"] = sp.tolist() if sp is not None else []
    kept = v.keep()
    at = step + 1
    names = {"all": [c[0] for c in SUBSET], "none": []}.get(args.cases, args.cases.split(","))
    results["cases"] = {
        name: caught_on_its_step(v, kept, at, (w, h, x), check=bool(args.sdcguard))
        for name, w, h, x in SUBSET
        if name in names
    }
    phases["cases"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not args.no_sweep:
        sweep: dict[str, Any] = {}
        for kind, (w, h, sizes) in SWEEPS.items():
            if args.quick:      # every other size, the smallest and the largest kept
                sizes = sorted(set(sizes[::2]) | {sizes[-1]})
            tried = []
            for x in sizes:
                got = caught_on_its_step(v, kept, at, (w, h, x))
                tried.append((x, got["right"], got["score"]))
            smallest = next((x for x, right, _ in tried if right), None)
            sweep[kind] = {"smallest": smallest, "tried": tried}
        results["sweep"] = sweep
    if device.type == "cuda":
        torch.cuda.synchronize()
    phases["sweep"] = time.perf_counter() - t0
    phases["total"] = time.perf_counter() - start
    results["phases_s"] = phases
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def report(r: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        (
            f"{r['model']} on {r['device']}, {r['ranks']} virtual ranks, {r['buckets']} buckets, "
            f"{r['step_s'] * 1e3:.0f} ms per step of all ranks; margin {args.margin}"
        )
    ]
    c = r["clean"]
    lines.append(
        f"clean: {c['steps']} steps after warm-up, {c['suspicions']} suspicions, largest clean score "
        f"{c['max_score']:.2f} of margin {args.margin}"
    )
    sp = torch.tensor(r["spread"], dtype=torch.float64)
    if sp.numel():
        for k, stat in enumerate(("norm", "maxabs")):
            col = sp[:, k]
            lines.append(
                f"clean cross-rank spread of {stat:6}: median x{math.exp(col.median()):.3f}, largest "
                f"x{math.exp(col.max()):.3f}; caught beyond x{math.exp(col.median() * args.margin):.2f} "
                "(median bucket)"
            )
    if r["cases"]:
        sg = f" {'sdcguard (if checked)':22}" if args.sdcguard else ""
        lines.append(
            f"{'fault on virtual rank 1':30} {'caught on its step':19} {'rank named':11} {'score':>8}{sg}"
        )
        for name, x in r["cases"].items():
            lines.append(
                f"{name:30} {'yes' if x['caught'] else 'no':19} "
                f"{('yes ' if x['right'] else 'NO ') + str(x['named']) if x['caught'] else '-':11} "
                f"{x['score']:8.2f}" + (f" {'yes' if x['sdcguard'] else 'no':22}" if args.sdcguard else "")
            )
        if args.sdcguard:
            lines.append(
                f"sdcguard checks 1 step in {args.sdcguard}: a transient fault is caught with probability "
                f"1/{args.sdcguard}, a persistent one within {args.sdcguard} steps; ours on every step"
            )
    for kind, s in r.get("sweep", {}).items():
        tried = ", ".join(f"{x:g}:{'Y' if ok else 'n'}({sc:.1f})" for x, ok, sc in s["tried"])
        lines.append(f"smallest {kind:18} caught on its step: {s['smallest']}   [{tried}]")
    if "phases_s" in r:
        lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
