"""Gradient buckets that can be exactly zero on a rank (an MoE expert that no token of that rank chose).

In a dense model a bucket whose gradient is exactly zero on one rank while the others' are not is a fault's
signature (the statistics' log puts it some 70 log units from the median). In an MoE model it is the data's:
before, the cross-rank spread learnt it during the warm-up (62.6 log units on the harness's tiny MoE against
1.29 for the dense GPT), leaving that bucket's statistics blind for the rest of the run. `SpreadTracker`
now learns such buckets ("zeroable") on steps it learns as clean (warm-up, clean, or cleared by a replay)
and leaves their zeros out of the comparison, on the host (`_judge`) and on the device (`device_flag`,
the flag carried in the sign of the spread it reads), without widening the spread.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from checksums.device_verdict import device_flag
from checksums.grad_checks import SpreadTracker, _deviations_of_log, _log_np, deviations

CUDA = torch.cuda.is_available()


def _step(g: torch.Generator, world: int, buckets: int, zero: dict[int, list[int]] | None = None) -> torch.Tensor:
    """One step's statistics [world, buckets, 2] near 1 (the ranks' data differ a little); `zero`: bucket ->
    ranks whose gradient in it is exactly zero."""
    stats = torch.exp(torch.randn(world, buckets, 2, generator=g, dtype=torch.float64) * 0.05)
    for b, ranks in (zero or {}).items():
        stats[ranks, b] = 0.0
    return stats


def _moe_zero(g: torch.Generator, world: int, bucket: int) -> dict[int, list[int]]:
    """A third of the steps: the expert's bucket zero on one or two ranks (never all)."""
    if torch.rand((), generator=g) < 0.33:
        k = int(torch.randint(1, world, (), generator=g))
        return {bucket: torch.randperm(world, generator=g)[:k].tolist()}
    return {}


def test_a_bucket_zero_on_some_ranks_is_learnt_and_its_zeros_left_out() -> None:
    g = torch.Generator().manual_seed(0)
    world, buckets = 4, 5
    t = SpreadTracker(warmup=20)
    for _ in range(20):                                    # warm-up: bucket 2 zero on some ranks at times
        t.assess(_step(g, world, buckets, _moe_zero(g, world, 2)))
    assert t.zeroable == (2,)
    spread = t.spread
    assert spread is not None and float(spread.max()) < 0.5, spread    # before: ~69 log units in bucket 2
    suspected = []
    for k in range(500):
        _, v = t.assess(_step(g, world, buckets, _moe_zero(g, world, 2)))
        if v.suspects:
            suspected.append((k, v))
    assert not suspected, suspected[:3]
    # the zeroable bucket is still compared among the ranks that are not zero there: x3 on rank 1
    stats = _step(g, world, buckets, {2: [0]})
    stats[1, 2] *= 3.0
    _, v = t.assess(stats)
    assert v.outliers == (1,) and v.bucket == 2, v
    # a dense bucket zero on one rank stays a suspicion (a fault's signature there)
    _, v = t.assess(_step(g, world, buckets, {0: [3]}))
    assert v.outliers == (3,) and v.bucket == 0, v
    # the signed spread tells the device which buckets: the same magnitudes, bucket 2's row negative
    signed = t.signed_spread
    assert signed is not None and torch.equal(signed.abs(), t.spread)
    assert (signed[:, 0] < 0).tolist() == [False, False, True, False, False]


def test_a_first_zero_after_the_warm_up_is_suspected_once_then_learnt_from_the_cleared_step() -> None:
    """A bucket first zero after the warm-up: a suspicion (the tracker cannot tell it from a fault); the
    replay clears it as the data's (`learn`), which makes the bucket zeroable without widening its spread;
    later zeros there raise nothing."""
    g = torch.Generator().manual_seed(1)
    world, buckets = 3, 4
    t = SpreadTracker(warmup=20)
    for _ in range(30):
        t.assess(_step(g, world, buckets))
    assert t.zeroable == ()
    before = t.spread.clone()
    version = t.spread_version
    stats = _step(g, world, buckets, {1: [2]})
    _, v = t.assess(stats)
    assert v.outliers == (2,) and v.bucket == 1, v
    t.learn(stats)                                         # the replays said: data
    assert t.zeroable == (1,) and t.spread_version > version
    assert float((t.spread - before).abs().max()) < 0.5, (before, t.spread)   # not ~69 log units wider
    for _ in range(50):
        _, v = t.assess(_step(g, world, buckets, {1: [int(torch.randint(0, world, (), generator=g))]}))
        assert not v.suspects, v


def test_a_bucket_zero_on_every_rank_is_not_zeroable() -> None:
    """Zero on every rank (a parameter no rank's data touched) teaches nothing: a fault that makes one rank's
    gradient there non-zero is still an outlier (the median is zero)."""
    g = torch.Generator().manual_seed(2)
    t = SpreadTracker(warmup=10)
    for _ in range(30):
        t.assess(_step(g, 3, 3, {0: [0, 1, 2]}))
    assert t.zeroable == ()
    _, v = t.assess(_step(g, 3, 3, {0: [0, 2]}))
    assert v.outliers == (1,), v


