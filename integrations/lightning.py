"""sdcwatch in a Lightning `Trainer`: one callback (`pip install 'sdcwatch[lightning]'`).

    from integrations.lightning import SdcwatchCallback
    trainer = L.Trainer(strategy="ddp", max_steps=10_000,
                        callbacks=[SdcwatchCallback(job_id="gpt2-run3", save_every=50)])
    trainer.fit(module, loader)

At `on_train_start` (after the strategy wrapped the module and set up the optimizer) the callback starts an
`integrations.session.TrainingSession` on the LightningModule and the trainer's (single) torch optimizer.
After each batch whose optimizer step ran (`on_train_batch_end`; with gradient accumulation, every k-th
batch) it runs the session's step with the batch's loss (`outputs["loss"]`, detached, never `.item()`),
checkpoints {"model", "optim", "sched"} through the agent every `save_every` steps, and honours the agent's
directives through the trainer's own state:

- rollback: the module, optimizer and LR schedulers are loaded from the verified checkpoint, the step
  guard and `trainer.global_step` (the loop's optimizer-step progress) go back to its step, so `max_steps`
  counts the redone steps, and the directive's batches are skipped: their updates are vetoed
  (ceil(skip_batches / accumulate_grad_batches) steps);
- skip batches: the same skip without a restore;
- stop: `trainer.should_stop = True`.

Compute checks (`compute=True`, or a dict of `ComputeChecks.attach` options such as `audit_every`, `margin`,
`mask`, `comm_hook`): a fault in one rank's forward or backward, which the all-reduce would average into every
replica, is caught before the optimizer applies it (docs/compute-checks.md). Strategy "ddp" (the DDP
wrapper's buckets are summarised in its communication hook; a `DDPStrategy(ddp_comm_hook=...)` is refused:
give the hook as `compute={"comm_hook": ...}` instead), automatic optimization. Each batch is retained at
`on_train_batch_start` (after it was moved to the device) with its index; a replay runs the module's
`training_step(batch, batch_idx)` (what Lightning's DDP forward runs), under the precision plugin's autocast
as the step did, divided by `accumulate_grad_batches` as Lightning's closure divides it, with `self.log`
silenced (a replay must not log twice), and under "16-mixed" times the scale the precision plugin's gradient
scaler applied to that step (given to the checks as `scaler=`; a step the scaler skips for an overflow is
judged at the next batch, and an overflow that reproduces everywhere names no GPU). "32-true", "bf16-mixed"
and "16-mixed" work. What cannot be checked is refused at `on_train_start`, before anything is attached.

Automatic optimization with one optimizer; with manual optimization, call the session yourself
(`callback.session.step(loss)` after your `opt.step()`).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from sdcwatch.extras import require

require("lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402

from checksums.compute_gate import ComputeChecks  # noqa: E402
from checksums.reporter import Directive  # noqa: E402
from integrations.session import (  # noqa: E402
    SessionOptions, TrainingSession, compute_options, output_loss, silenced, torch_optimizer,
)

logger = logging.getLogger(__name__)


def set_global_step(trainer: Any, step: int) -> None:
    """Set Lightning's optimizer-step progress (what `trainer.global_step` reads) to `step`."""
    loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        total = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        total = loop.manual_optimization.optim_step_progress.total
    total.ready = total.completed = step
    loop._batches_that_stepped = step


