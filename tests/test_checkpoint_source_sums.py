"""Issue 21, commit at the copy's pace, on CPU: a shard's chunk checksums and tensor fingerprints computed at
the source (`SnapshotConfig(checksums="source")`: per-piece fingerprints combined on the host, checkpoint.
source_sums) are exactly the integers the host computes from the saved bytes; COMMITTED needs no host hash;
the agent's scrub checks the bytes in node memory at a bounded rate and VERIFIED waits for it; a bad byte
found by the scrub keeps the checkpoint from VERIFIED and is journaled; an agent restart queues the unchecked
shards again. On CPU the source fingerprint is torch's (the GPU's kernel gives the same integers:
test_fingerprint*.py)."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from checkpoint.chunks import ALGORITHM, FP_ALGORITHM, Chunk, checksum, verify
from checkpoint.client import CheckpointClient
from checkpoint.coordinator import SCRUB_FIELD
from checkpoint.errors import InvalidInputError
from checkpoint.manifest import ShardManifest, TensorEntry
from checkpoint.snapshot import SnapshotConfig, Snapshotter
from checkpoint.source_sums import CombinePlan, ManifestTemplate, combine, pieces
from checksums.fingerprint import triton_available
from checksums.fingerprint_host import (MASK64, fingerprint_bytes, fmix64, fmix64_inverse, shift_sums,
                                        sums_from_tensor_words, word_sums_numpy)
from ckpt_support import (assert_same, assert_slots_pinned, flip_bit, job_id, node, side_stream_late,
                          state_dict)
from deadlines import scaled


def test_fmix64_inverts_and_sums_come_back_from_a_fingerprint() -> None:
    for _ in range(200):
        x = int.from_bytes(os.urandom(8), "little")
        assert fmix64_inverse(fmix64(x)) == x
    buf = os.urandom(1001)
    s0, s1 = word_sums_numpy(buf)
    assert sums_from_tensor_words(*fingerprint_bytes(buf, "uint8", (1001,)), "uint8", (1001,)) == \
        (s0 & MASK64, s1 & MASK64)
    a, b = word_sums_numpy(buf[:400]), shift_sums(*word_sums_numpy(buf[400:]), 100)
    assert ((a[0] + b[0]) & MASK64, (a[1] + b[1]) & MASK64) == (s0 & MASK64, s1 & MASK64)


def _aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Tensors of these byte sizes laid out at 64-byte-aligned offsets: (offsets, total bytes)."""
    offsets, pos = [], 0
    for n in sizes:
        pos = (pos + 63) // 64 * 64
        offsets.append(pos)
        pos += n
    return offsets, pos


@pytest.mark.parametrize("chunk_bytes", [4, 64, 256, 4096])
def test_pieces_combine_into_the_host_checksums_and_fingerprints(chunk_bytes: int) -> None:
    rng = np.random.default_rng(chunk_bytes)
    sizes = [1000, 6, 0, 4096, 13, 777, 2, 300]
    offsets, pos = _aligned_offsets(sizes)
    blob = bytearray(pos)
    data = []
    for off, n in zip(offsets, sizes):
        d = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        blob[off:off + n] = d
        data.append(d)
    cut = pieces(offsets, sizes, chunk_bytes)
    words = [fingerprint_bytes(data[p.tensor][p.start:p.start + p.length], "uint8", (p.length,)) for p in cut]
    chunks, fps = combine(cut, words, len(blob), chunk_bytes, [("uint8", (n,)) for n in sizes])
    view = memoryview(blob)
    assert [(c.offset, c.length) for c in chunks] == [(o, min(chunk_bytes, len(blob) - o))
                                                       for o in range(0, len(blob), chunk_bytes)]
    for c in chunks:
        assert c.algorithm == FP_ALGORITHM and verify(view[c.offset:c.offset + c.length], c)
        assert c.checksum == checksum(view[c.offset:c.offset + c.length], FP_ALGORITHM)
    assert fps == [fingerprint_bytes(d, "uint8", (n,)) for d, n in zip(data, sizes)]
    with pytest.raises(InvalidInputError, match="multiple of 4"):
        pieces(offsets, sizes, 6)


