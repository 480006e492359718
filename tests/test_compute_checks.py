"""The compute checks (issue 19): the cross-rank comparison and the replay classification as pure logic, and
three real gloo ranks under DDP with faults injected in one rank's forward and gradient (bench/compute_faults)."""
from __future__ import annotations

import math
import types
from typing import Any
from pathlib import Path

import numpy as np
import pytest
import torch
from rank_spawn import compute_faults as _faults
from rank_spawn import spawn

from bench import compute_faults
from checksums.compute_gate import _choose_mask
from checksums.grad_checks import SpreadTracker, bucket_summary, stats_of
from checksums.replay import (
    Cause, audit_every, bounded_reason, classify_pair_replays, classify_replays, classify_start,
    classify_start_rechecked, flaky_start,
)


def _stats(norms: list[float], amax: list[float] | None = None, buckets: int = 2) -> torch.Tensor:
    amax = amax if amax is not None else norms
    return torch.tensor([[[n, a]] * buckets for n, a in zip(norms, amax)], dtype=torch.float64)


def _rows(fp: int, world: int = 3, buckets: int = 2) -> torch.Tensor:
    row = torch.tensor([0, 0, fp, fp + 1], dtype=torch.int64)
    return row.repeat(world, buckets, 1)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_a_clean_batch_learnt_at_once_leaves_the_tracker_as_assessing_each_step_does(world: int):
    """Issue 19: `SpreadTracker.learn_clean` (the device path's unmasked steps, a batch at a time) gives the
    spread, history, count and clean maximum of `assess` on each step in turn, bit for bit, on a run with a
    widening spread; a batch holding a step that is not plain (an outlier, a non-finite or zero statistic)
    is refused and changes nothing (the caller assesses it step by step)."""
    import numpy as np

    rng = np.random.default_rng(world)
    one, batched = SpreadTracker(margin=3.0, warmup=4), SpreadTracker(margin=3.0, warmup=4)

    def step(k: int) -> np.ndarray:
        x = np.exp(rng.normal(0.0, 0.02 * (1 + k / 40), size=(world, 3, 2)))   # a slowly widening spread
        if k in (37, 61):
            x[world - 1, 1, 0] *= 1e3                   # an outlier (one rank alone: its own median)
        if k == 50:
            x[0, 2, 1] = math.nan
        if k == 70:
            x[0, 0, 0] = 0.0
        return x

    refused = 0
    for start in range(0, 96, 6):
        batch = np.stack([step(k) for k in range(start, start + 6)])
        for x in batch:
            _, want = one.assess(torch.from_numpy(x))
        before = (batched.learned, None if batched._spread is None else batched._spread.copy())
        got = batched.learn_clean(batch)
        if got is None:
            refused += 1
            assert batched.learned == before[0], "a refused batch learns nothing"
            for x in batch:
                _, got = batched.assess(torch.from_numpy(x))
        assert got == want, start
        assert batched.learned == one.learned and batched.max_score_clean == one.max_score_clean
        for a, b in ((batched._spread, one._spread), (batched._tspread, one._tspread),
                     (batched._last, one._last)):
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), start
    # refused: the warm-up's batch, and the batches with the NaN, the zero and (with two ranks or more) the
    # outliers
    assert refused == (5 if world >= 2 else 3), refused
    assert one.learned > 80


def test_spread_learns_then_names_the_outlier_rank():
    t = SpreadTracker(margin=3.0, warmup=5)
    for k in range(5):
        v = t.judge(_stats([1.0, 1.1 + 0.01 * k, 0.95]))
        assert v.warming and v.suspects == ()
    assert t.judge(_stats([1.0, 1.08, 0.97])).suspects == ()
    v = t.judge(_stats([1.0, 40.0, 0.97]))
    assert v.outliers == (1,) and v.scores[1] > 3.0 and v.stat in ("norm", "maxabs")
    # a clean step after it still passes: the outlier did not widen the spread
    assert t.judge(_stats([1.0, 1.08, 0.97])).suspects == ()


def test_a_ranks_data_moving_every_bucket_alike_leaves_a_one_bucket_fault_visible():
    """Ranks whose batches differ in kind (a source of short documents on one rank, long ones on another):
    each rank's gradient is scaled as a whole, up to e^2.5 (12x) apart, step to step; its buckets keep
    their profile within a few percent. The distance from the other ranks (columns norm, maxabs) then learns
    a spread that only a 1,000x change passes; the same distance less the rank's own median over its buckets
    (`relative`) learns the profile's few percent: 800 such steps raise no suspicion, and a bucket of one
    rank 1.5x off its profile is named on its step, by that bucket's relative norm, whatever the rank's data
    did to it as a whole. A rank whose every bucket is 1e5x off (a loss computed wrong) is still named by the
    plain distance."""
    g = np.random.default_rng(7)
    world, buckets = 4, 9
    profile = g.lognormal(0.0, 1.0, size=(buckets, 2))

    def step(fault: float = 1.0, everywhere: float = 1.0) -> torch.Tensor:
        whole = g.normal(0.0, 0.8, size=(world, 1, 1)).clip(-1.25, 1.25)   # each rank's data, all its buckets
        x = profile[None] * np.exp(whole + g.normal(0.0, 0.02, size=(world, buckets, 2)))
        x[2, 5, 0] *= fault
        x[1] *= everywhere
        return torch.from_numpy(x)

    t = SpreadTracker()
    for _ in range(800):
        assert t.judge(step()).suspects == ()
    spread = t.spread.numpy()
    assert spread[:, :2].min() > 1.5 and spread[:, 2:].max() < 0.15, spread     # log units: 4.5x vs 1.16x
    v = t.judge(step(fault=1.5))
    assert v.outliers == (2,) and (v.bucket, v.stat) == (5, "relative norm"), v
    v = t.judge(step(everywhere=1e5))
    assert v.outliers == (1,) and v.stat in ("norm", "maxabs"), v


def test_non_finite_names_the_rank_at_once_even_while_warming():
    t = SpreadTracker(warmup=100)
    v = t.judge(_stats([1.0, 1.0, math.nan, 1.0]))
    assert v.nonfinite == (2,) and v.suspects == (2,)
    v = t.judge(_stats([math.inf, 1.0, 1.0, 1.0]))
    assert v.nonfinite == (0,)


def test_two_ranks_make_both_suspects():
    t = SpreadTracker(warmup=3)
    for _ in range(3):
        t.judge(_stats([1.0, 1.1]))
    assert t.judge(_stats([1.0, 100.0])).outliers == (0, 1)


def test_buckets_rebuilt_restart_learning():
    t = SpreadTracker(warmup=2)
    t.judge(_stats([1.0, 1.1, 1.0], buckets=1))
    t.judge(_stats([1.0, 1.1, 1.0], buckets=1))
    assert t.judge(_stats([1.0, 50.0, 1.0], buckets=3)).warming


def test_the_spread_version_moves_only_when_the_spread_changes():
    """The device path copies the spread to the GPU when `spread_version` moves: on a value change, not on
    every clean step (`learned` counts those)."""
    t = SpreadTracker(warmup=3)
    same = _stats([1.0, 1.1, 0.95])
    t.judge(same)
    v = t.spread_version
    for _ in range(10):
        t.judge(same)
    assert t.spread_version == v and t.learned == 11
    t.judge(_stats([1.0, 1.2, 0.95]))          # within the margin, wider than seen: learnt, a new version
    assert t.spread_version == v + 1
    t.judge(_stats([1.0, 1.0, 1.0], buckets=3))  # the buckets were rebuilt: learning anew
    assert t.spread_version == v + 2 and t.learned == 1


def test_margin_must_exceed_one():
    with pytest.raises(ValueError, match="margin"):
        SpreadTracker(margin=1.0)


def test_bucket_summary_carries_nan_and_exact_fingerprint():
    g = [torch.ones(3, 4), torch.arange(5.0)]
    a, b = bucket_summary(g), bucket_summary([t.clone() for t in g])
    assert torch.equal(a, b)
    s = stats_of(a)
    assert s[0] == pytest.approx(math.sqrt(12 + 30)) and s[1] == 4.0
    g2 = [g[0].clone(), g[1].clone()]
    g2[1][2] = torch.nextafter(g2[1][2], torch.tensor(10.0))     # one ulp
    assert not torch.equal(bucket_summary(g2)[2:], a[2:])
    g2[0][0, 0] = math.nan
    assert not torch.isfinite(stats_of(bucket_summary(g2))).all()


def test_classify_replays():
    orig_ok, orig_bad = _rows(10)[0], _rows(99)[0]
    same = _rows(10)
    assert classify_replays(1, orig_ok, same).cause is Cause.DATA
    assert not classify_replays(1, orig_ok, same).drop
    c = classify_replays(1, orig_bad, same)
    assert (c.cause, c.faulty, c.drop) == (Cause.TRANSIENT, (1,), True)
    persistent = same.clone()
    persistent[1] = _rows(99)[1]
    c = classify_replays(1, orig_bad, persistent)
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,))
    # the auditor's GPU is the wrong one: the original and the third rank agree
    c = classify_replays(0, orig_ok, persistent)
    assert (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (1,), True)
    # four ranks, two faulty GPUs each wrong its own way: the two that agree bit for bit are the reference
    four = _rows(10, world=4)
    four[1], four[3] = _rows(98, world=4)[1], _rows(99, world=4)[3]
    c = classify_replays(1, _rows(98)[0], four)
    assert (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (1, 3), True), c
    bounded = four.clone()               # compared within a rounding bound (norms), plurality does not decide
    for r, norm in enumerate((1.0, 2.0, 1.0, 3.0)):
        bounded[r, :, :2] = torch.tensor([norm, norm], dtype=torch.float64).view(torch.int64)
    assert classify_replays(1, bounded[1], bounded, exact=False).cause is Cause.UNRESOLVED
    split = _rows(10, world=4)
    split[2], split[3] = _rows(99, world=4)[2], _rows(99, world=4)[3]                 # an even split
    c = classify_replays(0, _rows(10)[0], split)          # two HSDP replicas that differ: nobody named
    assert (c.cause, c.faulty, c.drop) == (Cause.DIVERGED, (), True), c
    assert classify_replays(0, _rows(10)[0], bounded, exact=False).cause is Cause.UNRESOLVED   # groups of one
    # two ranks that disagree: no majority
    two = _rows(10, world=2)
    two[1] = _rows(99, world=2)[1]
    c = classify_replays(1, orig_bad, two)
    assert (c.cause, c.faulty, c.drop) == (Cause.UNRESOLVED, (1,), True)
    # two ranks, a transient fault: both replays agree, the original differs
    c = classify_replays(1, orig_bad, _rows(10, world=2))
    assert c.cause is Cause.TRANSIENT


def test_a_replica_whose_weights_differ_is_not_named_as_computing_wrong():
    """HSDP, 3 replicas x 2 shards: a bit flipped in rank 5's weight shard reaches both ranks of its replica
    (each all-gathers the same parameters), so ranks 4 and 5 replay any batch alike and unlike the rest.
    Independent GPUs do not agree bit for bit on a wrong result: that is other weights, not arithmetic, and
    naming both accused rank 4's good GPU (measured: `bench.compute_faults --fsdp --hsdp 3 --world 6
    --fault-rank 5`, "weight exp-flip" named ranks [4, 5] persistent on every step after it). Nobody is
    named, the update is dropped; a rank wrong on its own beside such a replica still is."""
    six = _rows(10, world=6)
    six[4], six[5] = _rows(99, world=6)[4], _rows(99, world=6)[5]
    for suspect, original in ((4, _rows(99)[0]), (5, _rows(99)[0]), (0, _rows(10)[0])):
        c = classify_replays(suspect, original, six)
        assert (c.cause, c.faulty, c.drop) == (Cause.DIVERGED, (), True), (suspect, c)
        assert "[4, 5]" in c.detail and "[0, 1, 2, 3]" in c.detail
    lone = six.clone()
    lone[1] = _rows(98, world=6)[1]                       # and rank 1's GPU recomputes wrong on its own
    for suspect, original in ((1, _rows(98)[0]), (0, _rows(10)[0]), (4, _rows(99)[0])):
        c = classify_replays(suspect, original, lone)
        assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,)), (suspect, c)
    c = classify_replays(4, _rows(97)[0], six)            # rank 4's original unlike any replay, its own not
    assert (c.cause, c.faulty) == (Cause.TRANSIENT, (4,)), c
    c = classify_replays(2, _rows(97)[0], six)
    assert (c.cause, c.faulty) == (Cause.TRANSIENT, (2,)), c
    # at the first step: a replica initialised apart is not a GPU computing wrong from the start
    assert classify_start(_start([(10, 10)] * 4 + [(99, 99)] * 2)) == (True, None)
    exact, c = classify_start(_start([(10, 10), (98, 98), (10, 10), (10, 10), (99, 99), (99, 99)]))
    assert exact and c.faulty == (1,)


def test_audit_cadence_from_the_budget():
    assert audit_every(0.003, replay_s=0.1, step_s=0.1) == 334
    assert audit_every(0.003, replay_s=0.0, step_s=0.1) == 10
    with pytest.raises(ValueError):
        audit_every(0.0, 1.0, 1.0)


CATCH = ["mm one elem =1e4", "grad elem =100", "grad elem NaN", "mm one elem x1.01 persistent",
         "mm channel x2 persistent", "mm one elem ulp", "bwd one elem =1e4", "bwd one elem x1.01 persistent",
         "grad elem =0.01", "bwd one elem x2"]


