"""Issue 25: the torchtitan checkpoint manager (integrations/torchtitan.py), built from its config class with
torchtitan's own components (`OptimizersContainer`, `LRSchedulersContainer`, the DCP `CheckpointManager` it
extends) and driven the way torchtitan's `Trainer.train` drives it (step += 1, train_step, optimizers.step,
lr_schedulers.step, checkpointer.save(step)), on 2 gloo ranks with HSDP (`fully_shard` on a (2, 1) mesh:
DTensor parameters, the replicas on the "replicate" dim) and the real agent.

torchtitan's `Trainer` itself is started in tests/test_torchtitan_trainer.py (a tokenizer and a data set
made on disk, a tiny llama3 flavour); here the manager sees the objects the trainer hands it, on a hand-made
model.

One bit flipped in rank 1's shard after step FLIP: the vote catches it, the agent's rollback directive
loads the full train state (model, optimizers, schedulers, the trainer's step) through DCP from a VERIFIED
checkpoint before the flip, both ranks together, and the replicas end bit-identical."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent_harness import AgentProcess
from framework_support import (
    HOLD_AFTER_FLIP, check_recovered, checkpoint_states, flip_bit, mismatch_events, replicas_identical,
    settled_journal, spawn, torchrun_env, wait_directive, wait_verified,
)

JOB = "titan-tiny"
STEPS, FLIP, SAVE_EVERY = 40, 20, 5


class TrainState:
    """What torchtitan's Trainer is to its checkpointer: a Stateful with `step` and `ntokens_seen`."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


def _worker(rank: int, world: int, port: int, socket: str, outdir: str) -> None:
    torchrun_env(rank, world, port, socket)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {"rollbacks": []}
    try:
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

        from integrations.torchtitan import SdcwatchCheckpointer

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop").build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers,
                                                                        training_steps=STEPS)
        trainer = TrainState()
        ckpt = SdcwatchCheckpointer.Config(job_id=JOB, sdcwatch_interval=SAVE_EVERY).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={"train_state": trainer}, sd_adapter=None, base_folder=os.path.join(outdir, f"out{rank}"))
        ckpt.load(step=-1)
        gen = torch.Generator().manual_seed(rank)
        w_true = torch.linspace(-1, 1, 8).reshape(8, 1)
        flipped = held = False
        while trainer.step < STEPS:                    # Trainer.train's loop
            trainer.step += 1
            optimizers.zero_grad()
            x = torch.randn(16, 8, generator=gen)
            loss = (model(x) - x @ w_true).pow(2).mean()
            loss.backward()
            optimizers.step()
            schedulers.step()
            if rank == 1 and not flipped and ckpt.guard.step == FLIP:
                flipped = True
                wait_verified(JOB)                    # a VERIFIED checkpoint before the flip exists
                flip_bit(model[0].weight._local_tensor)
            elif flipped and not held and ckpt.guard.step == FLIP + HOLD_AFTER_FLIP:
                held = True
                wait_directive(JOB)                   # the run does not end before the agent's rollback
            ckpt.save(trainer.step, last_step=trainer.step == STEPS)
        out["rollbacks"] = [d.target_step for d in ckpt.rollbacks]
        out["final_step"] = ckpt.monitor.step_count
        out["framework_step"] = trainer.step
        out["identical"] = replicas_identical([p._local_tensor for p in model.parameters()])
        ckpt.close()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def test_torchtitan_checkpointer_recovers_from_a_flip(short_tmp: Path, tmp_path: Path) -> None:
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = spawn(_worker, 2, str(agent.socket), tmp_path)
        lines = settled_journal(agent, since="job.rollback ")
        mismatches = mismatch_events(agent)
        states = checkpoint_states(agent, JOB)
    finally:
        agent.stop()
    check_recovered(res, lines, states, FLIP, STEPS, mismatches)
