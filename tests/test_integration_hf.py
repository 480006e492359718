"""Issue 25: the Hugging Face Trainer callback (integrations/hf.py) on 2 gloo ranks (accelerate's DDP on CPU,
started like torchrun) training a tiny GPT-2 built from a config (no download), with the real agent.

With one bit flipped in rank 1's weights after update FLIP: the vote catches it, the agent's rollback
directive takes both ranks (the Trainer's model, optimizer, scheduler and global_step) back to a VERIFIED
checkpoint before the flip, and the replicas end bit-identical. A clean run: no rollback, no event."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from agent_harness import AgentProcess
from framework_support import (
    HOLD_AFTER_FLIP, check_clean, check_dropped_and_named, check_recovered, check_stopped,
    run_with_agent, checkpoint_states,
    flip_bit, mismatch_events,
    preloads, replicas_identical, settled_journal, spawn, torchrun_env, wait_directive, wait_verified,
)

JOB = "hf-gpt2"
STEPS, FLIP, SAVE_EVERY = 60, 30, 10
FAULT = 40          # the optimizer step whose backward is faulty on rank 1 (after the checks' 20 warm-up steps)


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


@preloads("transformers.trainer", "transformers.models.gpt2.modeling_gpt2", "integrations.hf")
def _worker(rank: int, world: int, port: int, socket: str, outdir: str, flip: bool, compute: Any = False,
            fault: str = "", accumulate: int = 1, bind: bool = True) -> None:
    torchrun_env(rank, world, port, socket)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from integrations.hf import SdcwatchCallback

    out: dict[str, Any] = {"rollbacks": []}
    try:
        model = tiny_gpt2()
        sdc = SdcwatchCallback(job_id=JOB, save_every=SAVE_EVERY, compute=compute)
        faulted: list[int] = []

        def bad_element(grad: torch.Tensor) -> torch.Tensor | None:
            # rank 1's backward: one element of a weight's gradient before DDP reduces it, at the last
            # micro-batch of step FAULT ("transient": once; a replay computes it right) or in every backward
            # from step FAULT on, replays too ("persistent")
            step = sdc.session.guard.step + 1 if sdc.session is not None else 0
            if rank != 1 or not fault or step < FAULT:
                return None
            if fault == "transient" and (faulted or step != FAULT):
                return None
            faulted.append(step)
            grad = grad.clone()
            grad.view(-1)[7] = 100.0
            return grad

        model.transformer.h[0].mlp.c_fc.weight.register_hook(bad_element)

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
                elif fault == "persistent" and rank == 1 and not self.held \
                        and sdc.session.guard.step == FAULT + HOLD_AFTER_FLIP:
                    self.held = True          # nor before its STOP (planned seconds behind on a loaded machine)
                    wait_directive(JOB, kind="job.stop_directive")

        args = TrainingArguments(
            output_dir=os.path.join(outdir, f"out{rank}"), use_cpu=True, ddp_backend="gloo", max_steps=STEPS,
            per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=5,
            logging_steps=1000, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_num_workers=0, max_grad_norm=1.0, gradient_accumulation_steps=accumulate)
        # two epochs' worth of batches in the one epoch max_steps asks for: the redone steps need batches
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(16 * STEPS * accumulate),
                          callbacks=[Flip(), sdc])
        if bind:
            sdc.bind(trainer)
        assert sdc.session is None
        try:
            trainer.train()
        except ValueError as e:
            out["error"] = str(e)
            return
        sess = sdc.session
        out["rollbacks"] = [d.target_step for d in sess.rollbacks]
        out["final_step"] = sess.step_count
        out["framework_step"] = trainer.state.global_step
        out["monitor_events"] = [e.kind for e in sess.monitor.events if e.kind not in ("directive",)]
        out["identical"] = replicas_identical(list(model.parameters()))
        out["skipped"] = sess.guard.skipped_count
        if sdc.checks is not None:
            out["compute"] = dataclasses.asdict(sdc.checks.status())
            out["compute"]["mode"] = sdc.checks.mode()
            out["findings"] = [dataclasses.asdict(f) for f in sdc.checks.findings]
        out["faulted"] = sorted(set(faulted))
        stop = sess.stopped
        out["stopped"] = None if stop is None else {"target": stop.target_step, "reason": stop.reason}
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


def test_hf_trainer_compute_checks_drop_a_faulty_backward_and_name_the_rank(short_tmp: Path,
                                                                          tmp_path: Path) -> None:
    """One element of rank 1's gradient set to 100 in its backward at step FAULT (the all-reduce would
    average it into both replicas, where the vote cannot see it): that step's update is dropped on both
    ranks, rank 1 named transient by the pair replays (run through the Trainer's compute_loss), the agent's
    journal names rank 1, and the run goes on to the end with the replicas bit-identical."""
    res, lines, states = run_with_agent(short_tmp / "state", tmp_path, JOB, _worker, False, True, "transient")
    assert res[1]["faulted"] == [FAULT], res[1]
    check_dropped_and_named(res, lines, FAULT, STEPS)


def test_hf_trainer_stops_for_a_gpu_that_keeps_computing_wrong(short_tmp: Path, tmp_path: Path) -> None:
    """Rank 1 computes one gradient element wrong in every backward from step FAULT, replays too: named
    persistent, the agent's STOP reaches both ranks at one step, the Trainer stops there, and
    `session.stopped` names rank 1 and a VERIFIED checkpoint before the fault to restart from."""
    res, lines, states = run_with_agent(short_tmp / "state", tmp_path, JOB, _worker,
                                        False, True, "persistent")
    check_stopped(res, lines, states, FAULT, STEPS)


def test_hf_trainer_compute_audits_agree_under_accumulation(short_tmp: Path, tmp_path: Path) -> None:
    """Replays must reproduce the Trainer's step bit for bit: audits every 5 steps over 2 accumulated
    micro-batches (the Trainer divides each loss by 2, or the model normalises by num_items_in_batch) raise
    no suspicion, stay exact, and the clean run has no event."""
    res, lines, states = run_with_agent(short_tmp / "state", tmp_path, JOB, _worker,
                                        False, {"audit_every": 5}, "", 2)
    check_clean(res, lines, states, STEPS)
    for r in res:
        c = r["compute"]
        assert c["mode"] == "exact" and c["audits"] >= STEPS // 5 - 2 and c["suspicions"] == 0, r
        assert r["skipped"] == 0 and not r["findings"], r


def test_hf_trainer_compute_checks_need_bind(short_tmp: Path, tmp_path: Path) -> None:
    """compute= without bind(trainer): a clear ValueError at train(), before any step."""
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = spawn(_worker, 2, str(agent.socket), tmp_path, False, True, "", 1, False)
    finally:
        agent.stop()
    for r in res:
        assert "sdc.bind(trainer)" in r.get("error", ""), r