def test_three_gloo_ranks_catch_name_and_drop(tmp_path):
    """The suite form of the harness: each fault on rank 1 is caught, rank 1 named, its update dropped; the
    transient faults below the statistics' margin (one ulp, a gradient element set to 0.01, x2 on one element
    in the backward) fall on an audit step (30, audits every 5), and every rank is audited on each (by its
    neighbour; when the audits took ranks in turn, step 30's audited rank 0 and missed them). Each case runs
    10 steps past its fault (every verdict comes within 5); 300 clean steps with 60 audits (10,000 clean
    steps: test_compute_clean_steps.py)."""
    results = _faults(["--world", "3", "--fault-step", "30", "--after", "10", "--cases", ",".join(CATCH),
                       "--clean", "300", "--audit-every", "5"])
    for name in CATCH:
        caught = results[name]["caught"]
        if name == "mm one elem ulp" and results[name]["effective"] is False:
            continue                  # the flip rounded away: the gradient was bit for bit the clean one
        assert results[name]["effective"] is not False, f"{name}: the fault changed no gradient bit"
        assert "compute" in caught, f"{name}: not caught ({caught})"
        hit = caught["compute"]
        assert hit["named"] == [1] and hit["dropped"], f"{name}: {hit}"
        assert hit["step"] - 30 <= 5, f"{name}: caught late: {hit}"
    assert results["mm one elem =1e4"]["caught"]["compute"]["cause"] == "transient"
    # the Monitor's step reports carried the finding to the agent's side, naming rank 1's host and GPU
    reported = results["mm one elem =1e4"]["reported"]
    assert reported and reported[0][:3] == [30, "stats", "transient"]
    assert [w[0] for w in reported[0][3]] == [1] and reported[0][3][0][2] == "GPU-fake-1"
    assert results["mm one elem x1.01 persistent"]["caught"]["compute"]["cause"] == "persistent"
    for name in ("grad elem =0.01", "bwd one elem x2"):     # below the margin: the audit of step 30 on rank 1
        assert results[name]["caught"]["compute"]["detector"] == "audit", results[name]["caught"]
        assert results[name]["caught"]["compute"]["cause"] == "transient", results[name]["caught"]
    # a fault in rank 1's backward (the gradient reaching the faulty layer's output): the same verdicts
    assert results["bwd one elem =1e4"]["caught"]["compute"]["detector"] == "stats"
    assert results["bwd one elem x1.01 persistent"]["caught"]["compute"]["cause"] == "persistent"
    clean = results["clean"]
    assert clean["status"]["suspicions"] == 0 and clean["status"]["dropped"] == 0, clean["status"]
    assert clean["status"]["exact"] and clean["status"]["audits"] >= 50


def test_the_harness_under_fp16_and_a_gradient_scaler_on_fsdp2(tmp_path):
    """`--amp fp16 --fsdp`: fp16 autocast and a GradScaler at its default scale (65536), the checks given it
    (DDP's loop under a scaler: test_replays_reproduce_a_step_under_a_gradient_scaler). A persistent x1.01
    matmul fault (relative: the scale does not hide it) is named by the next audit; a NaN in rank 1's
    gradient is named on its step (the optimizer is not fused, so the scaler skips its step() and the gate
    judges the step at the next retain, with its own number); a clean run with an audit every 5 steps names
    no GPU and every replay is exact (the audits' collective replays lost the scale once: every audit
    failed)."""
    cases = ["mm one elem x1.01 persistent", "grad elem NaN"]
    results = _faults(["--world", "3", "--fault-step", "30", "--cases", ",".join(cases), "--clean", "40",
                       "--audit-every", "5", "--amp", "fp16", "--fsdp"])
    for name in cases:
        hit = results[name]["caught"].get("compute")
        assert hit and hit["named"] == [1] and hit["dropped"] and hit["step"] - 30 <= 5, (name, hit)
    assert results["grad elem NaN"]["caught"]["compute"]["step"] == 30, results["grad elem NaN"]["caught"]
    clean = results["clean"]
    assert clean["mode"] == "exact" and clean["scale"] and clean["status"]["audits"] >= 7, clean
    assert clean["status"]["suspicions"] == 0, clean["status"]


def test_device_mask_skips_the_update_through_found_inf_and_judges_a_step_later():
    """The CUDA design run on CPU: fused Adam's found_inf masks the suspect step with no host veto (weights,
    moments and step count unchanged); the rows are judged and the masked step replayed at the next step."""
    results = _faults(["--world", "3", "--fault-step", "47", "--mask", "device",
                                   "--cases", "mm one elem =1e4,grad elem NaN"])
    for name in ("mm one elem =1e4", "grad elem NaN"):
        r = results[name]
        assert r["fault_step_unchanged"] is True, f"{name}: the masked step changed the weights"
        hit = r["caught"]["compute"]
        assert hit["step"] == 47 and hit["named"] == [1] and hit["dropped"], f"{name}: {hit}"


def test_device_mask_needs_a_fused_optimizer():
    plain = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    fused = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], fused=True)
    with pytest.raises(ValueError, match="fused optimizer"):
        _choose_mask("device", plain, torch.device("cpu"))
    assert _choose_mask("device", fused, torch.device("cpu")) == "device"
    assert _choose_mask("auto", fused, torch.device("cpu")) == "host"
    with pytest.raises(ValueError, match="mask is"):
        _choose_mask("sometimes", fused, torch.device("cpu"))


def test_device_path_replays_no_step_pending_from_before_a_restore_or_a_repair():
    """Issue 18 follow-up: the device path judges a masked step at the next step, replaying its retained batch
    on the weights it saw. After a restore (the guard's restore epoch moved) or a replica repair
    (`note_rewrite`) those weights are gone: that step is not replayed or classified (its verdict gates
    nothing after). Before the repair counted, HSDP 3 x 2 with the device mask and ReplicaRecovery
    (`bench.compute_faults --world 6 --fsdp --hsdp 3 --mask device --fused-adam --recover`, a weight
    exponent flipped on rank 5) replayed step 41 on the repaired weights and named rank 4's good GPU
    `transient`."""
    from checksums.compute_gate import ComputeChecks
    from checksums.step_guard import StepGuard

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    guard = StepGuard.attach(opt)
    guard.renumber(4)                        # the loop's own numbers: not a restore (a higher step)
    replayed: list[int] = []
    gate = object.__new__(ComputeChecks)     # the settle path alone: no ranks, no model
    gate.guard, gate.tracker, gate.last_verdict = guard, SpreadTracker(margin=3.0, warmup=0), None
    gate._classify = lambda *a: replayed.append(1) or []
    gate._learn_queue, gate._learn_batch = [], 8
    gate._suspicions = gate._dropped = 0
    gate.replayer = types.SimpleNamespace(reproduces=True, why_not="")
    gate._not_replayed = ""

    def pend() -> None:           # a step the device masked (its flag 1)
        gate._pending = (3, _slot(_rows(10, world=2), 1.0), True, None, guard.rewrites)

    pend()
    gate._settle_previous()
    assert replayed == [1] and guard.restores == 0, "same epoch: the masked step is replayed and classified"
    pend()
    guard.renumber(1)                        # a rollback: the weights the pending step saw are gone
    gate._settle_previous()
    assert replayed == [1] and gate._pending is None, "restored since: not replayed"
    pend()
    guard.note_restore(1)                    # a restore to the step the guard is at
    gate._settle_previous()
    assert replayed == [1]
    pend()
    guard.note_rewrite()                     # a replica repair (ReplicaRecovery): no restore, other weights
    gate._settle_previous()
    assert replayed == [1] and guard.restores == 2 and guard.rewrites == 3
    pend()
    gate._settle_previous()
    assert replayed == [1, 1], "nothing rewritten since: replayed"
    # each masked step, replayed or not, is a step the guard learns was skipped (its update never happened)
    assert [k.step for k in guard.skipped] == [3, 3, 3, 3, 3] and gate._dropped == 5, guard.skipped


def _slot(rows: torch.Tensor, flag: float) -> Any:
    """A host slot (checksums/host_ring.py) with a step's rows and the device's flag, as copied."""
    from checksums.host_ring import HostSlot

    slot = HostSlot(rows.shape, cuda=False)
    slot.rows.copy_(rows)
    slot.flag.fill_(flag)
    return slot


def test_the_host_ring_is_filled_in_turn_by_the_hook_or_by_the_gate():
    """The C++ hook fills the ring's slots in the ring's own turn (`fill`, `following`, `take`): a slot it
    took is where `next` goes on from, and `fill` makes every slot like the newest (a new shape too)."""
    from checksums.host_ring import HostRing

    ring = HostRing(4)
    first = ring.next(torch.zeros(2, 3, 4, dtype=torch.int64))
    slots = ring.fill()
    assert len(slots) == 4 and slots[0] is first and all(s.rows.shape == (2, 3, 4) for s in slots)
    assert ring.following() == 1
    assert ring.take(1) is slots[1] and ring.following() == 2
    assert ring.next(torch.zeros(2, 3, 4, dtype=torch.int64)) is slots[2]
    assert ring.take(3) is slots[3] and ring.following() == 0
    assert ring.next(torch.zeros(2, 3, 4, dtype=torch.int64)) is slots[0]
    bigger = ring.next(torch.zeros(2, 5, 4, dtype=torch.int64))     # DDP rebuilt its buckets
    assert bigger.rows.shape == (2, 5, 4) and ring.fill()[1] is bigger
    assert all(s.rows.shape == (2, 5, 4) for s in ring.fill())
    with pytest.raises(ValueError):
        HostRing(1)


def test_the_gate_takes_the_hooks_slot_and_flag_and_replays_itself_when_the_hook_did_not():
    """The device path once the C++ hook replays the verdict after its gather (`_arm_finish`): the gate
    launches nothing, masks with the graph's flag and pends the slot the hook filled; a step the hook did
    not finish (its gather disarmed: DDP rebuilt its buckets) disarms it and is judged here as before, into
    the ring's next slot; a host-path step (an audit) takes the hook's slot in turn, unread."""
    from checksums.compute_gate import ComputeChecks
    from checksums.device_mask import DeviceMask
    from checksums.step_guard import StepContext, StepGuard

    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], fused=True)
    guard = StepGuard.attach(opt)
    rows = _rows(10, world=2)

    class Summaries:            # what the gate asks of GradSummaries, the hook's part scripted
        finished, disarmed, armed, gathers_in_hook = -1, 0, [], True

        def bucket_count(self) -> int:
            return rows.shape[1]

        def gather(self, out: Any = None) -> torch.Tensor:
            self.finished = self.script.pop(0)
            if out is not None:
                out.copy_(rows.view(out.shape))
                return out.view(rows.shape)
            return rows.clone()

        def clear(self) -> None:
            pass

        def disarm_finish(self) -> None:
            self.disarmed += 1

        def arm_finish(self, handle: int, flag: torch.Tensor, keep: Any, slots: Any, start: int) -> str:
            self.armed.append((handle, start, len(slots)))
            return ""

    class Verdict:              # a captured graph: its flag tensor, replayed here when the hook did not
        replays = 0
        out = torch.zeros(())

        def input(self, n: int, device: torch.device) -> torch.Tensor:
            return torch.empty(n, 4, dtype=torch.int64)

        def flag(self, got: torch.Tensor, spread: Any) -> torch.Tensor:
            self.replays += 1
            return self.out

        def exec_handle(self) -> int:
            return 1234

    gate = object.__new__(ComputeChecks)
    gate.summaries, gate._verdict = Summaries(), Verdict()
    gate.world, gate.device, gate.guard, gate.fsdp = 2, torch.device("cpu"), guard, False
    gate.tracker = SpreadTracker(margin=3.0, warmup=0)
    gate.tracker.assess(stats_of(rows))                   # its spread set: armed
    gate._spread_dev, gate._spread_version, gate._spread_i = None, -1, 0
    gate._spread_pinned, gate._spread_done = [None, None], [None, None]
    gate._ring, gate._learn_batch = None, 8
    gate._finish, gate._finish_refused = None, False
    gate._device_mask = DeviceMask.of(guard)
    gate.replayer = types.SimpleNamespace(retained=None)
    summaries, verdict = gate.summaries, gate._verdict
    assert gate._spread_on(gate.device) is not None      # as the AFTER stage copies it, after an update

    def step(n: int) -> Any:
        ctx = StepContext(optimizer=opt, step=n)
        gate._mask_on_device(ctx)
        gate._device_mask.run(ctx)
        return gate._pending[1]

    # step 0: the rows' gather is not in the hook yet: replayed here, nothing armed (nor refused)
    summaries.script, summaries.gathers_in_hook = [-1, -1, 2, 3, -1, 0, 1], False
    step(0)
    assert verdict.replays == 1 and summaries.armed == [] and not gate._finish_refused
    # step 1: the hook gathers only: replayed here, copied to slot 1, and the hook armed from slot 2
    summaries.gathers_in_hook = True
    s1 = step(1)
    assert verdict.replays == 2 and summaries.armed == [(1234, 2, 10)] and gate._finish is verdict.out
    assert torch.equal(s1.rows, rows)
    # steps 2, 3: the hook finished into slots 2 and 3: nothing replayed or copied here
    s2, s3 = step(2), step(3)
    assert verdict.replays == 2 and gate._ring.take(2) is s2 and gate._ring.take(3) is s3
    # step 4: armed, but the hook did not finish (its gather disarmed): disarmed, replayed, the next slot
    s4 = step(4)
    assert summaries.disarmed == 1 and verdict.replays == 3 and gate._ring.following() == 5
    assert torch.equal(s4.rows, rows) and summaries.armed[-1] == (1234, 5, 10)   # and armed again
    # a host-path step the hook finished into slot 0... the ring goes on from there
    gate._ring._i = 9
    summaries.script = [0]
    assert torch.equal(gate._rows_on_host(), rows) and gate._ring.following() == 1
    # a slot the hook filled while the gate had it disarmed is skipped, never written by both
    gate._disarm_finish()
    summaries.script = [1]
    s6 = step(6)
    assert gate._ring.following() == 3 and gate._ring.take(2) is s6 and torch.equal(s6.rows, rows)


