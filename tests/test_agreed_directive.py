"""Issue 18 item 4: the agent hands a directive to each rank in its own next reply, so ranks see it at
different iterations. `Monitor.agreed_directive()` makes every rank act on it at the same iteration (the
README loop calls it), and a copy reaching a rank later is not acted on again."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import rank_spawn
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
    rank_spawn.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] == [[3, Directive.KIND_ROLLBACK, 2, 3, 41]]


class DirectiveAt(RecordingReporter):
    """Hands directive `seq` to this rank at each iteration listed in `at` (iteration = reports so far)."""

    def __init__(self, at: dict[int, int]) -> None:
        super().__init__()
        self.at = at

    def take_directives(self) -> list[Directive]:
        seq = self.at.pop(len(self.reports), None)
        if seq is None:
            return []
        return [Directive(kind=Directive.KIND_ROLLBACK, target_step=seq, skip_batches=1, reason=f"d{seq}",
                          event_seq=seq)]


_COLLECTIVES = tuple(n for n in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                                  "broadcast", "all_gather_object", "barrier", "reduce_scatter_tensor")
                     if hasattr(dist, n))       # all_gather_single: torch >= 2.13


def _count_collectives(counter: list[int]) -> None:
    """Wrap torch.distributed's collectives (the Monitor calls them through the module) to count calls."""
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            counter[0] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counted)


def _every_few_worker(rank: int, store: str, outdir: str) -> None:
    from checksums.monitor import Monitor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # no replica group (vote off): the rows still travel over the world group.
        # seq 7 reaches rank 0 at iteration 2 and rank 1 at 6; seq 9 reaches rank 1 only, at iteration 8.
        at = {2: 7} if rank == 0 else {6: 7, 8: 9}
        monitor = Monitor.attach(model, opt, job_id="agree-few", vote_enabled=False, reporter=DirectiveAt(at))
        counter = [0]
        _count_collectives(counter)
        got: list[Any] = []
        own = 0
        for i in range(1, 16):
            opt.zero_grad()
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            monitor.step()
            if i % 3 == 0:                       # every few steps
                before = counter[0]
                d = monitor.agreed_directive()
                own += counter[0] - before
                if d is not None:
                    got.append([i, d.target_step, d.event_seq, d.reason])
        monitor.close()
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"got": got, "own": own}))
    finally:
        dist.destroy_process_group()


def test_agreed_directive_issues_no_collective_and_ranks_agree_when_called_every_few_steps(tmp_path: Path) -> None:
    rank_spawn.spawn(_every_few_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert out[0]["own"] == out[1]["own"] == 0            # the rows travel in step(), not in the call
    # the first call (iteration 3) switches the rows on; seq 7 (held by rank 0 since iteration 2) is agreed
    # at the next call on both ranks, rank 1's late copy (iteration 6) is ignored, seq 9 (rank 1 only) reaches
    # rank 0 through the rows.
    assert [g[:3] for g in out[0]["got"]] == [g[:3] for g in out[1]["got"]] == [[6, 7, 7], [9, 9, 9]]
    # every rank reports the agent's reason: rank 0, which the agent never handed seq 9, reads it in the rows
    # rank 1 sent (it said "agreed across the ranks" before, and so did a loaded CI run's STOP on one rank)
    assert out[0]["got"][1][3] == out[1]["got"][1][3] == "d9"
    assert out[0]["got"][0][3] == out[1]["got"][0][3] == "d7"
