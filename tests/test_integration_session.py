"""Issue 25: the framework-free core of the adapters (integrations/session.py), in one process with a
recording reporter that hands out directives: skip-batches vetoes the right number of updates (with
gradient accumulation: ceil(batches / k)), stop is returned to the framework, checkpoints are taken every
`save_every` steps at the guard's number, and a closed session leaves the optimizer unguarded."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from checksums.reporter import Directive
from checksums.step_guard import StepGuard
from integrations.session import TrainingSession, output_loss, torch_optimizer
from support import RecordingReporter


class Handing(RecordingReporter):
    """Hands `directives[step]` out with the report of that step."""

    def __init__(self, directives: dict[int, Directive]) -> None:
        super().__init__()
        self.directives = directives
        self._due: list[Directive] = []

    def submit(self, report: Any) -> bool:
        if report.step in self.directives:
            self._due.append(self.directives[report.step])
        return super().submit(report)

    def take_directives(self) -> list[Directive]:
        due, self._due = self._due, []
        return due


class Saves:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def save(self, step: int, state: Any) -> None:
        self.steps.append(step)


def _run(directives: dict[int, Directive], steps: int, batches_per_step: int = 1,
         took: list | None = None) -> tuple[Any, list, list]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sess = TrainingSession(model, opt, job_id="j", state_fn=lambda: {"w": model.weight},
                           load_fn=lambda s: None, save_every=3, checkpoints=False,
                           batches_per_step=batches_per_step,
                           monitor_kwargs={"reporter": Handing(directives)})
    saves = Saves()
    sess.ckpt = saves   # type: ignore[assignment]   # records what would go to the agent
    changed, got = [], []
    for _ in range(steps):
        before = model.weight.detach().clone()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        changed.append(not torch.equal(before, model.weight))
        d = sess.step(torch.tensor(1.0))
        if d is not None:
            got.append((sess.step_count, d.kind))
    sess.ckpt = None
    sess.close()
    if took is not None:
        took.append(sess)
    assert StepGuard.of(opt) is None or not StepGuard.of(opt).stages, "closing removes the session's stages"
    return saves, changed, got


def test_skip_batches_vetoes_that_many_updates_and_stop_is_returned() -> None:
    saves, changed, got = _run({2: Directive(Directive.KIND_SKIP_BATCHES, skip_batches=3),
                                7: Directive(Directive.KIND_STOP, reason="operator")}, 9)
    assert changed == [True, True, False, False, False, True, True, True, True], changed
    assert got == [(2, Directive.KIND_SKIP_BATCHES), (7, Directive.KIND_STOP)]
    assert saves.steps == [3, 6, 9]


def test_stopped_is_the_stop_directive_the_session_took() -> None:
    took: list = []
    _run({2: Directive(Directive.KIND_SKIP_BATCHES, skip_batches=1)}, 4, took=took)
    assert took[0].stopped is None
    _run({3: Directive(Directive.KIND_STOP, target_step=1, reason="GPU-x computes wrong")}, 5, took=took)
    assert took[1].stopped is not None and took[1].stopped.reason == "GPU-x computes wrong"
    assert took[1].stopped.target_step == 1


def test_with_gradient_accumulation_a_skip_counts_optimizer_steps() -> None:
    _, changed, _ = _run({1: Directive(Directive.KIND_SKIP_BATCHES, skip_batches=5)}, 5, batches_per_step=4)
    assert changed == [True, False, False, True, True], changed   # ceil(5 / 4) = 2 updates


def test_helpers_find_the_loss_and_the_torch_optimizer() -> None:
    class Wrapper:   # accelerate's AcceleratedOptimizer keeps the torch optimizer as .optimizer
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    assert torch_optimizer(Wrapper(opt)) is opt and torch_optimizer(opt) is opt
    loss = torch.tensor(2.0, requires_grad=True)
    assert output_loss({"loss": loss}).requires_grad is False
    assert output_loss((loss, torch.zeros(3))) is not None
    assert output_loss(torch.zeros(3)) is None


def test_a_callbacks_job_id_the_agent_would_refuse_is_refused_when_the_callback_is_made() -> None:
    """The HF and Lightning callbacks share SessionOptions: a job id with a space or a slash (a run name
    taken as it is) was taken, then refused by Monitor.attach at the first step or, before, by the agent on
    every report."""
    from integrations.hf import SdcwatchCallback

    for bad, message in (("my run/3", "job_id 'my run/3' is invalid"), ("", "a non-empty string"),
                         (7, "job_id is a string")):
        with pytest.raises(ValueError, match=message):
            SdcwatchCallback(job_id=bad)  # type: ignore[arg-type]
    assert SdcwatchCallback(job_id="my-run.3").options.job_id == "my-run.3"
