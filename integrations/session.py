"""The README's training loop as an object a framework's hooks drive, once per optimizer step.

    session = TrainingSession(model, optimizer, job_id="run-42", state_fn=get_state, load_fn=put_state)
    ...                                       # the framework runs forward, backward, optimizer.step()
    directive = session.step(loss)            # after each optimizer step, on every rank at the same point
    if directive is not None and directive.kind == directive.KIND_STOP: ...   # the framework stops
    session.close()

What `step()` does (the README's loop, line by line): `monitor.step(loss, grad_norm)`; a checkpoint of
`state_fn()` through the agent every `save_every` steps (as `monitor.step_count`, the step guard's number);
`monitor.agreed_directive()`, the same directive on every rank at the same call; for a rollback it restores
the target step through the checkpoint client (every chunk verified), hands the state to `load_fn`,
renumbers the step guard and skips the directive's batches. It returns the directive it acted on (the
framework then sets its own step counter: `directive.target_step`) or None.

Skipping batches: a framework owns its data loader, so the session skips a batch's *update* instead: a GATE
stage on the step guard (`rollback.skip_batches`) vetoes the next ceil(skip_batches / batches_per_step)
optimizer steps (the batches are read and run forward and backward, the weights do not change; the steps
keep their numbers, as every vetoed step does). `batches_per_step` is the gradient accumulation factor.

Training-side module: torch only; never imports the agent.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from checkpoint.client import CheckpointClient
from checksums.monitor import Monitor
from checksums.replica_recovery import ReplicaRecovery
from checksums.reporter import Directive
from checksums.step_guard import Phase, StepContext, Veto
from sdcwatch.arguments import wire_name
from sdcwatch.names import JOB_ID

logger = logging.getLogger(__name__)

StateFn = Callable[[], Mapping[str, Any]]
LoadFn = Callable[[Mapping[str, Any]], None]


class SkipBatches:
    """GATE stage: vetoes the next `remaining` updates (the batches a rollback directive skips)."""

    phase = Phase.GATE
    name = "rollback.skip_batches"

    def __init__(self) -> None:
        self.remaining = 0
        self.vetoed = 0

    def run(self, ctx: StepContext) -> Veto | None:
        if self.remaining <= 0:
            return None
        self.remaining -= 1
        self.vetoed += 1
        return Veto(self.name, f"skipping the batches of a rollback directive ({self.remaining} more steps)")


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """What a framework callback takes from its user and hands to every `TrainingSession` it starts
    (the HF and Lightning callbacks share it). job_id: the agent's job; save_every: steps between
    checkpoints (0: none); checkpoints=False: no checkpoint client; recovery: ReplicaRecovery on the step
    guard; monitor_kwargs: for `Monitor.attach`; agent_target: the agent's gRPC target for checkpoints."""

    job_id: str
    save_every: int = 50
    checkpoints: bool = True
    recovery: bool = True
    monitor_kwargs: Mapping[str, Any] | None = None
    agent_target: str | None = None

    def __post_init__(self) -> None:
        # refused when the callback is made, not at the first training step's attach
        wire_name("job_id", self.job_id, JOB_ID, optional=False)

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> "TrainingSession":
        """A session with these options; `kwargs`: the framework's own (state_fn, load_fn, start_step, ...)."""
        return TrainingSession(model, optimizer, job_id=self.job_id, save_every=self.save_every,
                               checkpoints=self.checkpoints, recovery=self.recovery,
                               monitor_kwargs=self.monitor_kwargs, agent_target=self.agent_target, **kwargs)


