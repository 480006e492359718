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
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from sdcwatch.extras import require

require("transformers")
from transformers import TrainerCallback  # noqa: E402

from checksums.reporter import Directive  # noqa: E402
from integrations.session import SessionOptions, LossTap, TrainingSession, torch_optimizer  # noqa: E402

logger = logging.getLogger(__name__)


class SdcwatchCallback(TrainerCallback):
    """See the module docstring. job_id: the agent's job; save_every: steps between checkpoints (0: none);
    checkpoints=False: no checkpoint client; recovery: ReplicaRecovery on the step guard; monitor_kwargs:
    for `Monitor.attach` (every=, canary=, reporter=, agent_socket=...); agent_target: the agent's gRPC
    target for checkpoints (default: found like the CLI finds it)."""

    def __init__(self, job_id: str, *, save_every: int = 50, checkpoints: bool = True, recovery: bool = True,
                 monitor_kwargs: Mapping[str, Any] | None = None, agent_target: str | None = None) -> None:
        self.options = SessionOptions(job_id, save_every=save_every, checkpoints=checkpoints, recovery=recovery,
                                      monitor_kwargs=dict(monitor_kwargs or {}), agent_target=agent_target)
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

    # ---- Trainer events ----------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if model is None or optimizer is None:
            raise ValueError("SdcwatchCallback: the Trainer passed no model or optimizer at on_train_begin")
        self._model = model
        self._optimizer = torch_optimizer(optimizer)
        self._scheduler = lr_scheduler
        self.session = self.options.start(
            model, self._optimizer, state_fn=self._state, load_fn=self._load,
            start_step=int(state.global_step), batches_per_step=int(args.gradient_accumulation_steps))
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
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        if self.session is not None:
            self.session.close()
