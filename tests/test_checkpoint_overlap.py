"""Issue 21 item 1 on CPU: the checkpoint copy overlaps the next forward/backward and only the update waits
for it (the step guard's COPIES stage), slots are made ahead in the background, the every-step ring's size
comes from memory, and every skipped save is counted.

The device path is forced with a fake copy whose bytes are read only when its event is waited for (a stream
wait on the device, or the background's synchronize): if the update ran before the COPIES stage's wait, the
checkpoint would hold the updated weights. The real CUDA path is tested in test_step_guard.py (gpu) and
checked by bench/ckpt_overlap.py.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import checkpoint.snapshot as snapshot_mod
from checkpoint.client import CheckpointClient
from checkpoint.errors import InvalidInputError
from checkpoint.slots import SlotRing, memory_budget, ring_size
from checkpoint.snapshot import SnapshotConfig, Snapshotter, layout, optimizer_storages, pipelined_ring
from checkpoint.state_tree import flatten
from checksums.step_guard import Phase, StepContext, StepGuard, Veto
from ckpt_support import assert_same, job_id, node, side_stream_late, state_dict
from deadlines import scaled

MiB = 1 << 20


# ---- the ring size rule ------------------------------------------------------------------------------


def test_ring_size_is_the_share_of_memory_over_the_node_ranks() -> None:
    # 50% of min(64 GiB available, 100 GiB free) over 8 ranks = 4 GiB per rank: 4 slots of 1 GiB
    assert ring_size(1 << 30, mem_available=64 << 30, dir_free=100 << 30, local_ranks=8) == 4
    # the memory dir's free space is the smaller: it decides
    assert ring_size(1 << 30, mem_available=64 << 30, dir_free=16 << 30, local_ranks=1) == 8
    assert ring_size(1 << 20, mem_available=64 << 30, dir_free=64 << 30) == 16        # capped
    assert ring_size(8 << 30, mem_available=4 << 30, dir_free=4 << 30) == 1           # at least one
    assert ring_size(1 << 30, mem_available=8 << 30, dir_free=8 << 30, fraction=0.25) == 2
    avail, free, local = memory_budget("/tmp")
    assert avail > 0 and free > 0 and local >= 1


def test_every_step_config_and_its_ring_from_memory(redis_server, tmp_path: Path) -> None:
    cfg = SnapshotConfig.every_step(chunk_bytes=4096)
    assert (cfg.policy, cfg.block, cfg.max_slots, cfg.skip_until_ready) == ("skip", "update", "auto", True)
    with pytest.raises(InvalidInputError, match="max_slots"):
        SnapshotConfig(max_slots="lots")
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("ring")
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = CheckpointClient(co, job, 0, 1, config=cfg, guard=StepGuard.attach(opt))
    _train_step(model, opt)
    assert client.save(1, {"model": model.state_dict()}) is None   # policy skip: no buffer yet, none blocks
    client.prepare({"model": model.state_dict()}).result(scaled(30))
    for step in range(1, 4):
        client.guard.renumber(step - 1)
        _train_step(model, opt)
        h = client.save(step, {"model": model.state_dict()})
        assert h is not None and h.result(scaled(30)).state == "COMMITTED"
        spares = client.snapshotter._spare_fut   # the ring, made by the slot thread once the dir is known
        if spares is not None:
            spares.result(scaled(30))
    st = client.stats
    avail, free, local = memory_budget(co.location)
    total = layout(list(model.state_dict().values()))[1]
    # two in flight (pipelined): the ring from memory, at most what pipelining needs, made up front
    assert st.ring_size == min(ring_size(total, mem_available=avail, dir_free=free, local_ranks=local),
                               pipelined_ring(cfg.max_inflight))
    assert (st.saves, st.committed, st.skipped_by, st.slots_inline) == (3, 3, {"preparing": 1}, 0)
    client.close()


# ---- slots made ahead ----------------------------------------------------------------------------------


def test_slots_are_made_ahead_in_the_background_never_inside_a_save(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("ahead")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, max_slots=4))
    first = snap.save(1, state_dict(0, 1)).result(scaled(30))
    assert first.staging == "private" and first.spare_s > 0     # learnt the dir, then made a slot ahead
    assert snap.stats.slots == 1 and snap.stats.slots_ahead == 1
    for step in range(2, 8):
        res = snap.save(step, state_dict(0, step)).result(scaled(30))
        assert res.error == "" and res.staging == "slot", res
    st = snap.stats
    assert st.slots_inline == 0, "a save created a slot on the training thread"
    assert st.slots == st.slots_ahead <= 4
    for step in (6, 7):   # keep_committed=2: the newest two, from slots reused ahead of time
        assert_same(_restore(co, job, step), state_dict(0, step))
    snap.close()


def test_prepare_makes_the_first_saves_buffer_ahead(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("prep")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    sd = state_dict(0, 1)
    total = layout([t for _, t in flatten(sd)[1]])[1]
    assert not snap._arena.ready(total)
    snap.prepare(sd).result(scaled(30))
    assert snap._arena.ready(total)                    # the dir is not known yet: the private buffer
    buf = snap._arena.buf
    res = snap.save(1, sd).result(scaled(30))
    assert res.error == "" and res.staging == "private"
    assert snap.stats.slots_ahead == 1                  # and the slot for the next, made after the commit
    assert snap._arena.buf is buf or snap._arena.buf.numel() == 0
    assert snap.save(2, state_dict(0, 2)).result(scaled(30)).staging == "slot"
    assert snap.stats.slots_inline == 0
    snap.close()


def test_slot_ring_ensure_spare_respects_the_limit_and_sizes(tmp_path: Path) -> None:
    ring = SlotRing(tmp_path, "j", 0, max_slots=2, register_cuda=False)
    assert ring.ensure_spare(1000) and not ring.ensure_spare(1000)   # one free spare is enough
    s1 = ring.acquire(1000, create=False)
    assert s1 is not None and ring.ensure_spare(1000)
    ring.acquire(1000, create=False)
    assert not ring.ensure_spare(1000) and ring.acquire(1000, create=False) is None   # the ring is full
    ring.release(s1)
    assert ring.ensure_spare(2000) and len(ring) == 2   # the state grew: free s1 is dropped, one made anew
    assert s1 not in ring.slots and not ring.ensure_spare(2000)
    assert (ring.created_ahead, ring.created_inline) == (3, 0)
    ring.close()


# ---- skips are counted ---------------------------------------------------------------------------------


class GatedSink:
    """A Coordinator whose Begin waits for a gate: the background stays busy while the test saves."""

    def __init__(self, co: Any) -> None:
        self.co, self.gate, self.reports = co, threading.Event(), []

    def begin(self, *a: Any, **kw: Any) -> Any:
        assert self.gate.wait(scaled(30))
        return self.co.begin(*a, **kw)

    def commit_shard(self, *a: Any, report: Any = None, **kw: Any) -> Any:
        self.reports.append(report)
        return self.co.commit_shard(*a, report=report, **kw)


def test_a_save_while_the_previous_is_still_writing_is_skipped_and_counted(redis_server,
                                                                          tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("skip")
    sink = GatedSink(co)
    snap = Snapshotter(sink, job, 0, 1, SnapshotConfig(chunk_bytes=4096, policy="skip", staging="private",
                                                       skip_until_ready=True))
    # skip_until_ready never blocks on a buffer: the very first save finds none and makes it in the background
    assert snap.save(1, state_dict(0, 1)) is None
    assert snap.stats.skipped_by == {"preparing": 1}
    snap._prep.result(scaled(30))
    h = snap.save(2, state_dict(0, 2))
    assert h is not None
    assert snap.save(3, state_dict(0, 3)) is None and snap.save(4, state_dict(0, 4)) is None
    assert snap.stats.skipped_by == {"preparing": 1, "writing": 2}   # CPU copies are done: "writing"
    sink.gate.set()
    assert h.result(scaled(30)).skipped_before == 1
    res = snap.save(5, state_dict(0, 5)).result(scaled(30))
    assert res.skipped_before == 2 and sink.reports[-1].skipped_saves == 2   # the agent is told too
    st = snap.stats
    assert (st.saves, st.committed, st.skipped) == (2, 2, 3)
    snap.close()


def _slots_ready(snap: Snapshotter, want: int) -> None:
    from deadlines import wait_until

    wait_until(lambda: snap._ring is not None and snap._ring.free_slots(snap._ring.slots[0].nbytes) >= want
               if snap._ring is not None and snap._ring.slots else False, 30, "spare slots made ahead")


def test_pipelined_saves_are_in_flight_together_and_all_commit_in_order(redis_server, tmp_path: Path) -> None:
    """max_inflight (opt-in: every_step(max_inflight=4)): a save is not skipped because earlier ones are still
    committing; each has its own slot, the one worker commits them in step order, and each restores bit for bit."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id("pipe")
    sink = GatedSink(co)
    sink.gate.set()
    snap = Snapshotter(sink, job, 0, 1, SnapshotConfig(chunk_bytes=4096, policy="skip", max_inflight=3,
                                                       skip_until_ready=True))
    assert snap.save(1, state_dict(0, 1)) is None and snap.stats.skipped_by == {"preparing": 1}
    snap._prep.result(scaled(30))
    assert snap.save(1, state_dict(0, 1)).result(scaled(30)).state == "COMMITTED"   # learns the agent's dir
    _slots_ready(snap, 2)
    sink.gate.clear()   # the background is held in Begin: saves pile up in flight
    handles = [snap.save(step, state_dict(0, step)) for step in (2, 3)]
    _slots_ready(snap, 1)   # the slot thread tops the ring up while those two wait in the background
    handles.append(snap.save(4, state_dict(0, 4)))
    assert all(h is not None for h in handles), snap.stats.skipped_by
    assert snap.stats.in_flight == 3
    assert snap.save(5, state_dict(0, 5)) is None                    # max_inflight reached: skipped, counted
    assert snap.stats.skipped_by == {"preparing": 1, "writing": 1}
    sink.gate.set()
    res = [h.result(scaled(30)) for h in handles]
    assert [r.state for r in res] == ["COMMITTED"] * 3 and [r.staging for r in res] == ["slot"] * 3
    assert res[0].skipped_before == 0 and snap.stats.most_in_flight == 3
    for step in (2, 3, 4):
        assert_same(_restore(co, job, step), state_dict(0, step))
    st = snap.stats
    assert (st.saves, st.committed, st.slots_inline) == (4, 4, 0)
    snap.close()