def test_a_step_the_device_passed_is_learnt_after_the_update_a_batch_at_a_time_and_never_replayed():
    """Issue 19: the previous step's host verdict waits for the AFTER stage when the device did not mask it
    (its flag 0, `defer`): the pre-update stage only reads the flag; the spread learns from such steps after
    an update, a batch at a time once armed. A masked step (flag 1), or any step on an audit step (no
    `defer`), is judged at once, the queued steps before it learnt first. Where the host finds a suspect the
    device passed, nothing is replayed (the update was applied)."""
    from checksums.compute_gate import ComputeChecks
    from checksums.step_guard import StepGuard

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    guard = StepGuard.attach(opt)
    replayed: list[int] = []
    gate = object.__new__(ComputeChecks)
    gate.guard, gate.tracker, gate.last_verdict = guard, SpreadTracker(margin=3.0, warmup=0), None
    gate._classify = lambda verdict, *a: (replayed.append(1) if verdict.suspects else None) or []
    gate._learn_queue, gate._learn_batch, gate._host_only_said = [], 2, False
    gate._suspicions = gate._dropped = 0
    gate.replayer = types.SimpleNamespace(reproduces=True, why_not="")
    gate._not_replayed = ""

    def pend(flag: float, norms: list[float]) -> None:
        rows = torch.zeros(3, 2, 4, dtype=torch.int64)
        rows[..., :2] = _stats(norms).contiguous().view(torch.int64)
        gate._pending = (3, _slot(rows, flag), True, None, guard.restores)

    pend(0.0, [1.0, 1.01, 1.02])
    gate._settle_previous(defer=True)
    assert len(gate._learn_queue) == 1 and gate.tracker.learned == 0 and gate.last_verdict is None
    gate._learn_deferred()                              # the AFTER stage: half a batch waits
    assert gate.tracker.learned == 0
    pend(0.0, [1.0, 1.01, 1.02])
    gate._settle_previous(defer=True)
    gate._learn_deferred()                              # a batch: both learnt
    assert gate._learn_queue == [] and gate.tracker.learned == 2 and gate.last_verdict.suspects == ()
    pend(0.0, [1.0, 1.02, 1.03])
    gate._settle_previous(defer=True)
    pend(0.0, [1.0, 1.01, 1.02])
    gate._settle_previous(defer=False)                  # an audit step: the queued one first, then this one
    assert gate._learn_queue == [] and gate.tracker.learned == 4
    pend(0.0, [1.0, 1.01, 1.02])
    gate._settle_previous(defer=True)
    pend(1.0, [1.0, 1.01, 50.0])                        # the device masked it: judged and replayed at once
    gate._settle_previous(defer=True)
    assert gate._learn_queue == [] and gate.tracker.learned == 5, "the queued step learnt before it"
    assert replayed == [1] and gate.last_verdict.suspects == (2,)
    assert [k.step for k in guard.skipped] == [3], "the masked step is one the guard learns was skipped"
    pend(0.0, [1.0, 1.01, 50.0])                        # the host names a rank the device passed
    gate._settle_previous(defer=True)
    pend(0.0, [1.0, 1.01, 1.02])
    gate._settle_previous(defer=True)
    gate._learn_deferred()                              # not a clean batch: one by one, in order
    assert replayed == [1] and gate._host_only_said and gate.tracker.learned == 6
    for _ in range(2):                                  # the AFTER stage never ran (the update raised):
        pend(0.0, [1.0, 1.01, 1.02])
        gate._settle_previous(defer=True)
    pend(0.0, [1.0, 1.01, 1.02])
    gate._settle_previous(defer=True)                   # the next step learns the full batch first
    assert gate.tracker.learned == 8 and len(gate._learn_queue) == 1
    assert len(guard.skipped) == 1, "a step the device passed is not a skipped one"


def test_the_warming_spread_is_learnt_every_step_so_the_device_verdict_arms_on_time():
    """Issue 19: while the spread warms up, each unmasked step is learnt at its AFTER stage (a batch of one):
    the device verdict arms after `warmup` steps, not a batch later."""
    from checksums.compute_gate import ComputeChecks
    from checksums.step_guard import StepGuard

    gate = object.__new__(ComputeChecks)
    gate.guard = StepGuard.attach(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    gate.tracker, gate.last_verdict = SpreadTracker(margin=3.0, warmup=3), None
    gate._learn_queue, gate._learn_batch, gate._host_only_said = [], 8, False
    for k in range(5):
        rows = torch.zeros(3, 2, 4, dtype=torch.int64)
        rows[..., :2] = _stats([1.0, 1.01, 1.02 + 0.001 * k]).contiguous().view(torch.int64)
        gate._pending = (k, _slot(rows, 0.0), False, None, gate.guard.restores)
        gate._settle_previous(defer=True)
        gate._learn_deferred()
        assert gate.tracker.learned == min(k + 1, 3), k
    assert len(gate._learn_queue) == 2, "armed: the steps after the warm-up wait for a batch"


def _start(fps: list[tuple[int, int]]) -> torch.Tensor:
    """Every rank's two replays of rank 0's batch at the first step: rank r's pair of fingerprints."""
    return torch.stack([torch.stack([_rows(a, world=1)[0], _rows(b, world=1)[0]]) for a, b in fps])


def test_the_first_steps_check_names_a_gpu_faulty_from_the_start_instead_of_calling_the_model_random():
    """A GPU that computes wrong from the job's first step repeats its own result: with a strict majority
    agreeing on another, it is named and replays stay exact (a faulty GPU used to turn exact comparisons off
    for the whole run, its small fault then hidden under the rounding bound). Run-to-run variation on any
    rank, two ranks that differ, or no majority: the rounding-aware bound, naming nobody."""
    assert classify_start(_start([(10, 10)] * 3)) == (True, None)
    exact, c = classify_start(_start([(10, 10), (10, 10), (99, 99)]))
    assert exact and (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (2,), True), c
    exact, c = classify_start(_start([(99, 99), (10, 10), (10, 10), (10, 10)]))   # rank 0's own GPU
    assert exact and c.faulty == (0,)
    exact, c = classify_start(_start([(10, 10), (10, 10), (10, 10), (98, 98), (99, 99)]))
    assert exact and c.faulty == (3, 4)
    assert classify_start(_start([(10, 10), (10, 10), (10, 11)])) == (False, None)   # run to run: random
    assert classify_start(_start([(10, 10), (99, 99)])) == (False, None)             # two: the CPU decides
    assert classify_start(_start([(10, 10), (10, 10), (99, 99), (99, 99)])) == (False, None)   # no majority
    exact, c = classify_start(_start([(10, 10), (98, 98), (10, 10), (99, 99)]))     # two faulty, each its own
    assert exact and c.faulty == (1, 3)
    assert classify_start(_start([(10, 10), (11, 11), (12, 12)])) == (False, None)
    # a job across GPU models (or CUDA, torch builds): ranks round differently by design, nobody is named
    assert classify_start(_start([(10, 10), (10, 10), (99, 99)]), same_hardware=False) == (False, None)
    assert classify_start(_start([(10, 10)] * 3), same_hardware=False) == (True, None)


def test_one_rank_that_does_not_repeat_at_the_first_step_is_checked_again_not_taken_for_a_random_model():
    """3+ ranks, one (or a minority) whose two replays of rank 0's batch differ while the rest repeat theirs
    and agree: the kernels are deterministic (they show it). Every rank replays twice more: all repeat ->
    exact, nobody named (a one-off); the same ranks again -> exact, those GPUs named (persistent: they do not
    reproduce what the others repeat bit for bit); anything else -> the rounding bound, as before."""
    first = _start([(10, 10), (10, 10), (10, 11)])
    assert flaky_start(first) == (2,)
    assert flaky_start(_start([(10, 12), (10, 10), (10, 10), (10, 10)])) == (0,)
    assert flaky_start(_start([(10, 11), (10, 10), (10, 10), (10, 12)])) == ()      # half the ranks: random
    assert flaky_start(_start([(10, 10), (12, 12), (10, 11)])) == ()                 # no majority repeats
    assert flaky_start(_start([(10, 10), (10, 11)])) == ()                           # two ranks
    assert flaky_start(first, same_hardware=False) == ()
    assert flaky_start(_start([(10, 10)] * 3)) == ()
    # the second round
    assert classify_start_rechecked(first, _start([(10, 10)] * 3)) == (True, None)      # a one-off
    exact, c = classify_start_rechecked(first, _start([(10, 10), (10, 10), (10, 13)]))  # rank 2 again
    assert exact and (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (2,), True), c
    assert "do not reproduce" in c.detail
    exact, c = classify_start_rechecked(first, _start([(10, 10), (10, 10), (99, 99)]))  # repeats, but wrong
    assert exact and c.faulty == (2,), c
    assert classify_start_rechecked(first, _start([(10, 11), (10, 10), (10, 10)])) == (False, None)  # another
    assert classify_start_rechecked(first, _start([(10, 11), (10, 10), (10, 12)])) == (False, None)


def test_three_gloo_ranks_check_a_rank_whose_first_replays_differ_again():
    """End to end (bench.compute_faults `--flaky-replay`: rank 1's numbered replays come back with one
    fingerprint bit changed): differing once at the first step's check, the second round repeats and the run
    stays exact, nobody named, nothing dropped (before: the rounding bound for the whole run); differing in
    both rounds, rank 1 is named `persistent` at step 1 and that update dropped, exact kept."""
    once = _faults(["--world", "3", "--cases", "none", "--clean", "12", "--flaky-replay", "1:1"])["clean"]
    assert once["status"]["exact"] and once["reported"] == [], once["status"]
    assert once["status"]["dropped"] == 0, once["status"]
    twice = _faults(["--world", "3", "--cases", "none", "--clean", "12", "--flaky-replay", "1:1,3"])["clean"]
    assert twice["status"]["exact"] and twice["status"]["dropped"] == 1, twice["status"]
    [(step, _, cause, where)] = twice["reported"]
    assert (step, cause, [w[0] for w in where]) == (1, "persistent", [1]), twice["reported"]
    for bad in ("1", "x:1", "1:0", "1:"):
        with pytest.raises(SystemExit) as e:
            compute_faults.parse_args(["--flaky-replay", bad])
        assert e.value.code == 2, bad
    for bad in (["--host-ops", "-1"], ["--gpu-profile", "-3"], ["--arms", "checks,chekcs"]):
        with pytest.raises(SystemExit) as e:
            compute_faults.parse_args(bad)
        assert e.value.code == 2, bad


def test_the_determinism_check_replays_a_second_round_only_for_a_flaky_minority(caplog):
    """`Replayer.check_determinism` with its collectives scripted: a second round (every rank, twice) runs
    only when a minority did not repeat; its outcome sets `exact` and `start_fault`, and the log says
    which."""
    from checksums.replay import Replayer

    class Scripted:
        same_hardware, cpu_witness, replays = True, False, 10
        device = torch.device("cpu")

        def __init__(self, rounds: list[torch.Tensor]) -> None:
            self.rounds = rounds

        def fetch(self, src: int) -> object:
            return object()

        def replay_round(self, fn: object) -> torch.Tensor:
            return self.rounds.pop(0)

    first = _start([(10, 10), (10, 10), (10, 11)])
    cases = [([first, _start([(10, 10)] * 3)], True, None, "one-off"),
             ([first, _start([(10, 10), (10, 10), (10, 12)])], True, (2,), "named"),
             ([first, _start([(10, 12), (10, 10), (10, 10)])], False, None, "rounding bound"),
             ([_start([(10, 10)] * 3)], True, None, ""),                     # all repeat: one round
             ([_start([(10, 11), (10, 10), (10, 12)])], False, None, "")]    # random: one round, the bound
    for rounds, exact, faulty, said in cases:
        stub = Scripted(list(rounds))
        caplog.clear()
        with caplog.at_level("WARNING", logger="checksums.replay"):
            assert Replayer.check_determinism(stub) is exact
        assert stub.rounds == [] and stub.replays == 10 - 2 * len(rounds), (said, stub.replays)
        assert (stub.start_fault.faulty if stub.start_fault else None) == faulty, said
        assert (said in caplog.text) if said else "first step" not in caplog.text, caplog.text


def test_the_bounds_reason_says_what_to_change():
    """GetStatus's "bounded: ..." says why the rounding bound was chosen and what setting would give exact
    replays on a GPU (under warn_only=True, cuDNN attention's backward stays non-deterministic: GPT-2 small's
    replays on an H200), in a line the mode's 120 characters hold whole."""
    random = _start([(10, 10), (10, 10), (10, 11)])
    own = _start([(10, 10), (99, 99)])
    cases = {
        (False, "cuda", True, False, ":4096:8"): "different GPU models",
        (True, "cuda", True, False, ":4096:8"): "no deterministic variant",
        (True, "cuda", True, True, ":4096:8"): "set warn_only=False",
        (True, "cuda", False, False, ":4096:8"): "set torch.use_deterministic_algorithms(True)",
        (True, "cuda", True, False, None): "CUBLAS_WORKSPACE_CONFIG",
        (True, "cpu", False, False, None): "non-deterministic kernel",
    }
    for args, words in cases.items():
        why = bounded_reason(random, *args)
        assert words in why and len(f"bounded: {why}; norms within 1e-3") <= 120, (args, why)
    assert "no majority or witness" in bounded_reason(own, True, "cuda", True, False, ":4096:8")


@pytest.mark.parametrize("world,faulty", [(3, 2), (2, 1)])
def test_a_gpu_faulty_from_the_first_step_is_named_at_it_and_the_replays_stay_exact(world, faulty):
    """The harness with a persistent x1.01 fault on one element from step 1 (3 ranks: the majority decides;
    2 ranks: the CPU witness): named `persistent` at step 1, that update dropped, replays exact, the later
    audits of that rank find it again; without the fault the check stays exact and quiet."""
    name = "mm one elem x1.01 persistent"
    r = _faults(["--world", str(world), "--fault-rank", str(faulty), "--fault-step", "1", "--audit-every", "5",
                 "--cases", name, "--clean", "20"])
    hit = r[name]["caught"]["compute"]
    assert {k: v for k, v in hit.items() if k != "detail"} == {"step": 1, "named": [faulty], "cause": "persistent",
                                                               "dropped": True, "detector": "audit",
                                                               "one_of": False}, hit
    assert ("rank 0's batch" if world == 2 else "") in hit["detail"], hit["detail"]   # 2: the start check's
    assert r[name]["mode"] == "exact" and r[name]["status"]["exact"], r[name]["mode"]
    assert r[name]["status"]["suspicions"] >= 2, r[name]["status"]
    assert r["clean"]["mode"] == "exact" and r["clean"]["status"]["suspicions"] == 0, r["clean"]


@pytest.mark.parametrize("faulty,step", [(1, 1), (0, 40)])
def test_two_bf16_ranks_name_the_gpu_that_computes_wrong_not_the_good_one(faulty, step):
    """Two ranks training under bf16 autocast (the tiny GPT on the CPU, as GPUs train), a persistent fault
    on one rank from `step`: each GPU repeats its own result, so the CPU witness decides. In bf16 the fault
    changes the rounding of everything after it, and a witness projecting bf16 gradients sat near 0.5 (the
    x1.01 and x1.05 faults: both ranks named, unresolved) or past it: the backward's x1.01 named the GOOD
    rank persistent, which the agent's STOP would have blamed. The witness's GPU side now recomputes in
    float32 (`full_precision`): the faulty rank is named, on either rank, from step 1 or later."""
    names = ["bwd one elem x1.01 persistent", "mm x1.05 persistent"]
    r = _faults(["--model", "tiny-gpt", "--world", "2", "--cpu-autocast", "--fault-rank", str(faulty),
                 "--fault-step", str(step), "--audit-every", "5", "--cases", ",".join(names)])
    for name in names:
        hit = r[name]["caught"]["compute"]
        assert hit["named"] == [faulty] and hit["cause"] == "persistent", (name, hit)
        assert r[name]["mode"] == "exact", r[name]["mode"]


def test_a_witness_without_memory_for_float32_falls_back_on_every_rank():
    """The witness's float32 replay needs more activation memory than the step; when it fails on one rank
    (out of memory, injected on rank 1) every rank replays as the step computes instead (the same precision
    on both, never a projection of mixed evidence): a finding that names both ranks `unresolved`. Before,
    the failure made the audit unclassifiable: the fault held back with no finding at all."""
    name = "mm x1.05 persistent"
    r = _faults(["--model", "tiny-gpt", "--world", "2", "--cpu-autocast", "--witness-fp32-fails", "1",
                 "--audit-every", "5", "--cases", name])
    hit = r[name]["caught"]["compute"]
    assert hit["cause"] == "unresolved" and hit["named"] == [0, 1] and hit["dropped"], hit


def test_the_fsdp_witness_loads_a_model_with_tied_weights():
    """FSDP2 on two ranks, a GPT whose head is tied to its embedding: the witness's float64 copy needs the
    tied weight under both names (named_parameters gives it once, the copy's state_dict asks for both); it
    failed to load ("Missing key(s): head.weight"), so every persistent fault on two FSDP ranks ended
    `unresolved`. Now the faulty rank is named, in float32 and under bf16 autocast."""
    for extra in ([], ["--cpu-autocast"]):
        name = "mm x1.05 persistent"
        r = _faults(["--model", "tiny-gpt", "--fsdp", "--world", "2", "--fault-rank", "1", "--audit-every", "5",
                     "--cases", name, *extra])
        hit = r[name]["caught"]["compute"]
        assert hit["named"] == [1] and hit["cause"] == "persistent", (extra, hit)


def test_full_precision_replays_ignore_the_loss_fns_own_autocast():
    """The witness's replay runs in float32 even inside a loss_fn's `torch.autocast`, TF32 off, the flags
    put back after."""
    from checksums.replay_modes import full_precision
    a = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with full_precision("cpu"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.float32 and torch.nn.functional.linear(a, a).dtype == torch.float32
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_full_precision_reaches_an_activation_checkpoints_recomputation():
    """A non-reentrant activation checkpoint recomputes its forward in the backward, where autograd carries
    no function mode, under the autocast state its forward saw: the float32 replay's recomputation ran in
    bf16 and torch.utils.checkpoint refused it ("Recomputed values ... have different metadata"), so every
    float32 witness of such a model fell back to the step's precision. Now the recomputation is float32
    too, the gradient the plain float32 one bit for bit; autocast works again after."""
    import torch.utils.checkpoint as cp
    from torch import nn

    from checksums.replay_modes import full_precision
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def grad(checkpointed: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            body = lambda v: nn.functional.gelu(lin(v))    # noqa: E731
            y = cp.checkpoint(body, x, use_reentrant=False) if checkpointed else body(x)
            return torch.autograd.grad(y.float().pow(2).sum(), [lin.weight])[0]
    with full_precision("cpu"):
        got = grad(True)
        plain = grad(False)
    assert got.dtype == torch.float32 and torch.equal(got, plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16


def test_classify_pair_names_a_transient_by_its_non_repeating_original():
    ok, bad = _rows(10, world=1)[0], _rows(99, world=1)[0]
    other = _rows(20, world=1)[0]
    originals = torch.stack([other, bad])                       # rank 1's original was wrong once
    replays = torch.stack([torch.stack([other, ok]), torch.stack([other, ok])])
    c = classify_pair_replays(originals, replays)
    assert (c.cause, c.faulty, c.drop) == (Cause.TRANSIENT, (1,), True)
    c = classify_pair_replays(torch.stack([other, ok]), replays)
    assert (c.cause, c.faulty, c.drop) == (Cause.DATA, (), False)


def test_classify_pair_names_a_persistent_fault_by_its_history_or_both():
    """A persistent fault repeats on its GPU: each GPU reproduces itself and they disagree on both batches.
    The fingerprints are symmetric; the rank whose statistics jumped from its own history is named, and
    with no such witness both are (never one wrong rank)."""
    a0, a1 = _rows(10, world=1)[0], _rows(20, world=1)[0]        # GPU 0's results of batches 0 and 1
    b0, b1 = _rows(11, world=1)[0], _rows(21, world=1)[0]        # GPU 1's (wrong) results
    originals = torch.stack([a0, b1])
    replays = torch.stack([torch.stack([a0, a1]), torch.stack([b0, b1])])
    c = classify_pair_replays(originals, replays, (0.8, 9.0))
    assert (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (1,), True)
    c = classify_pair_replays(originals, replays, (9.0, 0.8))
    assert c.faulty == (0,)
    c = classify_pair_replays(originals, replays, (2.0, 2.5))
    assert (c.cause, c.faulty, c.drop) == (Cause.UNRESOLVED, (0, 1), True)
    c = classify_pair_replays(originals, replays, (0.0, math.inf))        # a non-finite rank is its own witness
    assert c.faulty == (1,)
    # no history jump: the CPU witness's projection (0: GPU 0 computed right, 1: GPU 1 did) names the GPU
    c = classify_pair_replays(originals, replays, (2.0, 2.5), witness=0.02)
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,))
    c = classify_pair_replays(originals, replays, (2.0, 2.5), witness=0.97)
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (0,))
    c = classify_pair_replays(originals, replays, (2.0, 2.5), witness=0.5)
    assert (c.cause, c.faulty) == (Cause.UNRESOLVED, (0, 1))


def test_classify_pair_takes_a_persistent_fault_some_data_shows_to_the_witness():
    """A persistent fault one batch shows and the other rounds away (x1.05 on one activation): the GPUs
    agree on one batch and each repeats its own result on the other. That was "no consistent story",
    both ranks unresolved, with no witness asked; now it is the persistent case, decided as that is (the
    history jump, else the witness on the batch they disagree on), and said so."""
    a0, a1 = _rows(10, world=1)[0], _rows(20, world=1)[0]        # GPU 0's results of batches 0 and 1
    b1 = _rows(21, world=1)[0]                                    # GPU 1's wrong result of batch 1 only
    originals = torch.stack([a0, b1])
    replays = torch.stack([torch.stack([a0, a1]), torch.stack([a0, b1])])
    c = classify_pair_replays(originals, replays, (2.0, 2.5))
    assert (c.cause, c.faulty) == (Cause.UNRESOLVED, (0, 1)), c
    assert c.detail.startswith("each GPU repeats") and "rank 1's batch" in c.detail, c.detail   # asks a witness
    c = classify_pair_replays(originals, replays, (2.0, 2.5), witness=0.01)
    assert (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (1,), True), c
    c = classify_pair_replays(originals, replays, (0.5, 9.0))
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,)), c
    # an original that does not repeat on its GPU as well: still no consistent story
    replays_odd = torch.stack([torch.stack([a0, a1]), torch.stack([a0, _rows(22, world=1)[0]])])
    c = classify_pair_replays(originals, replays_odd, (2.0, 2.5), witness=0.01)
    assert c.cause is Cause.UNRESOLVED and "no consistent story" in c.detail, c


