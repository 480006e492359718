"""The step guard around optimizer.step(): stage order by phase, vetoes that skip the update and keep the
step's number, the checkpoint copies waited for before the update, and the README loop's step numbers.

Real torch optimizers on CPU; the README loop on 2 gloo ranks with a real Coordinator (Redis) behind the
checkpoint client; the deferred checkpoint copy on a CUDA GPU (marked gpu).
"""
from __future__ import annotations

from support import RecordingReporter

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import rank_spawn
from torch import nn

from checkpoint.client import CheckpointClient
from checkpoint.errors import InvalidInputError
from checkpoint.snapshot import CheckpointCopies, SnapshotConfig
from checksums.fingerprint import fingerprint_tensors
from checksums.monitor import Monitor
from checksums.step_guard import Phase, StepContext, StepGuard, StepGuardError, Veto
from ckpt_support import job_id, node


class Recorder:
    """A stage that notes, into a shared trace, when it ran and whether the weight had changed by then."""

    def __init__(self, name: str, phase: Phase, trace: list[tuple[str, int, bool]], weight: torch.Tensor,
                 veto_steps: tuple[int, ...] = ()) -> None:
        self.name, self.phase, self.trace = name, phase, trace
        self.weight, self.start = weight, weight.detach().clone()
        self.veto_steps = veto_steps

    def run(self, ctx: StepContext) -> Veto | None:
        self.trace.append((self.name, ctx.step, not torch.equal(self.weight, self.start)))
        if ctx.step in self.veto_steps:
            return Veto(self.name, f"test veto at step {ctx.step}")
        return None


class Applied:
    """An after-update stage that notes whether each step's update was applied."""

    name, phase = "after", Phase.AFTER

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool | None]] = []

    def run(self, ctx: StepContext) -> Veto | None:
        self.seen.append((ctx.step, ctx.applied))
        return None


class Raising:
    name, phase = "raises", Phase.GATE

    def run(self, ctx: StepContext) -> Veto | None:
        raise RuntimeError("a broken check")


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_stages_run_in_phase_order_whatever_the_order_they_were_added() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard.attach(opt)
    trace: list[tuple[str, int, bool]] = []
    for name, phase in [("z.after", Phase.AFTER), ("repair", Phase.REPAIR), ("b.gate", Phase.GATE),
                        ("copies", Phase.COPIES), ("a.gate", Phase.GATE)]:
        guard.add(Recorder(name, phase, trace, model.weight))
    assert [s.name for s in guard.stages] == ["copies", "a.gate", "b.gate", "repair", "z.after"]
    _train_step(model, opt, 0)
    # every stage before the update saw the old weights, the one after saw the new ones
    assert trace == [("copies", 1, False), ("a.gate", 1, False), ("b.gate", 1, False), ("repair", 1, False),
                     ("z.after", 1, True)]
    guard.remove("repair")
    assert [s.name for s in guard.stages] == ["copies", "a.gate", "b.gate", "z.after"]


def test_a_veto_skips_the_update_and_the_step_keeps_its_number() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    reporter = RecordingReporter()
    monitor = Monitor.attach(model, opt, job_id="j", reporter=reporter)
    trace: list[tuple[str, int, bool]] = []
    monitor.guard.add(Recorder("gate", Phase.GATE, trace, model.weight, veto_steps=(2,)))
    after = Applied()
    monitor.guard.add(after)
    states = []
    for i in range(3):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad for p in model.parameters()]
        moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()] if i else None
        opt.step()
        changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
        states.append(changed)
        if i == 1:      # the vetoed step: weights and Adam's state untouched, gradients given back
            assert changed == [False, False]
            assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
            assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        monitor.step(1.0)
        opt.zero_grad()
    assert states[0] == states[2] == [True, True]
    guard = monitor.guard
    assert guard.step == 3 and monitor.step_count == 3
    assert guard.stats.applied == 2 and guard.stats.skipped == 1
    (skip,) = guard.skipped
    assert (skip.step, skip.stage) == (2, "gate") and "test veto" in skip.reason
    assert [r.step for r in reporter.requests] == [1, 2, 3]                 # not renumbered
    assert [(e.kind, e.step) for e in monitor.events] == [("step.skipped", 2)]
    assert after.seen == [(1, True), (2, False), (3, True)]                 # after-stages see applied or not
    assert [step for _, step, _ in trace] == [1, 2, 3]
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