def _by_hand(lx: np.ndarray) -> np.ndarray:
    """`deviations`' four columns one number at a time: the lower median is the ((n - 1) // 2)-th smallest."""
    def lower_median(values: list[float]) -> float:
        return sorted(values)[(len(values) - 1) // 2]
    world, buckets, _ = lx.shape
    out = np.zeros((world, buckets, 4))
    for s in range(2):
        d = [[lx[r, b, s] - lower_median([lx[q, b, s] for q in range(world)]) for b in range(buckets)]
             for r in range(world)]
        for r in range(world):
            shift = lower_median(d[r])
            for b in range(buckets):
                out[r, b, s], out[r, b, 2 + s] = abs(d[r][b]), abs(d[r][b] - shift)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_device_rule_equals_the_host_rule_with_zeroable_buckets(world: int) -> None:
    """`deviations(stats, zeroable)` (torch, the device's) equals the host's numpy rule: the lower medians
    over the ranks and over the rank's buckets not left out, 0 for the ones left out (without zeroable
    buckets, the rule worked by hand too); and `device_flag` with the signed spread raises exactly on the
    steps the host verdict has suspects."""
    g = torch.Generator().manual_seed(world)
    buckets = 6
    zeroable = torch.tensor([False, True, False, True, True, False])
    for k in range(40):
        stats = torch.exp(torch.randn(world, buckets, 2, generator=g, dtype=torch.float64) * 0.3)
        for b in range(buckets):
            if torch.rand((), generator=g) < 0.4:
                stats[torch.randperm(world, generator=g)[:int(torch.randint(1, world + 1, (), generator=g))], b] = 0
        if k % 7 == 3:
            stats[k % world, k % buckets, 0] = float("nan")
        x = stats.numpy()
        want = _deviations_of_log(_log_np(x), zeroable.numpy())
        got = deviations(stats, zeroable).numpy()
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), (k, got, want)
        left_out = (np.nan_to_num(x, nan=0.0) == 0) & zeroable.numpy()[None, :, None]
        assert np.all(got[np.concatenate([left_out, left_out], axis=-1)] == 0)
        plain = _deviations_of_log(_log_np(x))
        assert np.allclose(deviations(stats).numpy(), plain, rtol=1e-12, atol=1e-12)
        assert np.allclose(plain, _by_hand(_log_np(x)), rtol=1e-12, atol=1e-12)

    t = SpreadTracker(warmup=20)
    for _ in range(20):
        t.assess(_step(g, world, buckets, _moe_zero(g, world, 3) if world > 1 else {}))
    flags = set()
    for k in range(60):
        stats = _step(g, world, buckets, _moe_zero(g, world, 3) if world > 1 else {})
        if k % 3 == 1:
            stats[k % world, k % buckets, k % 2] *= 1.0 + 0.5 * (k % 5)   # some past the margin, some not
        if k % 11 == 5:
            stats[k % world, 0, 0] = float("inf")
        signed = t.signed_spread
        flag = float(device_flag(stats, signed, t.margin))
        _, v = t.assess(stats)
        assert flag == (1.0 if v.suspects else 0.0), (k, flag, v)
        flags.add(flag)
    assert flags == {0.0, 1.0} or world == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_device_graph_reads_the_zeroable_rows_of_the_spread() -> None:
    """The captured graph (DeviceVerdict.flag) leaves a zeroable bucket's zeros out once the gate turns its
    spread row negative in place, as the eager rule does; and flags the same zero on a dense bucket."""
    from checksums.device_verdict import DeviceVerdict
    from checksums.grad_checks import ROW_WORDS, stats_of

    world, buckets = 3, 4
    v = DeviceVerdict(3.0, graphs=True)
    inp = v.input(world * buckets, torch.device("cuda"))
    spread = torch.full((buckets, 4), math.log(1.05), dtype=torch.float64, device="cuda")
    stats = torch.ones(world, buckets, 2, dtype=torch.float64)
    stats[1, 2] = 0.0                                       # bucket 2 zero on rank 1
    rows = torch.zeros(world, buckets, ROW_WORDS, dtype=torch.int64)
    rows[..., :2] = stats.view(torch.int64)
    inp.copy_(rows.view(-1, ROW_WORDS).cuda())
    r = inp.view(world, buckets, ROW_WORDS)
    assert float(v.flag(r, spread)) == 1.0                  # dense: a suspicion
    spread[2].neg_()                                        # the tracker learnt bucket 2 zeroable
    assert float(v.flag(r, spread)) == 0.0 and v.captures == 1
    assert float(device_flag(stats_of(r), spread, 3.0)) == 0.0


