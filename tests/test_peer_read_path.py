"""Issue 21 item 6, the peer read path: the server reads each GetBlob chunk straight into the message
(`read_chunk`), the client copies each message's bytes once into place (`decode_chunk_span`, `copy_into`);
both stay byte-for-byte the protobuf `BlobChunk` wire format. Reads that run together take a stream each."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import test_peer_network
from test_peer_network import PeerServer, _creds
from test_peer_streams import counted_reads

import checkpoint.grpc_store as gs
from checkpoint import rawbytes
from checkpoint.grpc_store import GrpcBlobStore, PeerStoreError, decode_chunk, decode_chunk_span, encode_chunk
from daemon.peer_store_service import read_chunk
from proto.sdcwatch.v1 import peer_pb2 as pb

tls, peer = test_peer_network.tls, test_peer_network.peer    # the peer-transport fixtures, shared


def test_fresh_bytes_are_filled_in_place_and_copy_into_copies_a_span() -> None:
    b, view = rawbytes.fresh_bytes(5)
    view[:] = b"hello"
    view.release()
    assert isinstance(b, bytes) and b == b"hello" and hash(b) == hash(b"hello")
    src = os.urandom(300_000)
    dst = bytearray(200_000)
    rawbytes.copy_into(memoryview(dst), src, 50_000)            # large: the GIL-free path
    assert dst == src[50_000:250_000]
    other = bytearray(200_000)
    rawbytes.copy_into(memoryview(other), bytearray(src), 1)   # not exact bytes: a plain copy
    assert other == src[1:200_001]
    small = bytearray(10)
    rawbytes.copy_into(memoryview(small), src, 7)
    assert small == src[7:17]
    with pytest.raises(ValueError):
        rawbytes.copy_into(memoryview(dst), src, 200_000)       # past the source's end
    with pytest.raises(ValueError):
        rawbytes.fresh_bytes(-1)


def test_copy_into_runs_in_parallel_threads() -> None:
    src = os.urandom(1 << 20)
    outs = [bytearray(1 << 20) for _ in range(4)]
    ts = [threading.Thread(target=rawbytes.copy_into, args=(memoryview(o), src, 0)) for o in outs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(o == src for o in outs)


@pytest.mark.parametrize("at,n,blob_bytes", [(0, 100_000, 300_000), (100_000, 200_000, 0), (0, 0, 5),
                                             (299_999, 1, 0)])
def test_read_chunk_is_the_protobuf_blob_chunk(tmp_path: Path, at: int, n: int, blob_bytes: int) -> None:
    data = os.urandom(300_000)
    (tmp_path / "b").write_bytes(data)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        raw = read_chunk(fd, at, n, blob_bytes, "k")
    finally:
        os.close(fd)
    want = pb.BlobChunk(offset=at, data=data[at:at + n], blob_bytes=blob_bytes).SerializeToString()
    assert raw == want == encode_chunk(at, data[at:at + n], blob_bytes)
    off, start, size = decode_chunk_span(raw)
    assert (off, raw[start:start + size]) == (at, data[at:at + n])
    assert decode_chunk(raw)[:2] == (at, data[at:at + n])


def test_read_chunk_of_a_shrunken_file_and_a_malformed_chunk(tmp_path: Path) -> None:
    (tmp_path / "b").write_bytes(b"x" * 1000)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        with pytest.raises(EOFError):
            read_chunk(fd, 500, 1000, 0, "k")
    finally:
        os.close(fd)
    good = encode_chunk(7, b"abc")
    with pytest.raises(PeerStoreError):
        decode_chunk_span(good[:-1])                                  # truncated
    with pytest.raises(PeerStoreError):
        decode_chunk_span(b"\x0f")                                    # wire type 7


def test_reads_that_run_together_take_one_stream_each(peer: PeerServer, tls: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A large read alone is split over the streams; while another read runs (a restore's chunk pool), a read
    takes the next stream whole: no size lookup, no split."""
    monkeypatch.setattr(gs, "PARALLEL_MIN_BYTES", 1 << 20)
    store = GrpcBlobStore(peer.tls_url, credentials=_creds(tls), chunk_bytes=64 << 10, streams=3)
    calls = counted_reads(store, monkeypatch)
    try:
        key, data = "j/000000000003/rank-00000.bin", os.urandom(3 << 20)
        store.put(key, data)
        buf = bytearray(len(data))
        assert store.readinto(key, 0, memoryview(buf)) == len(data) and buf == data
        assert len(calls) == 3                                   # alone: three ranges
        calls.clear()
        store._reading = 1                                       # another read is running
        for _ in range(3):
            buf = bytearray(len(data))
            assert store.readinto(key, 0, memoryview(buf)) == len(data) and buf == data
        assert [(o, n) for o, n, _ in calls] == [(0, len(data))] * 3
        assert len({g for _, _, g in calls}) == 3                # the streams in turn
        assert store._reading == 1
    finally:
        store.close()
