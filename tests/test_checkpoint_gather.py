"""Issue 21, gathered copies (checkpoint.gather) on CPU: the tensors' bytes packed into a bounce buffer and
copied a chunk at a time land exactly where the per-tensor copies put them (offsets, zero gaps), group by
group; a save through the gathered path restores bit-identical and its checksums catch a flipped bit. The
CUDA path (side stream, events, the update's wait) is test_checkpoint_overlap.py's gpu test."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoint.snapshot as snapshot_mod
from checkpoint.client import CheckpointClient
from checkpoint.errors import InvalidInputError
from checkpoint.gather import GatherPlan, byte_view
from checkpoint.manifest import ShardManifest
from checkpoint.snapshot import ALIGN, SnapshotConfig, Snapshotter, layout
from ckpt_support import assert_same, flip_bit, job_id, node
from deadlines import scaled


def _mixed(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1000, generator=g),                                   # fp32, 4000 bytes
        torch.randn(333, generator=g).to(torch.bfloat16),                 # bf16, odd count
        torch.tensor(7, dtype=torch.int64),                               # a 0-d step count
        torch.rand(13, generator=g) > 0.5,                                # bool, 13 bytes
        torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),      # 7 bytes
        torch.empty(0),                                                   # no bytes
        torch.randn(40, 30, generator=g).t(),                             # non-contiguous
        torch.randn(2500, generator=g),                                   # 10000 bytes: over small bounces
        torch.randn(5, generator=g).to(torch.float64),
        torch.randint(-9, 9, (3, 5), generator=g),                        # int64
    ]


def _reference(tensors: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor:
    arena = torch.zeros(total, dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        if t.numel():
            snapshot_mod._dst(arena, off, t).copy_(t)
    return arena


@pytest.mark.parametrize("bounce", [1, 64, 100, 4096, 1 << 20])
@pytest.mark.parametrize("direct", [6000, 1 << 30])
def test_gathered_copies_land_exactly_where_the_per_tensor_copies_do(bounce: int, direct: int) -> None:
    tensors = _mixed()
    offsets, total = layout(tensors)
    want = _reference(tensors, offsets, total)
    zeros = torch.zeros(ALIGN, dtype=torch.uint8)
    early = [2, 3, 8]                                  # groups interleaved in the layout
    late = [i for i in range(len(tensors)) if i not in early]
    plan = GatherPlan(tensors, offsets, [early, late], bounce, zeros, direct_bytes=direct)
    got = torch.zeros(total, dtype=torch.uint8)
    plan.run(0, got, torch.empty(max(plan.bounce_bytes, 1), dtype=torch.uint8), tensors, non_blocking=False)
    plan.run(1, got, torch.empty(max(plan.bounce_bytes, 1), dtype=torch.uint8), tensors, non_blocking=False)
    assert torch.equal(got, want)
    assert plan.bounce_bytes <= bounce
    assert plan.stats.tensors == 1                     # the transposed one, copied per tensor
    assert plan.stats.direct == (1 if direct == 6000 else 0)
    if bounce < 10000 and direct > 10000:              # the 10000-byte tensor is split across chunks
        assert plan.stats.chunks >= 10000 // bounce


def test_a_group_writes_only_its_tensors_and_the_gaps_between_them() -> None:
    tensors = _mixed(1)
    offsets, total = layout(tensors)
    early, late = [0, 1, 4], [2, 3, 5, 6, 7, 8, 9]
    plan = GatherPlan(tensors, offsets, [early, late], 1 << 20, torch.zeros(ALIGN, dtype=torch.uint8))
    got = torch.full((total,), 0xAA, dtype=torch.uint8)
    plan.run(0, got, torch.empty(plan.bounce_bytes, dtype=torch.uint8), tensors, non_blocking=False)
    want = _reference(tensors, offsets, total)
    for i in early:
        n = tensors[i].numel() * tensors[i].element_size()
        assert torch.equal(got[offsets[i]:offsets[i] + n], want[offsets[i]:offsets[i] + n])
    for i in late:                                     # the late group's bytes: not touched yet
        n = tensors[i].numel() * tensors[i].element_size()
        assert bool((got[offsets[i]:offsets[i] + n] == 0xAA).all())
    assert len(plan.groups[0]) == 2                    # tensors 0, 1 adjacent (one chunk), 4 alone
    assert len(plan.groups[1]) == 3                    # 2, 3 | 6 (non-contiguous: its own copy) | 7, 8, 9


def test_many_small_adjacent_tensors_take_one_chunk_not_one_copy_each() -> None:
    tensors = [torch.full((n,), float(n)) for n in range(1, 601)]      # 600 tensors, odd sizes
    offsets, total = layout(tensors)
    zeros = torch.zeros(ALIGN, dtype=torch.uint8)
    plan = GatherPlan(tensors, offsets, [[], list(range(600))], 256 << 20, zeros)
    assert plan.n_ops == 1 and plan.stats.chunks == 1 and plan.stats.gathered_bytes == total
    got = torch.zeros(total, dtype=torch.uint8)
    plan.run(1, got, torch.empty(plan.bounce_bytes, dtype=torch.uint8), tensors, non_blocking=False)
    assert torch.equal(got, _reference(tensors, offsets, total))


def test_byte_views_only_for_plain_contiguous_tensors() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v = byte_view(t)
    assert v is not None and v.numel() == 48 and v.data_ptr() == t.data_ptr()
    assert byte_view(t.t()) is None
    assert byte_view(torch.tensor(True)) is not None
    assert byte_view(torch.zeros(2, dtype=torch.complex64).conj()) is None


def test_gather_bytes_is_validated() -> None:
    assert SnapshotConfig().gather_bytes == 0 and SnapshotConfig(gather_bytes=256 << 20).gather_bytes == 256 << 20
    for bad in (-1, True, 1.5, "256"):
        with pytest.raises(InvalidInputError, match="gather_bytes"):
            SnapshotConfig(gather_bytes=bad)


# ---- through a save: the gathered path on CPU (as on CUDA) ----------------------------------------------


def _state(step: int) -> dict[str, Any]:
    ts = _mixed(step)
    return {"model": {f"t{i}": t for i, t in enumerate(ts)}, "big": torch.randn(3000), "step": step}


@pytest.fixture()
def gathered(monkeypatch: pytest.MonkeyPatch) -> list[GatherPlan]:
    """CPU saves take the gathered path; the plans made are recorded."""
    made: list[GatherPlan] = []
    real = Snapshotter._gather_plan

    def spy(self: Snapshotter, *a: Any, **k: Any) -> GatherPlan:
        plan = real(self, *a, **k)
        made.append(plan)
        return plan
    monkeypatch.setattr(snapshot_mod, "_GATHER_ON_HOST", True)
    monkeypatch.setattr(Snapshotter, "_gather_plan", spy)
    return made


def _scrub_all(co: Any) -> None:
    while co.scrub_pending():
        co.scrub(2.0, 1 << 20)


@pytest.mark.parametrize("checksums", ["source", "host"])
def test_gathered_saves_restore_bit_identical_and_verify(redis_server, tmp_path: Path,
                                                         gathered: list[GatherPlan], checksums: str) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("gather")
    cfg = SnapshotConfig(chunk_bytes=1024, checksums=checksums, gather_bytes=1000)
    snap = Snapshotter(co, job, 0, 1, cfg)
    states = {step: _state(step) for step in (1, 2, 3)}
    for step, sd in states.items():
        res = snap.save(step, sd).result(scaled(30))
        assert res.state == "COMMITTED", res.error
    assert gathered and gathered[-1].stats.chunks > 1 and gathered[-1].stats.tensors == 1   # split; fallback
    if checksums == "source":
        co.on_job_event(job, 3, "checks_clean", 1.0)
        _scrub_all(co)
        assert co.stats["scrub_failures"] == 0 and co.info(job, 3).state == "VERIFIED"
    for step, sd in states.items():
        assert_same(CheckpointClient(co, job, 0, 1).restore(step), sd)
    snap.close()


def test_a_flipped_bit_in_a_gathered_shard_fails_the_scrub_and_the_restore(redis_server, tmp_path: Path,
                                                                          gathered: list[GatherPlan]) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("gatherbad")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", staging="private",
                                                     gather_bytes=1000))
    assert snap.save(1, _state(1)).result(scaled(30)).state == "COMMITTED"
    assert gathered
    m = ShardManifest.from_json(co.redis.hget(co._keys(job, 1)[1], "0"))
    flip_bit(tmp_path / "n0" / m.blob, m.chunks[1].offset + 3)
    co.on_job_event(job, 1, "checks_clean", 1.0)
    _scrub_all(co)
    assert co.info(job, 1).state == "COMMITTED" and co.stats["scrub_failures"] == 1
    with pytest.raises(Exception, match="checksum|fingerprint|corrupt|chunk"):
        CheckpointClient(co, job, 0, 1).restore(1)
    snap.close()


def test_no_memory_for_the_bounce_falls_back_to_per_tensor_copies(redis_server, tmp_path: Path,
                                                                  gathered: list[GatherPlan],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(self: Snapshotter, dev: torch.device, need: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
    monkeypatch.setattr(Snapshotter, "_bounce_for", no_memory)
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("gatheroom")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", gather_bytes=1000))
    states = {step: _state(step) for step in (1, 2)}
    for step, sd in states.items():
        assert snap.save(step, sd).result(scaled(30)).state == "COMMITTED"
    assert snap._gather_off == {torch.device("cpu")} and len(gathered) == 1   # tried once, then per tensor
    for step, sd in states.items():
        assert_same(CheckpointClient(co, job, 0, 1).restore(step), sd)
    _scrub_all(co)   # nothing left queued for the session's other tests (an agent restart requeues by node)
    assert co.stats["scrub_failures"] == 0
    snap.close()