def test_jumps_measure_each_rank_against_its_own_clean_history():
    t = SpreadTracker(warmup=3)
    for k in range(6):
        t.judge(_stats([1.0 + 0.01 * k, 1.1 - 0.01 * k]))
    j = t.jumps(_stats([1.05, 8.0]))
    assert j[1] > 3.0 * j[0] and j[1] > 1.0
    assert t.jumps(_stats([1.05, math.nan]))[1] == math.inf


ACCUM = ["mm one elem =1e4", "grad elem =100", "mm one elem x1.01 persistent"]


def test_gradient_accumulation_checks_the_accumulated_gradient_and_replays_every_micro_batch():
    """--accum 3: two micro-batches under ddp.no_sync(), the hook fires on the last; a transient fault in
    micro-batch 1 of rank 1 is caught on its step and classified transient (the replay of all three
    micro-batches reproduces the others' and not the original); a persistent one by the audit; the
    clean run (exact replays of accumulated gradients) has no suspicion."""
    results = _faults(["--world", "3", "--accum", "3", "--fault-micro", "1", "--fault-step", "50",
                                   "--audit-every", "5", "--cases", ",".join(ACCUM), "--clean", "200"])
    for name in ACCUM:
        hit = results[name]["caught"].get("compute")
        assert hit and hit["named"] == [1] and hit["dropped"] and hit["step"] - 50 <= 5, f"{name}: {hit}"
    assert results["mm one elem =1e4"]["caught"]["compute"]["cause"] == "transient"
    assert results["mm one elem x1.01 persistent"]["caught"]["compute"]["cause"] == "persistent"
    st = results["clean"]["status"]
    assert st["suspicions"] == 0 and st["exact"] and st["audits"] >= 30, st


PAIR = ["mm one elem =1e4", "mm one elem =1e4 persistent", "grad elem NaN"]


def test_two_ranks_name_the_right_gpu_for_transient_and_persistent_faults():
    """Two ranks have no median and no majority: both batches are replayed on both ranks. The transient
    fault does not repeat (rank 1 named, transient); the persistent one repeats on its GPU and rank 1's
    statistics jumped from its own history (rank 1 named, persistent); never rank 0."""
    results = _faults(["--world", "2", "--fault-step", "50", "--audit-every", "0",
                                   "--cases", ",".join(PAIR), "--accum", "2"])
    for name in PAIR:
        hit = results[name]["caught"].get("compute")
        assert hit and hit["named"] == [1] and hit["dropped"] and hit["step"] == 50, f"{name}: {hit}"
    assert results["mm one elem =1e4"]["caught"]["compute"]["cause"] == "transient"
    assert results["mm one elem =1e4 persistent"]["caught"]["compute"]["cause"] == "persistent"


def test_two_ranks_name_a_small_persistent_fault_through_the_cpu_witness():
    """A persistent x1.01 on one matmul element, only an audit sees it: no history jump; each GPU repeats its
    own result. The CPU's float64 replay of rank 0's batch sits by the right GPU's gradient: the faulty one is
    named, whichever rank it is (the harness's faults skip float64: the CPU is not the faulty GPU)."""
    for faulty in (1, 0):
        results = _faults(["--world", "2", "--fault-step", "50", "--audit-every", "5",
                                       "--fault-rank", str(faulty), "--cases", "mm one elem x1.01 persistent"])
        hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
        assert hit and hit["named"] == [faulty] and hit["cause"] == "persistent" and hit["dropped"], hit


FSDP = ["mm one elem =1e4", "grad elem =100", "grad elem NaN"]


def test_fsdp2_pre_reduce_scatter_checks_name_the_rank_and_drop():
    """FSDP2 (fully_shard) on 3 gloo ranks: each FSDP group's local unsharded gradient is summarised before
    its reduce-scatter (a custom reduce-scatter: the stats, then the default one); the same comparison names
    rank 1 on the fault's step and the step is dropped on every rank; the collective replay of the suspect's
    batch classifies it (transient: rank 1's replay agrees with the others). Audits off here: the
    statistics alone."""
    results = _faults(["--world", "3", "--fsdp", "--fault-step", "40", "--cases", ",".join(FSDP),
                       "--accum", "2", "--audit-every", "0"])
    for name in FSDP:
        hit = results[name]["caught"].get("compute")
        assert hit and hit["named"] == [1] and hit["dropped"] and hit["step"] == 40, f"{name}: {hit}"
        assert hit["cause"] == "transient", f"{name}: {hit}"


def test_fsdp2_device_mask_leaves_the_weights_the_host_veto_leaves():
    """FSDP2 on 3 gloo ranks with fused Adam (its parameters DTensor shards): the device mask (`found_inf`
    set to the verdict, no host wait; `mask="auto"` picks it on CUDA with a fused optimizer) drops the
    faulty step as the host veto does, rank 1 named at step 25, and every rank's shards end bit-identical
    to the host veto's run: the fused optimizer skipped the masked update on DTensor parameters too
    (parameters, moments and step count)."""
    def run(mask: str) -> tuple[dict, list[str]]:
        name = "mm one elem =1e4"
        r = _faults(["--world", "3", "--fsdp", "--mask", mask, "--fused-adam", "--fault-step", "25",
                     "--after", "8", "--audit-every", "0", "--cases", name])[name]
        return r["caught"].get("compute"), r["weights"]
    host_hit, host_w = run("host")
    dev_hit, dev_w = run("device")
    for hit in (host_hit, dev_hit):
        assert hit and hit["step"] == 25 and hit["named"] == [1] and hit["dropped"], hit
    assert dev_w == host_w


FSDP_AUDIT = ["mm one elem x1.01 persistent", "mm channel x2 persistent", "mm one elem =10"]