@pytest.mark.parametrize("chunk_bytes", [4, 256, 4096])
def test_the_vectorised_plan_and_template_give_combine_and_to_json_exactly(chunk_bytes: int) -> None:
    """Issue 21: CombinePlan (numpy over whole arrays) gives the integers `combine` gives, and
    ManifestTemplate the very text ShardManifest.to_json writes (what the agent parses and compares)."""
    rng = np.random.default_rng(chunk_bytes + 1)
    specs = [("float32", (10, 25)), ("bfloat16", (7,)), ("uint8", (0,)), ("int64", ()), ("float32", (333,)),
             ("uint8", (13,))]
    item = {"float32": 4, "bfloat16": 2, "uint8": 1, "int64": 8}
    sizes = [item[dt] * int(np.prod(shape)) for dt, shape in specs]
    offsets, total = _aligned_offsets(sizes)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    cut = pieces(offsets, sizes, chunk_bytes)
    words = [fingerprint_bytes(data[p.tensor][p.start:p.start + p.length], "uint8", (p.length,)) for p in cut]
    chunks, fps = combine(cut, words, total, chunk_bytes, specs)
    plan = CombinePlan(cut, total, chunk_bytes, specs)
    signed = np.array([[w - (1 << 64) if w >> 63 else w for w in pair] for pair in words],
                      dtype=np.int64).reshape(-1, 2)   # as the GPU hands them over: int64 bit patterns
    cw, tw = plan.run(signed)
    assert [c.checksum for c in chunks] == [f"{a:016x}{b:016x}" for a, b in cw.tolist()]
    assert fps == [tuple(x) for x in tw.tolist()]
    entries = [(f"model/t\u00e9{i}", dt, shape, off, n) for i, ((dt, shape), off, n)
               in enumerate(zip(specs, offsets, sizes))]
    tree = {"model": {f"t{i}": {"__sdcw_tensor__": i} for i in range(len(specs))}, "x": [1.5, None]}
    m = ShardManifest("job-x", 12, 1, 2, "job-x/12/rank-1.bin", total, chunk_bytes, tuple(chunks),
                      tuple(TensorEntry(*e, fp) for e, fp in zip(entries, fps)), tree, 1234.5678,
                      algorithm=FP_ALGORITHM, replica_set="set-a")
    text = ManifestTemplate("job-x", 1, 2, total, chunk_bytes, plan.ranges, entries, tree, "set-a").render(
        12, "job-x/12/rank-1.bin", cw, tw, 1234.5678)
    assert text == m.to_json()
    assert ShardManifest.from_json(text) == m
    with pytest.raises(InvalidInputError):
        plan.run(signed[1:])


def test_a_chunk_checksum_catches_a_flipped_bit_with_either_algorithm() -> None:
    buf = bytearray(os.urandom(4096))
    for algo in (ALGORITHM, FP_ALGORITHM):
        c = Chunk(0, len(buf), checksum(buf, algo), algo)
        assert verify(buf, c)
        buf[1234] ^= 0x10
        assert not verify(buf, c)
        buf[1234] ^= 0x10


def _unscrubbed(co: Any, job: str, step: int) -> dict[str, str]:
    h = co.redis.hgetall(co._meta(job, step))
    return {k.decode(): v.decode() for k, v in h.items() if k.decode().startswith(SCRUB_FIELD)}


