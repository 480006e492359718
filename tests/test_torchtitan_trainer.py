"""Issue 25: torchtitan's own `Trainer` (0.3.0), started the way `torchtitan.train.main` starts it
(`ConfigManager().parse_args(["--module", ..., "--config", ...])`, `config.build()`, `trainer.train()`,
`trainer.close()`), with `SdcwatchCheckpointer` named in the config-registry function (bench/titan_tiny.py:
a tiny llama3 flavour, HSDP over 2 gloo ranks on the CPU, a BPE tokenizer and a text data set made on
disk by the test), against the real agent.

- resume: a run of STEPS_A steps saves its full train state through the agent every SAVE_A steps; a second
  run of the same job (`sdcwatch_resume`, `load_step=RESUME_AT`) loads the agent's checkpoint of RESUME_AT
  and redoes the steps after it: its weights and token count at the end are bit-identical to the first
  run's (model, AdamW moments, LR schedulers, the data loader's position and the trainer's step all came
  back through DCP).
- flip: one bit flipped in rank 1's weights after step FLIP (an optimizer step post-hook, the fault): the
  replica vote catches it, both ranks load a VERIFIED checkpoint before the flip, the trainer redoes the
  steps to `training.steps`, and the replicas end bit-identical (as test_integration_torchtitan's loop).

torchtitan on a CPU needs bench/titan_tiny.py's shim `run_on_cpu()` (its device globals; see there) and,
with torch 2.13.0, `torch_compat()` (one nightly-only function name)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from agent_harness import AgentProcess
from framework_support import (
    HOLD_AFTER_FLIP, check_clean, check_recovered, checkpoint_states, flip_bit, journal, mismatch_events,
    replicas_identical, settled_journal, spawn, torchrun_env, wait_directive, wait_verified,
)

STEPS_A, SAVE_A, RESUME_AT = 12, 4, 8
STEPS_F, SAVE_F, FLIP = 30, 5, 19
HELD = 20    # saved (holding the flip) before the rollback, at the latest at the save that acts on it


def _env(tmp: Path, job: str, steps: int, save_every: int, **extra: str) -> dict[str, str]:
    from bench.titan_tiny import make_assets
    tok, data = make_assets(tmp / "assets")
    return {"TITAN_TINY_TOKENIZER": str(tok), "TITAN_TINY_DATA": str(data),
            "TITAN_TINY_DUMP": str(tmp / "dump"), "TITAN_TINY_STEPS": str(steps),
            "TITAN_TINY_SAVE_EVERY": str(save_every), "TITAN_TINY_JOB": job,
            "HF_DATASETS_CACHE": str(tmp / "hf-datasets"), **extra}


def _worker(rank: int, world: int, port: int, socket: str, outdir: str, env: dict[str, str],
            flip_at: int) -> None:
    torchrun_env(rank, world, port, socket)
    os.environ.update(env)
    out: dict[str, Any] = {"rollbacks": []}
    try:
        from bench.titan_tiny import run_on_cpu, torch_compat
        run_on_cpu()
        torch_compat()
        from torchtitan.config import ConfigManager

        config = ConfigManager().parse_args(["--module", "bench.titan_tiny", "--config", "sdcwatch_tiny",
                                             *env.get("TITAN_TINY_ARGS", "").split()])
        trainer = config.build()                         # torchtitan.train.main's path
        ckpt = trainer.checkpointer
        out["checkpointer"] = type(ckpt).__name__
        params = [p.to_local() for m in trainer.model_parts for p in m.parameters()]
        if flip_at:
            flipped = []

            def fault(*_: Any) -> None:                   # after the optimizer's update of step flip_at
                if rank == 1 and not flipped and trainer.step == flip_at:
                    flipped.append(trainer.step)
                    wait_verified(env["TITAN_TINY_JOB"])  # a VERIFIED checkpoint before the flip exists
                    flip_bit(params[0])
                elif rank == 1 and len(flipped) == 1 and trainer.step == flip_at + HOLD_AFTER_FLIP:
                    flipped.append(trainer.step)          # held once: the run does not end before the rollback
                    wait_directive(env["TITAN_TINY_JOB"])

            for opt in trainer.optimizers.optimizers:
                opt.register_step_post_hook(fault)
        act = ckpt._act

        def acting(directive: Any) -> None:              # the skipped-step count when the rollback is done
            act(directive)
            out["skips_at_rollback"] = ckpt.guard.skipped_count

        ckpt._act = acting
        try:
            trainer.train()
            out["rollbacks"] = [d.target_step for d in ckpt.rollbacks]
            out["final_step"] = ckpt.monitor.step_count
            out["framework_step"] = trainer.step
            out["ntokens_seen"] = trainer.ntokens_seen
            out["monitor_events"] = [e.kind for e in ckpt.monitor.events if e.kind != "directive"]
            out["skipped_steps"] = [s.step for s in ckpt.guard.skipped]
            if "skips_at_rollback" in out:
                out["skips_after_rollback"] = ckpt.guard.skipped_count - out["skips_at_rollback"]
            out["identical"] = replicas_identical(params)
            weights = b"".join(p.detach().numpy().tobytes() for p in params)
            out["weights_sha"] = hashlib.sha256(weights).hexdigest()
        finally:
            trainer.close()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(agent: AgentProcess, tmp: Path, env: dict[str, str], name: str, flip_at: int = 0) -> list[dict]:
    (tmp / name).mkdir()
    return spawn(_worker, 2, str(agent.socket), tmp / name, env, flip_at)


def test_torchtitan_trainer_resumes_from_the_agent_bit_identically(short_tmp: Path, tmp_path: Path) -> None:
    job = "titan-trainer-resume"
    agent = AgentProcess(short_tmp / "state").start()
    try:
        first = _run(agent, tmp_path, _env(tmp_path, job, STEPS_A, SAVE_A), "first")
        lines = settled_journal(agent)
        states = checkpoint_states(agent, job)
        check_clean(first, lines, states, STEPS_A)
        assert first[0]["checkpointer"] == "SdcwatchCheckpointer"
        assert {s for s, st in states.items() if st == "VERIFIED"} >= {RESUME_AT}, states
        env = _env(tmp_path, job, STEPS_A, SAVE_A, TITAN_TINY_RESUME="1",
                   TITAN_TINY_ARGS=f"--checkpoint.load_step {RESUME_AT}")   # a CLI override, as torchtitan's
        resumed = _run(agent, tmp_path, env, "resumed")
        after = journal(agent)
    finally:
        agent.stop()
    for a, b in zip(first, resumed):
        assert b["framework_step"] == STEPS_A and not b["rollbacks"], b
        assert b["weights_sha"] == a["weights_sha"], "resumed from the agent's checkpoint: bit-identical"
        assert b["ntokens_seen"] == a["ntokens_seen"], (a, b)
    went_back = [line for line in after if "job.rollback " in line and f"restored step {RESUME_AT}" in line]
    assert went_back, after[-20:]


def test_torchtitan_trainer_rolls_back_a_flip(short_tmp: Path, tmp_path: Path) -> None:
    job = "titan-trainer-flip"
    agent = AgentProcess(short_tmp / "state").start()
    try:
        res = _run(agent, tmp_path, _env(tmp_path, job, STEPS_F, SAVE_F), "flip", FLIP)
        lines = settled_journal(agent, since="job.rollback ")
        mismatches = mismatch_events(agent)
        states = checkpoint_states(agent, job)
    finally:
        agent.stop()
    check_recovered(res, lines, states, FLIP, STEPS_F, mismatches)
    for r in res:     # the vote of the left history (before the restore) vetoes no redone update
        assert r["skips_after_rollback"] == 0, r["skipped_steps"]
        assert all(s > FLIP for s in r["skipped_steps"]), r["skipped_steps"]
    went_back = next(i for i, line in enumerate(lines) if "job.rollback " in line)
    assert any(f"checkpoint step {HELD} committed" in line for line in lines[:went_back]), lines[:went_back]
    assert any(f"checkpoint step {HELD} is VERIFIED" in line for line in lines[went_back:]), (
        "the redone save of a step the agent held before the rollback", lines[went_back:])