def test_fsdp2_audits_name_a_small_persistent_fault_and_a_transient_on_an_audited_step():
    """FSDP2 on 3 gloo ranks, audits every 5: on an audit step every rank replays its neighbour's batch at
    once (a collective replay: the replay's gradient is summarised in the custom reduce-scatter and never
    reduced). A persistent x1.01 on one matmul element of rank 1 from step 22 (below the statistics'
    margin) is caught by the next audit (25), rank 1 named, persistent, its update dropped; a transient
    fault on an audited step (25) likewise, transient; 100 clean steps with accumulation: no suspicion,
    exact replays, every audit passing (10,000 clean steps: test_compute_clean_steps.py and BENCHMARKS).
    The faults and the clean run with the faulty layer activation-checkpointed (`--ac nonreentrant`, as
    torchtitan wraps its blocks: recomputed in the backward, and in every replay)."""
    results = _faults(["--world", "3", "--fsdp", "--fault-step", "22", "--after", "10", "--audit-every", "5",
                       "--cases", ",".join(FSDP_AUDIT[:2]), "--clean", "100", "--accum", "2",
                       "--ac", "nonreentrant"])
    for name in FSDP_AUDIT[:2]:
        hit = results[name]["caught"].get("compute")
        assert hit and hit["detector"] == "audit" and hit["step"] == 25, f"{name}: {hit}"
        assert hit["named"] == [1] and hit["cause"] == "persistent" and hit["dropped"], f"{name}: {hit}"
    st = results["clean"]["status"]
    assert st["suspicions"] == 0 and st["dropped"] == 0 and st["exact"] and st["audits"] == 20, st
    assert st["steps"] == 100, st
    transient = _faults(["--world", "3", "--fsdp", "--fault-step", "25", "--after", "10",
                         "--audit-every", "5", "--cases", FSDP_AUDIT[2]])
    transient = transient[FSDP_AUDIT[2]]["caught"].get("compute")
    assert transient and transient["detector"] == "audit" and transient["step"] == 25, transient
    assert transient["named"] == [1] and transient["cause"] == "transient" and transient["dropped"], transient


def test_fsdp2_audits_leave_the_training_bit_for_bit_alone():
    """A replay's gradient never reaches the reduce-scatter output, `.grad` or the optimizer: 30 clean steps
    with an audit every 2nd step (each a collective replay with two micro-batches) end with every rank's
    shards bit-identical to the same run without audits."""
    def weights(audit_every: int) -> list[str]:
        r = _faults(["--world", "3", "--fsdp", "--cases", "none", "--clean", "30", "--accum", "2",
                     "--audit-every", str(audit_every)])["clean"]
        assert r["status"]["suspicions"] == 0, r["status"]
        assert r["status"]["audits"] == (15 if audit_every else 0), r["status"]
        return r["weights"]
    assert weights(2) == weights(0)


def test_hsdp_audits_name_the_rank_and_leave_the_training_alone():
    """HSDP (FSDP2 on a (2 replicas, 2 shards) mesh, 4 gloo ranks): the rows are each shard group's
    reduce-scatter inputs; on an audit step every rank replays its neighbour's batch at once (FSDP's
    all-reduce across replicas runs on the zeroed output, paired on every rank). A persistent x1.01 on rank
    1 from step 22 is named by the audit at 25; 20 clean steps with an audit every 2nd leave every shard
    bit-identical to the run without audits. A weight's exponent flipped on rank 3 reaches both ranks of its
    replica, which replay alike and unlike the other replica: `diverged`, its update dropped, nobody named
    (before, the good replica's outlier rank was named `unresolved`)."""
    hsdp = ["--world", "4", "--fsdp", "--hsdp", "2"]
    name = "mm one elem x1.01 persistent"
    hit = _faults(hsdp + ["--fault-step", "22", "--after", "10", "--audit-every", "5",
                          "--cases", name])[name]["caught"]["compute"]
    assert hit["step"] == 25 and hit["named"] == [1] and hit["cause"] == "persistent" and hit["dropped"], hit
    flip = "weight exp-flip"
    hit = _faults(hsdp + ["--fault-step", "22", "--after", "4", "--audit-every", "5", "--fault-rank", "3",
                          "--cases", flip])[flip]["caught"]["compute"]
    assert hit["step"] == 23 and hit["named"] == [] and hit["cause"] == "diverged" and hit["dropped"], hit

    def clean(audit_every: int) -> list[str]:
        r = _faults(hsdp + ["--cases", "none", "--clean", "20", "--audit-every", str(audit_every)])["clean"]
        assert r["status"]["suspicions"] == 0, r["status"]
        return r["weights"]
    assert clean(2) == clean(0)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_ranks_whose_weights_differ_are_not_named_as_computing_wrong(world):
    """DDP: a bit flipped in rank 1's copy of a weight (or of Adam's state, which the next update turns into
    its weights) makes rank 1 replay every batch unlike the rest. The replays alone read that as a persistent
    fault of rank 1's GPU, repeated every step until the replicas are repaired or rolled back, and the agent
    failed the GPU and stopped the job on the second (measured before: `--world 2 --cases "weight exp-flip"`
    named rank 1 `persistent` on steps 31-38). The gate compares the ranks' parameter fingerprints before it
    names a GPU: `diverged`, nobody named, dropped; the vote names the rank. A fault of the arithmetic on
    the same run is still named."""
    cases = ["weight exp-flip", "adam exp_avg exp-flip", "mm one elem x1.01 persistent"]
    r = _faults(["--world", str(world), "--fault-step", "30", "--after", "4", "--audit-every", "5",
                 "--cases", ",".join(cases)])
    for name, late in (("weight exp-flip", 1), ("adam exp_avg exp-flip", 2)):
        hit = r[name]["caught"]["compute"]
        assert hit["step"] == 30 + late and hit["named"] == [] and hit["cause"] == "diverged", (name, hit)
        assert hit["dropped"] and "parameter fingerprints differ" in hit["detail"], (name, hit)
        # the vote names the rank (two replicas: no majority, both)
        named = [1] if world == 3 else [0, 1]
        assert r[name]["caught"]["vote"]["named"] == named, (name, r[name]["caught"])
    hit = r["mm one elem x1.01 persistent"]["caught"]["compute"]
    assert hit["named"] == [1] and hit["cause"] == "persistent", hit


def test_weights_are_compared_only_between_replicas_and_only_the_ranks_apart_are_relabelled():
    """`_weights_checked` alone (no ranks): ranks that were no replicas at the first step (experts sharded
    across them) keep their named faults; among replicas a named rank outside the majority's weights is
    `diverged`, a named rank inside it stays named; with no majority every named rank is `diverged`."""
    from checksums.compute_gate import ComputeChecks
    from checksums.replay import Cause, Classification

    gate = object.__new__(ComputeChecks)
    gate.world, gate.fsdp = 4, False
    fault = [("stats", 3, Classification(Cause.PERSISTENT, (3,), True, "d")),
             ("stats", 1, Classification(Cause.TRANSIENT, (1,), True, "d"))]
    gate._replicated = False
    gate._param_words = lambda: [(1,), (1,), (1,), (2,)]
    assert gate._weights_checked(fault) == fault, "no replicas: nothing compared"
    gate._replicated = True
    out = gate._weights_checked(fault)
    assert out[0][2].cause is Cause.DIVERGED and out[0][2].faulty == () and out[0][2].drop
    assert "rank(s) [3] hold other weights than the rest" in out[0][2].detail
    assert out[1] == fault[1], "rank 1's weights are the majority's: its fault stays named"
    gate._param_words = lambda: [(1,), (1,), (2,), (2,)]
    assert all(c.cause is Cause.DIVERGED for _, _, c in gate._weights_checked(fault))
    gate._param_words = lambda: [(1,)] * 4
    assert gate._weights_checked(fault) == fault


def test_fsdp2_two_ranks_pair_replays_name_the_gpu():
    """FSDP2 on 2 gloo ranks: no majority; an audit's mismatch replays both batches on both ranks (two
    collective rounds). A transient fault on an audited step does not repeat (rank 1 named, transient); a
    large persistent one repeats on its GPU and rank 1's statistics jumped (rank 1, persistent); a small
    persistent one (x1.01 on one element) leaves no jump: the CPU witness (the harness passes
    `witness_model`, a factory of the bare model; rank 0 loads the gathered full weights into it and
    recomputes rank 0's batch in float64) names the faulty rank, whichever it is; 100 clean steps: no
    suspicion."""
    results = _faults(["--world", "2", "--fsdp", "--fault-step", "25", "--after", "10", "--audit-every", "5",
                       "--clean", "100",
                       "--cases", "mm one elem =10,mm one elem =1e4 persistent,mm one elem x1.01 persistent"])
    for name, cause in (("mm one elem =10", "transient"), ("mm one elem =1e4 persistent", "persistent"),
                        ("mm one elem x1.01 persistent", "persistent")):
        hit = results[name]["caught"].get("compute")
        assert hit and hit["step"] == 25 and hit["named"] == [1] and hit["dropped"], f"{name}: {hit}"
        assert hit["cause"] == cause, f"{name}: {hit}"
    st = results["clean"]["status"]
    assert st["suspicions"] == 0 and st["exact"] and st["audits"] == 20, st
    hit = _faults(["--world", "2", "--fsdp", "--fault-step", "22", "--after", "10", "--audit-every", "5",
                   "--fault-rank", "0", "--cases", "mm one elem x1.01 persistent"]
                  )["mm one elem x1.01 persistent"]["caught"]["compute"]
    assert hit["step"] == 25 and hit["named"] == [0] and hit["cause"] == "persistent" and hit["dropped"], hit


def test_sdcguard_side_by_side_on_the_same_faults():
    """--sdcguard 1: sdcguard's ABFT check (its default dispatch mode, bf16 autocast on CPU) and the compute
    gate on the same injected faults in the same run: a matmul element set to 1e4 inside the matmul is caught
    by both on its step on rank 1; a gradient fault after the matmul is ours only (no matmul is wrong)."""
    results = _faults(["--world", "3", "--fault-step", "30", "--sdcguard", "1", "--audit-every", "0",
                                   "--cases", "mm one elem =1e4,grad elem =100"])
    mm = results["mm one elem =1e4"]["caught"]
    assert mm["compute"]["named"] == [1] and mm["compute"]["step"] == 30, mm
    assert mm["sdcguard"] == {"step": 30, "named": [1]}, mm
    assert mm["sdcguard_stats"]["checked"] > 0
    grad = results["grad elem =100"]["caught"]
    assert grad["compute"]["named"] == [1] and "sdcguard" not in grad, grad


def test_one_gpu_bench_runs_on_cpu():
    """bench.compute_gpu1 (virtual ranks on one device) on CPU: a large fault caught on its step naming rank
    1, the clean steps quiet, the sweep finds a smallest size; an overhead arm table from compute_faults on
    one rank (the numbers are the GPU run's business, not asserted)."""
    from bench import compute_gpu1
    r = compute_gpu1.main(["--model", "mlp", "--clean", "10", "--cases", "mm one elem =1e4,grad elem NaN"])
    assert r["clean"]["suspicions"] == 0
    for name in ("mm one elem =1e4", "grad elem NaN"):
        assert r["cases"][name]["right"], r["cases"][name]
    assert r["sweep"]["mm one elem = v"]["smallest"] is not None
    o = _faults(["--world", "1", "--cases", "none", "--overhead", "8", "--block", "4",
                             "--overhead-audit-every", "5", "--host-ops", "40"])["overhead"]
    assert set(o["arms"]) == {"base", "checks", "checks+audits"} and o["blocks"] == 2
    # --host-ops: what each arm adds over base on the host, by operation: the checks' one gather of the
    # rows a step (base has none), with the whole names kept
    diff = {k: (ms, n) for k, ms, n in o["host"]["checks"]["op_diff"]}
    assert diff["c10d::_allgather_base_"][1] == 1.0 and diff["c10d::_allgather_base_"][0] > 0, diff
    assert "c10d::_allgather_base_" not in o["host"]["base"]["all_ops"], o["host"]["base"]["all_ops"]


def test_host_parts_time_each_part_of_each_arm_and_the_checks_own_share():
    """`compute_faults --host-parts` (how the H200's host-bound step is measured): each arm's parts, with the
    hook-only arm's hook as the floor the checks' own host time is counted over."""
    o = _faults(["--world", "1", "--cases", "none", "--overhead", "4", "--block", "2", "--hook-arm",
                 "--host-parts", "3", "--busy-thread", "0.5"])["overhead"]
    assert o["busy_thread"] == 0.5, o
    parts, hook, base = (o["host"][a]["parts"] for a in ("checks-python", "hook", "base"))
    assert parts["GradSummaries._hook"] > parts["BucketAllreduce.__call__"] > 0, parts
    # the default arm's checks went through the C++ hook: no Python hook call, the step's enqueue timed
    assert o["hooks"] == {"checks": "C++", "checks-python": "Python (asked)", "checks+audits": "C++"}, \
        o["hooks"]
    native = o["host"]["checks"]["parts"]
    assert "GradSummaries._hook" not in native and native["(enqueue)"] > native["(backward)"] > 0, native
    assert parts["(backward)"] > parts["GradSummaries._hook"], parts      # the hooks run inside the backward
    assert parts["StepGuard._pre_hook"] >= parts["ComputeChecks.run"] > 0 and parts["(step)"] > 0, parts
    assert hook["hook-arm"] > 0 and "GradSummaries._hook" not in hook and "hook-arm" not in base, (hook, base)
    got = compute_faults._own_host_time(
        {"GradSummaries._hook": 5.0, "StepGuard._pre_hook": 2.0, "ComputeChecks.retain": 0.5,
         "StepGuard._post_hook": 1.5}, {"hook-arm": 3.0})
    assert got == (4.5, 1.5)                             # (5 - 3) + 2 + 0.5 before the update; 1.5 after
    assert compute_faults._own_host_time(base, hook) is None and compute_faults._own_host_time(parts, None) is None


