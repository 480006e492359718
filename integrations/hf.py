"""sdcwatch in a Hugging Face `transformers.Trainer`: one callback (`pip install 'sdcwatch[hf]'`).

    from integrations.hf import SdcwatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SdcwatchCallback(job_id="gpt2-run3", save_every=50)])
    trainer.train()

At `on_train_begin` (after the Trainer wrapped the model in DDP/FSDP and built the optimizer) the callback
starts an `integrations.session.TrainingSession` on the Trainer's model and optimizer (accelerate's
`AcceleratedOptimizer` is unwrapped to the torch optimizer, whose `optimizer.step()` the step guard hooks).
At each `on_step_end` (after `optimizer.step()`, `lr_scheduler.step()` and `zero_grad`) it runs the session's
step with the loss of that step (read from the model's output by a forward hook: a device tensor, never
`.item()`), checkpoints {"model", "optim", "sched"} through the agent every `save_every` steps, and honours
the agent's directives through the Trainer's own state:

- rollback: the model, optimizer and LR scheduler are loaded from the verified checkpoint, the step guard
  and `state.global_step` go back to its step (so `max_steps` counts the redone steps), and the directive's
  batches are skipped: their updates are vetoed (ceil(skip_batches / gradient_accumulation_steps) steps);
- skip batches: the same skip without a restore;
- stop: `control.should_training_stop = True`.

`check_grads=True` is not available here (the Trainer zeroes the gradients before `on_step_end`).

Compute checks (`compute=True`, or a dict of `ComputeChecks.attach` options such as `audit_every`, `margin`,
`mask`): a fault in one rank's forward or backward, which the all-reduce would average into every replica,
is caught before the optimizer applies it (docs/compute-checks.md). A callback is not handed the Trainer,
and a replay needs it (the step's loss is the Trainer's own `compute_loss`, scaled as its `training_step`
scales it), so bind it once the Trainer exists:

    sdc = SdcwatchCallback(job_id="gpt2-run3", save_every=50, compute=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[sdc])
    sdc.bind(trainer)
    trainer.train()

`bind` wraps that Trainer's `training_step` to retain each micro-batch (and its `num_items_in_batch`) before
its forward. A replay runs `trainer.compute_loss` on the module DDP wraps (accelerate's autocast is on its
forward), divided by the accumulation steps unless the Trainer's loss is already scaled for them (the model
takes `num_items_in_batch`, a `compute_loss_func`, or `loss_is_scaled_for_ga`), as `training_step` does; under
fp16 the accelerator's GradScaler is passed. A replay that does not reproduce its step (a `training_step`
overridden to change the loss) is found at the first step and no GPU is named on replays then (the mode
reads `unreproducible: ...`). Needs DDP (several processes; FSDP and DeepSpeed are refused with a message).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from sdcwatch.extras import require

require("transformers")
from transformers import TrainerCallback  # noqa: E402

import torch  # noqa: E402

from checksums.compute_gate import ComputeChecks  # noqa: E402
from checksums.reporter import Directive  # noqa: E402
from integrations.session import (  # noqa: E402
    SessionOptions, LossTap, TrainingSession, compute_options, torch_optimizer,
)

logger = logging.getLogger(__name__)


class SdcwatchCallback(TrainerCallback):
    """See the module docstring. job_id: the agent's job; save_every: steps between checkpoints (0: none);
    checkpoints=False: no checkpoint client; recovery: ReplicaRecovery on the step guard; monitor_kwargs:
    for `Monitor.attach` (every=, canary=, reporter=, agent_socket=...); agent_target: the agent's gRPC
    target for checkpoints (default: found like the CLI finds it); compute: the compute checks (module
    docstring; needs `bind(trainer)`)."""

    def __init__(self, job_id: str, *, save_every: int = 50, checkpoints: bool = True, recovery: bool = True,
                 monitor_kwargs: Mapping[str, Any] | None = None, agent_target: str | None = None,
                 compute: bool | Mapping[str, Any] = False) -> None:
        self.options = SessionOptions(job_id, save_every=save_every, checkpoints=checkpoints, recovery=recovery,
                                      monitor_kwargs=dict(monitor_kwargs or {}), agent_target=agent_target)
        self.compute = compute_options(compute)
        self.checks: ComputeChecks | None = None
        self._trainer: Any = None
        self.session: TrainingSession | None = None
        self._tap: LossTap | None = None
        self._model: Any = None
        self._optimizer: Any = None
        self._scheduler: Any = None

    # ---- the state a checkpoint holds --------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state = {"model": self._model.state_dict(), "optim": self._optimizer.state_dict()}
        if self._scheduler is not None:
            state["sched"] = self._scheduler.state_dict()
        return state

    def _load(self, state: Mapping[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optim"])
        if self._scheduler is not None and "sched" in state:
            self._scheduler.load_state_dict(state["sched"])

    # ---- the compute checks' replays ----------------------------------------------------------------

    def bind(self, trainer: Any) -> None:
        """Give the callback its Trainer (for `compute=`): that Trainer's `training_step` retains each
        micro-batch for a replay. Once per Trainer; the callback must be among its callbacks."""
        if self._trainer is not None:
            raise ValueError("SdcwatchCallback.bind: already bound to a Trainer")
        if self not in getattr(trainer.callback_handler, "callbacks", []):
            raise ValueError("SdcwatchCallback.bind: the callback is not one of this Trainer's callbacks "
                             "(pass it in Trainer(callbacks=[...]) or trainer.add_callback)")
        self._trainer = trainer
        inner = trainer.training_step

        def training_step(model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            # passed on as given: a Trainer before num_items_in_batch calls training_step(model, inputs)
            if self.checks is not None:
                self.checks.retain((inputs, a[0] if a else kw.get("num_items_in_batch")))
            return inner(model, inputs, *a, **kw)

        trainer.training_step = training_step

    def _attach_checks(self, args: Any) -> ComputeChecks:
        trainer = self._trainer
        assert self.session is not None and self.compute is not None and trainer is not None
        ddp = trainer.model_wrapped
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(f"sdcwatch's compute checks need DDP (several processes, no FSDP or DeepSpeed); "
                             f"the Trainer's model is a {type(ddp).__name__}")

        def replay_loss(module: Any, item: Any) -> torch.Tensor:
            """The micro-batch's loss again, as the Trainer's training_step back-propagated it."""
            inputs, items = item
            inputs = trainer._prepare_inputs(inputs)
            extra = {} if items is None else {"num_items_in_batch": items}   # a Trainer before it: none
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(module, inputs, **extra)
            if args.n_gpu > 1:
                loss = loss.mean()
            scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
            if scaled is None:
                scaled = (bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and items is not None) \
                    or getattr(trainer, "compute_loss_func", None) is not None
            if not scaled:
                loss = loss / getattr(trainer, "current_gradient_accumulation_steps",
                                      args.gradient_accumulation_steps)
            return loss

        options = dict(self.compute)
        options.setdefault("scaler", getattr(trainer.accelerator, "scaler", None))   # fp16: its GradScaler
        return ComputeChecks.attach(ddp, self._optimizer, loss_fn=replay_loss, monitor=self.session.monitor,
                                    **options)

    # ---- Trainer events ----------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if model is None or optimizer is None:
            raise ValueError("SdcwatchCallback: the Trainer passed no model or optimizer at on_train_begin")
        if self.compute is not None and self._trainer is None:
            raise ValueError("SdcwatchCallback(compute=...): call sdc.bind(trainer) before trainer.train() "
                             "(a replay runs the Trainer's compute_loss)")
        self._model = model
        self._optimizer = torch_optimizer(optimizer)
        self._scheduler = lr_scheduler
        self.session = self.options.start(
            model, self._optimizer, state_fn=self._state, load_fn=self._load,
            start_step=int(state.global_step), batches_per_step=int(args.gradient_accumulation_steps))
        if self.compute is not None:
            try:
                self.checks = self._attach_checks(args)
            except BaseException:
                self.session.close()
                self.session = None
                raise
        self._tap = LossTap(model)

    def on_step_end(self, args: Any, state: Any, control: Any, lr_scheduler: Any = None,
                    **kwargs: Any) -> None:
        if self.session is None:
            return
        if lr_scheduler is not None:
            self._scheduler = lr_scheduler
        directive = self.session.step(self._tap.take() if self._tap is not None else None)
        if directive is None:
            return
        if directive.kind == Directive.KIND_ROLLBACK and self.session.rollbacks \
                and self.session.rollbacks[-1] is directive:
            state.global_step = directive.target_step
            if state.max_steps > 0 and state.global_step < state.max_steps:
                control.should_training_stop = False   # the steps redone count towards max_steps again
        elif directive.kind == Directive.KIND_STOP:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.checks is not None:      # kept: its status() and findings stay readable after training
            self.checks.close()
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        if self.session is not None:
            self.session.close()
