"""Issue 18 item 4: the agent hands a directive to each rank in its own next reply, so ranks see it at
different iterations. `Monitor.agreed_directive()` makes every rank act on it at the same iteration (the
README loop calls it), and a copy reaching a rank later is not acted on again."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from checksums.reporter import Directive
from support import RecordingReporter


class LateDirectives(RecordingReporter):
    """Hands the directive to this rank at iteration `at` (rank 0 earlier than rank 1)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def take_directives(self) -> list[Directive]:
        if len(self.reports) == self.at:
            return [Directive(kind=Directive.KIND_ROLLBACK, target_step=2, skip_batches=3, reason="test",
                              event_seq=41)]
        return []


def _worker(rank: int, store: str, outdir: str) -> None:
    from checksums.monitor import Monitor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = Monitor.attach(ddp, opt, job_id="agree", reporter=LateDirectives(at=3 if rank == 0 else 5))
        got: list[Any] = []
        for i in range(1, 9):
            loss = ddp(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            monitor.step(loss.detach())
            d = monitor.agreed_directive()
            if d is not None:
                got.append([i, d.kind, d.target_step, d.skip_batches, d.event_seq])
        monitor.close()
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_every_rank_acts_on_a_directive_at_the_same_iteration_once(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] == [[3, Directive.KIND_ROLLBACK, 2, 3, 41]]