def test_pipelined_saves_skip_when_every_slot_is_taken_never_the_private_buffer(redis_server,
                                                                               tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("pipefull")
    sink = GatedSink(co)
    sink.gate.set()
    snap = Snapshotter(sink, job, 0, 1, SnapshotConfig(chunk_bytes=4096, policy="skip", max_inflight=4,
                                                       max_slots=2))
    assert snap.save(1, state_dict(0, 1)).result(scaled(30)).state == "COMMITTED"
    _slots_ready(snap, 2)
    sink.gate.clear()
    h2, h3 = snap.save(2, state_dict(0, 2)), snap.save(3, state_dict(0, 3))
    assert h2 is not None and h3 is not None
    assert snap.save(4, state_dict(0, 4)) is None and snap.stats.skipped_by == {"slots": 1}
    sink.gate.set()
    assert [h.result(scaled(30)).staging for h in (h2, h3)] == ["slot", "slot"]
    assert_same(_restore(co, job, 3), state_dict(0, 3))
    snap.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pipelined_saves_go_on_when_the_agent_holds_every_slot(redis_server, tmp_path: Path, caplog,
                                                               device: str) -> None:
    """Issue 21: a ring no larger than the agent's retention (cut by memory, or max_slots) has every slot
    holding a stored checkpoint once the saves in flight commit, and the agent frees one only when a newer
    checkpoint commits. Such a save goes through the private buffer instead of being skipped: checkpoints go
    on every step (before: skipped "slots" for good, found on the 2-core VM with a 2 GiB state), said once.
    On CUDA (bench/gpu_run.sh) the same with the state on the GPU: device-to-host copies into slots and the
    pinned private buffer, source fingerprints."""
    import logging
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("pipeshort")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, policy="skip", max_inflight=2,
                                                     max_slots=2, skip_until_ready=True))
    got: dict[int, str] = {}
    with caplog.at_level(logging.WARNING, logger="checkpoint.snapshot"):
        for step in range(10, 34):     # (two-digit steps: the state's plain values keep their size)
            h = snap.save(step, _on(state_dict(0, step), device))
            if h is None:
                if snap._prep is not None:
                    snap._prep.result(scaled(30))
                if snap._spare_fut is not None:
                    snap._spare_fut.result(scaled(30))
                continue
            res = h.result(scaled(30))
            assert res.state == "COMMITTED", res
            got[step] = res.staging
    skipped = snap.stats.skipped_by
    seen = " ".join(f"{k}{v[0]}" for k, v in sorted(got.items()))    # e.g. "10p 12s 13s 15p ...": step, staging
    assert "slots" not in skipped and skipped.get("preparing", 0) <= 3, (skipped, seen)   # buffers made once
    assert len(got) >= 24 - 3 and max(got) == 33, got
    assert set(got.values()) == {"slot", "private"}, got     # slots whenever the agent has freed one
    assert sum("hold checkpoints the agent keeps" in r.getMessage() for r in caplog.records) == 1
    assert_same(_restore(co, job, 33), state_dict(0, 33))
    snap.close()


