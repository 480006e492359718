"""Issue 18: `Monitor.agreed_directive()` on N ranks: no collective and no GPU synchronisation of its own,
every rank acts on a directive at the same iteration even when the agent's copies reach the ranks at
different steps, a late copy is ignored.

    torchrun --standalone --nproc-per-node 2 bench/agreed_directive.py [--device cpu] [--every K]

NCCL on GPUs (NVLink multicast stays off: NCCL_NVLS_ENABLE=0), gloo on the CPU; `--backend gloo` with
`--device cuda` puts every rank on the GPUs there are (rank r on cuda:(r mod GPUs): two ranks share one GPU,
which NCCL refuses), with the CUDA model and a synchronous vote:

    torchrun --standalone --nproc-per-node 2 bench/agreed_directive.py --device cuda --backend gloo  # one GPU
 The model is DDP over the
world, so the vote's group is the world; `--hsdp` gives each rank its own one-rank replica group (vote off)
to check that the rows still travel over the world group. Directive seq 7 reaches rank 0 at its 3rd report
and every other rank at its 9th; seq 9 reaches the last rank only, at its 14th. `agreed_directive()` runs
every `--every` steps under torch.cuda.set_sync_debug_mode("error") (a synchronising CUDA call raises), with
torch.distributed's collectives counted around it. Rank 0 prints one line per rank: `rank R got
[[iteration, target, seq, reason], ...] own_collectives=0`, then PASS (every rank the same list, seqs [7, 9]
with the agent's reasons "d7", "d9" on every rank (seq 9 reaches only the last rank), zero
own collectives) or FAIL; the exit status is non-zero on FAIL. On NCCL a directive is acted on one step
later than on gloo (the row of the previous step is read).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksums.monitor import Monitor
from checksums.reporter import Directive, ReporterStats, StepReport

_COLLECTIVES = tuple(n for n in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                                  "broadcast", "all_gather_object", "barrier", "reduce_scatter_tensor")
                     if hasattr(dist, n))       # all_gather_single: torch >= 2.13


class DirectiveAt:
    """A StepSink that hands directive `seq` to this rank when it has received `n` reports ({n: seq})."""

    def __init__(self, at: dict[int, int]) -> None:
        self.at = dict(at)
        self.reports = 0

    def submit(self, report: StepReport) -> bool:
        self.reports += 1
        return True

    def take_directives(self) -> list[Directive]:
        seq = self.at.pop(self.reports, None)
        return [] if seq is None else [Directive(kind=Directive.KIND_ROLLBACK, target_step=seq, skip_batches=1,
                                                 reason=f"d{seq}", event_seq=seq)]

    def stats(self) -> ReporterStats:
        return ReporterStats(sent=self.reports)


def _count(counter: list[int]) -> None:
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            counter[0] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counted)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--every", type=int, default=1, help="call agreed_directive() every K steps")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--hsdp", action="store_true", help="one-rank replica groups: the vote is off")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                    help="default: nccl on cuda, gloo on cpu (gloo on cuda: ranks may share a GPU)")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = args.device == "cuda"
    backend = args.backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        ap.error("--backend nccl needs --device cuda")
    if cuda:
        gpus = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if gpus < 1:
            ap.error("--device cuda: no GPU visible")
        if backend == "nccl" and local_world > gpus:
            ap.error(f"{local_world} ranks on this node over NCCL need {local_world} GPUs, {gpus} visible "
                     "(NCCL refuses two ranks on one GPU): use --backend gloo")
        torch.cuda.set_device(local % gpus)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
    net: nn.Module = model if args.hsdp else nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    at = {3: 7} if rank == 0 else {9: 7}
    if rank == world - 1:
        at[14] = 9
    monitor = Monitor.attach(net, opt, job_id="agreed-bench", vote_enabled=not args.hsdp, reporter=DirectiveAt(at))
    counter = [0]
    _count(counter)
    got: list[list[Any]] = []
    own = 0
    x = torch.randn(64, 256, device=device)
    for i in range(1, args.steps + 1):
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        monitor.step(loss.detach())
        if i % args.every == 0:
            before = counter[0]
            if cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                d = monitor.agreed_directive()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            own += counter[0] - before
            if d is not None:
                got.append([i, d.target_step, d.event_seq, d.reason])
    monitor.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (got, own))
    ok = True
    if rank == 0:
        for r, (g, o) in enumerate(everyone):
            print(f"rank {r} got {g} own_collectives={o}")
        ok = (all(g == everyone[0][0] for g, _ in everyone) and [g[2] for g in everyone[0][0]] == [7, 9]
              and [g[3] for g in everyone[0][0]] == ["d7", "d9"] and all(o == 0 for _, o in everyone))
        print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
