"""Issue 25: the Lightning callback (integrations/lightning.py) on 2 gloo ranks (strategy "ddp" on CPU,
started like torchrun) training a tiny GPT-2 built from a config (no download), with the real agent.

With one bit flipped in rank 1's weights after update FLIP: the vote catches it, the agent's rollback
directive takes both ranks (the module, optimizer, scheduler and trainer.global_step) back to a VERIFIED
checkpoint before the flip, and the replicas end bit-identical. A clean run: no rollback, no event."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agent_harness import AgentProcess
from framework_support import (
    check_clean, check_recovered, checkpoint_states, flip_bit, mismatch_events, replicas_identical,
    settled_journal, spawn, torchrun_env,
)
from test_integration_hf import Tokens, tiny_gpt2

JOB = "lightning-gpt2"
STEPS, FLIP, SAVE_EVERY = 60, 30, 10


def _worker(rank: int, world: int, port: int, socket: str, outdir: str, flip: bool) -> None:
    torchrun_env(rank, world, port, socket)
    import lightning as L

    from integrations.lightning import SdcwatchCallback

    out: dict[str, Any] = {"rollbacks": []}
    try:
        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.gpt = tiny_gpt2()

            def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
                return self.gpt(**batch).loss

            def configure_optimizers(self) -> Any:
                opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        module = Module()
        sdc = SdcwatchCallback(job_id=JOB, save_every=SAVE_EVERY)

        class Flip(L.Callback):
            done = False

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:   # before sdc's
                if flip and rank == 1 and not self.done and sdc.session.guard.step == FLIP:
                    self.done = True
                    flip_bit(module.gpt.transformer.h[0].mlp.c_fc.weight)

        loader = torch.utils.data.DataLoader(Tokens(8 * STEPS), batch_size=4, shuffle=False)
        trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp", max_steps=STEPS,
                            callbacks=[Flip(), sdc], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                            default_root_dir=str(Path(outdir, f"out{rank}")))
        trainer.fit(module, loader)
        sess = sdc.session
        out["rollbacks"] = [d.target_step for d in sess.rollbacks]
        out["final_step"] = sess.step_count
        out["framework_step"] = trainer.global_step
        out["monitor_events"] = [e.kind for e in sess.monitor.events if e.kind not in ("directive",)]
        out["identical"] = replicas_identical(list(module.parameters()))
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def test_lightning_recovers_from_a_flip(short_tmp: Path, tmp_path: Path) -> None:
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = spawn(_worker, 2, str(agent.socket), tmp_path, True)
        lines = settled_journal(agent, since="job.rollback ")
        mismatches = mismatch_events(agent)
        states = checkpoint_states(agent, JOB)
    finally:
        agent.stop()
    check_recovered(res, lines, states, FLIP, STEPS, mismatches)


def test_lightning_clean_run_has_no_events(short_tmp: Path, tmp_path: Path) -> None:
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = spawn(_worker, 2, str(agent.socket), tmp_path, False)
        lines = settled_journal(agent)
        states = checkpoint_states(agent, JOB)
    finally:
        agent.stop()
    check_clean(res, lines, states, STEPS)
