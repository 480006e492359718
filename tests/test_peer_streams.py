"""Issue 21 item 6: the peer transport's parallel streams (connections taken in turn by puts, a large read
split into ranged GetBlob calls run together) and its per-peer cap; real gRPC servers (TLS TCP, token)."""
from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest

import checkpoint.grpc_store as gs
from checkpoint.errors import InvalidInputError
from checkpoint.grpc_store import GrpcBlobStore, PeerTransport, RateLimit, grpc_store_for, set_transport
from daemon.errors import ConfigError
from daemon.peers_config import PeersConfig
from daemon.peers_wiring import configure_transport
import test_peer_network
from test_peer_network import PeerServer, _creds

tls, peer = test_peer_network.tls, test_peer_network.peer    # the peer-transport fixtures, shared

MiB = 1 << 20


def test_rate_limit_books_each_message_against_the_rate() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    lim = RateLimit(1_000_000, burst_s=0.05, clock=lambda: now[0], sleep=sleep)
    assert lim.take(50_000) == 0.0                 # inside the burst credit
    for _ in range(10):
        lim.take(100_000)                          # 1 MB more at 1 MB/s
    assert sum(slept) == pytest.approx(1.0, abs=1e-6)   # 1.05 MB in 1.05 s, 0.05 s of it credit
    now[0] += 10.0                                 # idle: the credit does not pile up past burst_s
    assert lim.take(50_000) == 0.0 and lim.take(100_000) == pytest.approx(0.1)
    with pytest.raises(InvalidInputError):
        RateLimit(0)
    with pytest.raises(InvalidInputError):
        PeerTransport(streams=0)


