"""torchtitan's `OptimizersContainer` (one torch optimizer per model part and per parameter-group recipe,
itself an Optimizer with an empty `state`) is checked, repaired and masked as one optimizer is
(checksums/optimizer_parts.py). Real torchtitan containers; real gloo ranks for the repair and the gate."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rank_spawn import compute_faults as _faults


def _container(model: nn.Module | list[nn.Module], implementation: str = "fused") -> Any:
    """Two optimizers per model part, as torchtitan's parameter-group recipes make them."""
    from bench.compute_faults import titan_optimizers
    return titan_optimizers(model, fused=implementation == "fused", lr=0.1)


def _mlp(seed: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)


def _train_step(parts: list[nn.Module], opt: Any) -> None:
    x = torch.randn(5, 4, device=next(parts[0].parameters()).device)
    for m in parts:
        m(x).square().sum().backward()
    opt.step()


def test_a_containers_states_are_read_from_the_optimizers_it_holds():
    """The vote's optimizer words, replica repair and the checkpoint copy fence read every parameter's
    moments from the optimizer holding it (the container's own `state` is empty), in the container's
    parameter order; a plain optimizer is its own part."""
    from checkpoint.snapshot import optimizer_storages
    from checksums.optimizer_parts import param_states, parts

    a, b = _mlp(0), _mlp(1)
    opt = _container([a, b])
    assert len(parts(opt)) == 4 and parts(opt) == list(opt.optimizers), "two parts x two recipes"
    _train_step([a, b], opt)
    assert len(opt.state) == 0, "torchtitan keeps no state on the container itself"
    pairs = list(param_states(opt))
    assert [p for p, _ in pairs] == [p for g in opt.param_groups for p in g["params"]]
    assert len(pairs) == 8 and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for _, s in pairs)
    moments = {s["exp_avg"].untyped_storage().data_ptr() for _, s in pairs}
    assert moments <= optimizer_storages(opt), "the copy fence waits for copies of the moments too"
    plain = torch.optim.Adam(a.parameters(), lr=0.1)
    assert parts(plain) == [plain] and all(s == {} for _, s in param_states(plain))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_device_mask_skips_every_optimizer_of_a_fused_container(device: str):
    """A fused container (torchtitan sets `fused` in each parameter group: no `_step_supports_amp_scaling`)
    takes the device mask: the flag goes to each optimizer it holds, a masked step leaves every weight and
    moment of every part as it was, an unmasked one updates them, and the flags are taken back after the
    step (on the CPU and, with torch's CUDA fused kernels, on a GPU). A container or optimizer with a group
    that does not run fused is refused the device mask (torch's other kernels reject `found_inf`): before,
    one fused group was enough."""
    from checksums.device_mask import DeviceMask, choose_mask, supports_device_mask
    from checksums.optimizer_parts import param_states, parts
    from checksums.step_guard import StepGuard

    a, b = _mlp(0, device), _mlp(1, device)
    opt = _container([a, b])
    assert supports_device_mask(opt) and choose_mask("auto", opt, torch.device(device)) == (
        "device" if device == "cuda" else "host")
    assert not supports_device_mask(_container(_mlp(2), "for-loop"))
    with pytest.raises(ValueError, match=r"Container holds optimizers that are not \(Adam, AdamW\)"):
        choose_mask("device", _container(_mlp(2), "for-loop"), torch.device(device))
    p, q = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    mixed = torch.optim.Adam([{"params": [p], "fused": True}, {"params": [q], "fused": False}], lr=0.1)
    assert not supports_device_mask(mixed)
    guard = StepGuard.attach(opt)
    mask = DeviceMask.of(guard)

    class Flag:
        name, phase, value = "flag", 20, 1.0

        def run(self, ctx: Any) -> None:
            mask.add(ctx, torch.tensor(self.value, device=device))

    flag = Flag()
    guard.add(flag)
    _train_step([a, b], opt)                       # masked from the first step: no state made
    assert all(s == {} or int(s["step"]) == 0 for _, s in param_states(opt))
    flag.value = 0.0
    _train_step([a, b], opt)
    before = [(w.detach().clone(), s["exp_avg"].clone()) for w, s in param_states(opt)]
    flag.value = 1.0
    _train_step([a, b], opt)
    after = list(param_states(opt))
    assert all(torch.equal(w0, w) and torch.equal(m0, s["exp_avg"])
               for (w0, m0), (w, s) in zip(before, after)), "masked: every part's weights and moments kept"
    assert not any(hasattr(o, "found_inf") for o in parts(opt)), "taken back after the step"
    flag.value = 0.0
    _train_step([a, b], opt)
    assert not any(torch.equal(w0, w) for (w0, _), (w, _) in zip(before, param_states(opt)))


def test_replica_repair_copies_the_moments_a_container_holds():
    """Three DDP replicas with torchtitan's container (Adam and AdamW, one model part): a bit flipped in
    rank 1's exp_avg. The vote names rank 1 and ReplicaRecovery repairs it once; the replicas train on, bit
    for bit alike. Before, the repair copied the weights only (the container's `state` is empty), the
    flipped moment stayed (non-finite), and the job repaired rank 1 again and again (measured: at 32, 34,
    36 and 38, each of those updates skipped).
    The compute gate drops a gradient fault on its step through the container, on the host and, fused, on
    the device."""
    r = _faults(["--world", "3", "--titan-optimizers", "--recover", "--fault-step", "30", "--after", "8",
                 "--audit-every", "5", "--cases", "adam exp_avg exp-flip,grad elem =100"])
    flip = r["adam exp_avg exp-flip"]
    assert flip["caught"]["vote"]["named"] == [1], flip["caught"]
    assert sorted({x["at_step"] for x in flip["repairs"]}) == [32] and all(x["ok"] for x in flip["repairs"])
    assert [s for s, _ in flip["skipped"]] == [32], flip["skipped"]
    assert flip["steps"] == 38 and len(set(flip["weights"])) == 1, "trained on, the replicas alike"
    hit = r["grad elem =100"]["caught"]["compute"]
    assert hit["step"] == 30 and hit["named"] == [1] and hit["dropped"], hit
    dev = _faults(["--world", "3", "--titan-optimizers", "--mask", "device", "--fused-adam",
                   "--fault-step", "30", "--after", "4", "--cases", "grad elem =100"])["grad elem =100"]
    hit = dev["caught"]["compute"]
    assert hit["step"] == 30 and hit["named"] == [1] and hit["dropped"], hit
    assert dev["fault_step_unchanged"] is True, "masked on the device: no part's weights moved"