def test_the_device_profile_diff_keeps_kernels_whose_names_share_a_prefix_apart():
    """`--gpu-profile`'s per-kernel diff against base: two copy kernels whose first 90 characters agree are
    two kernels (a truncated key kept the last of them: base seemed to run 7.7 ms of copies no arm ran)."""
    from types import SimpleNamespace as E
    stem = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(" + "x" * 50
    evs = [E(key=stem + "<bf16>", self_device_time_total=77_000.0, count=1250),
           E(key=stem + "<fp32>", self_device_time_total=2_000.0, count=30),
           E(key="gemm", self_device_time_total=264_000.0, count=10)]
    base = compute_faults.profile_times(evs, 10, "self_device_time_total")
    assert base == {stem + "<bf16>": (7.7, 125.0), stem + "<fp32>": (0.2, 3.0), "gemm": (26.4, 1.0)}, base
    summary = E(key="gs_partials", self_device_time_total=3_400.0, count=130)
    arm = compute_faults.profile_times([*evs[::-1], summary], 10, "self_device_time_total")
    assert compute_faults.profile_diff(base, arm) == [("gs_partials", pytest.approx(0.34), 13.0)]
    assert compute_faults.profile_diff(arm, base) == [("gs_partials", pytest.approx(-0.34), -13.0)]
    slower = dict(arm, **{stem + "<fp32>": (0.5, 3.0)})
    (name, ms, n), = [d for d in compute_faults.profile_diff(arm, slower) if d[0] != "gs_partials"]
    assert name == (stem + "<fp32>")[:90] and abs(ms - 0.3) < 1e-9 and n == 0, (name, ms, n)


def test_fsdp2_overhead_arms_run_on_cpu():
    """The FSDP2 overhead arms (bench/gpu_run.sh's compute-fsdp step on the GPU pair) run on 2 gloo ranks:
    base and checks with collective audits (`--arms`: the plain checks arm left out); every audit passes
    (the numbers are the GPU run's)."""
    o = _faults(["--world", "2", "--fsdp", "--cases", "none", "--overhead", "8", "--block", "4",
                 "--overhead-audit-every", "2", "--arms", "checks+audits"])["overhead"]
    assert set(o["arms"]) == {"base", "checks+audits"} and o["blocks"] == 2, o
    assert o["summary_paths"]["checks+audits"] == {"torch": 3}, o["summary_paths"]   # one row per FSDP group
    st = o["status"]["checks+audits"]
    assert st["audits"] >= 6 and st["suspicions"] == 0 and st["exact"], st


def _harness_steps(checks, ddp, opt, n: int, after_each=None) -> None:  # type: ignore[no-untyped-def]
    """`n` steps of the harness's model and data (compute_faults) under `checks`, as a loop writes them."""
    for s in range(n):
        b = compute_faults.batch_for(0, s, torch.device("cpu"))
        checks.retain(b)
        compute_faults.loss_fn(ddp, b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_each is not None:
            after_each()


def _device_path_host_rows(rank: int, init: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    compute_faults.MODEL["name"] = "mlp"
    ddp = DDP(compute_faults.make_model(0)[0])
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=True)
    checks = ComputeChecks.attach(ddp, opt, loss_fn=compute_faults.loss_fn, mask="device", audit_every=0)
    seen: list[Any] = []
    _harness_steps(checks, ddp, opt, 40, lambda: seen.append(checks._pending[1]))
    # a ring of host slots made once and used in turn: no step allocates the rows' host memory; room for a
    # learning batch, the step settled and the step's own
    n = checks._learn_batch + 2
    assert checks._learn_batch == 8 and len({id(t) for t in seen}) == n, [id(t) for t in seen]
    assert all(seen[k] is seen[k + n] for k in range(40 - n))
    learned, waiting = checks.tracker.learned, len(checks._learn_queue)
    status = checks.status()
    assert status.steps == 40 and status.suspicions == 0
    # the rows' all-gather: eager at the first step (the determinism check's and the step's own) and the
    # second, then in the C++ comm hook for the 38 steps after (it built here: the CPU runs it too)
    assert status.hook_gathers == 38 and status.hook_verdicts == 0, status   # (no verdict graph off CUDA)
    # every step but the last (judged at the next) learnt or waiting for its batch; reading the status
    # learns nothing (every rank must judge against the same spread, asked or not)
    assert learned + waiting == 39 and 0 < waiting < checks._learn_batch, (learned, waiting)
    assert checks.tracker.learned == learned and len(checks._learn_queue) == waiting
    dist.destroy_process_group()


def test_device_path_reuses_a_ring_of_host_slots_for_the_rows(tmp_path) -> None:
    spawn(_device_path_host_rows, (str(tmp_path / "init"),), nprocs=1)


def _tracker_per_step(rank: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=3)
    compute_faults.MODEL["name"] = "mlp"
    ddp = DDP(compute_faults.make_model(0)[0])
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=True)
    checks = ComputeChecks.attach(ddp, opt, loss_fn=compute_faults.loss_fn, mask="device", audit_every=0)
    seen = []
    for s in range(60):
        b = compute_faults.batch_for(rank, s, torch.device("cpu"))
        checks.retain(b)
        compute_faults.loss_fn(ddp, b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            checks.status()                  # one rank logs the checks' status every step
        seen.append([checks.tracker.learned, checks.tracker.spread_version])
    with open(out.format(rank=rank), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def test_every_rank_learns_the_spread_at_the_same_steps_whoever_reads_the_status(tmp_path) -> None:
    """Issue 19: each rank's device judges a step against its own copy of the spread, so the copies must
    move at the same steps on every rank, or one rank masks an update the others apply. The device path
    learns its unmasked steps a batch at a time; reading `status()` on one rank (as a loop logging on rank
    0 does) must not learn that rank's waiting batch early."""
    import json

    spawn(_tracker_per_step, (str(tmp_path / "init"), str(tmp_path / "r{rank}.json")), nprocs=3)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    assert got[0] == got[1] == got[2], [g[-5:] for g in got]
    assert got[0][-1][0] >= 40 and got[0][-1][1] >= 2, got[0][-1]   # it learnt, and the spread moved


def _refused_then_retried(rank: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    compute_faults.MODEL["name"] = "mlp"
    ddp = DDP(compute_faults.make_model(0)[0])
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)            # not fused: no device mask
    errors = []
    for bad in ({"mask": "device"}, {"mask": "bogus"}, {"margin": 0.5}, {"audit_every": -1},
                {"margin": float("nan")}, {"loss_fn": None}, {"audit_every": 2.5}, {"warmup": -1},
                {"max_findings": -1}, {"gpu_uuid": 7}):
        try:
            ComputeChecks.attach(ddp, opt, **{"loss_fn": compute_faults.loss_fn, **bad})
            errors.append("")
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # the error's advice taken on the same model: attached, and it checks every step
    checks = ComputeChecks.attach(ddp, opt, loss_fn=compute_faults.loss_fn, mask="host", audit_every=0,
                                  gpu_uuid=None)         # not known, as the Monitor takes it
    _harness_steps(checks, ddp, opt, 4)
    with open(out, "w") as f:
        json.dump({"errors": errors, "steps": checks.status().steps, "calls": checks.summaries.hook_calls}, f)
    dist.destroy_process_group()


def test_a_refused_attach_leaves_the_model_free_for_a_retry(tmp_path) -> None:
    """DDP takes one comm hook and cannot give it back: an attach refused for what the caller passed (a
    device mask without a fused optimizer, an unknown mask, a margin, an audit cadence, no loss function)
    refuses before the hook goes on the model, so the retry the message advises attaches (it was refused as
    'already has a communication hook'); and values that were taken silently (a NaN margin, under which
    nothing is ever caught; no loss_fn, under which nothing is replayed; 2.5 steps) are refused."""
    import json
    out = tmp_path / "out.json"
    spawn(_refused_then_retried, (str(tmp_path / "init"), str(out)), nprocs=1)
    got = json.loads(out.read_text())
    device, bogus, margin, cadence, nan, no_loss, half, warm, kept, uuid = got["errors"]
    assert "gpu_uuid is a string" in uuid, uuid
    assert "use mask='host'" in device and "'bogus'" in bogus and "margin" in margin, got
    assert "audit_every" in cadence and "audit_every" in half and "2.5" in half, got
    # a NaN margin compares false with every score (nothing would ever be caught); no loss_fn, no replays
    assert nan.startswith("ValueError") and "nan" in nan, nan
    assert no_loss.startswith("ValueError") and "loss_fn is a function (it recomputes" in no_loss, no_loss
    assert "warmup" in warm and "max_findings" in kept, got
    assert got["steps"] == 4 and got["calls"] >= 4, got


def _hook_trains_like_plain_ddp(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.grad_checks import GradSummaries
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 3))
    models, opts, hooks = [], [], []
    for with_hook in (False, True):
        m = nn.Sequential(*[type(l)(*(() if isinstance(l, nn.GELU) else (l.in_features, l.out_features)))
                            for l in base])
        m.load_state_dict(base.state_dict())
        ddp = DDP(m, bucket_cap_mb=0.002)            # several buckets (DDP rebuilds them after step 1)
        hooks.append(GradSummaries.attach(ddp) if with_hook else None)
        models.append(ddp)
        opts.append(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)
        for ddp, opt in zip(models, opts):
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        hooks[1].clear()
    same = all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    # the layout the hook keeps names every parameter once, in DDP's rebuilt bucket order
    layout = sorted(i for b in sorted(hooks[1].layout) for i in hooks[1].layout[b])
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"same": same, "buckets": len(hooks[1].layout), "calls": hooks[1].hook_calls,
                   "layout_ok": layout == list(range(len(hooks[1].params)))}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 3])
def test_the_hook_reduces_bit_for_bit_as_plain_ddp(tmp_path, world: int) -> None:
    """GradSummaries' reduction (the process group called directly, nothing scaled at world size 1) trains
    bit for bit as DDP without a hook, on every rank, over several buckets and DDP's rebuild (torch's own
    allreduce_hook does not: it divides where DDP multiplies by the reciprocal)."""
    import json
    out = str(tmp_path / "res")
    spawn(_hook_trains_like_plain_ddp, (world, str(tmp_path / "init"), out), nprocs=world)
    for r in range(world):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        assert res["same"], f"rank {r}: the weights differ from plain DDP's"
        # DDP's first step has one bucket, then it rebuilds them by bucket_cap_mb
        assert res["buckets"] >= 2 and res["calls"] == 1 + 5 * res["buckets"] and res["layout_ok"], res


def _own_comm_hook(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    res: dict = {}

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 2)), bucket_cap_mb=0.0005)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    # a DDP model that already has a hook: refused, saying what to do
    taken, opt = make()
    taken.register_comm_hook(None, fp16_compress_hook)
    try:
        ComputeChecks.attach(taken, opt, loss_fn=lambda m, b: m(b[0]).pow(2).mean())
        res["refused"] = ""
    except ValueError as e:
        res["refused"] = str(e)
    # the job's own hook passed as comm_hook=: the same training as that hook registered alone
    plain, plain_opt = make()
    plain.register_comm_hook(None, fp16_compress_hook)
    checked, checked_opt = make()
    checks = ComputeChecks.attach(checked, checked_opt, loss_fn=lambda m, b: m(b[0]).pow(2).mean(),
                                  comm_hook=fp16_compress_hook, audit_every=0, warmup=2)
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(5):
        batch = (torch.randn(6, 12, generator=g),)
        for ddp, o, ch in ((plain, plain_opt, None), (checked, checked_opt, checks)):
            if ch is not None:
                ch.retain(batch)
            ddp(batch[0]).pow(2).mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    res["same"] = all(torch.equal(a, b) for a, b in zip(plain.parameters(), checked.parameters()))
    res["steps"] = checks.status().steps
    res["hook_calls"] = checks.summaries.hook_calls
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_a_jobs_own_comm_hook_goes_through_the_checks(tmp_path) -> None:
    """DDP takes one comm hook: a job's own (fp16 compression here) passed as comm_hook= reduces each bucket
    after the summary, and trains bit for bit as that hook registered alone; a model that already has a hook
    is refused with a message that says what to do (torch's own error says only 'called once')."""
    import json
    out = str(tmp_path / "res")
    spawn(_own_comm_hook, (2, str(tmp_path / "init"), out), nprocs=2)
    for r in range(2):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        assert "already has a communication hook (fp16_compress_hook)" in res["refused"], res
        assert "comm_hook=" in res["refused"]
        assert res["same"] and res["steps"] == 5 and res["hook_calls"] >= 5, res


def test_assess_is_jumps_then_judge() -> None:
    """The gate's one call a step (one host copy, one log) gives what jumps() then judge() give, over
    warm-up, clean steps, outliers, non-finite values, zeros and a bucket rebuild: the verdict on every
    step, and the jumps on every step with suspects (the only steps that read them; zeros on the others,
    which are most steps: the history jumps are not computed there)."""
    import numpy as np
    rng = np.random.default_rng(5)
    a, b = SpreadTracker(warmup=5), SpreadTracker(warmup=5)
    suspects = moved = 0
    for k in range(400):
        buckets = 3 if k < 200 else 4
        x = np.exp(rng.normal(0, 0.02, size=(4, buckets, 2)))
        if k % 7 == 3:
            x[k % 4, k % buckets, k % 2] *= 3.0
        if k % 11 == 5:
            x[k % 4, 0, 0] = [math.nan, math.inf, -math.inf, 0.0][k % 4]
        stats = torch.from_numpy(x)
        want = (a.jumps(stats), a.judge(stats))
        got = b.assess(stats)
        if want[1].suspects:
            suspects += 1
            moved += any(0.0 < j < math.inf for j in want[0])
            assert got == want, (k, got, want)
        else:
            assert got == ((0.0,) * 4, want[1]), (k, got, want)
    assert suspects > 40 and moved > 20, (suspects, moved)      # steps whose jumps were compared, finite ones
    assert a.spread_version == b.spread_version and torch.equal(a.spread, b.spread)


