"""BlobStore conformance: the same behaviour from every store (memory, directory/shm, Redis, S3 via moto's
HTTP server)."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis

from checkpoint.blobstore import BlobStore
from checkpoint.errors import InvalidInputError
from checkpoint.memory_store import MemoryStore
from checkpoint.names import validate_job_id, validate_key
from checkpoint.redis_store import RedisStore
from checkpoint.shm_store import DirStore, ShmStore
from tier_support import moto_s3  # noqa: F401 - fixture


@pytest.fixture(params=["memory", "dir", "dir-fsync", "shm", "redis", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    kind = request.param
    if kind == "memory":
        return MemoryStore()
    if kind == "dir":
        return DirStore(tmp_path / "blobs")
    if kind == "dir-fsync":
        return DirStore(tmp_path / "blobs", fsync=True)
    if kind == "s3":
        return request.getfixturevalue("moto_s3").store()
    if kind == "shm":
        return ShmStore(tmp_path / "shm")
    server = request.getfixturevalue("redis_server")
    client = redis.Redis(port=server.port)
    return RedisStore(client, prefix=f"t-{uuid.uuid4().hex[:8]}:")


def test_is_a_blobstore(store: BlobStore) -> None:
    assert isinstance(store, BlobStore)


def test_put_get_round_trip_and_ranges(store: BlobStore) -> None:
    data = bytes(range(256)) * 40
    assert store.put("job/000000000001/rank-00000.bin", data) == len(data)
    key = "job/000000000001/rank-00000.bin"
    assert store.get(key) == data
    assert store.get(key, 100, 50) == data[100:150]
    assert store.get(key, len(data) - 10, 100) == data[-10:]  # clipped at the end
    assert store.get(key, len(data)) == b""
    buf = bytearray(64)
    assert store.readinto(key, 1000, memoryview(buf)) == 64
    assert bytes(buf) == data[1000:1064]
    assert store.size(key) == len(data)
    assert store.exists(key)


def test_streamed_put_equals_joined(store: BlobStore) -> None:
    parts = [b"a" * 10, memoryview(b"b" * 5), bytearray(b"c" * 7)]
    assert store.put("s/blob", parts) == 22
    assert store.get("s/blob") == b"a" * 10 + b"b" * 5 + b"c" * 7


def test_put_replaces(store: BlobStore) -> None:
    store.put("k/x", b"old-old-old")
    store.put("k/x", b"new")
    assert store.get("k/x") == b"new"


def test_failed_streamed_put_leaves_old_blob(store: BlobStore) -> None:
    store.put("k/y", b"intact")

    def broken():
        yield b"partial"
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        store.put("k/y", broken())
    assert store.get("k/y") == b"intact"
    assert store.list("k/") == ["k/y"]


def test_list_by_prefix_and_delete(store: BlobStore) -> None:
    for k in ["a/1/x", "a/1/y", "a/2/x", "ab/1", "b/1"]:
        store.put(k, b"1")
    assert store.list("a/") == ["a/1/x", "a/1/y", "a/2/x"]
    assert store.list("a/1/") == ["a/1/x", "a/1/y"]
    assert store.list("a") == ["a/1/x", "a/1/y", "a/2/x", "ab/1"]
    assert store.list("zzz/") == []
    assert store.delete("a/1/x") is True
    assert store.delete("a/1/x") is False
    assert not store.exists("a/1/x")
    assert store.list("a/1/") == ["a/1/y"]


def test_deleting_a_key_that_only_prefixes_others_deletes_nothing(store: BlobStore) -> None:
    # the file store keeps "a/1/y" under a directory "a/1": deleting the key "a/1" is a key not there (a
    # fuzzed PeerStore.DeleteBlob of "a" got INTERNAL from unlinking that directory)
    store.put("a/1/y", b"1")
    assert store.delete("a/1") is False and store.delete("a") is False
    assert store.get("a/1/y") == b"1" and store.list("a/") == ["a/1/y"]


def test_missing_key_raises_keyerror(store: BlobStore) -> None:
    with pytest.raises(KeyError):
        store.get("no/such")
    with pytest.raises(KeyError):
        store.size("no/such")
    with pytest.raises(KeyError):
        store.readinto("no/such", 0, memoryview(bytearray(4)))
    assert not store.exists("no/such")


@pytest.mark.parametrize("bad", ["../etc/passwd", "/abs", "a//b", "a/../b", ".hidden", "a b", "a/.tmp-1", ""])
def test_bad_keys_rejected(store: BlobStore, bad: str) -> None:
    with pytest.raises(InvalidInputError):
        store.put(bad, b"x")


def test_empty_blob(store: BlobStore) -> None:
    store.put("e/empty", b"")
    assert store.get("e/empty") == b""
    assert store.size("e/empty") == 0
    assert store.exists("e/empty")


@pytest.mark.parametrize("bad", ["a/b", "..", "job id", "x\\y", "", ".job", "j" * 200, "a*b", "ok\n", "-x",
                                 "a{b}", "a?b"])
def test_job_id_with_path_characters_rejected(bad: str) -> None:
    with pytest.raises(InvalidInputError, match="job id"):
        validate_job_id(bad)


def test_good_names_accepted() -> None:
    assert validate_job_id("llama-70b_run.3") == "llama-70b_run.3"
    assert validate_key("job/000000000001/rank-00000.bin")


@pytest.mark.parametrize("name", ["llama-70b_run.3", "team:llama@v2+het=1", "1234+0", "_x", "-x", "a" * 128,
                                  "a" * 129, "ok\n", "a/b", "a b", "", ".x", "x:y/z"])
def test_the_checkpoints_take_exactly_the_job_ids_the_agent_and_the_monitor_take(name: str) -> None:
    """One rule (sdcwatch.names.JOB_ID): a job the Monitor attached and the agent took under a name (Slurm's
    heterogeneous "1234+0", "team:run@v2") saves its checkpoints under it, and a name refused is refused
    by all three with the same words."""
    from sdcwatch.names import JOB_ID

    problem = JOB_ID.problem("job id", name) if name else "empty"
    try:
        validate_job_id(name)
    except InvalidInputError as err:
        assert problem is not None, f"{name!r}: the agent takes it, the checkpoints refused it: {err}"
        assert name == "" or problem in str(err)
    else:
        assert problem is None, f"{name!r}: the checkpoints took it, the agent refuses it: {problem}"


def test_a_job_id_with_every_character_the_rule_allows_keys_a_blob_in_every_store(store: BlobStore) -> None:
    job = validate_job_id("team:llama@v2+het=1_a.b-c")
    key = f"{job}/000000000001/rank-00000.bin"
    assert store.put(key, b"shard") == 5
    assert store.get(key) == b"shard" and store.size(key) == 5 and store.exists(key)
    assert store.list(f"{job}/") == [key] and store.list(f"{job}/000000000001/") == [key]
    assert store.list("team:llama@v2") == [key]
    assert store.delete(key) and store.list(f"{job}/") == []


def test_dir_store_sweeps_temp_files(tmp_path: Path) -> None:
    s = DirStore(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "blob.tmp-1-2").write_bytes(b"partial")
    s.put("x/real", b"1")
    assert s.list() == ["x/real"]
    assert s.sweep_temp(older_than_s=0, now=1e12) == 1
    assert s.list() == ["x/real"]


def test_shm_store_recycles_deleted_blobs_atomically(tmp_path: Path) -> None:
    s = ShmStore(tmp_path, spares=2)
    s.put("j/1/a", b"x" * 1000)
    assert s.delete("j/1/a")
    assert s.list() == []                      # spares are never listed
    s.put("j/2/a", b"short")                   # reuses the spare: truncated to the new size
    assert s.get("j/2/a") == b"short" and s.size("j/2/a") == 5
    assert not any((tmp_path / ".spares").iterdir())
