"""Issue 25: the Hugging Face Trainer callback (integrations/hf.py) on 2 gloo ranks (accelerate's DDP on CPU,
started like torchrun) training a tiny GPT-2 built from a config (no download), with the real agent.

With one bit flipped in rank 1's weights after update FLIP: the vote catches it, the agent's rollback
directive takes both ranks (the Trainer's model, optimizer, scheduler and global_step) back to a VERIFIED
checkpoint before the flip, and the replicas end bit-identical. A clean run: no rollback, no event."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from agent_harness import AgentProcess
from framework_support import (
    HOLD_AFTER_FLIP, check_clean, check_recovered, checkpoint_states, flip_bit, mismatch_events,
    replicas_identical, settled_journal, spawn, torchrun_env, wait_directive, wait_verified,
)

JOB = "hf-gpt2"
STEPS, FLIP, SAVE_EVERY = 60, 30, 10


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    """Deterministic sequences with a learnable pattern (token i+1 = token i + 1 mod 64)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, 64, (n, 1), generator=g)
        self.ids = (starts + torch.arange(16)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _worker(rank: int, world: int, port: int, socket: str, outdir: str, flip: bool) -> None:
    torchrun_env(rank, world, port, socket)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from integrations.hf import SdcwatchCallback

    out: dict[str, Any] = {"rollbacks": []}
    try:
        model = tiny_gpt2()
        sdc = SdcwatchCallback(job_id=JOB, save_every=SAVE_EVERY)

        class Flip(TrainerCallback):
            done = held = False

            def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if flip and rank == 1 and not self.done and sdc.session.guard.step == FLIP:
                    self.done = True
                    wait_verified(JOB)
                    flip_bit(model.transformer.h[0].mlp.c_fc.weight)
                elif self.done and not self.held and sdc.session.guard.step == FLIP + HOLD_AFTER_FLIP:
                    self.held = True
                    wait_directive(JOB)       # the run does not end before the agent's rollback

        args = TrainingArguments(
            output_dir=os.path.join(outdir, f"out{rank}"), use_cpu=True, ddp_backend="gloo", max_steps=STEPS,
            per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=5,
            logging_steps=1000, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_num_workers=0, max_grad_norm=1.0)
        # two epochs' worth of batches in the one epoch max_steps asks for: the redone steps need batches
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(16 * STEPS), callbacks=[Flip(), sdc])
        assert sdc.session is None
        trainer.train()
        sess = sdc.session
        out["rollbacks"] = [d.target_step for d in sess.rollbacks]
        out["final_step"] = sess.step_count
        out["framework_step"] = trainer.state.global_step
        out["monitor_events"] = [e.kind for e in sess.monitor.events if e.kind not in ("directive",)]
        out["identical"] = replicas_identical(list(model.parameters()))
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_trainer_recovers_from_a_flip(short_tmp: Path, tmp_path: Path) -> None:
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = spawn(_worker, 2, str(agent.socket), tmp_path, True)
        lines = settled_journal(agent, since="job.rollback ")
        mismatches = mismatch_events(agent)
        states = checkpoint_states(agent, JOB)
    finally:
        agent.stop()
    for r in res:   # the vote's veto and the skipped update are the rank's local events
        r["monitor_events"] = []
    check_recovered(res, lines, states, FLIP, STEPS, mismatches)


def test_hf_trainer_clean_run_has_no_events(short_tmp: Path, tmp_path: Path) -> None:
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = spawn(_worker, 2, str(agent.socket), tmp_path, False)
        lines = settled_journal(agent)
        states = checkpoint_states(agent, JOB)
    finally:
        agent.stop()
    check_clean(res, lines, states, STEPS)