def _scaled_loop(rank: int, world: int, init: str, out: str) -> None:
    """Three gloo ranks under a GradScaler (the loop back-propagates `scaler.scale(loss)`), each case a run
    of a checked model beside the same model unchecked; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)

    def loss_fn(m: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    def run(fused: bool, pass_scaler: bool, overflow_at: int = 0, nan_at: int = 0, nan_rank: int = 1,
            steps: int = 24) -> dict:
        arms = []
        for checked in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
            ddp = DDP(net, bucket_cap_mb=0.004)
            opt = (torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=True) if fused
                   else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
            checks, at = None, {"step": 0}
            if checked:
                def inject(idx: int, buf: torch.Tensor, at: dict = at) -> None:   # a fault on rank 1's GPU
                    if rank == nan_rank and at["step"] == nan_at and idx == 0:
                        buf.view(-1)[0] = float("nan")
                checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, audit_every=4, warmup=8,
                                              scaler=scaler if pass_scaler else None, inject_bucket=inject)
            arms.append((ddp, opt, scaler, checks, at))
        g = torch.Generator().manual_seed(10 + rank)
        for s in range(1, steps + 1):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if s == overflow_at and rank == 1:
                x = x * 1e30       # the data: rank 1's scaled gradient overflows (inf), every replay's too
            for ddp, opt, scaler, checks, at in arms:
                at["step"] = s
                if checks is not None:
                    checks.retain((x, y))
                scaler.scale(loss_fn(ddp, (x, y))).backward()
                scaler.step(opt)       # non-fused: skipped on inf, so the gate runs at the next retain
                scaler.update()
                opt.zero_grad(set_to_none=True)
        plain, checked = arms[0], arms[1]
        st = checked[3].status()
        same = all(torch.equal(a, b) for a, b in zip(plain[0].parameters(), checked[0].parameters()))
        return {"same": same,
                "mode": checked[3].mode(), "audits": st.audits, "suspicions": st.suspicions,
                "scale": float(checked[2].get_scale()), "plain_scale": float(plain[2].get_scale()),
                "findings": [(f.detector, f.cause, list(f.faulty), f.dropped) for f in checked[3].findings]}

    res = {"clean_fused": run(True, True), "clean_sgd": run(False, True),
           "overflow_fused": run(True, True, overflow_at=14),
           "overflow_sgd": run(False, True, overflow_at=14),
           "nan_sgd": run(False, True, nan_at=14), "no_scaler": run(True, False),
           "nan_first": run(True, True, nan_at=1, nan_rank=0, steps=6)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_replays_reproduce_a_step_under_a_gradient_scaler(tmp_path) -> None:
    """A loop under a GradScaler back-propagates the loss times the scale. The checks take `scaler=` and a
    replay multiplies by the scale its step ran under: audits compare exact fingerprints and agree (before,
    every audit named the audited GPU transient, as the unscaled replay never matched). An overflow of one
    rank's scaled gradient (the data's: it reproduces on every rank) names no GPU, with a fused optimizer
    (the gate runs in the step) and a plain one (the scaler skips `step()`: the gate judges it at the next
    `retain`); a NaN on one rank at a step the scaler skips names that rank. Without `scaler=` the first
    step's check finds the replay 1024x off: no audit runs and no GPU is named on a replay's evidence. A
    fault on rank 0 at that first step does not turn the check off (rank 1's batch reproduces)."""
    import json
    out = str(tmp_path / "res")
    spawn(_scaled_loop, (3, str(tmp_path / "init"), out), nprocs=3)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        for case in ("clean_fused", "clean_sgd"):
            c = res[case]
            assert c["mode"] == "exact" and c["audits"] >= 5 and c["suspicions"] == 0 and c["same"], (case, c)
        for case in ("overflow_fused", "overflow_sgd"):
            c = res[case]
            assert c["mode"] == "exact" and c["findings"] == [["nonfinite", "data", [], True]], (case, c)
            assert c["same"] and c["scale"] == c["plain_scale"], (case, c)     # the scaler backed off alike
        c = res["nan_sgd"]
        assert c["findings"] == [["nonfinite", "transient", [1], True]], c
        c = res["no_scaler"]
        assert c["mode"].startswith("unreproducible: the step's gradient is 1024x its replay's"), c
        assert c["audits"] == 0 and not c["findings"] and c["same"], c
        c = res["nan_first"]         # a fault on rank 0 at the first step: named, and the check stays on
        assert c["mode"] == "exact" and c["findings"] == [["nonfinite", "transient", [0], True]], c


def test_a_replay_mismatch_says_what_to_fix() -> None:
    from checksums.replay import replay_mismatch

    def rows(norms: list[float], fp: int = 5) -> torch.Tensor:
        r = torch.zeros(len(norms), 4, dtype=torch.int64)     # one bucket a norm; max-abs = norm
        r[:, :2] = torch.tensor([[n, n] for n in norms], dtype=torch.float64).view(torch.int64)
        r[:, 2:] = fp
        return r
    assert replay_mismatch(rows([1.0, 2.0]), rows([1.0, 2.0]), exact=True) == ""
    ratio = replay_mismatch(rows([65536.0, 131072.0], 6), rows([1.0, 2.0]), exact=True)
    assert "65536x its replay's" in ratio
    assert "overflowed" in replay_mismatch(rows([math.inf, 2.0], 6), rows([1.0, 2.0]), exact=True)
    assert "loss_fn must be" in replay_mismatch(rows([3.0, 2.0], 6), rows([1.0, 2.0]), exact=True)
    assert max(len(replay_mismatch(rows(n, 6), rows([1.0, 2.0]), exact=True))    # it goes in GetStatus's mode
               for n in ([65536.0, 131072.0], [math.inf, 2.0], [3.0, 2.0])) <= 105


def test_replays_by_backward_give_autograd_grads_gradients_bit_for_bit() -> None:
    """The stand-in replay (`.backward()` into leaves sharing the parameters' storage: what a reentrant
    checkpoint needs) against `torch.autograd.grad`'s: the same gradients bit for bit, over three
    micro-batches (accumulated), with a tied weight, an unused parameter (None), a frozen one and a dropout;
    the module's own `.grad`, parameters and buffers untouched."""
    from torch import nn

    from checksums.replay import Replayer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mid, self.unused = nn.Linear(6, 6, bias=False), nn.Linear(6, 6), nn.Linear(6, 6)
            self.head = nn.Linear(6, 6, bias=False)
            self.head.weight = self.emb.weight                     # tied
            self.norm = nn.BatchNorm1d(6)
            self.mid.bias.requires_grad_(False)                    # frozen

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(nn.functional.dropout(torch.relu(self.mid(self.norm(self.emb(x)))), 0.3))

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    torch.manual_seed(0)
    net = Net()
    net.mid.weight.grad = torch.full_like(net.mid.weight, 7.0)     # the step's own .grad
    params = [p for p in net.parameters() if p.requires_grad]
    rep = Replayer(net, None, loss_fn, device=torch.device("cpu"))
    for k in range(3):
        rep.retain(torch.randn(5, 6))
    before = [t.clone() for t in [*net.parameters(), *net.buffers()]]
    by_grad = rep._grads(rep.retained, net, params)
    rep.by_backward = True
    by_backward = rep._grads(rep.retained, net, params)
    assert len(by_grad) == len(by_backward) == len(params)
    for a, b, p in zip(by_grad, by_backward, params):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), p.shape
    assert by_grad[[id(p) for p in params].index(id(net.unused.weight))] is None
    assert all(torch.equal(a, b) for a, b in zip(before, [*net.parameters(), *net.buffers()]))
    assert torch.equal(net.mid.weight.grad, torch.full_like(net.mid.weight, 7.0))
    assert net.emb.weight.grad is None


def test_batches_travel_in_the_containers_they_came_in() -> None:
    """A batch fetched by another rank (or cast for the CPU witness) keeps its container, so `loss_fn` finds
    what it reads: named tuples, dataclasses and dict subclasses (a Hugging Face BatchEncoding) included;
    the tensors inside each moved, everything else as is."""
    import collections
    import dataclasses

    from transformers import BatchEncoding

    from checksums.rank_transit import map_tensors

    Pair = collections.namedtuple("Pair", "x y")

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor
        name: str = "b"

    batch = {"pair": Pair(torch.ones(2), [torch.zeros(1), 3]), "dc": Batch(torch.ones(3)),
             "enc": BatchEncoding({"input_ids": torch.ones(1, 2)}), "tag": "t"}
    out = map_tensors(batch, lambda t: t.double() * 2)
    assert isinstance(out["pair"], Pair) and out["pair"].x.dtype == torch.float64 and out["pair"].y[1] == 3
    assert isinstance(out["dc"], Batch) and out["dc"].ids.dtype == torch.float64 and out["dc"].name == "b"
    assert isinstance(out["enc"], BatchEncoding) and float(out["enc"].input_ids.sum()) == 4.0
    assert out["tag"] == "t" and float(batch["dc"].ids.sum()) == 3.0      # the original left alone


def test_a_retained_step_keeps_the_loss_scale_it_ran_under() -> None:
    """The scale is copied as a step's first batch is retained: the scaler's update (in place, after the step)
    does not reach a step kept for a replay at the next step; before the scaler's first scale() its
    init_scale; a disabled scaler or none keeps nothing."""
    from torch import nn

    from checksums.replay import Replayer, scaled

    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    rep = Replayer(nn.Linear(2, 1), None, lambda m, b: m(b).sum(), device=torch.device("cpu"), scaler=scaler)
    rep.retain(torch.ones(1, 2))
    first = rep.retained
    assert float(first.loss_scale) == 256.0             # the scaler made no tensor yet
    scaler.scale(torch.ones(()))                        # now it has one
    rep.end_step()
    rep.retain(torch.ones(1, 2))
    rep.retain(torch.ones(1, 2))                        # a second micro-batch: the same step, the same scale
    second = rep.retained
    scaler._scale.fill_(512.0)                          # update() after the step, in place
    assert float(second.loss_scale) == 256.0 and float(first.loss_scale) == 256.0
    rep.end_step()
    rep.retain(torch.ones(1, 2))
    assert float(rep.retained.loss_scale) == 512.0 and float(second.loss_scale) == 256.0
    assert float(scaled(torch.tensor(3.0), rep.retained.loss_scale)) == 1536.0
    for off in (None, torch.amp.GradScaler("cpu", enabled=False)):
        rep = Replayer(nn.Linear(2, 1), None, lambda m, b: m(b).sum(), device=torch.device("cpu"), scaler=off)
        rep.retain(torch.ones(1, 2))
        assert rep.retained.loss_scale is None


