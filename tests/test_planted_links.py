"""Issue 20: the memory dir is shared with the ranks' group (mode 2770), so a member can plant a symbolic link
inside it under a blob's, a job directory's or a spare's name. `DirStore` works fd-relative from one O_NOFOLLOW
fd of its root: a planted link is refused (PlantedLinkError, counted in `refused`), never followed. The agent
neither reads, truncates, overwrites nor removes what the link points at."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpoint.drainer import _mapped
from checkpoint.shm_store import DirStore, ShmStore
from sdcwatch.safe_fs import PlantedLinkError

SECRET = b"root's secret, not a checkpoint\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the store that a planted link points at: it must come out unread and untouched."""
    d = tmp_path / "outside"
    d.mkdir()
    f = d / "secret"
    f.write_bytes(SECRET)
    return f


def untouched(victim: Path) -> None:
    assert victim.read_bytes() == SECRET, "the link's target was written or truncated"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["secret"], "something was made beside it"


def test_a_link_under_a_blob_name_is_never_read(tmp_path: Path, victim: Path) -> None:
    store = ShmStore(tmp_path / "memory")
    store.put("job/000000000005/rank-0", b"shard")
    (tmp_path / "memory" / "job" / "000000000005" / "rank-1").symlink_to(victim)
    key = "job/000000000005/rank-1"
    with pytest.raises(PlantedLinkError, match="rank-1"):
        store.get(key)
    with pytest.raises(OSError):   # an OSError: readers fall back to another copy
        store.readinto(key, 0, memoryview(bytearray(64)))
    with pytest.raises(PlantedLinkError):
        store.size(key)
    assert not store.exists(key)
    assert store.list("job/") == ["job/000000000005/rank-0"], "a link is not a blob"
    assert store.used_bytes() == len(b"shard"), "the target's bytes are not counted"
    with _mapped(store, key, len(SECRET)) as view:
        assert view is None, "the drainer never maps (nor pins) a link's target"
    assert store.refused >= 4
    untouched(victim)


def test_writing_deleting_and_purging_over_links_leave_the_targets_alone(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "memory"
    store = ShmStore(root, spares=2)
    step = root / "job" / "000000000007"
    store.put("job/000000000007/rank-0", b"a")
    (step / "rank-1").symlink_to(victim)
    assert store.put("job/000000000007/rank-1", b"new") == 3   # replaces the link itself (rename)
    assert not (step / "rank-1").is_symlink() and store.get("job/000000000007/rank-1") == b"new"
    (step / "rank-2").symlink_to(victim)
    assert store.delete("job/000000000007/rank-2")              # the name goes, the target stays
    assert not os.path.lexists(step / "rank-2")
    (step / "rank-3").symlink_to(victim)
    (step / f"rank-4.tmp-{os.getpid()}-999").symlink_to(victim)
    store.purge("job/000000000007/")
    assert not step.exists()
    untouched(victim)
    # a planted spare: never renamed into place and written through
    (root / ".spares").mkdir(exist_ok=True)
    (root / ".spares" / "spare-planted").symlink_to(victim)
    store.put("job/000000000008/rank-0", b"x" * 100)
    assert store.get("job/000000000008/rank-0") == b"x" * 100
    untouched(victim)


def test_a_link_in_place_of_a_directory_is_refused(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "memory"
    store = DirStore(root)
    (root / "job").symlink_to(victim.parent)
    with pytest.raises(PlantedLinkError, match="job"):
        store.put("job/000000000001/rank-0", b"shard")
    with pytest.raises(PlantedLinkError):
        store.get("job/000000000001/rank-0")
    assert store.list("job/") == [] and store.list() == []
    assert store.purge("job/") == 1 and not os.path.lexists(root / "job"), "the link's name removed, only"
    assert store.sweep_temp(0, 1e12) == 0
    untouched(victim)


def test_a_rank_slot_that_is_a_link_is_not_published(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "memory"
    store = ShmStore(root)
    slot = root / ".slots" / "job" / "rank-0-slot-0"
    slot.parent.mkdir(parents=True)
    slot.symlink_to(victim)
    with pytest.raises(PlantedLinkError):
        store.link_in("job/000000000003/rank-0", slot)
    assert not store.exists("job/000000000003/rank-0") and store.list() == []
    untouched(victim)


def test_the_root_itself_swapped_for_a_link_is_refused(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "memory"
    root.symlink_to(victim.parent)
    with pytest.raises(PlantedLinkError):
        DirStore(root, create=False).get("secret")
    untouched(victim)


def test_the_agent_serves_no_planted_link_to_a_peer(short_tmp: Path, victim: Path) -> None:
    """The real agent: a link planted in its memory dir under a blob's name, asked for over PeerStore (which
    any local client of the socket reaches), is refused; the target's bytes never leave it."""
    import grpc

    from agent_harness import AgentProcess
    from checkpoint.shm_store import default_shm_root
    from proto.sdcwatch.v1 import peer_pb2 as ppb
    from proto.sdcwatch.v1 import peer_pb2_grpc as ppb_grpc
    from sdcwatch.safe_fs import remove_tree

    state = short_tmp / "s"
    agent = AgentProcess(state).start()
    memory = default_shm_root(state)
    try:
        (memory / "job").mkdir()
        (memory / "job" / "rank-0").symlink_to(victim)
        with grpc.insecure_channel(agent.target) as ch:
            stub = ppb_grpc.PeerStoreStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.GetBlob(ppb.GetBlobRequest(key="job/rank-0", to_end=True), timeout=30))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
            assert SECRET.decode().strip() not in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.StatBlob(ppb.StatBlobRequest(key="job/rank-0"), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
            assert list(stub.ListBlobs(ppb.ListBlobsRequest(prefix="job/"), timeout=30).keys) == []
            assert stub.DeleteBlob(ppb.DeleteBlobRequest(key="job/rank-0"), timeout=30).deleted
        untouched(victim)
    finally:
        assert agent.stop(timeout=30) == 0, agent.log()
        remove_tree(memory.parent)
    untouched(victim)


def test_a_link_planted_in_place_of_the_spares_dir_stops_no_put(tmp_path: Path, victim: Path) -> None:
    """The memory dir's own entries can be renamed by any group member: `.spares` swapped for a link must
    neither be written through nor make puts fail (recycling is simply off)."""
    root = tmp_path / "memory"
    store = ShmStore(root, spares=2)
    (root / ".spares").symlink_to(victim.parent)
    store.put("job/000000000001/rank-0", b"a" * 10)
    assert store.delete("job/000000000001/rank-0")     # not recycled into the link's target
    store.put("job/000000000002/rank-0", b"b" * 10)
    assert store.get("job/000000000002/rank-0") == b"b" * 10
    assert store.refused >= 1
    untouched(victim)
