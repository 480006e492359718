"""Issue 18: the replica vote's verdict gates the next update on the device, with no host synchronisation
(checksums/replica_recovery.py, mask="device"; checksums/device_mask.py). Run on gloo ranks with CPU tensors
and a fused Adam (which honours found_inf on CPU too); `settle_lag=4` gives the host the lag it has on CUDA,
where the Monitor reads a vote when the ring reuses its slot. Every gate call counts the host
synchronisations it makes (item/tolist/bool/equal, Event.synchronize, Monitor.flush, a blocking drain):
there must be none."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import rank_spawn
from torch import nn

from support import RecordingReporter, count_host_syncs, recovery_outcome

STEPS, FLIP_STEP, LAG = 14, 5, 4


def _batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[list[int]]:
    from checksums.optimizer_parts import param_states
    out = [p.detach().clone() for p in model.parameters()]
    out += [v.clone() for _, state in param_states(opt) for _, v in sorted(state.items())]
    return [t.reshape(-1).view(torch.int32).tolist() if t.dtype == torch.float32 else
            t.reshape(-1).view(torch.uint8).tolist() for t in out]


def _run(rank: int, world: int, batches: list[int], *, flip: bool, recover: bool,
         restore_at: int | None = None, restore_to: int = 3, titan: bool = False) -> dict[str, Any]:
    """titan: torchtitan's OptimizersContainer (fused Adam on the weights, fused AdamW on the biases), the
    flip in a moment it holds, the vote fingerprinting the optimizer state too."""
    from checksums.monitor import Monitor
    from checksums.optimizer_parts import param_states
    from checksums.replica_recovery import ReplicaRecovery

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    if titan:
        from bench.compute_faults import titan_optimizers
        opt: Any = titan_optimizers(model, lr=0.01)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    monitor = Monitor.attach(ddp, opt, job_id="device-gate", reporter=RecordingReporter(), host=f"host{rank}",
                             check_optimizer_state=titan)
    recovery = ReplicaRecovery.attach(monitor, mask="device", settle_lag=LAG) if recover else None
    syncs: list[str] = []
    if recovery is not None:
        assert recovery.mask == "device"
        gate_run = recovery.gate.run

        def counted(ctx: Any) -> Any:
            with count_host_syncs(monitor, syncs):
                return gate_run(ctx)
        recovery.gate.run = counted  # type: ignore[method-assign]
    saved: dict[str, Any] = {}
    restored = False
    for index in batches:
        x, y = _batch(rank, index)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if flip and index == FLIP_STEP and rank == world - 1 and not restored:
            flipped = (next(st["exp_avg"] for p, st in param_states(opt) if p is model[0].weight) if titan
                       else model[0].weight)
            with torch.no_grad():
                flipped.view(torch.int32).view(-1)[3] ^= 1 << 20
        monitor.step(loss.detach())
        if monitor.step_count == restore_to and not restored:
            saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
        if restore_at is not None and index == restore_at and not restored:   # the rollback directive
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            monitor.guard.renumber(restore_to)
            restored = True
    return recovery_outcome(monitor, recovery, _state(model, opt), syncs=sorted(set(syncs)))


def _worker(rank: int, world: int, store: str, outdir: str, titan: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out: dict[str, Any] = {}
        all_batches = list(range(1, STEPS + 1))
        if world == 3:
            out["faulty"] = faulty = _run(rank, world, all_batches, flip=True, recover=True, titan=titan)
            skipped = set(faulty["skipped"])
            out["clean"] = _run(rank, world, [i for i in all_batches if i not in skipped], flip=False,
                                recover=False, titan=titan)
        else:
            # replicas differ from step 5; the rollback directive comes after step 11: restore step 3, replay
            replay = all_batches[:11] + list(range(4, STEPS + 1))
            out["faulty"] = _run(rank, world, replay, flip=True, recover=True, restore_at=11)
            out["clean"] = _run(rank, world, all_batches, flip=False, recover=False)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("titan", [False, True], ids=["adam", "torchtitan-container"])
def test_three_replicas_mask_on_the_device_then_repair_when_every_replica_has_read_the_vote(tmp_path: Path,
                                                                                            titan: bool):
    """A flipped weight bit (with torchtitan's OptimizersContainer: a flipped bit of a moment one of its
    optimizers holds, the vote reading the optimizer state): every replica masks the same updates on the
    device, the odd one is repaired from rank 0 (weights and every part's moments), and the run ends bit for
    bit a clean run that skipped those batches. With the container, before: the device gate was refused (no
    `_step_supports_amp_scaling`: torchtitan sets `fused` per group), the vote read no moment, and the repair
    copied none."""
    rank_spawn.spawn(_worker, args=(3, str(tmp_path / "store"), str(tmp_path), titan), nprocs=3)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    masked = list(range(FLIP_STEP + 1, FLIP_STEP + LAG + 2))      # steps 6..10: until the vote of 5 is settled
    for r in res:
        f = r["faulty"]
        assert f["syncs"] == [], f"the device gate synchronised with the host: {f['syncs']}"
        assert f["errors"] == 0
        assert f["skipped"] == masked, "every replica masked the same updates, recorded once read"
        assert f["repairs"] == [[FLIP_STEP, FLIP_STEP + LAG + 1, 0, True]], "repaired from rank 0, checked"
        assert f["mismatches"] == LAG + 1, "votes 5..9 disagreed; from the repair on the replicas agree"
        assert f["step"] == STEPS
        assert f["state"] == r["clean"]["state"], "bit-identical to a clean run that skipped those batches"
    assert res[0]["faulty"]["state"] == res[2]["faulty"]["state"]


def test_two_replicas_stay_masked_until_the_restore_which_clears_the_flag(tmp_path: Path):
    """No majority: every update is masked on the device while the replicas differ (no drift); the rollback
    restores step 3 on both; the flag clears at once, so the replay matches a clean run bit for bit."""
    rank_spawn.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        f = res["faulty"]
        assert f["syncs"] == [] and f["errors"] == 0
        assert f["repairs"] and not any(ok for *_, ok in f["repairs"])
        assert f["repairs"][0][:3] == [FLIP_STEP, FLIP_STEP + LAG + 1, -1], "no majority: nothing to copy"
        assert f["skipped"] == list(range(6, 12)), "the masked updates before the restore; none after it"
        assert f["state"] == res["clean"]["state"], "after the restore and the replay: a clean run's bytes"


def test_device_mask_combines_with_and_restores_a_found_inf_already_set() -> None:
    from checksums.device_mask import DeviceMask, device_disagree
    from checksums.step_guard import StepGuard

    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    guard = StepGuard.attach(opt)
    mask = DeviceMask.of(guard)
    assert DeviceMask.of(guard) is mask, "one per guard"
    words = torch.tensor([[1, 2], [1, 2], [1, 2]])
    assert device_disagree(words).item() == 0.0
    words[1, 1] = 3
    assert device_disagree(words).item() == 1.0 and device_disagree(words).dim() == 0

    class Flag:
        name, phase = "flag", 20

        def __init__(self, value: float) -> None:
            self.value = value

        def run(self, ctx: Any) -> None:
            mask.add(ctx, torch.tensor(self.value))

    flag = Flag(1.0)
    guard.add(flag)
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)), "masked: unchanged"
    assert not hasattr(opt, "found_inf"), "taken back after the step"
    scaler_flag = torch.tensor([0.0])
    opt.found_inf = scaler_flag                     # as GradScaler sets it around the step
    flag.value = 0.0
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3)), "neither flag set: applied"
    assert opt.found_inf is scaler_flag, "the scaler's own flag put back"
    before = p.detach().clone()
    opt.found_inf = torch.tensor([1.0])
    opt.step()
    assert torch.equal(p.detach(), before), "the scaler's flag still masks, combined with the stage's"


def test_mask_choice() -> None:
    from checksums.device_mask import choose_mask

    plain = torch.optim.Adam([nn.Parameter(torch.ones(2))])
    fused = torch.optim.Adam([nn.Parameter(torch.ones(2))], fused=True)
    assert choose_mask("auto", fused, torch.device("cpu")) == "host"
    assert choose_mask("auto", plain, torch.device("cuda", 0)) == "host"
    assert choose_mask("auto", fused, torch.device("cuda", 0)) == "device"
    with pytest.raises(ValueError, match="fused optimizer"):
        choose_mask("device", plain, torch.device("cpu"))


@pytest.mark.parametrize("lag", [-1, 2.5, True, "4"])
def test_a_settle_lag_that_is_not_a_whole_number_of_steps_is_refused(lag) -> None:
    """settle_lag=2.5 (or True) was taken and compared with step numbers; now refused with its name."""
    from checksums.monitor import Monitor
    from checksums.replica_recovery import ReplicaRecovery

    model = nn.Linear(2, 2)
    monitor = Monitor.attach(model, torch.optim.Adam(model.parameters(), fused=True), job_id="j", reporter=False)
    with pytest.raises(ValueError, match="settle_lag is a number of steps"):
        ReplicaRecovery.attach(monitor, mask="device", settle_lag=lag)
