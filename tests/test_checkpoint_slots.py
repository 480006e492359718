"""Staging slots: the rank's staging buffer is a file in the agent's memory dir, published by a hard link,
reused only once no stored checkpoint references it, swept when its rank is gone."""
from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from checkpoint.locations import dir_store_for
from checkpoint.restore import restore_from_plan
from checkpoint.shm_store import ShmStore, sweep_dead_slots
from checkpoint.slots import SlotRing
from checkpoint.snapshot import Snapshotter, SnapshotConfig
from ckpt_support import assert_same, assert_slots_pinned, job_id, node, state_dict
from deadlines import scaled


def _save(snap: Snapshotter, step: int, rank: int = 0):
    res = snap.save(step, state_dict(rank, step)).result(30)
    assert res.error == "", res.error
    return res


def test_saves_after_the_first_land_in_a_slot_published_by_hard_link(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("slot")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, max_slots=3))
    assert _save(snap, 1).staging == "private"  # learns where the agent's memory dir is
    inodes = {}
    for step in (2, 3, 4, 5):
        res = _save(snap, step)
        assert res.staging == "slot" and res.state == "COMMITTED"
        blob = Path(co.location) / job / f"{step:012d}" / "rank-00000.bin"
        st = blob.stat()
        assert st.st_nlink == 2  # the blob and the rank's slot are one file: no bytes were copied
        inodes[step] = st.st_ino
        assert_same(restore_from_plan(co.restore_plan(job, step, 0), 0, dir_store_for), state_dict(0, step))
    # keep_committed=2: step 4 evicted step 2 (its slot free again), step 5 reused step 2's slot
    assert [i.step for i in co.list(job)] == [4, 5]
    assert inodes[5] in (inodes[2], inodes[3]) and len(snap._ring) <= 3
    # steps 4 and 5 are still referenced: their bytes are intact after more saves overwrite free slots
    assert_same(restore_from_plan(co.restore_plan(job, 4, 0), 0, dir_store_for), state_dict(0, 4))
    snap.close()
    assert not list((Path(co.location) / ".slots").rglob("*.slot"))  # close() drops the slot names
    assert_same(restore_from_plan(co.restore_plan(job, 5, 0), 0, dir_store_for), state_dict(0, 5))


def test_all_slots_referenced_falls_back_to_a_private_buffer(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=5), job_id("full")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, max_slots=1))
    got = [_save(snap, s).staging for s in (1, 2, 3)]
    assert got == ["private", "slot", "private"]  # the one slot holds step 2, which is kept
    for s in (1, 2, 3):
        assert_same(restore_from_plan(co.restore_plan(job, s, 0), 0, dir_store_for), state_dict(0, s))
    snap.close()


def test_agent_dir_wiped_under_a_live_rank_copies_instead(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=5), job_id("wiped")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    _save(snap, 1)
    assert _save(snap, 2).staging == "slot"
    shutil.rmtree(Path(co.location) / ".slots")  # e.g. an agent restart cleaned its memory dir
    res = _save(snap, 3)
    assert res.staging == "private" and res.state == "COMMITTED"
    assert _save(snap, 4).staging == "slot"  # the ring was rebuilt
    for s in (3, 4):
        assert_same(restore_from_plan(co.restore_plan(job, s, 0), 0, dir_store_for), state_dict(0, s))
    snap.close()


def test_deleting_a_published_slot_never_recycles_its_pages(tmp_path: Path) -> None:
    store = ShmStore(tmp_path, spares=4)
    ring = SlotRing(tmp_path, "j", 0, register_cuda=False)
    slot = ring.acquire(1000)
    slot.tensor.fill_(7)
    assert store.link_in("j/000000000001/rank-00000.bin", slot.path) == 1000
    ring.release(slot)
    assert not slot.free()
    assert store.delete("j/000000000001/rank-00000.bin")
    assert not (tmp_path / ".spares").exists() or not any((tmp_path / ".spares").iterdir())
    assert slot.free() and ring.acquire(1000) is slot
    store.put("j/000000000002/rank-00000.bin", b"x" * 1000)  # a put never lands in the slot's file
    assert bool((slot.tensor == 7).all())
    assert store.used_bytes() == 2000  # the slot counted once, whatever its names
    ring.close()