def test_a_step_the_optimizer_never_took_is_counted_as_skipped() -> None:
    # GradScaler does not call optimizer.step() when it finds inf/NaN gradients: Monitor.step() counts it
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reporter = RecordingReporter()
    monitor = Monitor.attach(model, opt, job_id="j", reporter=reporter)
    _train_step(model, opt, 0)
    monitor.step(1.0)
    monitor.step(float("inf"))                 # the skipped iteration
    _train_step(model, opt, 1)
    monitor.step(1.0)
    assert [r.step for r in reporter.requests] == [1, 2, 3]
    assert [(s.step, s.stage) for s in monitor.guard.skipped] == [(2, "")]
    assert [e.kind for e in monitor.events] == ["nonfinite.loss"]       # a not-called step is no veto event
    # step= renumbers: the loop owns the numbers (a restore to step 10, say)
    _train_step(model, opt, 2)
    monitor.step(1.0, step=11)
    _train_step(model, opt, 3)
    monitor.step(1.0)
    assert [r.step for r in reporter.requests][-2:] == [11, 12] and monitor.guard.step == 12


def test_stage_rules_are_checked_when_added() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    guard = StepGuard.attach(opt)
    w = torch.zeros(1)
    with pytest.raises(StepGuardError, match="UPDATE"):
        guard.add(Recorder("x", Phase.UPDATE, [], w))
    guard.add(Recorder("x", Phase.GATE, [], w))
    with pytest.raises(StepGuardError, match="already"):
        guard.add(Recorder("x", Phase.AFTER, [], w))
    with pytest.raises(TypeError, match="not a Stage"):
        guard.add(object())  # type: ignore[arg-type]
    with pytest.raises(StepGuardError, match="already has a step guard"):
        StepGuard(opt)
    assert StepGuard.attach(opt) is guard is StepGuard.of(opt)
    guard.close()
    assert StepGuard.of(opt) is None


def test_a_failing_stage_is_logged_once_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard.attach(opt)
    guard.add(Raising())
    with caplog.at_level(logging.ERROR, logger="checksums.step_guard"):
        for i in range(3):
            before = model.weight.detach().clone()
            _train_step(model, opt, i)
            assert not torch.equal(before, model.weight)
    assert guard.stats.errors == 3 and guard.stats.applied == 3
    assert sum("raises" in r.getMessage() for r in caplog.records) == 1


def test_a_veto_of_a_closure_step_is_refused_not_applied() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    guard = StepGuard.attach(opt)
    x = torch.randn(4, 3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)                               # no veto: a closure step runs as usual
    assert guard.step == 1
    guard.add(Recorder("gate", Phase.GATE, [], model.weight, veto_steps=(2,)))
    before = model.weight.detach().clone()
    with pytest.raises(StepGuardError, match="closure"):
        opt.step(closure)
    assert torch.equal(before, model.weight)