def test_source_checksums_commit_without_host_hashing_and_verified_waits_for_the_scrub(
        redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("src")
    cfg = SnapshotConfig(chunk_bytes=1024, checksums="source", fingerprint_threads=1)
    snap = Snapshotter(co, job, 0, 1, cfg)
    sds = {}
    for step in (1, 2, 3):   # step 1 stages privately (a streamed write), the others in slots
        sds[step] = state_dict(0, step, size=3000)
        res = snap.save(step, sds[step]).result(scaled(30))
        assert res.state == "COMMITTED", res.error
        assert res.fingerprint_s == 0.0                  # no host fingerprint of the bytes
        m = ShardManifest.from_json(co.redis.hget(co._keys(job, step)[1], "0"))
        assert m.algorithm == FP_ALGORITHM and len(m.chunks) > 3
        blob = (tmp_path / "n0" / m.blob).read_bytes()
        for c in m.chunks:                               # the source's integers are the saved bytes' integers
            assert c.checksum == checksum(blob[c.offset:c.offset + c.length], FP_ALGORITHM)
        for e in m.tensors:
            assert e.fingerprint == fingerprint_bytes(blob[e.offset:e.offset + e.nbytes], e.dtype, e.shape)
        assert _unscrubbed(co, job, step) == {"scrub:0": "pending"}
    co.on_job_event(job, 3, "checks_clean", 1.0)
    assert {i.state for i in co.list(job)} == {"COMMITTED"}   # clean, but the host bytes are not checked yet
    assert co.scrub_pending() == 3
    n = co.scrub(2.0, 1024)                              # bounded: one chunk's worth
    assert 0 < n <= 1024 and co.scrub_pending() == 3
    while co.scrub_pending():
        co.scrub(2.0, 1 << 20)
    assert {i.step: i.state for i in co.list(job)} == {1: "VERIFIED", 2: "VERIFIED", 3: "VERIFIED"}
    assert _unscrubbed(co, job, 3) == {"scrub:0": "ok"}
    client = CheckpointClient(co, job, 0, 1)
    for step in (1, 3):
        assert_same(client.restore(step), sds[step])
    snap.close()


def test_the_scrub_finds_a_bad_byte_in_node_memory(redis_server, tmp_path: Path) -> None:
    events: list[Any] = []
    co = node(redis_server.port, tmp_path, "n0", publish=lambda *a, **k: events.append((a, k)), keep_committed=4)
    job = job_id("scrubbad")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", staging="private"))
    assert snap.save(1, state_dict(0, 1, size=3000)).result(scaled(30)).state == "COMMITTED"
    m = ShardManifest.from_json(co.redis.hget(co._keys(job, 1)[1], "0"))
    flip_bit(tmp_path / "n0" / m.blob, m.chunks[2].offset + 5)
    co.on_job_event(job, 1, "checks_clean", 1.0)
    while co.scrub_pending():
        co.scrub(2.0, 1 << 20)
    assert co.info(job, 1).state == "COMMITTED"          # never VERIFIED
    assert _unscrubbed(co, job, 1)["scrub:0"].startswith("bad: chunk at 2048")
    assert co.stats["scrub_failures"] == 1
    assert co.info(job, 1).reason.startswith("never VERIFIED: rank 0's bytes in node memory: bad: chunk at 2048")
    assert any("checkpoint.copy_corrupt" in repr(e) for e in events), events
    with pytest.raises(Exception, match="checksum|fingerprint|corrupt|chunk"):
        CheckpointClient(co, job, 0, 1).restore(1)      # the restore verifies the chunks it reads
    snap.close()


def test_a_restarted_agent_queues_the_unchecked_shards_again(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("requeue")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source"))
    assert snap.save(1, state_dict(0, 1)).result(scaled(30)).state == "COMMITTED"
    snap.close()
    again = node(redis_server.port, tmp_path, "n0", keep_committed=4)   # the agent restarted: nothing queued
    assert again.scrub_pending() == 0
    again.maintain(3.0)
    assert again.scrub_pending() == 1
    again.on_job_event(job, 1, "checks_clean", 4.0)
    again.scrub(5.0, 1 << 30)
    assert again.info(job, 1).state == "VERIFIED"


def test_host_checksums_stay_the_cpu_default_and_source_is_checked(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("auto")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024))
    assert snap.save(1, state_dict(0, 1)).result(scaled(30)).state == "COMMITTED"
    m = ShardManifest.from_json(co.redis.hget(co._keys(job, 1)[1], "0"))
    assert m.algorithm == ALGORITHM and not _unscrubbed(co, job, 1)   # checked on commit, as before
    snap.close()
    with pytest.raises(InvalidInputError, match="checksums"):
        SnapshotConfig(checksums="gpu")
    with pytest.raises(InvalidInputError, match="multiple of 4"):
        SnapshotConfig(checksums="source", chunk_bytes=1022)


def test_a_reused_buffer_has_the_gaps_of_a_new_layout_zeroed(redis_server, tmp_path: Path) -> None:
    """Same total size, another layout: the old layout's bytes in the new gaps would break the source
    checksums (which count the gaps as zero) unless the buffer's gaps are zeroed."""
    import torch

    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("gaps")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=64, checksums="source", staging="private"))
    one = {"a": torch.full((100,), -1.0), "b": torch.ones(3, dtype=torch.uint8)}      # 400 @0, 3 @448
    two = {"x": torch.ones(3, dtype=torch.uint8), "y": torch.full((387,), 7, dtype=torch.uint8)}  # 3 @0, 387 @64
    for step, sd in ((1, one), (2, two)):
        assert snap.save(step, sd).result(scaled(30)).state == "COMMITTED"
    co.on_job_event(job, 2, "checks_clean", 1.0)
    while co.scrub_pending():
        co.scrub(2.0, 1 << 20)
    assert co.info(job, 2).state == "VERIFIED" and co.stats["scrub_failures"] == 0
    assert_same(CheckpointClient(co, job, 0, 1).restore(2), two)
    snap.close()


