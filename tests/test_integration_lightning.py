"""Issue 25: the Lightning callback (integrations/lightning.py) on 2 gloo ranks (strategy "ddp" on CPU,
started like torchrun) training a tiny GPT-2 built from a config (no download), with the real agent.

With one bit flipped in rank 1's weights after update FLIP: the vote catches it, the agent's rollback
directive takes both ranks (the module, optimizer, scheduler and trainer.global_step) back to a VERIFIED
checkpoint before the flip, and the replicas end bit-identical. A clean run: no rollback, no event, with the
compute checks on (`compute=True`) as well. With the compute checks on and one element of rank 1's gradient
set to 100 in its backward for one step (the replica vote cannot see it: the all-reduce averages it into both
replicas; a forward fault's effect is often squashed by the LayerNorm after it in so small a model): that
step's update is dropped on both ranks, rank 1 named as transient by the pair replays, the agent's journal
holds a compute.fault naming rank 1, and the run goes on with the replicas bit-identical."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_harness import AgentProcess
from framework_support import (
    HOLD_AFTER_FLIP, check_clean, check_dropped_and_named, check_recovered, check_stopped,
    run_with_agent, checkpoint_states,
    flip_bit, mismatch_events,
    preloads, replicas_identical, settled_journal, spawn, torchrun_env, wait_directive,
)
from test_integration_hf import Tokens, tiny_gpt2

JOB = "lightning-gpt2"
STEPS, FLIP, SAVE_EVERY = 60, 30, 10
FAULT = 40          # the optimizer step whose forward is faulty on rank 1 (after the checks' 20 warm-up steps)


@preloads("lightning.pytorch", "integrations.lightning", "transformers.models.gpt2.modeling_gpt2")
def _worker(rank: int, world: int, port: int, socket: str, outdir: str, flip: bool, compute: Any = False,
            fault: bool = False, accumulate: int = 1, precision: str = "32-true",
            persistent: bool = False) -> None:
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
        sdc = SdcwatchCallback(job_id=JOB, save_every=SAVE_EVERY, compute=compute)
        faulted: list[int] = []

        def one_bad_element(grad: torch.Tensor) -> torch.Tensor | None:
            # the backward of step FAULT on rank 1, once (a replay of that step computes it right): one
            # element of a weight's gradient before DDP reduces it
            if fault and rank == 1 and not faulted and sdc.session.guard.step == FAULT - 1:
                faulted.append(sdc.session.guard.step + 1)
                grad = grad.clone()
                grad.view(-1)[7] = 100.0
                return grad
            if persistent and rank == 1 and sdc.session.guard.step >= FAULT - 1:   # every backward from
                grad = grad.clone()                                                 # FAULT on, replays too
                grad.view(-1)[7] = 100.0
                return grad
            return None

        module.gpt.transformer.h[0].mlp.c_fc.weight.register_hook(one_bad_element)

        class Flip(L.Callback):
            done = held = False

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:   # before sdc's
                if flip and rank == 1 and not self.done and sdc.session.guard.step == FLIP:
                    self.done = True
                    flip_bit(module.gpt.transformer.h[0].mlp.c_fc.weight)
                elif self.done and not self.held and sdc.session.guard.step == FLIP + HOLD_AFTER_FLIP:
                    self.held = True
                    wait_directive(JOB)       # the run does not end before the agent's rollback
                elif persistent and rank == 1 and not self.held and sdc.session.guard.step == FAULT + HOLD_AFTER_FLIP:
                    self.held = True          # nor before its STOP (planned seconds behind on a loaded machine)
                    wait_directive(JOB, kind="job.stop_directive")

        loader = torch.utils.data.DataLoader(Tokens(8 * STEPS), batch_size=4, shuffle=False)
        # "16-mixed" on the CPU: Lightning's own choice would be bf16 there, so its plugin is given as the GPU
        # gets it (fp16 autocast, a GradScaler)
        amp = ({"plugins": [L.pytorch.plugins.MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed"
               else {"precision": precision})
        trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp", max_steps=STEPS,
                            accumulate_grad_batches=accumulate, **amp,
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
        out["skipped"] = sess.guard.skipped_count
        if sdc.checks is not None:
            out["compute"] = dataclasses.asdict(sdc.checks.status())
            out["findings"] = [dataclasses.asdict(f) for f in sdc.checks.findings]
            out["compute"]["mode"] = sdc.checks.mode()
            scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
            out["scale"] = float(scaler.get_scale()) if scaler is not None else None
        out["faulted"] = faulted
        stop = sess.stopped
        out["stopped"] = None if stop is None else {"target": stop.target_step, "reason": stop.reason}
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
        res = spawn(_worker, 2, str(agent.socket), tmp_path, False, True)
        lines = settled_journal(agent)
        states = checkpoint_states(agent, JOB)
    finally:
        agent.stop()
    check_clean(res, lines, states, STEPS)
    for r in res:                       # the compute checks ran on every step and suspected none
        c = r["compute"]
        assert c["steps"] == STEPS and c["suspicions"] == 0 and c["dropped"] == 0 and r["skipped"] == 0, c


def test_lightning_compute_checks_drop_a_faulty_forward_and_name_the_rank(short_tmp: Path,
                                                                         tmp_path: Path) -> None:
    res, lines, states = run_with_agent(short_tmp / "state", tmp_path, JOB, _worker, False, True, True)
    assert res[1]["faulted"] == [FAULT], res[1]
    check_dropped_and_named(res, lines, FAULT, STEPS)


def test_lightning_stops_for_a_gpu_that_keeps_computing_wrong(short_tmp: Path, tmp_path: Path) -> None:
    """Rank 1's GPU computes one gradient element wrong in every backward from step FAULT (its replays too):
    the checks name it `persistent` (two ranks: each GPU repeats its own result; the CPU witness decides),
    the agent's STOP directive reaches both ranks at the same step, the Trainer stops there (its stop flag)
    and `session.stopped` holds the directive: the newest VERIFIED checkpoint before the fault to restart
    from, the GPU named in its reason."""
    res, lines, states = run_with_agent(short_tmp / "state", tmp_path, JOB, _worker,
                                        False, True, False, 1, "32-true", True)
    check_stopped(res, lines, states, FAULT, STEPS)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_compute_audits_agree_under_accumulation_and_mixed_precision(
        short_tmp: Path, tmp_path: Path, precision: str) -> None:
    """Replays must reproduce the step's gradient bit for bit: with an audit every 5 steps (each replays a
    neighbour's micro-batches and its own, and compares exact fingerprints), gradient accumulation over 2
    batches (Lightning divides the loss by 2 before its backward) and mixed precision, a clean run raises no
    suspicion that names a GPU. "16-mixed": Lightning back-propagates the loss times its GradScaler's scale
    (refused before: a replay without the scale never reproduced a step, and with the scale left out a
    hand-written loop's audits named a GPU 7 times in 35 clean steps); the checks take the plugin's scaler,
    and a step the scaler skipped for an overflow would be cleared as data. Without the scaler passed, the
    mode reads `unreproducible: ... 65536x ...` (checked by hand, 2026-12-04)."""
    res, lines, states = run_with_agent(short_tmp / "state", tmp_path, JOB, _worker,
                                        False, {"audit_every": 5}, False, 2, precision)
    check_clean(res, lines, states, STEPS)
    for r in res:
        c = r["compute"]
        assert c["mode"] == "exact" and c["audits"] >= STEPS // 5 - 2, r
        assert all(f["cause"] == "data" and not f["faulty"] for f in r["findings"]), r
        if precision == "bf16-mixed":
            assert c["suspicions"] == 0 and r["scale"] is None, r
        else:
            assert r["scale"] not in (None, 1.0), r          # the scaler ran


def test_compute_checks_refuse_a_strategy_without_ddp_and_bad_options(tmp_path: Path) -> None:
    """One process (Lightning's single-device strategy: no DDP model): compute=True is refused at the start
    of training with a message naming the strategy; compute= values that are not options are refused at
    construction."""
    import lightning as L

    from integrations.lightning import SdcwatchCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    sdc = SdcwatchCallback(job_id="one", checkpoints=False, monitor_kwargs={"reporter": False}, compute=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[sdc], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="strategy='ddp'.*SingleDeviceStrategy"):
        trainer.fit(Module(), loader)
    sdc.close()
    with pytest.raises(TypeError, match="compute="):
        SdcwatchCallback(job_id="one", compute="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_fn"):
        SdcwatchCallback(job_id="one", compute={"loss_fn": len})
