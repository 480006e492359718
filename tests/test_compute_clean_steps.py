"""No false suspicion in 10,000 clean steps: issue 19's target, on the CPU, in the suite.

A clean step can be wrongly suspected in two places: the statistics' cross-rank comparison (the ranks'
batches differ, so their gradients do; `SpreadTracker` must learn how much) and a replay that does not
reproduce its step. Ten thousand steps of three real gloo ranks take about four minutes here
(test_compute_checks.py runs 600 of them, with 120 audits, through the hook, the gather and the replays),
so this test runs the harness's model and data (`bench.compute_faults`: the MLP, each rank its own batch
stream) with three ranks in one process: the replicas are identical, as DDP keeps them, so one model takes
each rank's local gradient in turn. Each rank's gradient is laid out in the harness's two DDP buckets
(`bucket_cap_mb=0.01`: parameters in reverse order) and its statistics taken as the hook's CPU path takes them
(`bucket_stats`: the norm and max-abs of `bucket_summary_torch`'s row, of the bucket's flat buffer; the
fingerprint words, which the comparison does not read, on audited steps: a third of the loop's time); every
step is judged by the gate's `SpreadTracker` with its defaults (warm-up 20, margin 3); the mean gradient is
applied with Adam, as DDP's all-reduce would. The three ranks' local gradients come from one batched pass
(`_per_rank_grads`: each Linear as a batched matmul over the ranks with the weights repeated per rank, whose
gradients are then each rank's own: the same values up to rounding, a third of the calls: 77 s -> 30 s here;
the statistics alone: 46 s -> 29 s). Every 50th step one rank's gradient is computed from its batch alone,
twice (the step's and the audit's replay: the exact fingerprint words must repeat), and its statistics must
equal the batched pass's to rounding.

The device path (CUDA, a fused optimizer) judges each step on the device against its copy of the spread,
which learns the steps it passed a batch at a time after the warm-up (`SpreadTracker.learn_clean`, eight
steps: checksums/compute_gate.py), so its spread lags the host's by up to a batch; the same steps run
through that rule too, and it must mask none of them and end with the host's spread: where the lagged
spread equals the host's the device's verdict is the host's (`device_flag` is `SpreadTracker.judge`'s
rule, tests/test_compute_gate_device.py), elsewhere `device_flag` judges the step against it.
"""

from __future__ import annotations

import numpy as np
import torch

from bench import compute_faults as cf
from checksums.compute_gate import LEARN_BATCH
from checksums.device_verdict import device_flag
from checksums.grad_checks import SpreadTracker, bucket_stats, bucket_summary, fingerprints_of, stats_of

STEPS = 10_000
AUDIT_EVERY = 50


def _rows(grads: dict[torch.Tensor, torch.Tensor], buckets: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([bucket_summary([_flat(grads, b)]) for b in buckets])


def _stats(grads: dict[torch.Tensor, torch.Tensor], buckets: list[list[torch.Tensor]]) -> torch.Tensor:
    """`stats_of(_rows(grads, buckets))` without the fingerprints, which the comparison does not read."""
    return torch.stack([bucket_stats([_flat(grads, b)]) for b in buckets])


def _flat(grads: dict[torch.Tensor, torch.Tensor], bucket: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[p].reshape(-1) for p in bucket])       # the bucket's flat buffer, as DDP lays it


def _per_rank_grads(model: torch.nn.Sequential, batches: list[tuple[torch.Tensor, torch.Tensor]],
                    params: list[torch.Tensor]) -> list[dict[torch.Tensor, torch.Tensor]]:
    """Each rank's local gradient of `cf.loss_fn` (mean squared error) for its own batch, all ranks in one
    pass: every Linear as a batched matmul over the ranks with its weight and bias repeated per rank (the
    gradient of copy r is rank r's), its activations as they are."""
    world = len(batches)
    x = torch.stack([b[0] for b in batches])
    y = torch.stack([b[1] for b in batches])
    copies: dict[torch.Tensor, torch.Tensor] = {}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            w = copies[layer.weight] = layer.weight.detach().expand(world, -1, -1).clone().requires_grad_()
            b = copies[layer.bias] = layer.bias.detach().expand(world, -1).clone().requires_grad_()
            x = torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))
        else:
            assert isinstance(layer, torch.nn.GELU), layer
            x = layer(x)
    loss = ((x - y) ** 2).mean(dim=(1, 2)).sum()
    grads = torch.autograd.grad(loss, [copies[p] for p in params])
    return [{p: g[r] for p, g in zip(params, grads)} for r in range(world)]


