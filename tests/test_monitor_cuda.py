"""The Monitor's CUDA path: fused fingerprint, pinned buffers, events, results read a step later; and the
replica vote over NCCL on two GPUs. Skipped without CUDA (and the NCCL test without two GPUs)."""
from __future__ import annotations

from support import RecordingReporter

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from checksums.fingerprint import fingerprint_tensors_torch, fingerprint_words_to_ints
from checksums.monitor import Monitor

pytestmark = pytest.mark.gpu


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
    model.register_parameter("table", nn.Parameter(torch.randn(16, 8, device="cuda"), requires_grad=False))
    return model


def test_cuda_results_match_the_cpu_reference_and_arrive_a_step_later() -> None:
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    reporter = RecordingReporter()
    monitor = Monitor.attach(model, opt, job_id="gpu", reporter=reporter)
    expected: list[tuple[int, ...]] = []
    for step in range(1, 6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model[2](model[1](model[0](torch.randn(32, 64, device="cuda")))).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        trainable = [p.detach().cpu() for p in model.parameters() if p.requires_grad]
        expected.append(fingerprint_words_to_ints(fingerprint_tensors_torch(trainable)[0]))
        if step == 3:
            loss = torch.tensor(float("nan"), device="cuda")
        monitor.step(loss.detach())
    monitor.flush()
    assert [r.step for r in reporter.requests] == [1, 2, 3, 4, 5]
    for req, words in zip(reporter.requests, expected):
        assert tuple(req.fingerprint[:len(words)]) == words     # parameter words first, then frozen
    assert [(e.kind, e.step) for e in monitor.events] == [("nonfinite.loss", 3)]
    assert reporter.requests[0].gpu_uuid.startswith(("GPU-", "MIG-"))
    monitor.close()


def test_cuda_frozen_flip_is_an_event() -> None:
    model = _model()
    monitor = Monitor.attach(model, job_id="gpu", reporter=False)
    monitor.step()
    with torch.no_grad():
        model.table.view(torch.int32).view(-1)[5] ^= 1 << 9
    monitor.step()
    monitor.step()
    monitor.flush()
    assert [(e.kind, e.step, e.details["names"]) for e in monitor.events] == [("frozen.changed", 2, ["table"])]


FLIP_STEP = 4


def _nccl_worker(rank: int, world: int, store: str, outdir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        monitor = Monitor.attach(ddp, opt, job_id="nccl", reporter=False)
        for step in range(1, FLIP_STEP + 3):
            loss = ddp(torch.randn(16, 64, device="cuda")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == FLIP_STEP and rank == world - 1:
                with torch.no_grad():
                    model[0].weight.view(torch.int32).view(-1)[7] ^= 1 << 3
            monitor.step(loss.detach())
        monitor.close()
        events = [{"kind": e.kind, "step": e.step, "details": e.details} for e in monitor.events]
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"events": events,
                                                                "mismatches": monitor.stats.mismatches}))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_replicas_flip_makes_both_suspect(tmp_path: Path) -> None:
    mp.spawn(_nccl_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        mism = [e for e in res["events"] if e["kind"] == "replica.mismatch"]
        assert len(mism) == 1 and mism[0]["step"] == FLIP_STEP
        assert [s["rank"] for s in mism[0]["details"]["suspects"]] == [0, 1]
        assert res["mismatches"] == 3
