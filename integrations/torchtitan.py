"""sdcwatch in torchtitan (0.3): a checkpoint manager its trainer config names (`pip install
'sdcwatch[torchtitan]'`).

    from integrations.torchtitan import SdcwatchCheckpointer
    config = Trainer.Config(...,
                            checkpoint=SdcwatchCheckpointer.Config(job_id="llama3-8b", sdcwatch_interval=50))

torchtitan's trainer builds its checkpoint manager from `config.checkpoint` after it parallelized the model
(FSDP2/HSDP, TP, compile) and built the optimizers, with the whole train state (`states`: the trainer's
step and token count, the model parts, the `OptimizersContainer`, the LR schedulers, the data loader), and
calls `save(step)` after every optimizer step. `SdcwatchCheckpointer` is torchtitan's own DCP
`CheckpointManager` (its files, when `enable=True`, are unchanged) plus, on every `save(step)`:

- `monitor.step()`: fingerprints and the replica vote (HSDP's replicate dim, or DDP's world; plain FSDP
  says no vote is possible, `docs/frameworks.md`), with `ReplicaRecovery` on the optimizers' step guard;
- every `sdcwatch_interval` steps, the full train state through DCP into the agent's memory tier
  (`checkpoint.dcp.SdcwStorageWriter`: DTensor shards, resharding on load, the data loader's and
  schedulers' plain values without pickle);
- the agreed directive: a rollback loads the VERIFIED step's full train state through DCP (the trainer's
  `step` comes back with it, so the loop redoes the steps), renumbers the step guard and skips the
  directive's batches (their updates vetoed); the redone steps are saved again (the writer's next begin
  carries the restore, `SdcwStorageWriter.note_restore`, and the agent cuts the steps after the target
  first; a rank's step report showing the job went back cuts them too: `Coordinator.cut_history`);
  stop ends the loop (`training.steps` set to the current step).

With `sdcwatch_resume=True`, `load()` at the start (when torchtitan's own folder holds no checkpoint) loads
the full train state from the agent's newest VERIFIED checkpoint of the job (or of `load_step`).
Tested with torchtitan's own `Trainer` in tests/test_torchtitan_trainer.py; naming it in a torchtitan
config-registry function: docs/frameworks.md.

The loss is not reported (torchtitan computes it inside `train_step`; no hook hands it out), so the agent's
loss detector does not run for these jobs; the replica vote, fingerprints and checks do.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from sdcwatch.extras import require

require("torchtitan")
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

from checkpoint.agent_link import GrpcAgentLink  # noqa: E402
from checkpoint.dcp import SdcwStorageReader, SdcwStorageWriter  # noqa: E402
from checksums.monitor import Monitor  # noqa: E402
from checksums.replica_recovery import ReplicaRecovery  # noqa: E402
from checksums.reporter import Directive  # noqa: E402
from integrations.session import SkipBatches  # noqa: E402

logger = logging.getLogger(__name__)


class SdcwatchCheckpointer(CheckpointManager):
    """See the module docstring."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        job_id: str = ""
        """The sdcwatch job id (required): names the job at the agent."""

        sdcwatch_interval: int = 50
        """Steps between full-train-state checkpoints into the agent's memory (0: none)."""

        monitor_every: int = 1
        """Fingerprint check every N steps."""

        recovery: bool = True
        """A replica mismatch vetoes the next update (3+ replicas: repaired in place)."""

        agent_target: str | None = None
        """The agent's gRPC target (default: found as the CLI finds it)."""

        sdcwatch_resume: bool = False
        """At `load()`, when torchtitan's own folder has no checkpoint: resume from the newest VERIFIED
        checkpoint the agent holds for `job_id` (or the agent's checkpoint of `load_step`, when set)."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[Any], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        if not config.job_id:
            raise ValueError("SdcwatchCheckpointer.Config needs job_id")
        super().__init__(config, dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                         lr_schedulers=lr_schedulers, states=states, sd_adapter=sd_adapter,
                         base_folder=base_folder)
        self.sdc_config = config
        self.train_state = states.get("train_state")
        # the full train state, as torchtitan's own manager saves it (Stateful objects, loaded in place)
        self.sdc_states: dict[str, Any] = {"train_state": self.train_state, "optimizer": optimizers,
                                           "lr_scheduler": lr_schedulers}
        for i, part in enumerate(model_parts):
            self.sdc_states[f"model_{i}"] = _ModelState(part)
        if dataloader is not None:
            self.sdc_states["dataloader"] = dataloader
        self.sdc_states = {k: v for k, v in self.sdc_states.items() if v is not None}
        model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)
        self.monitor = Monitor.attach(model, optimizers, job_id=config.job_id, every=config.monitor_every)
        assert self.monitor.guard is not None
        self.guard = self.monitor.guard
        self.recovery = ReplicaRecovery.attach(self.monitor) if config.recovery else None
        self.skipper = SkipBatches()
        self.guard.add(self.skipper)
        self.link = GrpcAgentLink.connect(config.agent_target, 10.0) if config.sdcwatch_interval else None
        self.writer = SdcwStorageWriter(self.link, config.job_id) if self.link is not None else None
        self.rollbacks: list[Directive] = []
        self._sdc_closed = False

    # ---- torchtitan's manager interface (the public methods: they run when enable=False too) ---------

    def load(self, step: int = -1) -> bool:
        loaded = super().load(step)
        if not loaded and self.sdc_config.sdcwatch_resume:
            loaded = self._resume_from_agent(step)
        if self.train_state is not None:      # a resumed run: the weights are at the trainer's step
            self.guard.renumber(int(self.train_state.step))
        return loaded

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        self.monitor.step(step=curr_step)
        every = self.sdc_config.sdcwatch_interval
        if self.writer is not None and every and curr_step % every == 0:
            dcp.save(self.sdc_states, storage_writer=self.writer, checkpoint_id=curr_step)
        saved = super().save(curr_step, last_step)
        directive = self.monitor.agreed_directive()
        if directive is not None:
            self._act(directive)
        return saved

    def close(self) -> None:
        if not self._sdc_closed:
            self._sdc_closed = True
            self.monitor.close()
            if self.link is not None:
                self.link.close()
        super().close()

    def _resume_from_agent(self, step: int) -> bool:
        """Load the full train state of the agent's checkpoint `step` (-1: its newest VERIFIED one) through
        DCP. The ranks agree on the step (the smallest any rank sees VERIFIED: each rank may ask the agent
        at a slightly different moment), so all load the same one."""
        if self.link is None:
            raise ValueError("SdcwatchCheckpointer: sdcwatch_resume needs sdcwatch_interval > 0 "
                             "(the agent link)")
        if step < 0:
            newest = self.link.latest_verified(self.sdc_config.job_id)
            step = newest.step if newest is not None else -1
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                flag = torch.tensor([step], dtype=torch.int64, device=self.monitor.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                step = int(flag.item())
        if step < 0:
            logger.info("sdcwatch: the agent holds no VERIFIED checkpoint of %s; starting afresh",
                        self.sdc_config.job_id)
            return False
        self._load_from_agent(step)
        logger.info("sdcwatch: resumed %s from the agent's checkpoint of step %d",
                    self.sdc_config.job_id, step)
        return True

    def _load_from_agent(self, step: int) -> None:
        """The full train state of the agent's checkpoint `step`, through DCP; the writer is told, so the
        saves after it (the redone steps) have the agent cut the job's history there first."""
        assert self.link is not None
        started = time.time()
        dcp.load(self.sdc_states, storage_reader=SdcwStorageReader(self.link, self.sdc_config.job_id),
                 checkpoint_id=step)
        if self.writer is not None:
            self.writer.note_restore(step, started)

    # ---- directives ----------------------------------------------------------------------------------

    def _act(self, directive: Directive) -> None:
        if directive.kind == Directive.KIND_ROLLBACK:
            if self.link is None:
                logger.error("sdcwatch: rollback directive but sdcwatch_interval=0 (no checkpoints): ignored")
                return
            self._load_from_agent(directive.target_step)
            if self.train_state is not None:
                self.train_state.step = directive.target_step
            self.guard.note_restore(directive.target_step)   # the votes before it veto no redone update
            self.guard.renumber(directive.target_step)
            self._skip(directive.skip_batches)
            self.rollbacks.append(directive)
            logger.warning("sdcwatch: rolled back to step %d (%s)", directive.target_step, directive.reason)
        elif directive.kind == Directive.KIND_SKIP_BATCHES:
            self._skip(directive.skip_batches)
        elif directive.kind == Directive.KIND_STOP:
            logger.error("sdcwatch: the agent asks this job to stop: %s", directive.reason)
            training = getattr(getattr(self.train_state, "config", None), "training", None)
            if training is not None:
                training.steps = int(self.train_state.step)

    def _skip(self, batches: int) -> None:
        if batches > 0:
            self.skipper.remaining += math.ceil(batches / _accumulation(self.train_state))


class _ModelState:
    """A model part as a DCP Stateful (its own state_dict/load_state_dict: DTensors stay sharded)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)


def _accumulation(train_state: Any) -> int:
    return max(1, int(getattr(train_state, "gradient_accumulation_steps", 1) or 1))