def _ddp_options(rank: int, world: int, init: str, out: str) -> None:
    """The checks under DDP options jobs use, each run beside the same model unchecked; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch.utils.checkpoint import checkpoint

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.d = nn.Linear(32, 4)

            self.ckpt: bool | None = None       # activation checkpointing of b (and a dropout): reentrant?

        def _b(self, h: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.b(h))
            return h if self.ckpt is None else nn.functional.dropout(h, 0.2)

        def forward(self, x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
            h = torch.relu(self.a(x))
            h = self._b(h) if self.ckpt is None else checkpoint(self._b, h, use_reentrant=self.ckpt)
            return self.d(torch.relu(self.c(h)) if use_c else h)

    def loss_fn(m: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0], bool(batch[2])), batch[1])

    res = {}
    options = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "frozen", "no_retain",
               "checkpoint", "reentrant_checkpoint", "clip_and_schedule", "replay_raises",
               "mismatch_then_raises")
    plain = options[3:]
    for option in options:
        arms = []
        for checked in (False, True):
            torch.manual_seed(0)
            net = Net()
            if option == "frozen":
                net.a.requires_grad_(False)
            if option.endswith("checkpoint"):
                net.ckpt = option == "reentrant_checkpoint"
            flags = {} if option in plain else {option: True}
            ddp = DDP(net, bucket_cap_mb=0.004, **flags)
            opt = torch.optim.Adam([p for p in ddp.parameters() if p.requires_grad], lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5) if option == "clip_and_schedule" else None
            at = {"step": 0}
            checks = None
            if checked:
                def inject(idx: int, buf: torch.Tensor, at: dict = at, option: str = option) -> None:
                    if rank == 1 and at["step"] == 18 and idx == 0:
                        buf.view(-1)[0] += 50.0
                    if option == "mismatch_then_raises" and rank == 2 and at["step"] == 8 and idx == 0:
                        buf.view(-1)[0] += 1e-4        # below the statistics' margin: the audit of 8 differs
                def replay_loss(m: nn.Module, batch: tuple, at: dict = at, option: str = option
                                ) -> torch.Tensor:
                    raising = {"replay_raises": 0, "mismatch_then_raises": 1}.get(option)
                    if at["step"] == 8 and not isinstance(m, DDP) and rank == raising:
                        at["replays"] = at.get("replays", 0) + 1   # the audit at 8: every rank replays
                        if option == "replay_raises" or at["replays"] == 2:   # or the classifying round's
                            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's)")
                    return loss_fn(m, batch)
                checks = ComputeChecks.attach(ddp, opt, loss_fn=replay_loss, audit_every=4, warmup=8,
                                              inject_bucket=inject)
            arms.append((ddp, opt, checks, at, sched))
        g = torch.Generator().manual_seed(10 + rank)
        torch.manual_seed(100 + rank)        # the dropout's draws: each arm's step starts from the same state
        for s in range(1, 23):
            batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g),
                     s % 2 == 0 or option != "find_unused_parameters")   # layer c unused on odd steps
            rng = torch.get_rng_state()
            for ddp, opt, checks, at, sched in arms:
                at["step"] = s
                torch.set_rng_state(rng)
                if checks is not None and option != "no_retain":
                    checks.retain(batch)
                loss_fn(ddp, batch).backward()
                if sched is not None:
                    nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad(set_to_none=True)
                if s == 17:          # the weights agree with the unchecked run's until the fault
                    at["same"] = all(torch.equal(a, b) for a, b in zip(arms[0][0].parameters(),
                                                                        ddp.parameters()))
        checks = arms[1][2]
        st = checks.status()
        res[option] = {"same_before": arms[1][3]["same"], "mode": checks.mode(), "audits": st.audits,
                       "dropped": st.dropped, "skipped": [k.step for k in checks.guard.skipped],
                       "findings": [(f.step, f.detector, f.cause, list(f.faulty)) for f in checks.findings]}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_the_checks_follow_ddps_options(tmp_path) -> None:
    """find_unused_parameters (a layer unused on odd steps: its gradient is zeros in its bucket and None in a
    replay), static_graph, gradient_as_bucket_view and frozen parameters (requires_grad False): the training
    is the unchecked one's bit for bit, every audit's replay agrees exactly, and a fault in rank 1's bucket
    at step 18 is caught on its step with rank 1 named; so with activation checkpointing, non-reentrant and
    reentrant (a dropout inside: the replay restores its RNG; reentrant: replayed by .backward() into
    stand-in leaves), and with gradient clipping and an LR scheduler. A loop that never calls retain(): that
    step is dropped without a replay, no GPU named, and the mode says why. A replay that raises on one rank
    (an audit's): every rank skips that audit, the checks stay on; after the audit's replay differed from
    the step's own: the update is held back.
    (torch.compile inside and outside DDP: the same by hand, 2026-12-04; its compile takes a minute a run
    on the CPU.)"""
    import json
    out = str(tmp_path / "res")
    spawn(_ddp_options, (3, str(tmp_path / "init"), out), nprocs=3)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        c = res.pop("no_retain")    # a loop that never retains: the suspect step is dropped, no GPU named
        assert c["mode"] == "unreproducible: no batch retained: call checks.retain(batch) before each forward"
        assert c["same_before"] and not c["findings"] and c["audits"] == 0 and c["dropped"] == 1, c
        assert c["skipped"] == [18], c
        # one rank's replay raised (an out-of-memory in the audit at step 8): every rank leaves that audit
        # at once (none waits in its gather), the training goes on, the checks stay on
        assert res["replay_raises"]["audits"] == res["frozen"]["audits"] - 1, res
        # the audit of step 8 differed (rank 2's bucket), then its classifying round raised (on rank 1): the
        # update is held back without a finding
        c = res.pop("mismatch_then_raises")
        assert c["skipped"] == [8, 18] and c["dropped"] == 2 and c["mode"] == "exact", c
        assert c["findings"] == [[18, "stats", "transient", [1]]], c
        for option, c in res.items():
            assert c["same_before"] and c["mode"] == "exact" and c["audits"] >= 3, (option, c)
            assert c["findings"] == [[18, "stats", "transient", [1]]], (option, c)


def test_an_audit_before_the_first_clean_one_dates_the_fault_from_this_processs_first_step():
    """`since_step` of an audit finding is the rank's last clean audit + 1; before the first one, this
    process's first step: a fresh job's 1, a resumed job's first step after its restore (the steps before it
    were judged by the process that trained them: one finding must not take every VERIFIED checkpoint)."""
    import collections

    from checksums.compute_gate import ComputeChecks
    from checksums.grad_checks import StatsVerdict
    from checksums.replay import Classification

    gate = object.__new__(ComputeChecks)
    gate.rank, gate.where = 0, [("h0", "GPU-0"), ("h1", "GPU-1"), ("h2", "GPU-2")]
    gate.findings, gate._unreported = collections.deque(), collections.deque()
    verdict = StatsVerdict(scores=(0.0, 0.0, 0.0), outliers=(), nonfinite=())
    c = Classification(Cause.PERSISTENT, (1,), True, "injected")
    for first, last_audit, step, since in ((1, {}, 40, 1), (5001, {}, 5001, 5001), (5001, {1: 5010}, 5020, 5011)):
        gate._first_step, gate._last_audit = first, last_audit
        gate._record(step, "audit", 1, c, True, verdict)
        assert gate.findings[-1].since_step == since, (first, last_audit, gate.findings[-1])
    gate._record(5030, "stats", 1, c, True, verdict)
    assert gate.findings[-1].since_step == 5030            # a fault seen on its step dates from it


def test_every_harness_command_of_the_gpu_script_parses():
    """bench/gpu_run.sh's compute_faults commands run only on a device machine: each parses here (an option
    renamed, or a case name misspelt, would cost a device session; a misspelt case ran nothing before, and
    now exits 2 naming it)."""
    import re
    import shlex
    text = (Path(__file__).resolve().parents[1] / "bench" / "gpu_run.sh").read_text().replace("\\\n", " ")
    commands = [m.group(1) for m in re.finditer(r"(?:bench/compute_faults\.py|-m bench\.compute_faults)\b([^\n]*)",
                                                 text)]
    assert len(commands) >= 15, commands
    for command in commands:
        args = compute_faults.parse_args(shlex.split(command))
        assert args.device == "cuda", command
    with pytest.raises(SystemExit) as e:
        compute_faults.parse_args(["--cases", "mm one elem =10,mm one elem x1.05 persistant"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:                 # a case run no step past its fault would say nothing
        compute_faults.parse_args(["--after", "0"])
    assert e.value.code == 2
    # a tensor core's fault fires only in bf16/fp16: on the CPU without autocast it would say "no effect"
    for bad in (["--cases", "tc"], ["--model", "tiny-moe", "--cases", "moe"]):
        with pytest.raises(SystemExit) as e:
            compute_faults.parse_args(bad)
        assert e.value.code == 2
    for good in (["--cases", "tc", "--cpu-autocast"], ["--cases", "tc", "--amp", "fp16"],
                 ["--cases", "tc", "--device", "cuda"], ["--cases", "all"]):
        compute_faults.parse_args(good)


def test_a_bucket_zero_on_a_rank_is_no_jump():
    """An MoE expert no token of a rank chose has a zero gradient there one step and not the next: its
    statistics move by some 70 log units by the data alone. That is no jump of the rank (the two-rank
    tie-break would name a clean rank on it), nor part of the clean step-to-step spread."""
    t = SpreadTracker(warmup=3)
    for k in range(6):
        t.judge(_stats([1.0 + 0.01 * k, 1.1 - 0.01 * k]))
    zero = _stats([1.03, 1.07])
    zero[1, 0] = 0.0                                   # rank 1's first bucket: no token chose that expert
    assert max(t.jumps(zero)) < 3.0, t.jumps(zero)
    t.learn(zero)                                      # a step the replays cleared: learnt
    back = _stats([1.04, 1.06])
    assert max(t.jumps(back)) < 3.0, t.jumps(back)      # and back from zero: no jump either
    j = t.jumps(_stats([1.05, 8.0]))
    assert j[1] > 3.0 * j[0] and j[1] > 1.0, j          # a live bucket's move still counts


def test_a_convolutional_model_with_batchnorm_and_dropout_is_checked_like_the_gpts():
    """`--model cnn`: convolutions, BatchNorm (running statistics: buffers every replay must put back, and
    DDP broadcasts from rank 0 each forward) and dropout (a replay needs the step's RNG state). Three gloo
    ranks, faults on rank 1 at step 40 (an audit step): each caught on its step with
    rank 1 named and its update dropped, and clean steps raise nothing (exact audits)."""
    r = _faults(["--world", "3", "--model", "cnn", "--after", "3", "--audit-every", "5", "--clean", "40",
                 "--cases", "mm one elem x1.01 persistent,bwd zeroed column,grad elem =100,grad elem NaN"])
    for name in ("mm one elem x1.01 persistent", "bwd zeroed column", "grad elem =100", "grad elem NaN"):
        hit = r[name]["caught"].get("compute")
        assert hit is not None and hit["step"] == 40 and hit["named"] == [1] and hit["dropped"], (name, r[name])
    assert r["mm one elem x1.01 persistent"]["caught"]["compute"]["cause"] == "persistent"
    assert r["grad elem =100"]["caught"]["compute"]["detector"] == "stats"   # on the statistics' evidence
    clean = r["clean"]["status"]
    assert clean["suspicions"] == 0 and clean["dropped"] == 0 and clean["audits"] >= 8 and clean["exact"], clean


def _cross_rank_norm(rank: int, world: int, init: str, out: str) -> None:
    """Three gloo ranks, a convolutional model whose norm layers are SyncBatchNorm (their class, so the
    checks see what a user's model holds; computing per rank here: torch runs SyncBatchNorm on GPUs only, and
    bench/gpu_run.sh `syncbn` runs the real one); see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)

    class PerRankSyncBN(nn.SyncBatchNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                            True, 0.1, self.eps)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 4))
    ddp = DDP(net, bucket_cap_mb=0.001)
    sync, bn = PerRankSyncBN(8), net[1]
    sync.weight, sync.bias = bn.weight, bn.bias      # the parameters DDP reduces
    net[1] = sync                       # (DDP refuses a SyncBatchNorm module on the CPU at wrap time)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    at = {"step": 0}

    def inject(idx: int, buf: torch.Tensor) -> None:
        if rank == 1 and at["step"] == 12 and idx == 0:
            buf.view(-1)[0] = float("nan")

    def loss_fn(m: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, audit_every=4, warmup=4, inject_bucket=inject)
    g = torch.Generator().manual_seed(rank)
    weights_at = {}
    for s in range(1, 17):
        at["step"] = s
        batch = (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        checks.retain(batch)
        loss_fn(ddp, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights_at[s] = [p.detach().clone() for p in net.parameters()]
    st = checks.status()
    unchanged = all(torch.equal(a, b) for a, b in zip(weights_at[11], weights_at[12]))
    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"mode": checks.mode(), "replays": st.replays, "audits": st.audits,
                   "cross_rank": checks.replayer.cross_rank, "unchanged": unchanged, "finite": finite,
                   "findings": [(f.detector, f.cause, list(f.faulty)) for f in checks.findings]}, f)
    dist.destroy_process_group()


def test_a_model_with_syncbatchnorm_is_checked_without_replays_and_says_why(tmp_path) -> None:
    """SyncBatchNorm normalises each rank's batch by the statistics of every rank's: no replay of one batch
    (nor of each rank's neighbour's, whose statistics combine in another order) is the step's arithmetic.
    Before, the first step's check replayed rank 0's batch on every rank, found it unlike the step and blamed
    the loss function ("loss_fn must be the loss the loop back-propagates"). Now the layers are found at attach:
    no replay or audit runs, GetStatus's mode says why, and the statistics still drop a rank's NaN gradient
    on its step (on every rank) without naming a GPU on a replay's evidence."""
    import json
    out = str(tmp_path / "res")
    spawn(_cross_rank_norm, (3, str(tmp_path / "init"), out), nprocs=3)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        assert res["cross_rank"] == ["1"], res
        assert res["mode"].startswith("unreproducible: SyncBatchNorm mixes every rank's batch"), res
        assert res["replays"] == 0 and res["audits"] == 0, res
        assert res["unchanged"] and res["finite"] and res["findings"] == [], res


def test_attaching_without_torch_distributed_says_what_to_do_first() -> None:
    """A loop that attaches the checks before `init_process_group` gets our error naming the two steps, not
    torch's "Default process group has not been initialized" from inside the checks (a fresh interpreter:
    no process group from another test)."""
    import subprocess
    import sys
    code = ("import torch\nfrom torch import nn\nfrom checksums.compute_gate import ComputeChecks\n"
            "m = nn.Linear(4, 4)\n"
            "try:\n    ComputeChecks.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), "
            "loss_fn=lambda mod, b: mod(b).sum())\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert "refused: ComputeChecks compares the ranks" in out.stdout, out.stdout
    assert "init_process_group and wrap the model in DistributedDataParallel" in out.stdout, out.stdout


def test_a_model_cast_to_bfloat16_is_checked_like_one_under_autocast():
    """`--params-bf16`: parameters, gradients, DDP's buckets and Adam's state in bfloat16 (a job that casts
    its model rather than autocasting). The summaries, the replays and the fingerprints take bf16 buckets:
    faults on rank 1 at step 40 (an audit step) are caught there, rank 1 named, updates dropped."""
    cases = ["mm channel x2 persistent", "grad elem NaN"]
    r = _faults(["--world", "3", "--params-bf16", "--model", "tiny-gpt", "--after", "3", "--audit-every", "5",
                 "--cases", ",".join(cases)])
    for name in cases:
        hit = r[name]["caught"].get("compute")
        assert hit is not None and hit["step"] == 40 and hit["named"] == [1] and hit["dropped"], (name, r[name])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_syncbatchnorm_on_a_gpu_is_found_at_attach_and_nothing_is_replayed():
    """The real SyncBatchNorm (torch runs it on GPUs only; the CPU test uses a stand-in of its class): three
    gloo ranks sharing the GPU, its statistics all-gathered in every forward. The checks say at attach that
    no replay reproduces a step; a NaN in rank 1's gradient is held back on its step without naming a GPU,
    and clean steps raise nothing."""
    r = _faults(["--device", "cuda", "--backend", "gloo", "--world", "3", "--model", "cnn", "--sync-bn",
                 "--fault-step", "12", "--after", "3", "--audit-every", "5", "--determinism", "strict",
                 "--cases", "grad elem NaN", "--clean", "20"])
    assert r["clean"]["mode"].startswith("unreproducible: SyncBatchNorm mixes every rank's batch"), r["clean"]
    assert r["clean"]["status"]["suspicions"] == 0 and r["clean"]["status"]["replays"] == 0, r["clean"]
    nan = r["grad elem NaN"]
    assert "compute" not in nan["caught"] and nan["held"] == 12, nan     # held back, no GPU named


def test_cross_rank_norm_layers_are_found_by_class_and_by_name():
    """torch's SyncBatchNorm by its class; other libraries' (apex's SyncBatchNorm, detectron2's
    NaiveSyncBatchNorm, mmcv-style SyncBN), which are plain BatchNorm subclasses, by their class names;
    BatchNorm, GroupNorm and LayerNorm are not."""
    from torch import nn

    from checksums.replay import cross_rank_layers

    class NaiveSyncBatchNorm(nn.BatchNorm2d):
        pass

    class SyncBN(nn.BatchNorm1d):
        pass

    class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):      # apex.parallel's name, not torch's class
        pass

    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), NaiveSyncBatchNorm(4), nn.GroupNorm(2, 4),
                      nn.Sequential(nn.SyncBatchNorm(4), SyncBN(4), SyncBatchNorm(4)), nn.LayerNorm(4))
    assert cross_rank_layers(m) == ["2", "4.0", "4.1", "4.2"]
    assert cross_rank_layers(nn.Sequential(nn.BatchNorm2d(4), nn.InstanceNorm2d(4))) == []