def test_pipelined_ring_is_made_up_front_and_no_slot_is_made_in_steady_state(redis_server,
                                                                             tmp_path: Path) -> None:
    """Pipelined with max_slots="auto": the slot thread fills the ring (sized for max_inflight, not the
    memory rule's 16) once the agent's dir is known; after that saves only reuse slots: none is made (a
    pinned slot made during training stalled the H200's steps) and the slot thread gets no more work."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("pipering")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, policy="skip", max_inflight=3,
                                                     max_slots="auto", skip_until_ready=True))
    # steps 10-30: the state's plain values (the step) keep their size, so the layout stays the same
    assert snap.save(10, state_dict(0, 10)) is None   # no buffer yet: skipped, made in the background
    snap._prep.result(scaled(30))
    assert snap.save(10, state_dict(0, 10)).result(scaled(30)).state == "COMMITTED"   # learns the agent's dir
    fill = snap._spare_fut
    assert fill is not None
    fill.result(scaled(60))
    ring = snap._ring
    assert ring is not None and snapshot_mod.pipelined_ring(3) == 3 + snapshot_mod.HELD_SLOTS + 1
    assert len(ring) == ring.max_slots == snap.stats.ring_size <= snapshot_mod.pipelined_ring(3)
    made = snap.stats.slots_ahead + snap.stats.slots_inline
    for step in range(11, 31):
        h = snap.save(step, state_dict(0, step))
        assert h is not None, (step, snap.stats.skipped_by)
        assert h.result(scaled(30)).staging == "slot"
    assert snap.stats.slots_ahead + snap.stats.slots_inline == made and snap.stats.slots_inline == 0
    assert snap._spare_fut is fill   # steady state: not even a no-op task for the slot thread
    assert_same(_restore(co, job, 30), state_dict(0, 30))
    snap.close()


def test_max_inflight_must_be_a_positive_int() -> None:
    # every_step() keeps three saves in flight (with one, the host a step ahead skips most saves; with two,
    # a few at a short step); issue 21
    assert SnapshotConfig.every_step().max_inflight == 3 and SnapshotConfig().max_inflight == 1
    assert SnapshotConfig.every_step(max_inflight=4).max_inflight == 4
    for bad in (0, "4", True):
        with pytest.raises(InvalidInputError, match="max_inflight"):
            SnapshotConfig(max_inflight=bad)


# ---- the COPIES stage orders the update after the copy (forced device path) ---------------------------


class LateCopy:
    """A fake CUDA event whose copy runs only when waited for: a stream wait (`_stream_wait`) or the
    background's synchronize, which also waits for the stream wait (as the device's copy would be done by
    then). If the update ran first, the copy reads the updated weights."""

    def __init__(self, copy: Any) -> None:
        self.copy, self.done, self.waited = copy, False, threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        with self.lock:
            if not self.done:
                self.copy()
                self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        assert self.waited.wait(scaled(30)), "nothing ever waited for the copy"
        self.run()


class Trace:
    name, phase = "trace.gate", Phase.GATE

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.log = weight, []

    def run(self, ctx: StepContext) -> Veto | None:
        self.log.append(("gate", ctx.step))
        return None


class Copies(list):
    log: list[Any]


@pytest.fixture()
def late_copies(monkeypatch: pytest.MonkeyPatch) -> Copies:
    """Snapshotter._copy as on a device: tensors the optimizer changes are copied late (LateCopy), the
    others at once (their group is ordered before save returns); `_stream_wait` runs a late copy."""
    made = Copies()

    def fake_copy(self: Snapshotter, tensors: list[torch.Tensor], offsets: list[int], arena: torch.Tensor,
                  block: str = "copy", late: list[bool] | None = None, cut: Any = None,
                  transfer_check: bool = True, plan: Any = None, ph: Any = None) -> tuple[list[Any], dict]:
        src: dict[Any, Any] = {}
        if cut is not None:   # source checksums: taken from the tensors now, before the update can run
            views = snapshot_mod._piece_views(tensors, cut)
            per = torch.empty(len(views), 2, dtype=torch.int64)
            snapshot_mod.fingerprint_tensors_async(views, per_tensor_out=per)
            src[("pieces", torch.device("cpu"))] = (list(range(len(cut))), per)
        deferred = [i for i in range(len(tensors)) if late is not None and late[i]]
        for i, t in enumerate(tensors):
            if i not in deferred and t.numel():
                snapshot_mod._dst(arena, offsets[i], t).copy_(t)

        def copy_late() -> None:
            for i in deferred:
                snapshot_mod._dst(arena, offsets[i], tensors[i]).copy_(tensors[i])
        ev = LateCopy(copy_late)
        made.append(ev)
        if block == "update" and deferred:
            self._inflight.append((torch.device("cuda", 0), ev))
        else:
            ev.run()
            ev.waited.set()
        return [ev], src

    def fake_wait(dev: torch.device, ev: LateCopy) -> None:
        made_log.append(("wait", id(ev)))
        ev.run()
        ev.waited.set()

    made_log: list[Any] = []
    monkeypatch.setattr(Snapshotter, "_copy", fake_copy)
    monkeypatch.setattr(snapshot_mod, "_stream_wait", fake_wait)
    made.log = made_log
    return made


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, model.in_features if isinstance(model, nn.Linear) else 8, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 4), nn.BatchNorm1d(4)
        self.in_features = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@pytest.mark.parametrize("checksums", ["host", "source"])
def test_the_update_waits_for_the_copy_and_only_the_update(redis_server, tmp_path: Path,
                                                           late_copies: Copies, checksums: str) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id("order")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = StepGuard.attach(opt)
    gate = Trace(model.fc.weight)
    guard.add(gate)
    client = CheckpointClient(co, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096, checksums=checksums),
                              guard=guard)  # block auto
    _train_step(model, opt, 0)
    for step in (1, 2, 3):
        expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optim": _clone(opt.state_dict())}
        h = client.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        ev = late_copies[-1]
        assert not ev.done, "save waited for the copy of the optimizer's tensors"
        model(torch.randn(4, 8)).pow(2).mean().backward()   # the forward changes BatchNorm's running stats
        assert not ev.done, "the forward and backward ran while the copy was in flight"
        opt.step()                                          # COPIES: the stream wait, then the update
        opt.zero_grad()
        assert ev.done and late_copies.log[-1] == ("wait", id(ev))
        assert gate.log[-1] == ("gate", step + 1)
        assert h.result(scaled(30)).state == "COMMITTED"
        co.scrub(0.0, 1 << 30)                              # source checksums: the host bytes match them
        assert_same(_restore(co, job, step), expected)      # pre-step weights, moments and running stats
    assert len(late_copies.log) == 3                        # one wait per save
    client.close()


def test_without_the_copies_stage_the_update_would_race_the_copy(redis_server, tmp_path: Path,
                                                                  late_copies: Copies) -> None:
    """The negative control: the same forced path with the stage taken off the guard saves updated
    weights, so the test above would catch an update that did not wait."""
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("race")
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = StepGuard.attach(opt)
    client = CheckpointClient(co, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096, block="update"),
                              guard=guard)
    guard.remove(client.snapshotter.copy_fence().name)
    _train_step(model, opt, 0)
    before = model.weight.detach().clone()
    h = client.save(1, {"model": model.state_dict()})
    _train_step(model, opt, 1)                              # nothing makes it wait
    client.snapshotter.order_before_update()                # the copy runs now, after the update
    assert h.result(scaled(30)).state == "COMMITTED"
    assert not torch.equal(_restore(co, job, 1)["model"]["weight"], before)
    client.close()


def test_which_tensors_only_the_update_waits_for() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt)
    _, named = flatten({"model": model.state_dict(), "optim": opt.state_dict()})
    mine = optimizer_storages(opt)
    late = {path.removeprefix("state_dict/"): t.untyped_storage().data_ptr() in mine for path, t in named}
    assert late["model/fc.weight"] and late["model/bn.bias"]
    assert not late["model/bn.running_mean"] and not late["model/bn.num_batches_tracked"]
    moments = [v for p, v in late.items() if p.startswith("optim/state/") and "exp_avg" in p]
    assert len(moments) == 8 and all(moments)


def test_restore_and_close_order_after_copies_in_flight(redis_server, tmp_path: Path,
                                                        late_copies: Copies) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("rclose")
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    client = CheckpointClient(co, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096),
                              guard=StepGuard.attach(opt))
    _train_step(model, opt)
    first = client.save(1, {"model": model.state_dict()})
    _train_step(model, opt)                                 # the update orders itself after the copy
    assert first.result(scaled(30)).state == "COMMITTED"
    second = client.save(2, {"model": model.state_dict()})  # left in flight: no step follows
    assert client.snapshotter._inflight
    client.restore(1)                                       # restore orders itself after that copy
    assert not client.snapshotter._inflight and late_copies[-1].done
    assert second.result(scaled(30)).state == "COMMITTED"
    _train_step(model, opt)
    client.save(3, {"model": model.state_dict()})
    client.close()                                          # so does close
    assert late_copies[-1].done


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def _on(sd: Any, device: str) -> Any:
    """`sd` with its tensors on `device` (plain values as they are)."""
    if isinstance(sd, torch.Tensor):
        return sd.to(device)
    if isinstance(sd, dict):
        return {k: _on(v, device) for k, v in sd.items()}
    return sd


def _restore(co: Any, job: str, step: int) -> Any:
    from checkpoint.locations import dir_store_for
    from checkpoint.restore import restore_from_plan

    return restore_from_plan(co.restore_plan(job, step, 0), 0, dir_store_for)


# ---- CUDA: the real streams ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_forward_buffers_are_ordered_at_once_weights_only_before_the_update(redis_server,
                                                                                 tmp_path: Path) -> None:
    """BatchNorm's running stats change in the next forward: their copy is ordered before save returns;
    the weights and AdamW's moments are copied while that forward runs and the update waits for them."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id("cudabn")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096)).cuda()   # 64 MiB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    client = CheckpointClient(co, job, 0, 1, guard=StepGuard.attach(opt), config=SnapshotConfig())
    x = torch.randn(256, 4096, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    for step in range(1, 4):
        expected = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "optim": _clone(opt.state_dict())}
        expected["optim"] = {"state": {k: {n: t.cpu() for n, t in s.items()}
                                       for k, s in expected["optim"]["state"].items()}}
        h = client.save(step, {"model": model.state_dict(), "optim": {"state": opt.state_dict()["state"]}})
        model(x).pow(2).mean().backward()      # running stats change at once; the weights wait for the update
        opt.step()
        opt.zero_grad()
        res = h.result(scaled(60))
        assert res.state == "COMMITTED", res.error
        assert_same(_restore(co, job, step), expected)
    assert client.stats.slots_inline == 0
    client.close()


