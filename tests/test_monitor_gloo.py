"""The Monitor across real processes: DDP over gloo on CPU, 3 and 2 ranks.

Each world is spawned once (process start-up dominates) and runs its scenarios in order; every rank writes
what it saw to a JSON file and the tests assert on those files.
"""
from __future__ import annotations

from support import RecordingReporter

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import rank_spawn
from torch import nn

from checksums.monitor import Monitor

FLIP_STEP = 5
CLEAN_STEPS = 500


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model.register_parameter("table", nn.Parameter(torch.randn(4, 8), requires_grad=False))
    return model


def _flip_bit(t: torch.Tensor, index: int = 3, bit: int = 7) -> None:
    with torch.no_grad():
        t.view(torch.int32).view(-1)[index] ^= 1 << bit


def _train(monitor: Monitor, ddp: nn.Module, opt: torch.optim.Optimizer, steps: int, gen: torch.Generator,
           after_step: Any = None, loss_override: Any = None) -> None:
    for i in range(1, steps + 1):
        x = torch.randn(4, 8, generator=gen)
        y = torch.randn(4, 1, generator=gen)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(monitor.step_count + 1)
        monitor.step(loss.detach() if loss_override is None else loss_override(i, loss.detach()))


def _setup(rank: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.Generator]:
    model = _model(seed=1)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    return model, ddp, opt, gen


def _summary(monitor: Monitor, reporter: RecordingReporter) -> dict[str, Any]:
    vote = monitor.last_vote
    return {
        "events": [{"kind": e.kind, "step": e.step, "details": dict(e.details)} for e in monitor.events],
        "stats": {k: getattr(monitor.stats, k) for k in ("steps", "checks_run", "votes", "mismatches",
                                                        "frozen_changes", "nonfinite")},
        "last_vote": None if vote is None else {"step": vote.step, "agreed": vote.result.agreed,
                                                 "suspects": list(vote.result.suspect_ranks),
                                                 "method": vote.result.method},
        "reports": [{"step": r.step, "rank": r.rank, "fp_words": len(r.fingerprint),
                     "vote_checked": r.vote.checked, "agreed": r.vote.agreed, "vote_step": r.vote.step,
                     "suspects": [(s.rank, s.host, s.gpu_uuid, len(s.fingerprint)) for s in r.vote.suspects],
                     "method": r.vote.method, "frozen_changed": list(r.frozen_changed),
                     "loss": r.loss if r.HasField("loss") else None, "host": r.host,
                     "replica_group": r.replica_group} for r in reporter.requests],
    }


