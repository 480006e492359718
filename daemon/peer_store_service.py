"""grpc.aio servicer for `sdcwatch.v1.PeerStore` (proto/sdcwatch/v1/peer.proto): other nodes' agents read
and write this agent's memory tier (peer replicas; the client is checkpoint/grpc_store.py).

Wiring (daemon/checkpoint_service.py `register`): served next to `Checkpoints`, over the agent's own
memory-tier store, on the unix socket and on the TCP listener (TLS + bearer token, enforced for every
service by daemon/interceptors.py).

Rules:
- every key and prefix from a client is checked with `checkpoint.names.validate_key` / `validate_prefix`
  before any path is built: INVALID_ARGUMENT with the reason (no '..', no absolute path, no temp names);
- a missing blob is NOT_FOUND; the memory tier's directory gone is FAILED_PRECONDITION; a full one (or a
  blob over `max_blob_bytes`) RESOURCE_EXHAUSTED;
- a put is the store's atomic put (temp name, rename): it is renamed into place only after the message
  marked `finish` arrived with the declared byte count; a broken, cancelled, idle or malformed stream
  removes the temp file, so nothing partial is ever visible;
- bytes only: messages are parsed as protobuf wire format; nothing is ever unpickled or executed.

Bulk messages are parsed and built as raw wire bytes (checkpoint.grpc_store codec): a received chunk is
written to the file straight from the message buffer; a sent chunk is one `pread` plus one copy into the
message. Blocking file I/O runs in the service's own bounded pool (`pool`, daemon/pools.py), never on the event
loop nor in threads other services need; at most `max_puts` puts run at once (workers - 2: gets, stats,
lists and deletes always find a thread); more wait for a slot (no thread held) up to `idle_timeout_s`. A put drops its
stream after `idle_timeout_s` without a message.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import threading
from typing import Any, AsyncIterator, Iterator

import grpc

from checkpoint.blobstore import BlobStore, check_range
from checkpoint.chunks import checksum
from checkpoint.errors import InvalidInputError
from checkpoint import rawbytes
from checkpoint.grpc_store import CHUNK_BYTES, PutMessage, chunk_frame, decode_put, encode_chunk
from checkpoint.names import validate_key, validate_prefix
from daemon.pools import WorkPool
from sdcwatch.safe_fs import PlantedLinkError
from proto.sdcwatch.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PeerStore"].full_name
MAX_BLOB_BYTES = 64 << 30          # one blob (a rank's shard); larger puts are refused
MAX_RANGES = 1 << 20               # ChecksumBlob: ranges per request (a 64 GiB blob in 64 KiB chunks)
MAX_RANGE_BYTES = 256 << 20        # ChecksumBlob: bytes per range (one buffer of this size at most)
MAX_CHUNK_BYTES = 3 << 20          # GetBlob messages stay under the agent's 4 MiB message limit
MIN_CHUNK_BYTES = 64 << 10
IDLE_TIMEOUT_S = 30.0              # a put whose client sends nothing for this long is dropped
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG)


class _StreamError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerStoreService:
    """Serves `store` (the agent's memory tier) through PeerStore. `stats` counts puts, gets and bytes."""

    def __init__(self, store: BlobStore, *, max_blob_bytes: int = MAX_BLOB_BYTES,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, pool: WorkPool | None = None) -> None:
        self.store = store
        self.pool = pool or WorkPool("peer-store")
        self.max_puts = max(1, self.pool.workers - 2)
        self._put_slots: asyncio.Semaphore | None = None   # made on the event loop, at the first put
        self.max_blob_bytes = max_blob_bytes
        self.idle_timeout_s = idle_timeout_s
        self.stats = {"peer_puts": 0, "peer_put_bytes": 0, "peer_put_failures": 0, "peer_gets": 0,
                      "peer_checksums": 0, "peer_checksum_bytes": 0,
                      "peer_get_bytes": 0}

    # ---- RPCs -----------------------------------------------------------------------------------------
    async def PutBlob(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> pb.PutBlobResponse:
        if self._put_slots is None:
            self._put_slots = asyncio.Semaphore(self.max_puts)
        try:   # waiting for a slot holds no thread; the client's stream is held back by flow control
            await asyncio.wait_for(self._put_slots.acquire(), self.idle_timeout_s)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_puts} puts ran on this node for "
                                f"{self.idle_timeout_s:.0f}s without one finishing; retry later")
        try:
            return await self._put(requests, context)
        finally:
            self._put_slots.release()

    async def _put(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> pb.PutBlobResponse:
        try:
            first = await asyncio.wait_for(requests.__anext__(), self.idle_timeout_s)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PutBlob: empty stream (no key)")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"PutBlob: no message for {self.idle_timeout_s:.0f}s")
        if isinstance(first, ValueError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(first))
        key = await self._key(first.key, context)
        if first.total_bytes > self.max_blob_bytes:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"blob {key!r} of {first.total_bytes} bytes "
                                f"exceeds this agent's limit of {self.max_blob_bytes} bytes")
        await self._check_room(key, first.total_bytes, context)
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        pending: list[concurrent.futures.Future[Any]] = []
        chunks = self._chunks(key, first, requests, loop, stop, pending)
        try:
            n = await self.pool.run(self.store.put, key, chunks)
        except asyncio.CancelledError:
            stop.set()              # the client went away: the writer thread drops the temp file
            for f in pending:
                f.cancel()
            self.stats["peer_put_failures"] += 1
            raise
        except _StreamError as e:
            self.stats["peer_put_failures"] += 1
            await context.abort(e.code, str(e))
        except OSError as e:
            self.stats["peer_put_failures"] += 1
            await context.abort(*self._os_status(e, key))
        self.stats["peer_puts"] += 1
        self.stats["peer_put_bytes"] += n
        return pb.PutBlobResponse(bytes=n)

    def _chunks(self, key: str, first: PutMessage, requests: AsyncIterator[Any], loop: asyncio.AbstractEventLoop,
                stop: threading.Event, pending: list[concurrent.futures.Future[Any]]) -> Iterator[memoryview]:
        """Runs in the writer thread: yields each message's bytes, pulling the next message from the event
        loop; raises (so the store drops its temp file) on anything but a clean, complete stream."""
        got = 0
        msg = first
        while True:
            if msg.key and msg is not first:
                raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, "PutBlob: the key goes in the first message only")
            got += len(msg.data)
            if got > self.max_blob_bytes:
                raise _StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"blob {key!r} exceeds this agent's limit "
                                   f"of {self.max_blob_bytes} bytes; nothing was stored")
            if first.total_bytes and got > first.total_bytes:
                raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"blob {key!r}: more bytes than the "
                                   f"{first.total_bytes} declared; nothing was stored")
            fut = None if msg.finish else asyncio.run_coroutine_threadsafe(_next(requests), loop)
            pending[:] = [fut] if fut is not None else []   # the loop reads the next message during the write
            if len(msg.data):
                yield msg.data
            if fut is None:
                break
            if stop.is_set():
                raise _StreamError(grpc.StatusCode.CANCELLED, "PutBlob cancelled")
            try:
                nxt = fut.result(self.idle_timeout_s)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                raise _StreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"PutBlob {key!r}: no data for {self.idle_timeout_s:.0f}s") from None
            except (concurrent.futures.CancelledError, asyncio.CancelledError):
                raise _StreamError(grpc.StatusCode.CANCELLED, "PutBlob cancelled") from None
            except Exception as e:  # noqa: BLE001 - the stream broke
                raise _StreamError(grpc.StatusCode.ABORTED, f"PutBlob {key!r}: the stream broke: {e}") from None
            if nxt is None:
                raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"PutBlob {key!r}: the stream ended after "
                                   f"{got} bytes without its finishing message; nothing was stored")
            if isinstance(nxt, ValueError):
                raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, str(nxt))
            msg = nxt
        if first.total_bytes and got != first.total_bytes:
            raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"PutBlob {key!r}: {got} bytes arrived, "
                               f"{first.total_bytes} declared; nothing was stored")

    async def GetBlob(self, request: pb.GetBlobRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        key = await self._key(request.key, context)
        if request.offset < 0 or request.length < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"bad range offset={request.offset} length={request.length} for {key!r}")
        chunk = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, request.chunk_bytes or CHUNK_BYTES))
        open_blob = getattr(self.store, "open_blob", None)   # DirStore: fd-relative, never through a link
        if open_blob is None:   # a store without files: ranged gets
            async for raw in self._get_generic(key, request, chunk, context):
                yield raw
            return
        try:
            fd = await self.pool.run(open_blob, key)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no blob {key!r} on this node")
        except OSError as e:
            await context.abort(*self._os_status(e, key))
        nxt: asyncio.Future[bytes] | None = None
        try:
            size = os.fstat(fd).st_size
            try:
                off, n = check_range(request.offset, None if request.to_end else request.length, size, key)
            except ValueError as e:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
            start, end = off, off + n
            self.stats["peer_gets"] += 1

            def read(at: int) -> bytes:   # the next message, built in a thread while this one is sent
                return read_chunk(fd, at, min(chunk, end - at), size if at == start else 0, key)

            nxt = asyncio.ensure_future(self.pool.run(read, off))
            while nxt is not None:
                try:
                    raw = await nxt
                except EOFError as e:
                    await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
                sent = min(chunk, end - off)
                off += sent
                nxt = asyncio.ensure_future(self.pool.run(read, off)) if off < end else None
                self.stats["peer_get_bytes"] += sent
                yield raw
        finally:
            if nxt is not None and not nxt.done():
                await asyncio.gather(nxt, return_exceptions=True)   # never close the fd under a read
            os.close(fd)

    async def _get_generic(self, key: str, request: pb.GetBlobRequest, chunk: int,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            size = await self.pool.run(self.store.size, key)
            off, n = check_range(request.offset, None if request.to_end else request.length, size, key)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no blob {key!r} on this node")
        except ValueError as e:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        end, first = off + n, True
        while off < end or first:
            data = await self.pool.run(self.store.get, key, off, min(chunk, end - off)) if off < end else b""
            yield encode_chunk(off, data, size if first else 0)
            first = False
            off += len(data)

    async def StatBlob(self, request: pb.StatBlobRequest, context: grpc.aio.ServicerContext) -> pb.StatBlobResponse:
        key = await self._key(request.key, context)
        try:
            size = await self.pool.run(self.store.size, key)
        except KeyError:
            return pb.StatBlobResponse(exists=False)
        except OSError as e:
            await context.abort(*self._os_status(e, key))
        return pb.StatBlobResponse(exists=True, size=size)

    async def ChecksumBlob(self, request: pb.ChecksumBlobRequest,
                           context: grpc.aio.ServicerContext) -> pb.ChecksumBlobResponse:
        """xxh3-128 of each requested range of the stored blob (the work: at most the blob's size, once)."""
        key = await self._key(request.key, context)
        try:
            size = await self.pool.run(self.store.size, key)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no blob {key!r} here")
            raise
        except OSError as e:
            await context.abort(*self._os_status(e, key))
            raise
        ranges = [(r.offset, r.length) for r in request.ranges]
        why = _check_ranges(ranges, size)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ChecksumBlob {key!r}: {why}")
        try:
            sums = await self.pool.run(self._checksums, key, ranges)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no blob {key!r} here (deleted during the read)")
            raise
        except OSError as e:
            await context.abort(*self._os_status(e, key))
            raise
        self.stats["peer_checksums"] += 1
        self.stats["peer_checksum_bytes"] += sum(n for _, n in ranges)
        return pb.ChecksumBlobResponse(size=size, checksums=sums)

    def _checksums(self, key: str, ranges: list[tuple[int, int]]) -> list[str]:
        buf = memoryview(bytearray(max((n for _, n in ranges), default=0)))
        out = []
        for off, n in ranges:
            got = self.store.readinto(key, off, buf[:n])
            out.append(checksum(buf[:got]))   # a short read (the blob shrank) gives a checksum that differs
        return out

    async def ListBlobs(self, request: pb.ListBlobsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListBlobsResponse:
        try:
            prefix = validate_prefix(request.prefix)
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ListBlobsResponse(keys=await self.pool.run(self.store.list, prefix))

    async def DeleteBlob(self, request: pb.DeleteBlobRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeleteBlobResponse:
        key = await self._key(request.key, context)
        try:
            deleted = await self.pool.run(self.store.delete, key)
        except OSError as e:
            await context.abort(*self._os_status(e, key))
        return pb.DeleteBlobResponse(deleted=deleted)

    # ---- helpers ------------------------------------------------------------------------------------------
    async def _key(self, key: str, context: grpc.aio.ServicerContext) -> str:
        try:
            return validate_key(key)
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise

    async def _check_room(self, key: str, nbytes: int, context: grpc.aio.ServicerContext) -> None:
        root = getattr(self.store, "root", None)
        if root is None:
            return
        try:
            st = await self.pool.run(os.statvfs, root)
        except FileNotFoundError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this node's memory tier {root} does not exist (agent stopping or misconfigured)")
            return
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"blob {key!r} needs {nbytes} bytes; this node's memory tier has {free} free")

    def _os_status(self, e: OSError, key: str) -> tuple[grpc.StatusCode, str]:
        if isinstance(e, PlantedLinkError):
            return grpc.StatusCode.FAILED_PRECONDITION, f"{key!r} on this node is refused: {e}"
        if e.errno in _FULL:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"this node's memory tier is full writing {key!r}: {e}"
        if isinstance(e, FileNotFoundError):
            return grpc.StatusCode.FAILED_PRECONDITION, f"this node's memory tier is gone: {e}"
        log.warning("peer store I/O on %r failed: %s", key, e)
        return grpc.StatusCode.INTERNAL, f"I/O error on {key!r}: {e}"


def read_chunk(fd: int, at: int, n: int, blob_bytes: int, key: str) -> bytes:
    """A serialized `BlobChunk` of the `n` bytes of `fd` at `at`, read (`preadv`) straight into the message:
    the bytes are copied once, from the file into the message. EOFError when the file is shorter."""
    if not n or not rawbytes.available():
        data = os.pread(fd, n, at) if n else b""
        if len(data) < n:
            raise EOFError(f"blob {key!r} shrank while being read")
        return encode_chunk(at, data, blob_bytes)
    head, tail = chunk_frame(at, n, blob_bytes)
    h = len(head)
    msg, view = rawbytes.fresh_bytes(h + n + len(tail))
    view[:h] = head
    got = 0
    while got < n:
        r = os.preadv(fd, [view[h + got:h + n]], at + got)
        if r <= 0:
            raise EOFError(f"blob {key!r} shrank while being read")
        got += r
    view[h + n:] = tail
    view.release()
    return msg


async def _next(requests: AsyncIterator[Any]) -> Any:
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return None


def _check_ranges(ranges: list[tuple[int, int]], size: int) -> str:
    """Why ChecksumBlob's ranges are refused ('' when fine): in order, not overlapping, inside the blob."""
    if len(ranges) > MAX_RANGES:
        return f"{len(ranges)} ranges; at most {MAX_RANGES}"
    end = 0
    for off, n in ranges:
        if off < end or n < 0 or n > MAX_RANGE_BYTES or off + n > size:
            return (f"range ({off}, {n}) is out of order, overlaps, exceeds {MAX_RANGE_BYTES} bytes or lies "
                    f"outside the blob of {size} bytes")
        end = off + n
    return ""


def _decode_put(raw: bytes) -> PutMessage | ValueError:
    """Never raises (a deserializer error would be an opaque INTERNAL): the handler reports the ValueError."""
    try:
        return decode_put(raw)
    except ValueError as e:
        return ValueError(f"PutBlob: {e}")


def _raw(b: bytes) -> bytes:
    return b


def register(server: grpc.aio.Server, service: PeerStoreService) -> None:
    """Add PeerStore to `server`: the generated stubs' method table, with the bulk messages (PutBlob
    requests, GetBlob responses) as raw wire bytes."""
    handlers = {
        "PutBlob": grpc.stream_unary_rpc_method_handler(
            service.PutBlob, request_deserializer=_decode_put, response_serializer=pb.PutBlobResponse.SerializeToString),
        "GetBlob": grpc.unary_stream_rpc_method_handler(
            service.GetBlob, request_deserializer=pb.GetBlobRequest.FromString, response_serializer=_raw),
        "StatBlob": grpc.unary_unary_rpc_method_handler(
            service.StatBlob, request_deserializer=pb.StatBlobRequest.FromString,
            response_serializer=pb.StatBlobResponse.SerializeToString),
        "ListBlobs": grpc.unary_unary_rpc_method_handler(
            service.ListBlobs, request_deserializer=pb.ListBlobsRequest.FromString,
            response_serializer=pb.ListBlobsResponse.SerializeToString),
        "DeleteBlob": grpc.unary_unary_rpc_method_handler(
            service.DeleteBlob, request_deserializer=pb.DeleteBlobRequest.FromString,
            response_serializer=pb.DeleteBlobResponse.SerializeToString),
        "ChecksumBlob": grpc.unary_unary_rpc_method_handler(
            service.ChecksumBlob, request_deserializer=pb.ChecksumBlobRequest.FromString,
            response_serializer=pb.ChecksumBlobResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