def counted_reads(store: GrpcBlobStore, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Each one-stream read of `store` from now on, as (offset, length, id of the stream's call)."""
    calls: list[tuple[int, int, int]] = []
    one = store._readinto_one

    def counted(key: str, offset: int, view: memoryview, get: object) -> int:
        calls.append((offset, len(view), id(get)))
        return one(key, offset, view, get)

    monkeypatch.setattr(store, "_readinto_one", counted)
    return calls


def test_streams_split_a_large_read_and_carry_puts_in_turn(peer: PeerServer, tls: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gs, "PARALLEL_MIN_BYTES", 1 * MiB)
    store = GrpcBlobStore(peer.tls_url, credentials=_creds(tls), chunk_bytes=64 << 10, streams=3)
    calls = counted_reads(store, monkeypatch)
    try:
        blobs = {f"j/000000000001/rank-{r:05d}.bin": os.urandom(MiB + 4097 * r) for r in range(6)}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:   # the shards of a step, replicated together
            sizes = list(pool.map(lambda kv: store.put(*kv), blobs.items()))
        assert sizes == [len(b) for b in blobs.values()]
        key, data = "j/000000000002/rank-00000.bin", os.urandom(5 * MiB + 123)
        store.put(key, data)
        buf = bytearray(len(data) + 1000)          # longer than the blob: a short read, as one stream gives
        assert store.readinto(key, 0, memoryview(buf)) == len(data) and bytes(buf[:len(data)]) == data
        assert len(calls) == 3 and len({g for _, _, g in calls}) == 3   # three ranges, three connections
        assert sorted(o for o, _, _ in calls)[0] == 0 and sum(n for _, n, _ in calls) == len(data)
        calls.clear()
        view = memoryview(bytearray(2 * MiB))
        assert store.readinto(key, 3 * MiB, view) == 2 * MiB and bytes(view) == data[3 * MiB:5 * MiB]
        for k, b in blobs.items():
            assert store.get(k) == b
        assert len({id(ch) for ch, _, _ in store._lanes}) == 3
    finally:
        store.close()


def test_the_cap_paces_puts_and_reads(peer: PeerServer, tls: dict[str, Path]) -> None:
    store = GrpcBlobStore(peer.tls_url, credentials=_creds(tls), chunk_bytes=64 << 10, streams=2,
                          max_bytes_per_s=8e6)
    try:
        data = os.urandom(MiB)
        store.put("j/000000000001/rank-00000.bin", data)
        assert store.limit is not None and store.limit.waited_s > 0   # 1 MiB at 8 MB/s: paced
        before = store.limit.waited_s
        assert store.get("j/000000000001/rank-00000.bin") == data
        assert store.limit.waited_s > before
    finally:
        store.close()


def test_peers_config_sets_streams_and_cap(tls: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="peers.streams"):
        PeersConfig(streams=0).validate()
    with pytest.raises(ConfigError, match="peers.max_mb_per_s"):
        PeersConfig(max_mb_per_s=-1).validate()
    try:
        configure_transport(PeersConfig(streams=3, max_mb_per_s=250, tls_ca=str(tls["cert"]),
                                        token_file=str(tls["token"])))
        store = grpc_store_for("grpcs://localhost:1")
        assert store.streams == 3 and store.limit is not None and store.limit.rate == 250e6
    finally:
        set_transport(None)
        gs.set_credentials(None)


# ---- ChecksumBlob: a copy verified on the peer, not read back over the network -------------------------


def test_checksum_blob_hashes_what_the_peer_stored(peer: PeerServer, tls: dict[str, Path]) -> None:
    from checkpoint.chunks import checksum_chunks

    store = GrpcBlobStore(peer.tls_url, credentials=_creds(tls), chunk_bytes=64 << 10)
    try:
        data = os.urandom(300_000)
        key = "j/000000000001/rank-00000.bin"
        store.put(key, data)
        chunks = checksum_chunks(memoryview(data), 65536)
        size, sums = store.checksums(key, [(c.offset, c.length) for c in chunks])
        assert size == len(data) and sums == [c.checksum for c in chunks]
        assert store.checksums(key, []) == (len(data), [])
        for bad in ([(0, 10), (5, 10)], [(100, 10), (0, 10)], [(299_990, 11)], [(0, -1)]):
            with pytest.raises(InvalidInputError, match="out of order"):
                store.checksums(key, bad)
        with pytest.raises(KeyError):
            store.checksums("j/000000000001/rank-00009.bin", [(0, 1)])
        assert peer.service.stats["peer_checksums"] == 2 and peer.service.stats["peer_gets"] == 0
    finally:
        store.close()


class Flipping:
    """The peer's store, flipping one byte of every blob it writes (a copy corrupted on the peer)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def put(self, key: str, data: object) -> int:
        n = self.inner.put(key, data)   # type: ignore[attr-defined]
        path = self.inner.path(key)     # type: ignore[attr-defined]
        with open(path, "r+b") as f:
            f.seek(n // 2)
            b = f.read(1)
            f.seek(n // 2)
            f.write(bytes([b[0] ^ 0x10]))
        return n


@pytest.mark.parametrize("peer_checks", [True, False])
def test_replicas_are_verified_on_the_peer_and_a_bad_copy_is_never_recorded(
        redis_server, short_tmp: Path, peer: PeerServer, tls: dict[str, Path], peer_checks: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpoint.peers import Peer, Replicator
    from checkpoint.snapshot import SnapshotConfig, Snapshotter
    from ckpt_support import job_id, node, state_dict

    if not peer_checks:   # an agent from before ChecksumBlob: the copy is read back instead
        def old(self: GrpcBlobStore, key: str, ranges: list) -> tuple[int, list[str]]:
            raise NotImplementedError("an older agent")
        monkeypatch.setattr(GrpcBlobStore, "checksums", old)
    co, job = node(redis_server.port, short_tmp, "node-a"), job_id("sums")
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=64 << 10, staging="private"))
    assert snap.save(1, state_dict(0, 1, size=200_000)).result(30).state == "COMMITTED"
    assert snap.save(2, state_dict(0, 2, size=200_000)).result(30).state == "COMMITTED"
    snap.close()
    store = GrpcBlobStore(peer.tls_url, credentials=_creds(tls), chunk_bytes=64 << 10)
    try:
        rep = Replicator(co, [Peer("node-b", store, peer.tls_url)])
        assert rep.replicate(job, 1, 0) == ["node-b"]
        stats = peer.service.stats
        assert (stats["peer_checksums"], stats["peer_gets"] > 0) == ((1, False) if peer_checks else (0, True))
        peer.service.store = Flipping(peer.service.store)
        assert rep.replicate(job, 2, 0) == []                          # the corrupted copy: refused
        assert co.stats["replication_failures"] == 1
        assert not store.exists(co.shard_manifest(job, 2, 0).blob)     # and deleted on the peer
        assert {c.node for c in co.info(job, 2).copies} == {"node-a"}
    finally:
        store.close()