@pytest.mark.parametrize("checksums", ["host", "source"])
def test_a_save_with_no_host_buffer_ready_stages_on_the_device_and_returns(
        redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checksums: str) -> None:
    """Item 2 (first save blocks no longer than a steady one): with no host buffer ready the copy goes to a
    zeroed device buffer and save() returns; the background makes the host buffer and copies there. On CPU
    the "device" buffer is a host tensor (forced here); the real one is a GPU buffer (bench part c)."""
    import torch

    import checkpoint.snapshot as snapshot_mod

    made: list[int] = []

    def fake_stage(self: Snapshotter, tensors: list, total: int, block: str) -> Any:
        assert block != "copy"
        made.append(total)
        return torch.zeros(total, dtype=torch.uint8)

    real_ensure = snapshot_mod._Arena.ensure
    inline: list[int] = []

    def watch_ensure(self: Any, nbytes: int) -> Any:
        if threading.current_thread() is threading.main_thread():
            inline.append(nbytes)
        return real_ensure(self, nbytes)

    monkeypatch.setattr(Snapshotter, "_device_stage", fake_stage)
    monkeypatch.setattr(snapshot_mod._Arena, "ensure", watch_ensure)
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id("stage")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums=checksums, block="enqueue"))
    sd = state_dict(0, 1, size=3000)
    res = snap.save(1, sd).result(scaled(30))
    assert res.state == "COMMITTED" and res.device_staged and made and not inline, (res, inline)
    sd2 = state_dict(0, 2, size=3000)
    res2 = snap.save(2, sd2).result(scaled(30))       # a slot made ahead by then: no device staging
    assert res2.state == "COMMITTED" and not res2.device_staged and res2.staging == "slot"
    co.on_job_event(job, 2, "checks_clean", 1.0)
    while co.scrub_pending():
        co.scrub(2.0, 1 << 20)
    assert {i.step: i.state for i in co.list(job)} == {1: "VERIFIED", 2: "VERIFIED"}
    client = CheckpointClient(co, job, 0, 1)
    assert_same(client.restore(1), sd)
    assert_same(client.restore(2), sd2)
    snap.close()


def test_device_staging_is_for_one_gpu_and_a_save_that_does_not_promise_the_host_copy(
        redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("nostage")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024))
    tensors = [t for t in state_dict(0, 1)["model"].values()]
    assert snap._device_stage(tensors, 4096, "update") is None      # CPU tensors: nothing to stage on
    assert snap._device_stage(tensors, 4096, "copy") is None
    snap.close()