def test_destination_views_are_kept_per_slot_and_layout_only(redis_server, tmp_path: Path) -> None:
    from checkpoint.snapshot import copy_all

    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dsts")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, max_inflight=2))
    assert snap.save(1, state_dict(0, 1)).result(scaled(30)).state == "COMMITTED"   # learns the agent's dir
    tensors = [t for _, t in flatten(state_dict(0, 2))[1]]
    offsets, total = layout(tensors)
    ring = snap._ring_for(total)
    assert ring is not None
    slot = ring.acquire(total)
    dev = torch.device("cpu")
    views = snap._dsts(dev, slot.tensor, tensors, offsets)
    assert snap._dsts(dev, slot.tensor, tensors, offsets) is views          # kept for the slot
    copy_all(views, tensors, list(range(len(tensors))))
    for t, off in zip(tensors, offsets):
        assert torch.equal(snapshot_mod._dst(slot.tensor, off, t), t)
    private = torch.zeros(total, dtype=torch.uint8)
    assert snap._dsts(dev, private, tensors, offsets) is not snap._dsts(dev, private, tensors, offsets)
    other = tensors[:-1]
    snap._dsts(dev, slot.tensor, other, layout(other)[0])                    # a new layout drops the old views
    assert views not in snap._dst_cache.values()
    ring.release(slot)
    snap.close()
    assert snap._dst_cache == {}