def _worker(rank: int, world: int, store: str, outdir: str, scenarios: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        for name in scenarios:
            model, ddp, opt, gen = _setup(rank)
            if name == "not_replicas":                 # each rank its own model (model parallel, say)
                ddp = model = _model(seed=rank)
                opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
            reporter = RecordingReporter()
            monitor = Monitor.attach(ddp, opt, job_id=f"test-{name}", reporter=reporter, host=f"host{rank}")
            if name in ("clean", "not_replicas"):
                _train(monitor, ddp, opt, CLEAN_STEPS if name == "clean" else 3, gen)
            elif name == "flip":
                bad = world - 1
                def flip(step: int) -> None:
                    if step == FLIP_STEP and rank == bad:
                        _flip_bit(model[0].weight)
                _train(monitor, ddp, opt, FLIP_STEP + 3, gen, after_step=flip)
            elif name == "frozen":
                def flip_frozen(step: int) -> None:
                    if step == FLIP_STEP:        # the same change on every rank: the vote still agrees
                        _flip_bit(model.table, index=1, bit=2)
                _train(monitor, ddp, opt, FLIP_STEP + 2, gen, after_step=flip_frozen)
            elif name == "nan":
                def nan_at_3(i: int, loss: torch.Tensor) -> torch.Tensor:
                    return torch.tensor(float("nan")) if i == 3 else loss
                _train(monitor, ddp, opt, 5, gen, loss_override=nan_at_3)
                monitor.step(0.5, grad_norm=torch.tensor(float("inf")))
            monitor.close()
            results[name] = _summary(monitor, reporter)
            dist.barrier()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _spawn(world: int, tmp: Path, scenarios: list[str]) -> list[dict[str, Any]]:
    """The ranks are forked from a forkserver that has torch imported already (as tests/test_multi_rank_gloo.py
    does): a fresh interpreter per rank imports torch again, ~5 s each on the 2-core CI machine."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rank_spawn.spawn(_worker, args=(world, str(tmp / "store"), str(tmp), scenarios), nprocs=world)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(3, tmp_path_factory.mktemp("gloo3"), ["flip", "clean", "frozen", "nan"])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(2, tmp_path_factory.mktemp("gloo2"), ["flip", "not_replicas"])


def _kinds(result: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in result["events"]]


def test_three_ranks_flip_names_exactly_the_flipped_rank_at_that_step(three_ranks) -> None:
    for rank, res in enumerate(three_ranks):
        flip = res["flip"]
        mismatches = [e for e in flip["events"] if e["kind"] == "replica.mismatch"]
        assert len(mismatches) == 1, f"rank {rank}: {flip['events']}"   # once, not every later step
        event = mismatches[0]
        assert event["step"] == FLIP_STEP
        assert [s["rank"] for s in event["details"]["suspects"]] == [2]
        assert event["details"]["suspects"][0]["host"] == "host2"
        assert event["details"]["method"] == "majority"
        by_step = {r["step"]: r for r in flip["reports"]}
        assert all(by_step[s]["agreed"] for s in range(1, FLIP_STEP))
        report = by_step[FLIP_STEP]
        assert report["vote_checked"] and not report["agreed"] and report["vote_step"] == FLIP_STEP
        assert [(s[0], s[1]) for s in report["suspects"]] == [(2, "host2")]
        assert report["suspects"][0][3] == report["fp_words"]        # the suspect's own words travel
        assert report["rank"] == rank and report["host"] == f"host{rank}"
        assert report["replica_group"] == "world"
        # the flipped replica stays different: later steps keep voting it suspect
        assert flip["last_vote"]["suspects"] == [2]
        assert flip["stats"]["mismatches"] == 4


def test_two_ranks_flip_makes_both_suspect(two_ranks) -> None:
    for res in two_ranks:
        flip = res["flip"]
        mismatches = [e for e in flip["events"] if e["kind"] == "replica.mismatch"]
        assert len(mismatches) == 1 and mismatches[0]["step"] == FLIP_STEP
        assert [s["rank"] for s in mismatches[0]["details"]["suspects"]] == [0, 1]
        assert mismatches[0]["details"]["method"] == "all_disagreeing"
        report = {r["step"]: r for r in flip["reports"]}[FLIP_STEP]
        assert [s[0] for s in report["suspects"]] == [0, 1]


def test_clean_steps_raise_no_event(three_ranks) -> None:
    for res in three_ranks:
        clean = res["clean"]
        assert clean["events"] == []
        assert clean["stats"]["checks_run"] == CLEAN_STEPS
        assert clean["stats"]["votes"] == CLEAN_STEPS
        assert clean["stats"]["mismatches"] == 0
        assert len(clean["reports"]) == CLEAN_STEPS
        assert all(r["agreed"] and r["vote_checked"] for r in clean["reports"])


def test_frozen_parameter_change_is_an_event(three_ranks) -> None:
    for res in three_ranks:
        frozen = res["frozen"]
        assert _kinds(frozen) == ["frozen.changed"]
        event = frozen["events"][0]
        assert event["step"] == FLIP_STEP and event["details"]["names"] == ["table"]
        report = {r["step"]: r for r in frozen["reports"]}[FLIP_STEP]
        assert report["frozen_changed"] == ["table"] and report["agreed"]
        # re-baselined: the next step is quiet
        assert {r["step"]: r for r in frozen["reports"]}[FLIP_STEP + 1]["frozen_changed"] == []


def test_nan_loss_and_inf_grad_norm_are_events(three_ranks) -> None:
    for res in three_ranks:
        nan = res["nan"]
        assert [(e["kind"], e["step"]) for e in nan["events"]] == [("nonfinite.loss", 3),
                                                                   ("nonfinite.grad_norm", 6)]
        assert nan["stats"]["nonfinite"] == 2
        loss3 = {r["step"]: r for r in nan["reports"]}[3]["loss"]
        assert loss3 != loss3          # NaN travels to the agent as is


# ---- single process (no process group): the same Monitor, no vote --------------------------------------


def test_every_n_checks_only_those_steps_but_reports_every_step() -> None:
    reporter = RecordingReporter()
    model = nn.Linear(3, 2)
    monitor = Monitor.attach(model, job_id="j", every=3, reporter=reporter)
    for _ in range(7):
        monitor.step(1.0)
    assert monitor.stats.checks_run == 2 and monitor.last_vote is None
    assert [len(r.fingerprint) > 0 for r in reporter.requests] == [False, False, True, False, False, True, False]
    assert all(not r.vote.checked and r.replica_group == "" for r in reporter.requests)


def test_optimizer_state_and_grads_join_the_words() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    reporter = RecordingReporter()
    monitor = Monitor.attach(model, opt, job_id="j", check_optimizer_state=True, check_grads=True,
                             reporter=reporter)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        monitor.step()
        opt.zero_grad()
    words = [list(r.fingerprint) for r in reporter.requests]
    w = len(words[0]) // 3                                 # params, optimizer state, grads
    assert w >= 1 and len(words[0]) == 3 * w
    assert words[0][w:2 * w] != words[1][w:2 * w]          # Adam moments changed between steps


def test_compiled_and_ddp_wrappers_are_unwrapped_for_names() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    compiled = torch.compile(model)
    monitor = Monitor.attach(compiled, job_id="j", frozen=["0.bias"], reporter=False)
    assert [n for n, _ in monitor._frozen] == ["0.bias"]
    with pytest.raises(ValueError, match="frozen names"):
        Monitor.attach(compiled, job_id="j", frozen=["_orig_mod.0.bias"], reporter=False)


def test_replaced_storage_is_followed_without_a_false_alarm() -> None:
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    reporter = RecordingReporter()
    monitor = Monitor.attach(model, job_id="j", reporter=reporter)
    monitor.step()
    with torch.no_grad():
        model.weight.data = model.weight.data.clone()      # same values, new storage
        model.bias.data = model.bias.data.clone()
    monitor.step()
    with torch.no_grad():
        model.weight.add_(1.0)
    monitor.step()
    fps = [list(r.fingerprint) for r in reporter.requests]
    assert fps[0] == fps[1] != fps[2]
    assert monitor.events == []


@pytest.mark.parametrize("kwargs, message", [
    ({"job_id": ""}, "job_id"),
    ({"job_id": "j", "every": 0}, "every"),
    ({"job_id": "j", "check_optimizer_state": True}, "optimizer"),
    ({"job_id": "j", "frozen": ["nope"]}, "frozen names"),
    # each of these was taken (True as every=1) or failed later, or with another library's message
    ({"job_id": "j", "every": True}, "every"),
    ({"job_id": "j", "max_events": -1}, "max_events"),
    ({"job_id": "j", "frozen": "weight"}, "the string 'weight'"),
    ({"job_id": "j", "host": 3}, "host is a string"),
    ({"job_id": "j", "gpu_uuid": b"GPU-1"}, "gpu_uuid is a string"),
    ({"job_id": "j", "on_directive": "print"}, "on_directive is a function"),
    ({"job_id": "j", "fingerprint_fn": 3}, "fingerprint_fn is a function"),
    ({"job_id": "j", "canary": "yes"}, "maybe_run"),
])
def test_bad_arguments_are_value_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Monitor.attach(nn.Linear(2, 2), reporter=False, **kwargs)


def test_a_tensor_loss_must_be_one_value() -> None:
    monitor = Monitor.attach(nn.Linear(2, 2), job_id="j", reporter=False)
    with pytest.raises(ValueError, match="one value"):
        monitor.step(torch.ones(3))


def test_ranks_that_are_not_replicas_turn_the_vote_off(two_ranks) -> None:
    for res in two_ranks:
        run = res["not_replicas"]
        assert _kinds(run) == ["vote.disabled"]
        assert run["stats"]["votes"] == 0 and run["stats"]["checks_run"] == 3
        assert all(not r["vote_checked"] and r["replica_group"] == "" for r in run["reports"])