def test_sweep_removes_only_slots_whose_rank_is_gone(tmp_path: Path) -> None:
    store = ShmStore(tmp_path)
    live = SlotRing(tmp_path, "j", 0, register_cuda=False)
    live_slot = live.acquire(64)
    dead = SlotRing(tmp_path, "j", 1, register_cuda=False)
    dead_slot = dead.acquire(64)
    dead_slot.tensor.fill_(3)
    store.link_in("j/000000000001/rank-00001.bin", dead_slot.path)
    # a dead rank: its process (and so its lock and fd) is gone, the slot file remains
    fcntl.flock(dead_slot.fd, fcntl.LOCK_UN)
    os.close(dead_slot.fd)
    dead.slots.clear()
    assert sweep_dead_slots(tmp_path, time.time()) == 0           # too young: may be being created
    assert sweep_dead_slots(tmp_path, time.time() + 120) == 1
    assert live_slot.path.exists() and not dead_slot.path.exists()
    assert store.get("j/000000000001/rank-00001.bin") == bytes([3]) * 64  # the published bytes stay
    live.close()


def test_slot_staging_matches_private_staging_bit_for_bit(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=5), job_id("same")
    sd = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16), "n": 1}
    for staging, steps in (("private", (1, 2)), ("slots", (3, 4))):
        snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=512, staging=staging))
        for s in steps:
            assert snap.save(s, sd).result(30).error == ""
        snap.close()
    m2, m4 = co.shard_manifest(job, 2, 0), co.shard_manifest(job, 4, 0)
    assert [c.checksum for c in m2.chunks] == [c.checksum for c in m4.chunks]
    assert [t.fingerprint for t in m2.tensors] == [t.fingerprint for t in m4.tensors]


def test_parameters_that_require_grad_are_saved_as_themselves(redis_server, tmp_path: Path) -> None:
    """A model's live parameters (requires_grad) save and restore bit for bit, the copy builds no autograd
    graph, and flatten hands out the state dict's own tensor objects (so per-tensor caches, such as the GPU
    fingerprint plan, live as long as the model, not one save)."""
    from checkpoint.state_tree import flatten

    model = torch.nn.Linear(64, 32)
    sd = {"model": model.state_dict(keep_vars=True), "step": 3}
    assert all(p.requires_grad for p in sd["model"].values())
    _, named = flatten(sd)
    assert [t for _, t in named][0] is sd["model"]["weight"]
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("grad")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    for step in (1, 2):
        res = snap.save(step, sd).result(30)
        assert res.error == "" and res.state == "COMMITTED", res.error
    assert snap._arena.buf.grad_fn is None and not snap._arena.buf.requires_grad
    back = restore_from_plan(co.restore_plan(job, 2, 0), 0, dir_store_for)
    assert torch.equal(back["model"]["weight"], model.weight.detach())
    assert not back["model"]["weight"].requires_grad and back["step"] == 3
    snap.close()