def test_retention_keeps_the_checkpoint_the_scrub_is_reading(redis_server, tmp_path: Path) -> None:
    """Every step: newer checkpoints commit while the scrub reads one; retention must not evict that one
    (else under every-step saves nothing would ever be VERIFIED). The newest queued is scrubbed next."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=1), job_id("hold")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", max_slots=4))
    assert snap.save(1, state_dict(0, 1, size=3000)).result(scaled(30)).state == "COMMITTED"
    assert co.scrub(1.0, 1024) > 0                        # reading step 1 now
    for step in (2, 3, 4):
        assert snap.save(step, state_dict(0, step, size=3000)).result(scaled(30)).state == "COMMITTED"
    assert [i.step for i in co.list(job) if i.state == "COMMITTED"] == [1, 4]   # 2, 3 evicted; 1 held
    co.on_job_event(job, 4, "checks_clean", 2.0)
    co.scrub(3.0, 1 << 20)                                # finishes 1, then the newest (4); 2, 3 are gone
    assert _unscrubbed(co, job, 1) == {"scrub:0": "ok"} and co.info(job, 4).state == "VERIFIED"
    assert co.scrub_pending() == 0
    snap.close()


@pytest.mark.gpu
def test_cuda_source_checksums_and_first_save_on_the_device(redis_server, tmp_path: Path) -> None:
    """On a GPU: the first save stages on the device (no host buffer yet), the pieces' fingerprints come from
    the kernel at the source, CPU tensors of the state (AdamW's step counts, plain values) ride along; the
    scrub finds the host bytes equal to them; every restore is bit-identical to the weights at the save."""
    import torch
    from torch import nn

    from checksums.step_guard import StepGuard

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id("cudasrc")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.LayerNorm(2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)             # step counts: CPU tensors
    client = CheckpointClient(co, job, 0, 1, guard=StepGuard.attach(opt),
                              config=SnapshotConfig(chunk_bytes=1 << 20))
    x = torch.randn(64, 2048, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    for step in range(1, 4):
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "loader": {"pos": step}}
        expected = {"model": {k: v.detach().cpu().clone() for k, v in sd["model"].items()},
                    "loader": {"pos": step}}
        h = client.save(step, sd)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        res = h.result(scaled(120))
        assert res.state == "COMMITTED", res.error
        m = ShardManifest.from_json(co.redis.hget(co._keys(job, step)[1], "0"))
        assert res.device_staged == (step == 1)
        if step == 1 and triton_available():   # the layout's plan is built ahead, never in the first save:
            assert m.algorithm == ALGORITHM     # that one is checksummed on the host from the landed bytes
            client.snapshotter._plan_fut.result(scaled(120))
        else:
            assert m.algorithm == FP_ALGORITHM and res.fingerprint_s == 0.0
        got = CheckpointClient(co, job, 0, 1).restore(step)
        assert_same(got["model"], expected["model"])
        assert got["loader"] == expected["loader"]
    co.on_job_event(job, 3, "checks_clean", 1.0)
    while co.scrub_pending():
        co.scrub(2.0, 1 << 30)
    assert co.stats["scrub_failures"] == 0
    assert {i.step: i.state for i in co.list(job)} == {1: "VERIFIED", 2: "VERIFIED", 3: "VERIFIED"}
    client.close()


def _every_step_on_gpu(redis_server: Any, tmp_path: Path, name: str, checksums: str) -> tuple[Any, ...]:
    """A small model with AdamW on the GPU, its client bound to a step guard with every-step saves (3 in
    flight, `policy="wait"`): (coordinator, job, client, train_step), train_step() -> the state after one
    update. Skips without a GPU."""
    import torch
    from torch import nn

    from checksums.step_guard import StepGuard

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=4), job_id(name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.LayerNorm(1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    client = CheckpointClient(co, job, 0, 1, guard=StepGuard.attach(opt),
                              config=SnapshotConfig.every_step(checksums=checksums, chunk_bytes=1 << 20,
                                                               policy="wait", skip_until_ready=False))
    x = torch.randn(64, 1024, device="cuda")

    def train_step() -> dict[str, Any]:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    return co, job, client, train_step


@pytest.mark.gpu
@pytest.mark.parametrize("checksums", ["source", "host"])
def test_steady_saves_reuse_their_fingerprint_word_buffers(redis_server, tmp_path: Path, checksums: str) -> None:
    """On a GPU, every step with 3 saves in flight: the pinned buffers the fingerprint words land in are made
    in the first saves and then reused (no host allocation a steady save: at most one buffer a save in flight
    and one for the next, however the saves' timing falls), and reuse never hands a save another's words:
    every save commits (the transfer check or the scrub compares them with the landed bytes) and restores
    bit-identical."""
    co, job, client, train_step = _every_step_on_gpu(redis_server, tmp_path, f"words{checksums}", checksums)
    handles, expected = [], {}
    steps = 24
    for step in range(1, steps + 1):
        sd = train_step()
        expected[step] = {k: v.detach().cpu().clone() for k, v in sd["model"].items()}
        handles.append(client.save(step, sd))
    results = [h.result(scaled(120)) for h in handles if h is not None]
    assert len(results) == steps and all(r.state == "COMMITTED" for r in results), [r.error for r in results]
    made = client.snapshotter._words.made
    assert 0 < made <= client.snapshotter.config.max_inflight + 1, made   # one a save would make 24
    assert_slots_pinned(client)
    for step in (steps - 1, steps):
        assert_same(CheckpointClient(co, job, 0, 1).restore(step)["model"], expected[step])
    client.close()


@pytest.mark.gpu
@pytest.mark.parametrize("checksums", ["source", "host"])
def test_the_update_waits_for_the_save_fingerprints(redis_server, tmp_path: Path, checksums: str,
                                                    monkeypatch) -> None:
    """The save's fingerprint kernels read the state on the device after save() returns (issue 21): the next
    update must wait for them there. Here they start only after a 100 ms device sleep while the update follows
    save() at once: an update not ordered after them would change the tensors before they read them, and the
    saves would not commit (the words would not match the copied bytes) or restore other bytes. The
    fingerprints are in use in every timed save (source: the pieces' plan built first; host: the transfer
    check)."""
    co, job, client, train_step = _every_step_on_gpu(redis_server, tmp_path, f"fpwait{checksums}", checksums)
    # warm: the buffers, and (source) the pieces' fingerprint plan, made before the timed saves
    assert client.save(1, train_step()).result(scaled(120)).state == "COMMITTED"
    if client.snapshotter._plan_fut is not None:
        client.snapshotter._plan_fut.result(scaled(120))
    late = side_stream_late(monkeypatch, ms=100, copies=False)   # the fingerprint stream waits for it
    handles, expected = [], {}
    for step in range(2, 10):
        sd = train_step()
        expected[step] = {k: v.detach().cpu().clone() for k, v in sd["model"].items()}
        handles.append(client.save(step, sd))
    results = [h.result(scaled(120)) for h in handles if h is not None]
    assert len(results) == 8 and all(r.state == "COMMITTED" for r in results), [r.error for r in results]
    # the device fingerprints were checked: words to the host, and the pieces' plan or the transfer check
    with_words = [a[3] is not None and (a[1] is not None or a[2] is not None) for a in late.fingerprint_args]
    assert len(with_words) >= 8 and all(with_words), with_words
    assert_slots_pinned(client)
    for step in (8, 9):
        assert_same(CheckpointClient(co, job, 0, 1).restore(step)["model"], expected[step])
    client.close()


def test_word_buffers_are_reused_once_given_back_and_kept_bounded() -> None:
    """`_WordBuffers`: a buffer taken is not handed out again until given back; given back, it is the next
    one of its size; at most `keep` kept per size."""
    from checkpoint.snapshot import _WordBuffers

    w = _WordBuffers(pin=False, keep=2)
    a, b = w.take(5), w.take(5)
    assert a.shape == (5, 2) and a.data_ptr() != b.data_ptr() and w.made == 2
    w.give([a])
    assert w.take(5).data_ptr() == a.data_ptr() and w.made == 2
    assert w.take(3).shape == (3, 2) and w.made == 3              # another size: its own buffer
    w.give([a, b, w.take(5)])                                     # a third of size 5 is not kept
    assert w.made == 4
    got = {w.take(5).data_ptr(), w.take(5).data_ptr()}
    assert got == {a.data_ptr(), b.data_ptr()} and w.made == 4
    w.take(5)
    assert w.made == 5


def test_the_torch_piece_fingerprints_equal_the_host_ones() -> None:
    """The GPU's torch-ops path (no Triton, or its JIT still compiling), run here on CPU tensors: the pieces'
    words equal numpy's over the same bytes."""
    import torch

    from checkpoint.snapshot import _piece_views
    from checksums.fingerprint import prepare_fingerprint_torch

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(1000, generator=g), torch.randn(33, generator=g).to(torch.bfloat16),
               torch.randint(0, 9, (7, 3), generator=g)]
    offsets = [0, 4032, 4160]
    cut = pieces(offsets, [t.numel() * t.element_size() for t in tensors], 256)
    run = prepare_fingerprint_torch(_piece_views(tensors, cut))
    for t in tensors:
        t.add_(1)                                     # read when run, not when prepared
    got = [tuple(int(v) & MASK64 for v in row) for row in run().tolist()]
    want = [fingerprint_bytes(_piece_views(tensors, [p])[0].numpy().tobytes(), "uint8", (p.length,)) for p in cut]
    assert got == want



def test_the_real_agent_scrubs_and_then_verifies(short_tmp: Path) -> None:
    """Through the agent process: shards saved with source checksums commit, the agent's scrub loop checks
    their bytes in node memory, and the agreed vote then makes the checkpoint VERIFIED."""
    import uuid

    import grpc

    from agent_harness import AgentProcess
    from ckpt_support import wait_for
    from proto.sdcwatch.v1 import agent_pb2 as apb
    from proto.sdcwatch.v1 import agent_pb2_grpc as apb_grpc

    state = short_tmp / f"ckpt-{uuid.uuid4().hex[:8]}"
    job = job_id("agentscrub")
    with AgentProcess(state) as agent:
        ranks = [CheckpointClient.connect(job, r, 2, target=agent.target, deadline_s=10,
                                          config=SnapshotConfig(chunk_bytes=4096, checksums="source"))
                 for r in (0, 1)]
        try:
            res = [c.save(1, state_dict(0, 1)).result(scaled(30)) for c in ranks]   # replicas: same bytes
            assert all(r.error == "" for r in res) and res[1].state == "COMMITTED", res
            vote = apb.ReplicaVote(checked=True, agreed=True, replicas=2, step=1, method="majority")
            with grpc.insecure_channel(agent.target) as ch:
                apb_grpc.AgentStub(ch).ReportStep(
                    apb.ReportStepRequest(job_id=job, rank=0, world_size=2, step=2, vote=vote), timeout=10)
            wait_for(lambda: [i.state for i in ranks[0].list()] == ["VERIFIED"])
            assert_same(ranks[1].restore("latest_verified"), state_dict(0, 1))
        finally:
            for c in ranks:
                c.close()


# ---- restore: a source-checksummed shard's bytes are summed once ---------------------------------------


def _fp1_blob(sizes: list[int], chunk_bytes: int, seed: int = 0) -> tuple[bytearray, ShardManifest]:
    from checkpoint.manifest import TensorEntry

    rng = np.random.default_rng(seed)
    offsets, pos = _aligned_offsets(sizes)
    blob = bytearray(pos)
    for off, n in zip(offsets, sizes):
        blob[off:off + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    view = memoryview(blob)
    cut = pieces(offsets, sizes, chunk_bytes)
    words = [fingerprint_bytes(view[offsets[p.tensor] + p.start:offsets[p.tensor] + p.start + p.length],
                               "uint8", (p.length,)) for p in cut]
    chunks, fps = combine(cut, words, len(blob), chunk_bytes, [("uint8", (n,)) for n in sizes])
    tensors = tuple(TensorEntry(f"t{i}", "uint8", (n,), off, n, fp)
                    for i, (off, n, fp) in enumerate(zip(offsets, sizes, fps)))
    tree = {f"t{i}": {"__sdcw_tensor__": i} for i in range(len(sizes))}
    m = ShardManifest("j", 1, 0, 1, "j/1/rank-00000.bin", len(blob), chunk_bytes, tuple(chunks), tensors, tree,
                      1.0, algorithm=FP_ALGORITHM)
    return blob, m


class _Mem:
    def __init__(self, blob: bytes | bytearray) -> None:
        self.blob = bytes(blob)

    def readinto(self, key: str, offset: int, out: memoryview) -> int:
        n = min(len(out), len(self.blob) - offset)
        out[:n] = self.blob[offset:offset + n]
        return n


@pytest.mark.parametrize("chunk_bytes", [64, 256, 4096])
def test_restore_sums_a_source_checksummed_shard_once(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    import checkpoint.shard_reader as sr

    blob, m = _fp1_blob([1000, 6, 0, 4096, 13, 777, 2, 300, 4], chunk_bytes)
    summed = []
    real = sr.word_sums_numpy
    monkeypatch.setattr(sr, "word_sums_numpy", lambda b: summed.append(memoryview(b).nbytes) or real(b))
    monkeypatch.setattr(sr, "fingerprint_bytes", lambda *a: pytest.fail("a tensor was fingerprinted again"))
    out = bytearray(m.nbytes)
    sr.read_checked(m, [("mem", _Mem(blob))], memoryview(out))
    assert out == blob and sum(summed) == len(blob)    # every byte summed once, chunks and tensors both
    # a flipped bit in a tensor: its chunk fails on the only copy
    bad = bytearray(blob)
    bad[m.tensors[3].offset + 100] ^= 1
    with pytest.raises(sr.CorruptCheckpointError, match="t3"):
        sr.read_checked(m, [("bad", _Mem(bad))], memoryview(bytearray(m.nbytes)))
    # ... and another copy has it: the fallback copy's sums are the tensors'
    rep = sr.read_checked(m, [("bad", _Mem(bad)), ("good", _Mem(blob))], memoryview(out))
    assert rep.fallbacks == 1 and out == blob


def test_restore_once_still_catches_a_wrong_fingerprint_and_a_nonzero_pad() -> None:
    import dataclasses

    import checkpoint.shard_reader as sr

    blob, m = _fp1_blob([13, 6, 300], 64)
    wrong = dataclasses.replace(m, tensors=(m.tensors[0], dataclasses.replace(m.tensors[1], fingerprint=(1, 2)),
                                            *m.tensors[2:]))
    with pytest.raises(sr.CorruptCheckpointError, match="t1 has fingerprint"):
        sr.read_checked(wrong, [("mem", _Mem(blob))], memoryview(bytearray(m.nbytes)))
    # a byte after a tensor in its last word (in the gap) that is not zero: the chunk checksum says so
    # (the gaps were zero when saved), and with a checksum made over such bytes the tensor is summed apart
    padded = bytearray(blob)
    padded[m.tensors[0].offset + 13] = 7
    chunks = tuple(Chunk(c.offset, c.length, checksum(memoryview(padded)[c.offset:c.offset + c.length],
                                                      FP_ALGORITHM), FP_ALGORITHM) for c in m.chunks)
    m2 = dataclasses.replace(m, chunks=chunks)
    out = bytearray(m.nbytes)
    sr.read_checked(m2, [("mem", _Mem(padded))], memoryview(out))
    assert out == padded


def test_cpu_restore_of_a_source_checksummed_checkpoint_reads_once(redis_server, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import checkpoint.shard_reader as sr

    co, job = node(redis_server.port, tmp_path, "n0"), job_id("once")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", fingerprint_threads=1))
    sd = state_dict(0, 1, size=3000)
    assert snap.save(1, sd).result(scaled(30)).state == "COMMITTED"
    summed = []
    real = sr.word_sums_numpy
    monkeypatch.setattr(sr, "word_sums_numpy", lambda b: summed.append(memoryview(b).nbytes) or real(b))
    monkeypatch.setattr(sr, "fingerprint_bytes", lambda *a: pytest.fail("a tensor was fingerprinted again"))
    assert_same(CheckpointClient(co, job, 0, 1).restore(1), sd)
    m = ShardManifest.from_json(co.redis.hget(co._keys(job, 1)[1], "0"))
    assert sum(summed) == m.nbytes
    snap.close()


def test_a_save_never_builds_a_fingerprint_plan_it_checksums_on_the_host_meanwhile(
        redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save of a layout whose fused plan is not built (the GPU case, forced here) does not build it:
    the plan thread does, and that save is checksummed on the host (xxh3, from the landed bytes); once the
    plan is there saves are checksummed at the source again. prepare() builds it ahead."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id("plan")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", fingerprint_threads=1))
    built: list[int] = []
    ready = threading.Event()
    monkeypatch.setattr(snap, "_plans_ready", lambda tensors, cut, plan=None: ready.is_set())
    monkeypatch.setattr(snap, "_build_plans", lambda tensors, cut: (built.append(len(cut)), ready.set()))
    sds = {s: state_dict(0, s, size=3000) for s in (1, 2)}
    res = snap.save(1, sds[1]).result(scaled(30))
    assert res.state == "COMMITTED" and built and snap._plan_fut is not None
    m = ShardManifest.from_json(co.redis.hget(co._keys(job, 1)[1], "0"))
    assert m.algorithm == ALGORITHM
    snap._plan_fut.result(scaled(30))
    assert snap.save(2, sds[2]).result(scaled(30)).state == "COMMITTED"
    assert ShardManifest.from_json(co.redis.hget(co._keys(job, 2)[1], "0")).algorithm == FP_ALGORITHM
    client = CheckpointClient(co, job, 0, 1)
    for step in (1, 2):
        assert_same(client.restore(step), sds[step])
    # prepare() builds the plans (and the rest) in the background, before any save
    snap2 = Snapshotter(co, job_id("plan2"), 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source"))
    calls: list[int] = []
    monkeypatch.setattr(snap2, "_build_plans", lambda tensors, cut: calls.append(len(cut)))
    snap2.prepare(sds[1]).result(scaled(30))
    assert calls and snap2._cuts is not None
    snap.close()
    snap2.close()


def test_prepare_makes_the_first_save_cost_a_steady_one(redis_server, tmp_path: Path) -> None:
    """prepare() leaves nothing for the first save to make: the buffer (its gaps known zero), the pieces and
    the destination views are reused as a steady save reuses them; the save is bit-identical."""
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("prep1")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=1024, checksums="source", fingerprint_threads=1))
    sd = state_dict(0, 1, size=3000)
    snap.prepare(sd).result(scaled(30))
    buf = snap._arena.buf
    assert buf.numel() and buf.data_ptr() in snap._zeroed and snap._cuts is not None
    zeroed = []
    real = snap._zero_gaps
    snap._zero_gaps = lambda *a: (zeroed.append(1), real(*a))   # type: ignore[method-assign]
    res = snap.save(1, sd).result(scaled(30))
    assert res.state == "COMMITTED" and res.staging == "private" and res.checksums == "source"
    assert snap._arena.buf is buf or snap._arena.buf.numel() == 0
    assert_same(CheckpointClient(co, job, 0, 1).restore(1), sd)
    snap.close()