def test_a_closure_step_runs_the_stages_after_the_closure_and_can_be_vetoed() -> None:
    """Issue 25: Lightning passes forward and backward as the closure of `optimizer.step(closure)`; a
    first-order optimizer evaluates it once, so the stages run once the gradients exist, and a veto
    hides them."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard.attach(opt)
    x = torch.randn(4, 3)
    seen: list[bool] = []

    class Look:
        name, phase = "look", Phase.GATE

        def run(self, ctx: Any) -> Any:
            seen.append(model.weight.grad is not None)
            return Veto(self.name, "no") if ctx.step == 2 else None

    guard.add(Look())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    before = model.weight.detach().clone()
    opt.step(closure)
    assert not torch.equal(before, model.weight) and seen == [True]
    before = model.weight.detach().clone()
    opt.step(closure=closure)                       # vetoed: the closure ran, the update did not
    assert torch.equal(before, model.weight) and seen == [True, True]
    assert model.weight.grad is not None, "the gradients are given back after the veto"
    assert guard.step == 2 and guard.stats.skipped == 1


def test_a_compiled_models_optimizer_is_guarded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="aot_eager")   # the training graph; inductor needs a C compiler
    opt = torch.optim.AdamW(compiled.parameters(), lr=0.1)
    reporter = RecordingReporter()
    monitor = Monitor.attach(compiled, opt, job_id="j", reporter=reporter)
    monitor.guard.add(Recorder("gate", Phase.GATE, [], model[0].weight, veto_steps=(2,)))
    seen = []
    for i in range(3):
        compiled(torch.randn(8, 3)).pow(2).mean().backward()
        before = model[0].weight.detach().clone()
        opt.step()
        seen.append(torch.equal(before, model[0].weight))
        monitor.step(1.0)
        opt.zero_grad()
    assert seen == [False, True, False]
    assert [r.step for r in reporter.requests] == [1, 2, 3]
    fps = [list(r.fingerprint) for r in reporter.requests]
    assert fps[0] == fps[1] != fps[2]           # the vetoed step left the fingerprinted weights as they were


def test_two_optimizers_get_two_guards_each_with_its_own_count() -> None:
    gen, disc = nn.Linear(3, 3), nn.Linear(3, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    guard_g, guard_d = StepGuard.attach(opt_g), StepGuard.attach(opt_d)
    assert guard_g is not guard_d
    guard_d.add(Recorder("gate", Phase.GATE, [], disc.weight, veto_steps=(1,)))
    for _ in range(2):                       # two discriminator steps per generator step
        disc(gen(torch.randn(4, 3)).detach()).sum().backward()
        opt_d.step()
        opt_d.zero_grad()
    before = gen.weight.detach().clone()
    disc(gen(torch.randn(4, 3))).sum().backward()
    opt_g.step()
    assert not torch.equal(before, gen.weight)      # the discriminator's veto is its own
    assert (guard_g.step, guard_d.step) == (1, 2)
    assert [s.step for s in guard_d.skipped] == [1] and guard_g.skipped == []


def test_checkpoint_copies_run_first_and_a_deferred_copy_needs_a_guard(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", key_prefix=f"{job_id('p')}:"), job_id("g")
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard.attach(opt)
    trace: list[tuple[str, int, bool]] = []
    guard.add(Recorder("gate", Phase.GATE, trace, model.weight))
    update = SnapshotConfig(block="update", chunk_bytes=4096, staging="private")
    unbound = CheckpointClient(co, job, 0, 1, config=update)
    with pytest.raises(InvalidInputError, match="step guard"):
        unbound.save(1, {"model": model.state_dict()})
    unbound.close()
    client = CheckpointClient(co, job, 0, 1, config=update, guard=guard)
    (fence,) = [s for s in guard.stages if isinstance(s, CheckpointCopies)]
    assert [s.name for s in guard.stages] == [fence.name, "gate"] and fence.phase == Phase.COPIES
    _train_step(model, opt, 0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert client.save(1, {"model": model.state_dict()}).result(30).state == "COMMITTED"
    _train_step(model, opt, 1)                                # the update after a deferred save
    assert client.restore(1)["model"]["weight"].equal(saved["weight"])
    client.close()
    assert [s.name for s in guard.stages] == ["gate"]        # closing the client takes its stage off


# ---- the README loop on 2 gloo ranks -------------------------------------------------------------------

README_STEPS, SAVE_EVERY, VETO_STEP = 6, 2, 4


def _readme_worker(rank: int, world: int, store: str, outdir: str, redis_port: int, job: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp_model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        reporter = RecordingReporter()
        # as in README.md's "In the training script", with a Coordinator in-process as the agent link
        monitor = Monitor.attach(ddp_model, optimizer, job_id=job, reporter=reporter)
        co = node(redis_port, Path(outdir), f"n{rank}", key_prefix=f"{job}:", keep_committed=8)
        ckpt = CheckpointClient(co, job, rank, world, config=SnapshotConfig(chunk_bytes=4096),
                                guard=monitor.guard)
        # every rank vetoes the same step, as a gate deciding together would
        monitor.guard.add(Recorder("gate", Phase.GATE, [], model[0].weight, veto_steps=(VETO_STEP,)))
        gen = torch.Generator().manual_seed(10 + rank)
        loader = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))
                  for _ in range(README_STEPS)]

        def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            loss = ((ddp_model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        saved = []
        for step, batch in enumerate(loader, start=1):
            loss = train_step(batch)
            monitor.step(loss.detach())
            if step % SAVE_EVERY == 0:
                ckpt.save(step, {"model": model.state_dict(), "step": step})
                saved.append(step)
        ckpt.wait(30)
        dist.barrier()                                 # every rank's shards are in
        monitor.close()
        words = {r.step: [w & (2 ** 64 - 1) for w in r.fingerprint] for r in reporter.requests}
        restored = {}
        for step in saved:
            sd = ckpt.restore(step)["model"]
            fp = fingerprint_tensors([sd[n] for n, _ in model.named_parameters()])
            restored[step] = list(fp) == words[step]
        refused = ""
        try:
            ckpt.save(0, {"model": model.state_dict()})   # a loop that counts from 0 is off by one
        except InvalidInputError as e:
            refused = str(e)
        ckpt.close()
        out = {"reported": sorted(words), "saved": saved, "same_weights": restored, "refused": refused,
               "skipped": [(s.step, s.stage) for s in monitor.guard.skipped],
               "events": [(e.kind, e.step) for e in monitor.events]}
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def test_the_readme_loop_saves_the_step_the_monitor_fingerprinted(redis_server, tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world, job = 2, job_id("readme")
    rank_spawn.spawn(_readme_worker, args=(world, str(tmp_path / "store"), str(tmp_path), redis_server.port, job),
                     nprocs=world)
    for rank in range(world):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["reported"] == list(range(1, README_STEPS + 1))
        assert res["saved"] == [2, 4, 6]
        # the checkpoint of step S holds the weights the Monitor fingerprinted (and the replicas voted on)
        # at S, the vetoed step 4 included
        assert res["same_weights"] == {"2": True, "4": True, "6": True}
        assert res["skipped"] == [[VETO_STEP, "gate"]]
        assert ["step.skipped", VETO_STEP] in res["events"]
        assert "save(step=0)" in res["refused"] and "save as step 6" in res["refused"]


# ---- CUDA: the update waits for a deferred checkpoint copy ---------------------------------------------


@pytest.mark.gpu
def test_cuda_update_waits_for_the_deferred_checkpoint_copy(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", key_prefix=f"{job_id('p')}:"), job_id("cuda")
    torch.manual_seed(0)
    model = nn.Linear(4096, 4096).cuda()               # 64 MiB: the copy takes long enough to race
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    guard = StepGuard.attach(opt)
    client = CheckpointClient(co, job, 0, 1, guard=guard,
                              config=SnapshotConfig(block="update", staging="private"))
    for step in range(1, 4):
        model(torch.randn(64, 4096, device="cuda")).pow(2).mean().backward()
        opt.step()
        expected = model.weight.detach().cpu()
        handle = client.save(step, {"model": model.state_dict()})
        with torch.no_grad():                          # what the next forward/backward would do meanwhile
            model.weight.grad.fill_(1.0)
        opt.step()                                     # the update: waits on the GPU for the copy first
        opt.zero_grad()
        guard.renumber(step)                           # the test's extra update does not count
        assert handle.result(60).state == "COMMITTED", handle.result().error
        assert client.restore(step)["model"]["weight"].equal(expected)
    client.close()