def test_cudart_calls_run_on_a_thread_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing cudaHostRegister leaves its error as its thread's "last error", which torch's next launch
    check on that thread raises: the calls run on a short-lived thread, their result and errors handed back."""
    import threading

    import checkpoint.slots as slots_mod
    seen: list[str] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
            seen.append(threading.current_thread().name)
            return 1 if ptr == 1 else 0

        def cudaHostUnregister(self, ptr: int) -> int:
            raise RuntimeError("no CUDA here")
    monkeypatch.setattr(slots_mod.torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(slots_mod.torch.cuda, "is_available", lambda: True)
    assert slots_mod.register_host_memory(4096, 4096) is True
    assert slots_mod.register_host_memory(1, 4096) is False      # cudaErrorInvalidValue: logged, not raised
    assert seen == ["sdcw-cudart", "sdcw-cudart"] and threading.current_thread().name not in seen
    with pytest.raises(RuntimeError, match="no CUDA here"):
        slots_mod._cudart_call("cudaHostUnregister", 4096)
    slots_mod.unregister_host_memory(4096)                       # logged, never raised


@pytest.mark.gpu
def test_a_failed_registration_does_not_fail_the_next_kernel_launch() -> None:
    """cudaHostRegister of an invalid range fails (cudaErrorInvalidValue); the training thread's next kernel
    launch must not report that error as its own (it did: "CUDA error: invalid argument" in a forward)."""
    import checkpoint.slots as slots_mod
    x = torch.ones(8, device="cuda")
    assert slots_mod.register_host_memory(1, 4096) is False
    y = x + 1          # torch checks cudaGetLastError after the launch
    assert float(y.sum()) == 16.0


def test_filesystem_type_is_the_longest_mount_above_the_real_path(tmp_path: Path) -> None:
    """`filesystem_type`: the mount point that holds the path (the longest prefix by path component, not by
    string), spaces as the kernel escapes them, a link followed to where it points."""
    from checkpoint.shm_store import filesystem_type
    mounts = ("/dev/vda1 / ext4 rw 0 0\n"
              "tmpfs /dev/shm tmpfs rw,nosuid 0 0\n"
              "shm /dev/shm2 tmpfs rw 0 0\n"
              "/dev/vdb /data/my\\040disk xfs rw 0 0\n"
              "broken\n")
    assert filesystem_type("/dev/shm/sdcw/mem", mounts) == "tmpfs"
    assert filesystem_type("/dev/shm", mounts) == "tmpfs"
    assert filesystem_type("/dev/shmother/x", mounts) == "ext4"       # a string prefix is not a parent
    assert filesystem_type("/data/my disk/mem", mounts) == "xfs"
    assert filesystem_type("/var/tmp", mounts) == "ext4"
    assert filesystem_type("/x", "") == ""
    (tmp_path / "link").symlink_to("/dev/shm")
    assert filesystem_type(tmp_path / "link", mounts) == "tmpfs"


def test_a_failed_registration_names_a_disk_filesystem_as_the_cause(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A slot whose pages the device could not pin: the warning says when its dir is on a disk filesystem
    (the kernel pins no such file pages for a device) and where to put the memory dir instead; on tmpfs it
    adds nothing it does not know."""
    import checkpoint.shm_store as shm_store_mod
    import checkpoint.slots as slots_mod
    monkeypatch.setattr(slots_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(slots_mod, "_cudart_call", lambda name, *a: 1)          # cudaErrorInvalidValue
    kinds = {"/srv/mem": "ext4", "/dev/shm/mem": "tmpfs"}
    monkeypatch.setattr(shm_store_mod, "filesystem_type", lambda p, mounts=None: kinds[str(p)])
    with caplog.at_level("WARNING", logger="checkpoint.slots"):
        assert slots_mod.register_host_memory(4096, 8192, Path("/srv/mem")) is False
        assert slots_mod.register_host_memory(4096, 8192, Path("/dev/shm/mem")) is False
    disk, shm = (r.getMessage() for r in caplog.records)
    assert "cudaError 1" in disk and "/srv/mem is on ext4" in disk and "/dev/shm" in disk
    assert "cudaError 1" in shm and " is on " not in shm


def test_a_stale_registration_at_a_new_slot_is_dropped_and_the_slot_pinned(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture
                                                                          ) -> None:
    """cudaErrorHostMemoryAlreadyRegistered for memory just mapped: the registration that starts there
    outlived its own mapping (H200: every slot of a client made after one was dropped unclosed failed so, and copied
    synchronously). It is dropped and the slot registered; any other failure is left as it is."""
    import checkpoint.slots as slots_mod
    monkeypatch.setattr(slots_mod.torch.cuda, "is_available", lambda: True)
    calls: list[tuple[str, int]] = []
    answers: dict[str, list[int]] = {}

    def cudart(name: str, ptr: int, *a: int) -> int:
        calls.append((name, ptr))
        return answers[name].pop(0)
    monkeypatch.setattr(slots_mod, "_cudart_call", cudart)
    answers.update(cudaHostRegister=[712, 0], cudaHostUnregister=[0])
    with caplog.at_level("WARNING", logger="checkpoint.slots"):
        assert slots_mod.register_host_memory(8192, 4096) is True
    assert calls == [("cudaHostRegister", 8192), ("cudaHostUnregister", 8192), ("cudaHostRegister", 8192)]
    assert "stale registration" in caplog.text
    calls.clear()
    answers.update(cudaHostRegister=[712], cudaHostUnregister=[1])     # not a registration of ours to drop
    assert slots_mod.register_host_memory(8192, 4096) is False
    answers.update(cudaHostRegister=[1])                                 # another error: no retry
    assert slots_mod.register_host_memory(8192, 4096) is False
    assert calls == [("cudaHostRegister", 8192), ("cudaHostUnregister", 8192), ("cudaHostRegister", 8192)]


@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_a_pinned_slot_is_unregistered_once_closed_or_collected_unclosed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         how: str) -> None:
    """Each registered slot's range is unregistered exactly once, before its mapping goes: when the ring is
    closed, and when a ring nobody closed (a client dropped without close()) is collected; memory unmapped
    while registered leaves a registration that fails every later one at that address."""
    import gc

    import checkpoint.slots as slots_mod
    pinned: set[int] = set()
    unpinned: list[int] = []
    monkeypatch.setattr(slots_mod, "register_host_memory", lambda ptr, n, where=None: pinned.add(ptr) or True)
    monkeypatch.setattr(slots_mod, "unregister_host_memory", lambda ptr: unpinned.append(ptr))
    ring = SlotRing(tmp_path, "j", 0, max_slots=3, register_cuda=True)
    for k in range(3):
        assert ring.ensure_spare(1 << 16, want=k + 1)
    assert len(pinned) == 3 and all(s.registered for s in ring.slots)
    fds = [s.fd for s in ring.slots]
    if how == "closed":
        ring.close()
    del ring
    gc.collect()
    assert sorted(unpinned) == sorted(pinned)          # each once, none twice
    for fd in fds:                                     # the files closed: their locks free for the sweep
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.gpu
def test_on_a_gpu_a_collected_ring_leaves_no_registration_and_a_stale_one_is_replaced(tmp_path: Path) -> None:
    """On the device: a ring nobody closed, once collected, has unregistered its slots (unregistering their
    addresses again finds nothing); and memory unmapped while registered (as a slot of a client dropped
    before this change left it) does not keep the next slot at that address from being pinned."""
    import gc
    import mmap as mmap_mod

    import checkpoint.slots as slots_mod
    from checkpoint.shm_store import filesystem_type
    assert filesystem_type(tmp_path) == "tmpfs", "tests/conftest.py puts tmp_path on /dev/shm"
    size = 3 << 20
    ring = SlotRing(tmp_path, "j", 0, max_slots=2, register_cuda=True)
    assert ring.ensure_spare(size) and ring.ensure_spare(size, want=2)
    ptrs = [s.tensor.data_ptr() for s in ring.slots]
    assert all(s.registered for s in ring.slots)
    del ring
    gc.collect()
    not_registered = 713   # cudaErrorHostMemoryNotRegistered
    assert [slots_mod._cudart_call("cudaHostUnregister", p) for p in ptrs] == [not_registered] * 2
    # a stale registration: anonymous memory registered, then unmapped without unregistering
    m = mmap_mod.mmap(-1, size)
    stale = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    assert slots_mod._cudart_call("cudaHostRegister", stale, size, 1) == 0
    m.close()
    again = SlotRing(tmp_path, "k", 0, max_slots=1, register_cuda=True)
    s = again.ensure_spare(size)
    assert s is not None and s.tensor.data_ptr() == stale, "the new slot did not land where the stale one is"
    assert s.registered
    x = torch.arange(size // 4, dtype=torch.int32, device="cuda")
    s.tensor.view(torch.int32).copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(s.tensor.view(torch.int32), x.cpu())
    again.close()
    assert slots_mod._cudart_call("cudaHostUnregister", stale) == not_registered


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_on_a_gpu_the_next_client_pins_its_slots_after_one_closed_or_dropped(redis_server, tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture,
                                                                             how: str) -> None:
    """Two clients in one process, one after the other (a job that makes its client again, a test suite):
    whether the first was closed or dropped unclosed, every slot of the second is pinned (H200, before:
    after a client was dropped, the slots of every later client failed cudaHostRegister with 712 and
    copied synchronously) and its saves commit."""
    import gc

    from torch import nn

    from checkpoint.client import CheckpointClient
    from checksums.step_guard import StepGuard
    co = node(redis_server.port, tmp_path, "n0", keep_committed=4)

    def run(name: str) -> CheckpointClient:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 512)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        client = CheckpointClient(co, job_id(name), 0, 1, guard=StepGuard.attach(opt),
                                  config=SnapshotConfig.every_step(checksums="source", policy="wait",
                                                                   skip_until_ready=False))
        x = torch.randn(256, 1024, device="cuda")
        handles = []
        for step in range(1, 5):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            handles.append(client.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}))
        assert [h.result(scaled(60)).state for h in handles if h is not None] == ["COMMITTED"] * 4
        assert_slots_pinned(client)
        return client

    with caplog.at_level("WARNING", logger="checkpoint.slots"):
        for round_ in range(3):
            first = run(f"first{round_}")
            if how == "closed":
                first.close()
            del first
            gc.collect()
    assert "cudaHostRegister" not in caplog.text, caplog.text