def test_declared_expert_buckets_are_zeroable_from_the_start_on_host_and_device() -> None:
    """`declare_zeroable` (ComputeChecks' `experts=`: the buckets of MoE experts' parameters): a first zero
    there after the warm-up is no suspicion (undeclared it is: the previous test), on the host and in the
    device rule (the signed spread); a dense bucket zero on one rank still is; marks made before the spread
    exists, or kept for a layout of the same size, apply when it is made; another layout's size ignores
    them."""
    g = torch.Generator().manual_seed(3)
    world, buckets = 3, 4
    t = SpreadTracker(warmup=20)
    assert t.declare_zeroable([1, 3, 9], buckets) == (1, 3)     # before any step; 9 is not a bucket
    for _ in range(30):
        t.assess(_step(g, world, buckets))                       # no zero seen in the warm-up
    assert t.zeroable == (1, 3)
    first = _step(g, world, buckets, {3: [2]})
    _, v = t.assess(first)
    assert v.suspects == (), v
    signed = t.signed_spread
    assert signed is not None
    assert float(device_flag(first, signed, t.margin)) == 0.0
    dense = _step(g, world, buckets, {0: [1]})
    _, v = t.assess(dense)
    assert v.outliers == (1,) and v.bucket == 0, v
    assert float(device_flag(dense, signed, t.margin)) == 1.0
    # declared after the spread exists: the new ones only; the version moves so the device copy follows
    version = t.spread_version
    assert t.declare_zeroable([0, 1], buckets) == (0,) and t.zeroable == (0, 1, 3)
    assert t.spread_version > version
    # DDP's layout of another size (a rebuild): the spread is learnt anew, the marks do not carry over
    for _ in range(3):
        t.assess(_step(g, world, buckets + 1))
    assert t.zeroable == ()


def test_expert_parameters_are_named_as_moe_models_name_them() -> None:
    from checksums.compute_gate import expert_param

    yes = ["model.layers.0.block_sparse_moe.experts.3.w1.weight",
           "model.layers.7.mlp.experts.12.up_proj.weight",
           "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", "blocks.0.experts.2.0.bias",
           "layers.3.moe.routed_experts.w2"]
    no = ["model.layers.0.mlp.shared_experts.up_proj.weight", "model.layers.0.block_sparse_moe.gate.weight",
          "blocks.0.router.weight", "expertsx.w", "mlp.expert_bias", "lm_head.weight"]
    assert [expert_param(n) for n in yes] == [True] * len(yes)
    assert [expert_param(n) for n in no] == [False] * len(no)


def test_experts_must_be_a_predicate() -> None:
    from checksums.compute_gate import ComputeChecks

    with pytest.raises(ValueError, match="experts is a function \\(a predicate on a parameter's qualified name"):
        ComputeChecks(object(), object(), loss_fn=lambda m, b: b,  # type: ignore[arg-type]
                      experts=["experts.0.weight"])


def _expert_layout_worker(rank: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    try:
        class Moe(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inp = nn.Linear(8, 8)
                self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
                self.shared_experts = nn.Linear(8, 8)
                self.out = nn.Linear(8, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.inp(x)
                h = h + sum(e(h) for e in self.experts) + self.shared_experts(h)
                return self.out(h)

        got = {}
        for hint in (True, False):
            torch.manual_seed(0)
            model = Moe()
            ddp = DDP(model, bucket_cap_mb=0.0002)                   # about a Linear a bucket
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            kw = {} if hint else {"experts": None}
            checks = ComputeChecks.attach(ddp, opt, loss_fn=lambda m, b: m(b).square().mean(), audit_every=0,
                                          **kw)
            steps = []
            for step in range(6):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                checks.retain(x)
                ddp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                steps.append(checks.expert_buckets)
            names = [n for n, p in model.named_parameters()]
            layout = checks.summaries.layout
            want = sorted(b for b, idx in layout.items() if all(".experts." in "." + names[i] for i in idx))
            got[str(hint)] = {"steps": [None if s is None else list(s) for s in steps], "want": want,
                              "zeroable": list(checks.tracker.zeroable), "buckets": len(layout)}
            checks.close()
        with open(out, "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_the_expert_buckets_follow_ddps_settled_layout(tmp_path) -> None:
    """On a DDP model with four routed experts and a shared one (one rank, gloo): once DDP's layout has
    settled (its rebuild after the first step behind it) the buckets holding routed experts' parameters
    only are declared zeroable, the shared expert's and the dense layers' are not; `experts=None` declares
    nothing."""
    import json

    from rank_spawn import spawn

    out = tmp_path / "out.json"
    spawn(_expert_layout_worker, (str(tmp_path / "init"), str(out)), nprocs=1)
    got = json.loads(out.read_text())
    hint, none = got["True"], got["False"]
    assert hint["buckets"] >= 5 and hint["want"], hint
    assert hint["steps"][0] is None and hint["steps"][-1] == hint["want"], hint    # declared once settled
    assert set(hint["want"]) <= set(hint["zeroable"]), hint
    assert none["steps"][-1] == [] and none["zeroable"] == [], none