def test_a_slot_made_ahead_gets_its_views_and_zero_gaps_before_its_first_save(redis_server,
                                                                              tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("fresh")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, max_slots=8))
    assert snap.save(1, state_dict(0, 1)).result(scaled(30)).state == "COMMITTED"
    tensors = [t for _, t in flatten(state_dict(0, 2))[1]]
    offsets, total = layout(tensors)
    ring = snap._ring_for(total)
    used = ring.acquire(total)
    dev = torch.device("cpu")
    snap._dsts(dev, used.tensor, tensors, offsets)         # the layout is known now
    snap._zero_gaps(used.tensor, tensors, offsets, total)
    fresh = ring.ensure_spare(total, want=8)
    assert fresh is not None
    snap._ready_fresh(fresh)
    ptr = fresh.tensor.data_ptr()
    assert snap._zeroed[ptr] == (tuple(offsets), total)    # a new slot file is all zero bytes
    views = snap._dst_cache[ptr]
    assert snap._dsts(dev, fresh.tensor, tensors, offsets) is views
    for v, t, off in zip(views, tensors, offsets):
        want = snapshot_mod._dst(fresh.tensor, off, t) if t.numel() else None
        assert (v is None and want is None) or (v.data_ptr() == want.data_ptr() and v.dtype == want.dtype
                                                and v.shape == want.shape)
    ring.release(used)
    snap.close()