def test_ten_thousand_clean_steps_raise_no_suspicion() -> None:
    world = 3
    torch.manual_seed(0)
    model, _ = cf.make_model(0)
    params = list(model.parameters())
    buckets = cf.ddp_buckets(params, 0.01)                # the harness's bucket_cap_mb
    assert len(buckets) == 2, [len(b) for b in buckets]
    opt = torch.optim.Adam(params, lr=1e-3)
    tracker = SpreadTracker()

    def local(rank: int, step: int) -> dict[torch.Tensor, torch.Tensor]:
        loss = cf.loss_fn(model, cf.batch_for(rank, step, torch.device("cpu")))
        return dict(zip(params, torch.autograd.grad(loss, params)))

    suspicions: list[tuple[int, object]] = []
    lagged = SpreadTracker()             # the device path's: learns the steps it passed a batch at a time
    queue: list[np.ndarray] = []
    masked: list[int] = []
    lagging = 0                          # steps judged against a lagged spread unlike the host's
    audits = 0
    cpu = torch.device("cpu")
    for step in range(1, STEPS + 1):
        grads = _per_rank_grads(model, [cf.batch_for(r, step, cpu) for r in range(world)], params)
        stats = torch.stack([_stats(g, buckets) for g in grads])        # [world, buckets, 2]
        host_spread = tracker._spread     # replaced when it widens, never changed in place
        _, verdict = tracker.assess(stats)
        if verdict.suspects:
            suspicions.append((step, verdict))
        armed = lagged.learned >= lagged.warmup
        if armed and not np.array_equal(lagged._spread, host_spread):
            lagging += 1
            if float(device_flag(stats, lagged.signed_spread, lagged.margin)):
                masked.append(step)
        queue.append(stats.numpy())
        if len(queue) >= (LEARN_BATCH if armed else 1):
            if lagged.learn_clean(np.stack(queue)) is None:
                for q in queue:
                    lagged.assess(torch.from_numpy(q))
            queue.clear()
        if step % AUDIT_EVERY == 0:
            r = (step // AUDIT_EVERY) % world
            computed, replay = (_rows(local(r, step), buckets) for _ in range(2))
            assert torch.equal(fingerprints_of(replay), fingerprints_of(computed)), (step, r, "replay")
            assert torch.allclose(stats_of(computed), stats[r], rtol=1e-4), (step, r)
            audits += 1
        for p in params:
            p.grad = torch.stack([g[p] for g in grads]).mean(dim=0)
        opt.step()
    assert not suspicions, f"{len(suspicions)} clean steps suspected, first: {suspicions[:3]}"
    assert not masked, f"the device path would have masked {len(masked)} clean steps, first: {masked[:3]}"
    assert lagging > 0, "the lagged spread never differed from the host's: nothing was checked"
    assert lagged.learned == STEPS - len(queue) and lagged.max_score_clean <= tracker.max_score_clean
    assert np.array_equal(lagged._spread, tracker._spread), "the batches learnt the host's spread"
    assert audits == STEPS // AUDIT_EVERY
    # the comparison had something to learn: the ranks' statistics differ every step (their batches do)
    assert tracker.learned == STEPS and tracker.max_score_clean > 0.5, (tracker.learned, tracker.max_score_clean)
    spread = tracker.spread
    assert spread is not None and bool((spread > tracker.floor).all()), spread
    print(f"world {world}: {STEPS} clean steps, 0 suspicions, {audits} audits exact, largest clean score "
          f"{tracker.max_score_clean:.2f} of margin {tracker.margin}, spread (log) {spread.tolist()}; "
          f"the device rule against a lagged spread on {lagging} steps, no mask")