class SdcwatchCallback(Callback):
    """See the module docstring; the options are those of `integrations.hf.SdcwatchCallback`."""

    def __init__(self, job_id: str, *, save_every: int = 50, checkpoints: bool = True, recovery: bool = True,
                 monitor_kwargs: Mapping[str, Any] | None = None, agent_target: str | None = None,
                 compute: bool | Mapping[str, Any] = False) -> None:
        self.options = SessionOptions(job_id, save_every=save_every, checkpoints=checkpoints, recovery=recovery,
                                      monitor_kwargs=dict(monitor_kwargs or {}), agent_target=agent_target)
        self.compute = compute_options(compute)
        self.session: TrainingSession | None = None
        self.checks: ComputeChecks | None = None
        self._trainer: Any = None
        self._module: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._attempts = 0

    def _state(self) -> dict[str, Any]:
        assert self._optimizer is not None
        state: dict[str, Any] = {"model": self._module.state_dict(), "optim": self._optimizer.state_dict()}
        scheds = [c.scheduler.state_dict() for c in self._trainer.lr_scheduler_configs]
        if scheds:
            state["sched"] = scheds
        return state

    def _load(self, state: Mapping[str, Any]) -> None:
        assert self._optimizer is not None
        self._module.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optim"])
        for config, sd in zip(self._trainer.lr_scheduler_configs, state.get("sched", [])):
            config.scheduler.load_state_dict(sd)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"sdcwatch's Lightning callback supports one optimizer, got "
                             f"{len(trainer.optimizers)}; attach a Monitor per optimizer instead")
        self._trainer, self._module = trainer, pl_module
        self._optimizer = torch_optimizer(trainer.optimizers[0])
        if self.compute is not None:
            _refuse_unchecked(trainer, pl_module)
        self.session = self.options.start(
            pl_module, self._optimizer, state_fn=self._state, load_fn=self._load,
            start_step=int(trainer.global_step), batches_per_step=int(trainer.accumulate_grad_batches))
        self._attempts = self.session.guard.attempts
        if self.compute is not None:
            try:
                self.checks = self._attach_checks(trainer, pl_module)
            except BaseException:
                self.session.close()
                raise

    def _attach_checks(self, trainer: Any, pl_module: Any) -> ComputeChecks:
        assert self.session is not None and self._optimizer is not None and self.compute is not None
        precision = trainer.strategy.precision_plugin
        normalize = int(trainer.accumulate_grad_batches)

        def replay_loss(module: Any, item: Any) -> torch.Tensor:
            """The step's loss again, on the module DDP wraps (the LightningModule: Lightning's DDP forward is
            its training_step, redirected)."""
            batch, batch_idx = item
            with precision.train_step_context(), silenced(module, "log", "log_dict"):
                out = module.training_step(batch, batch_idx)
            loss = output_loss(out, detach=False)
            if loss is None:
                raise ValueError("sdcwatch: training_step returned no loss for a compute replay")
            return loss / normalize            # what Lightning back-propagates (its closure divides, always)

        options = dict(self.compute)
        options.setdefault("scaler", getattr(precision, "scaler", None))   # "16-mixed": its GradScaler
        return ComputeChecks.attach(trainer.strategy.model, self._optimizer, loss_fn=replay_loss,
                                    monitor=self.session.monitor, **options)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.checks is not None:
            self.checks.retain((batch, batch_idx))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self.session
        if session is None or session.guard.attempts == self._attempts:
            return                              # no optimizer step this batch (gradient accumulation)
        self._attempts = session.guard.attempts
        directive = session.step(output_loss(outputs))
        self._attempts = session.guard.attempts
        if directive is None:
            return
        if directive.kind == Directive.KIND_ROLLBACK and session.rollbacks[-1:] == [directive]:
            set_global_step(trainer, directive.target_step)
        elif directive.kind == Directive.KIND_STOP:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.checks is not None:      # kept: its status() and findings stay readable after training
            self.checks.close()
        if self.session is not None:
            self.session.close()


def _refuse_unchecked(trainer: Any, pl_module: Any) -> None:
    """ValueError for a training the compute checks cannot follow (the module docstring says why)."""
    ddp = trainer.strategy.model
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"sdcwatch's compute checks need strategy='ddp' (a DistributedDataParallel model), "
                         f"got {type(trainer.strategy).__name__} with a {type(ddp).__name__} model")
    if not pl_module.automatic_optimization:
        raise ValueError("sdcwatch's compute checks need automatic optimization (a replay runs training_step, "
                         "which under manual optimization steps the optimizer itself)")