class TrainingSession:
    """See the module docstring.

    model, optimizer: the rank's model (any wrapper: DDP, FSDP2, torch.compile) and its torch optimizer.
    state_fn: the state to checkpoint (e.g. {"model": ..., "optim": ..., "sched": ...}); load_fn: puts a
    restored state back. save_every: steps between checkpoints (0: none). checkpoints: False for no
    checkpoint client (no rollback possible), or a ready `CheckpointClient`. recovery: attach
    `ReplicaRecovery` (a replica mismatch vetoes the next update; 3+ replicas repair). start_step: the
    guard's number at attach (a resumed run). monitor_kwargs: passed to `Monitor.attach` (e.g. every=,
    reporter=, agent_socket=, canary=)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, job_id: str,
                 state_fn: StateFn, load_fn: LoadFn, save_every: int = 50,
                 checkpoints: bool | CheckpointClient = True, recovery: bool = True,
                 start_step: int | None = None, batches_per_step: int = 1,
                 monitor_kwargs: Mapping[str, Any] | None = None, agent_target: str | None = None) -> None:
        if not isinstance(save_every, int) or save_every < 0:
            raise ValueError(f"save_every must be an int >= 0, got {save_every!r}")
        if not isinstance(batches_per_step, int) or batches_per_step < 1:
            raise ValueError(f"batches_per_step must be an int >= 1, got {batches_per_step!r}")
        self.state_fn, self.load_fn = state_fn, load_fn
        self.save_every = save_every
        self.batches_per_step = batches_per_step
        self.monitor = Monitor.attach(model, optimizer, job_id=job_id, start_step=start_step,
                                      **dict(monitor_kwargs or {}))
        assert self.monitor.guard is not None
        self.guard = self.monitor.guard
        self.recovery = ReplicaRecovery.attach(self.monitor) if recovery else None
        self.skipper = SkipBatches()
        self.guard.add(self.skipper)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.ckpt: CheckpointClient | None
        if isinstance(checkpoints, CheckpointClient):
            self.ckpt = checkpoints
        elif checkpoints:
            self.ckpt = CheckpointClient.connect(job_id, self.rank, self.world_size, target=agent_target,
                                                 guard=self.guard)
        else:
            self.ckpt = None
        self._own_ckpt = self.ckpt is not None and not isinstance(checkpoints, CheckpointClient)
        self._last_saved = -1
        self.rollbacks: list[Directive] = []
        self.directives: list[Directive] = []
        self._closed = False

    @property
    def step_count(self) -> int:
        """The step guard's number: the optimizer steps taken, skipped ones included."""
        return self.monitor.step_count

    def step(self, loss: Any = None, grad_norm: Any = None) -> Directive | None:
        """After each optimizer step, on every rank at the same point (see the module docstring)."""
        self.monitor.step(loss, grad_norm)
        step = self.monitor.step_count
        if (self.ckpt is not None and self.save_every and step % self.save_every == 0
                and step != self._last_saved):
            self.ckpt.save(step, self.state_fn())
            self._last_saved = step
        directive = self.monitor.agreed_directive()
        if directive is None:
            return None
        self.directives.append(directive)
        if directive.kind == Directive.KIND_ROLLBACK:
            self.rollback(directive)
        elif directive.kind == Directive.KIND_SKIP_BATCHES:
            self._skip(directive.skip_batches)
        elif directive.kind == Directive.KIND_STOP:
            logger.error("sdcwatch: the agent asks this job to stop: %s", directive.reason)
        return directive

    @property
    def stopped(self) -> Directive | None:
        """The STOP directive the job took, or None. The agent sends one when a GPU of the job keeps
        computing wrong (`job.stop_directive`); the framework then ends training as it ends any run, so a
        script checks this after training returns and exits non-zero (`sys.exit(session.stopped.reason)`)
        for its launcher to restart the job without that GPU, from `target_step` (a VERIFIED checkpoint)."""
        return next((d for d in reversed(self.directives) if d.kind == Directive.KIND_STOP), None)

    def rollback(self, directive: Directive) -> None:
        """Restore `directive.target_step` (verified), load it, renumber the guard, skip its batches."""
        if self.ckpt is None:
            logger.error("sdcwatch: rollback directive to step %d but no checkpoint client (checkpoints="
                         "False): not restored", directive.target_step)
            return
        self.ckpt.wait(600)                  # saves still in flight land before the restore reads the agent
        state = self.ckpt.restore(directive.target_step, device=self.monitor.device)
        self.load_fn(state)
        self.guard.note_restore(directive.target_step)   # the votes before it veto no redone update
        self.guard.renumber(directive.target_step)
        self._last_saved = directive.target_step
        self._skip(directive.skip_batches)
        self.rollbacks.append(directive)
        logger.warning("sdcwatch: rolled back to step %d (%s); skipping %d batches", directive.target_step,
                       directive.reason, directive.skip_batches)

    def _skip(self, batches: int) -> None:
        if batches > 0:
            self.skipper.remaining += math.ceil(batches / self.batches_per_step)

    def close(self) -> None:
        """Flush the Monitor, wait for checkpoint copies, close what the session opened. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.ckpt is not None:
            try:
                self.ckpt.wait(60)
            except Exception as err:  # noqa: BLE001 - closing must not fail the end of training
                logger.warning("sdcwatch: checkpoint copies still in flight at close: %s", err)
        self.monitor.close()
        self.guard.remove(self.skipper.name)
        if self.recovery is not None:
            self.recovery.detach()
        if self.ckpt is not None and self._own_ckpt:
            self.ckpt.close()


# ---- helpers the adapters share --------------------------------------------------------------------

def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's AcceleratedOptimizer (and similar `.optimizer` wrappers)."""
    seen = 0
    while not _is_plain(optimizer) and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"sdcwatch needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def _is_plain(optimizer: Any) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer")


def output_loss(output: Any, detach: bool = True) -> torch.Tensor | None:
    """The loss of a model output (a ModelOutput, a dict with "loss", or a 0-dim tensor), or None; detached
    unless `detach=False` (a replay differentiates it)."""
    loss = None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif hasattr(output, "loss"):
        loss = output.loss
    elif torch.is_tensor(output):
        loss = output
    elif isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        loss = output[0]
    if torch.is_tensor(loss) and loss.numel() == 1:
        return loss.detach() if detach else loss
    return None


def compute_options(compute: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """A callback's `compute=` option: None (no compute checks), or the keyword arguments for
    `ComputeChecks.attach` (True: its defaults). Refuses what the callback sets itself."""
    if compute is False or compute is None:
        return None
    if compute is True:
        return {}
    if not isinstance(compute, Mapping):
        raise TypeError(f"compute= is True, False or a dict of ComputeChecks options, got {type(compute).__name__}")
    taken = sorted({"loss_fn", "monitor"} & set(compute))
    if taken:
        raise ValueError(f"compute= cannot set {', '.join(taken)}: the callback supplies them")
    return dict(compute)


@contextlib.contextmanager
def silenced(obj: Any, *methods: str) -> Iterator[None]:
    """`obj`'s `methods` do nothing inside the block (a replay of a step must not log its metrics again)."""
    for name in methods:
        setattr(obj, name, _nothing)
    try:
        yield
    finally:
        for name in methods:
            obj.__dict__.pop(name, None)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class LossTap:
    """A forward hook that keeps the training loss of each micro-batch (summed on the device, averaged at
    `take()`): no host sync."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._sum: torch.Tensor | None = None
        self._n = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        loss = output_loss(output)
        if loss is None:
            return
        loss = loss.reshape(()).float()
        self._sum = loss if self._sum is None else self._sum + loss
        self._n += 1

    def take(self) -> torch.Tensor | None:
        if self._sum is None:
            return None
        out = self._sum / self._n if self._n > 1 else self._sum
        self._sum, self._n = None, 0
        return out

    def remove(self) -> None:
        self._handle.remove()
