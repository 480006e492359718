"""The in-rank loss gate (issue 19, opt-in): the pure loss detector in the rank, a GATE stage of the guard.
A non-finite loss masks its own step's update; a critical (or chosen) loss event seen a step later masks the
next update; the flagged step is replayed forward-only and classified; bounded, never loops. One process on
CPU, and two gloo ranks under DDP that agree on the veto."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from rank_spawn import spawn
from torch import nn

from checksums.replay import Cause
from probes.loss_gate import LossGate, classify_loss_replays


def test_classify_loss_replays():
    assert classify_loss_replays(1, 9.0, 1.0, [1.1, 1.05, 0.98]).cause is Cause.TRANSIENT
    c = classify_loss_replays(1, 9.0, 1.0, [8.7, 8.9, 9.1])
    assert (c.cause, c.drop) == (Cause.DATA, False)
    c = classify_loss_replays(1, 9.0, 1.0, [1.1, 8.9, 1.0])
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,))
    c = classify_loss_replays(0, 9.0, 1.0, [8.9, 1.2, 9.0])
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,))
    # two ranks: the baseline is the third witness
    c = classify_loss_replays(1, math.nan, 1.0, [1.0, math.nan])
    assert (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (1,), True)
    # a non-finite loss that reproduces everywhere is the data's, but its update is never applied
    c = classify_loss_replays(0, math.inf, 1.0, [math.inf])
    assert (c.cause, c.drop) == (Cause.DATA, True)


def _model() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    return m, m[0]


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1].sin()


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]), b[1])


def _train(steps: int, fault: dict, gate_on=None, rank: int = 0, ddp: bool = False, mask: str = "auto",
           loss_fn=_loss):
    model, layer = _model()
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=mask == "device")
    on = {"v": False}

    def hook(mod, inp, out):
        if on["v"]:
            with torch.no_grad():
                out.view(-1)[3] = fault["value"]

    layer.register_forward_hook(hook)
    gate = LossGate.attach(opt, module=net, loss_fn=loss_fn, gate_on=gate_on, mask=mask)
    for step in range(1, steps + 1):
        b = _batch(rank, step)
        gate.retain(b)
        on["v"] = rank == fault.get("rank", 0) and (
            step == fault["step"] or (fault.get("persistent") and step >= fault["step"])
        )
        loss = _loss(net, b)
        loss.backward()
        if not fault.get("persistent"):
            on["v"] = False  # a transient fault: the replay in the gate computes right
        gate.observe(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, gate


def test_a_non_finite_loss_masks_its_own_step_and_a_transient_one_is_named():
    model, gate = _train(40, {"step": 25, "value": math.inf})
    assert all(torch.isfinite(p).all() for p in model.parameters()), (
        "the non-finite update reached the weights"
    )
    skipped = [(s.step, s.stage) for s in gate.guard.skipped]
    assert skipped == [(25, "loss")], skipped
    f = list(gate.findings)
    assert len(f) == 1 and (f[0].step, f[0].detector, f[0].cause, f[0].faulty) == (
        25,
        "loss",
        "transient",
        (0,),
    )
    st = gate.status()
    assert st.flagged == 1 and st.dropped == 1 and st.replays == 1


@pytest.mark.parametrize("mask", ["host", "device"])
def test_a_replay_that_raises_drops_the_flagged_step_without_a_finding(mask: str, caplog):
    """A replay that cannot run (here the loss_fn raises under no_grad, where only replays run it): the
    flagged step's update is still held back, no rank is named, the training goes on, the reason is logged."""
    def replay_raises(m, b):
        if not torch.is_grad_enabled():
            raise RuntimeError("CUDA out of memory (a test's)")
        return _loss(m, b)
    model, gate = _train(40, {"step": 25, "value": math.inf}, loss_fn=replay_raises, mask=mask)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not list(gate.findings)
    assert gate.status().dropped == 1
    if mask == "host":
        assert [(s.step, s.stage) for s in gate.guard.skipped] == [(25, "loss")]
        assert "not replayed (a replay raised RuntimeError: CUDA out of memory" in gate.guard.skipped[0].reason
    assert "could not replay step 25" in caplog.text


def test_device_mask_skips_the_update_through_found_inf_and_classifies_a_step_later():
    """The CUDA design on CPU: fused Adam's found_inf (checksums.device_mask) masks the step of the non-finite
    loss with no host veto; the flags are read and the step replayed and classified at the next step."""
    model, gate = _train(40, {"step": 25, "value": math.inf}, mask="device")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert gate.guard.skipped == [], "the device mask is no host veto"
    f = list(gate.findings)
    assert len(f) == 1 and (f[0].step, f[0].cause, f[0].dropped) == (25, "transient", True), f
    assert not hasattr(gate.guard._optimizer_ref(), "found_inf"), "found_inf left on the optimizer"


def test_a_persistent_non_finite_loss_is_dropped_every_step_and_never_loops():
    model, gate = _train(30, {"step": 20, "value": math.nan, "persistent": True})
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [s.step for s in gate.guard.skipped] == list(range(20, 31))
    assert gate.status().replays == 11  # one replay per flagged step, never retried
    assert {f.cause for f in gate.findings} == {"data"} and all(f.dropped for f in gate.findings)


def test_a_loss_spike_seen_a_step_later_masks_the_next_update_and_is_classified():
    """The detector reads step N's loss at step N+1's gate (no sync in the step): the spike vetoes update
    N+1; the replay of step N's batch on the current weights is near the baseline: transient."""
    _, gate = _train(60, {"step": 50, "value": 300.0}, gate_on=lambda e: e.kind in ("spike", "nonfinite"))
    assert any(e.kind == "spike" and e.step == 50 for e in gate.events)
    assert [s.step for s in gate.guard.skipped] == [51]
    f = list(gate.findings)
    assert len(f) == 1 and (f[0].step, f[0].cause, f[0].dropped) == (50, "transient", True), f


def test_clean_run_has_no_suspicion():
    _, gate = _train(300, {"step": 10_000, "value": 0.0}, gate_on=lambda e: e.kind in ("spike", "nonfinite"))
    assert gate.status().flagged == 0 and not gate.guard.skipped


def _worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, gate = _train(30, {"step": 20, "value": math.inf, "rank": 1}, rank=rank, ddp=True)
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        fp = float(sum(p.double().sum() for p in model.parameters()))
        found = [(x.step, x.cause, list(x.faulty)) for x in gate.findings]
        json.dump([finite, [s.step for s in gate.guard.skipped], found, fp], f)
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_ranks_agree_on_the_veto_and_name_the_rank(tmp_path):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    got = [json.loads((tmp_path / f"{r}.txt").read_text()) for r in range(2)]
    for finite, skipped, found, _ in got:
        assert finite and skipped == [20], got
        assert found == [[20, "transient", [1]]], got
    assert got[0][3] == got[1][3], "the replicas diverged"