def test_a_save_reuses_its_layouts_plan_and_a_new_layout_gets_a_new_one(redis_server, tmp_path: Path) -> None:
    """Issue 21: a save computes the offsets, manifest entries, pieces and copy order once per layout (a plan
    kept while the tensors' addresses, dtypes, shapes and paths stay the same); an every-step first save that
    finds nothing ready is skipped and counted and the plan thread makes that plan, which the next save
    uses; the saved bytes stay exactly the state's."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id("plan")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096, checksums="source", policy="skip",
                                                     skip_until_ready=True, fingerprint_threads=1))
    w, h = torch.randn(3000), torch.randn(500).to(torch.bfloat16)

    def sd(weight: torch.Tensor) -> dict[str, Any]:
        return {"model": {"w": weight, "h": h}, "pos": 7}

    assert snap.save(1, sd(w)) is None and snap.stats.skipped_by == {"preparing": 1}
    snap._prep.result(scaled(30))
    snap._plan_fut.result(scaled(30))
    made = snap._plan
    assert made is not None and made.cut is not None and made.total >= 3000 * 4 + 500 * 2
    client = CheckpointClient(co, job, 0, 1)
    for step in (2, 3):
        w.add_(1.0)
        want = {"model": {"w": w.clone(), "h": h.clone()}, "pos": 7}
        res = snap.save(step, sd(w)).result(scaled(30))
        assert res.state == "COMMITTED" and res.checksums == "source", res.error
        assert snap._plan is made            # the plan thread's plan, reused
        assert_same(client.restore(step), want)
    # the same bytes in another shape: a new plan (the manifest says the new shape)
    w2 = w.reshape(1000, 3)
    res = snap.save(4, sd(w2)).result(scaled(30))
    assert res.state == "COMMITTED" and snap._plan is not made and snap._plan.entries[0][2] == (1000, 3)
    assert_same(client.restore(4), {"model": {"w": w2.clone(), "h": h.clone()}, "pos": 7})
    while co.scrub_pending():   # the shared Redis holds no unchecked shard after this test (a restarted
        co.scrub(2.0, 1 << 20)  # agent's queue in test_checkpoint_source_sums counts them)
    snap.close()
    client.close()


def test_a_devices_share_of_a_mixed_state_is_kept_in_the_plan() -> None:
    """Issue 21: a GPU state with plain values on the host is copied per device; each device's offsets, late
    flags and pieces are cut out once per plan (the same lists at every save), its tensors picked by one
    getter, and they are exactly the per-index subsets."""
    tensors = [torch.zeros(n) for n in (5, 1, 7, 3)]
    offsets, total = layout(tensors)
    cut = snapshot_mod.pieces(offsets, [t.nbytes for t in tensors], 16)
    plan = snapshot_mod._SavePlan((), offsets, total, [], {}, True, cut=cut)
    plan.late, plan.late_key = [True, False, True, False], ("opt",)
    dev = torch.device("cpu")
    for idx in ([0, 2], [3]):
        mine = [k for k, p in enumerate(cut) if p.tensor in idx]
        got = snapshot_mod._dev_subsets(plan, dev, idx, mine, tensors, offsets, plan.late, cut)
        want = ([tensors[i] for i in idx], [offsets[i] for i in idx], [plan.late[i] for i in idx],
                [cut[k] for k in mine])
        assert all(a is b for a, b in zip(got[0], want[0])) and list(got[1:]) == list(want[1:])
        again = snapshot_mod._dev_subsets(plan, dev, idx, mine, list(tensors), offsets, plan.late, cut)
        assert again[1] is got[1] and again[2] is got[2] and again[3] is got[3]   # kept
        plan.subs.clear()
    # lists that are not the plan's: cut out afresh, nothing kept
    other = list(offsets)
    got = snapshot_mod._dev_subsets(plan, dev, [1], [], tensors, other, None, None)
    assert got == ([tensors[1]], [offsets[1]], None, None) and not plan.subs


@pytest.mark.gpu
@pytest.mark.parametrize("gather", [1 << 20, 0])
def test_cuda_gathered_copies_restore_bit_identical_with_the_update_ordered(redis_server, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            gather: int) -> None:
    """Gathered copies (checkpoint.gather: a 1 MiB bounce buffer, so the 4 MiB weight is split across chunks)
    against per-tensor copies (gather_bytes=0): fp32 weights, AdamW's moments and its step counts on the
    device (fused), BatchNorm's int64 counter, bf16, bool, int64, 64 small odd-sized tensors and a
    non-contiguous tensor (per-tensor fallback); the tensors outside the optimizer change in place right
    after save returns, the optimizer's in the update: every restore is bit-identical to the state at the
    save, and the scrub finds the host bytes equal to the source checksums, with each save's copies held
    back on the device (`ckpt_support.side_stream_late`). The gathered plan and the bounce are made ahead
    by prepare() (the plan thread) and the saves use them."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id(f"cudagather{gather}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    extra = {"bf16": torch.randn(333, device="cuda").to(torch.bfloat16),
             "mask": torch.rand(13, device="cuda") > 0.5,
             "count": torch.arange(7, device="cuda"), "nc": torch.randn(64, 48, device="cuda").t(),
             "small": {f"s{i}": torch.randn(17 + i, device="cuda") for i in range(64)}}   # odd sizes
    client = CheckpointClient(co, job, 0, 1, guard=StepGuard.attach(opt),
                              config=SnapshotConfig(gather_bytes=gather, checksums="source",
                                                    chunk_bytes=1 << 20))
    x = torch.randn(256, 1024, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

    def on_host(sd: Any) -> Any:
        if isinstance(sd, torch.Tensor):
            return sd.detach().cpu().clone()
        return {k: on_host(v) for k, v in sd.items()} if isinstance(sd, dict) else sd

    state = lambda: {"model": model.state_dict(), "optim": {"state": opt.state_dict()["state"]},  # noqa: E731
                     "extra": extra}
    client.prepare(state()).result(scaled(120))
    ahead = list(client.snapshotter._plan.gathers.values())   # made on the plan thread, with the bounce
    assert bool(ahead) == bool(gather) and bool(client.snapshotter._bounce) == bool(gather)
    delayed = side_stream_late(monkeypatch).sleeps
    for step in range(1, 5):
        sd = state()
        expected = on_host(sd)
        h = client.save(step, sd)
        extra["count"].add_(1)                  # in place, right away: ordered after its copy (ev_early)
        extra["mask"].logical_not_()
        extra["nc"].mul_(2)
        extra["small"]["s5"].add_(1)
        model(x).pow(2).mean().backward()      # running stats change now; the weights wait for the update
        opt.step()
        opt.zero_grad()
        res = h.result(scaled(60))
        assert res.state == "COMMITTED", res.error
        assert_same(_restore(co, job, step), expected)
    assert len(delayed) >= 8, delayed   # fingerprints and copies held back in every save
    plans = list(client.snapshotter._plan.gathers.values())
    if gather:
        gp = plans[-1]
        n_tensors = sum(1 for _ in flatten(sd)[1])
        assert gp.stats.tensors == 1 and gp.stats.chunks >= 4 and gp.n_ops < n_tensors // 2, gp.stats
        assert gp.bounce_bytes <= gather and gp is ahead[-1]   # the saves used the plan made ahead
    else:
        assert not plans
    co.on_job_event(job, 4, "checks_clean", 1.0)
    while co.scrub_pending():
        co.scrub(2.0, 1 << 30)
    assert co.stats["scrub_failures"] == 0 and co.info(job, 4).state == "VERIFIED"
    assert client.stats.slots_inline == 0
    client.close()


@pytest.mark.gpu
@pytest.mark.parametrize("copy_thread", [True, False])
@pytest.mark.parametrize("with_buffers", [True, False])
def test_cuda_copies_enqueued_by_the_copy_thread_restore_bit_identical(redis_server, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      copy_thread: bool,
                                                                      with_buffers: bool) -> None:
    """`SnapshotConfig.copy_thread`: the copies only the update waits for are enqueued by the copy thread
    (with no early group, the pieces' fingerprints too), two saves in flight, the next forward and update
    right after each save (its copies held back on the device, `ckpt_support.side_stream_late`): every restore is
    bit-identical to the state at its save and the scrub finds the bytes equal to the source checksums.
    Then an enqueue that fails on the copy thread fails that save with its error, the update does not hang,
    and the next save commits."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=8), job_id(f"cudacopyq{int(copy_thread)}")
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(1024, 1024), nn.Linear(1024, 512)]
    if with_buffers:
        layers.append(nn.BatchNorm1d(512))   # its running stats: the early group, copied by save()
    model = nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    client = CheckpointClient(co, job, 0, 1, guard=StepGuard.attach(opt),
                              config=SnapshotConfig.every_step(max_inflight=2, copy_thread=copy_thread,
                                                               checksums="source", chunk_bytes=1 << 20,
                                                               policy="wait"))
    x = torch.randn(256, 1024, device="cuda")

    def train() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    train()
    state = lambda: {"model": model.state_dict(), "optim": {"state": opt.state_dict()["state"]}}  # noqa: E731
    client.prepare(state()).result(scaled(120))
    threads: list[str] = []
    real_copy_all = snapshot_mod.copy_all

    def spy(dsts: Any, srcs: Any, idx: Any) -> None:
        threads.append(threading.current_thread().name)
        real_copy_all(dsts, srcs, idx)
    monkeypatch.setattr(snapshot_mod, "copy_all", spy)
    delayed = side_stream_late(monkeypatch).sleeps
    handles, expected = [], []
    for step in range(1, 7):
        sd = state()
        expected.append(_clone_to_host(sd))
        handles.append((step, client.save(step, sd)))
        train()                      # the forward at once; the update waits for the copies
    for (step, h), want in zip(handles, expected):
        assert h is not None
        res = h.result(scaled(60))
        assert res.state == "COMMITTED", res.error
        assert_same(_restore(co, job, step), want)
    assert len(delayed) >= 12, delayed   # fingerprints and copies held back in every save
    on_copier = [t for t in threads if t.startswith("sdcw-ckpt-copy")]
    assert bool(on_copier) == copy_thread, threads
    co.on_job_event(job, 6, "checks_clean", 1.0)
    while co.scrub_pending():
        co.scrub(2.0, 1 << 30)
    assert co.stats["scrub_failures"] == 0 and co.info(job, 6).state == "VERIFIED"

    if copy_thread:   # a failing enqueue on the copy thread: that save fails, nothing hangs, the next commits
        def broken(dsts: Any, srcs: Any, idx: Any) -> None:
            if threading.current_thread().name.startswith("sdcw-ckpt-copy"):
                raise RuntimeError("injected enqueue failure")
            real_copy_all(dsts, srcs, idx)
        monkeypatch.setattr(snapshot_mod, "copy_all", broken)
        h = client.save(7, state())
        train()
        assert h is not None
        res = h.result(scaled(60))
        assert res.state != "COMMITTED" and "injected enqueue failure" in res.error
        monkeypatch.setattr(snapshot_mod, "copy_all", real_copy_all)
        want = _clone_to_host(state())
        h = client.save(8, state())
        train()
        assert h is not None and h.result(scaled(60)).state == "COMMITTED"
        assert_same(_restore(co, job, 8), want)
    client.close()


def _clone_to_host(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return sd.detach().cpu().clone()
    return {k: _clone_to_host(v) for k, v in sd.items()} if isinstance(sd, dict) else sd


def test_the_updates_host_waits_for_the_copy_thread_are_counted(redis_server, tmp_path: Path,
                                                                monkeypatch) -> None:
    """Issue 21: an optimizer step that finds the copy thread still enqueueing a save's copies waits for it
    on the host; `stats.update_waits` / `update_wait_s` count it (the H200's every-step runs read them), and
    the device wait is still ordered after it."""
    import concurrent.futures

    class Late(concurrent.futures.Future):
        """Not done when first asked; done by the wait itself (the copy thread finishing its enqueue)."""

        def done(self) -> bool:
            return False

        def exception(self, timeout=None):  # type: ignore[no-untyped-def]
            if not super().done():
                self.set_result(None)
            return super().exception(timeout)

    co, job = node(redis_server.port, tmp_path, "n0"), job_id("updwait")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    ordered: list[Any] = []
    monkeypatch.setattr(snapshot_mod, "_stream_wait", lambda dev, ev: ordered.append(ev))
    late = snapshot_mod._QueuedCopy(None, "event", Late())
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    early = snapshot_mod._QueuedCopy(None, "event2", done)
    snap._inflight = [(torch.device("cpu"), late), (torch.device("cpu"), early)]
    snap.order_before_update()
    st = snap.stats
    assert st.update_waits == 1 and st.update_wait_s >= 0.0, st     # the late one only
    assert ordered == [late, early] and snap._inflight == []
    snap.order_before_update()                                       # nothing in flight: nothing counted
    assert snap.stats.update_waits == 1
    snap.close()
