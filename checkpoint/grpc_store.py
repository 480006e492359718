"""`GrpcBlobStore`: another node's memory tier over the network, through its agent's `sdcwatch.v1.PeerStore`
service (proto/sdcwatch/v1/peer.proto, served by daemon/peer_store_service.py).

Locations (the `[peers] nodes` entries, and the copy locations recorded for them):

    grpcs://HOST:PORT        the peer agent's TCP listener, TLS (CA from the credentials) + bearer token
    unix:///abs/agent.sock   the peer agent's unix socket (same host; local trust, no token)
    grpc://HOST:PORT         plain TCP: only when the credentials allow `insecure` (warns once)

Credentials are per process (`set_credentials`; the agent sets them from `[peers]`). A training rank that
restores from a peer's copy reads them from the environment: `SDCWATCH_PEER_TLS_CA` (PEM CA file),
`SDCWATCH_PEER_TOKEN_FILE`, `SDCWATCH_PEER_INSECURE=1`.

The store follows the `BlobStore` protocol: `put` streams the blob in chunks and the peer makes it visible
only when the whole stream arrived (the last message says so; a broken stream leaves nothing); `get` /
`readinto` stream ranged reads. Errors: a missing blob is `KeyError`; a bad key `InvalidInputError` (before
any RPC); an unreachable, refusing or full peer is `PeerStoreError` (an `OSError`), so restore falls back
to the next copy as it does for a missing directory.

Chunks travel as raw protobuf wire bytes built and parsed here (`encode_put`, `decode_chunk`, wire-equal
to `PutBlobRequest` / `BlobChunk`): each chunk is copied once into the message and once out of it.

Streams and a cap (issue 21 item 6; `[peers] streams`, `max_mb_per_s`; `set_transport`): a store opens
`streams` connections to its peer (separate TCP/TLS connections, so encryption and framing run on as many
cores); puts take the connections in turn (the agent replicates the shards of a step concurrently, one
stream each), and a large `readinto` (restore, the replicator's read-back) is split into `streams` ranged
GetBlob calls run in parallel, unless other reads run at the same time (a restore reads its chunks from a
thread pool): then each read takes one stream, in turn. `max_bytes_per_s` caps the bytes per second to and
from that peer, all streams together (a token bucket paced per message: `RateLimit`), so replication leaves the link to the
training job's own traffic.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Iterator

import grpc

from checkpoint.blobstore import Data, as_buffers
from checkpoint.errors import InvalidInputError
from checkpoint.names import validate_key, validate_prefix
from checkpoint.rawbytes import copy_into
from proto.sdcwatch.v1 import peer_pb2 as pb
from sdcwatch.channels import agent_channel
from sdcwatch.errors import SdcwatchError

log = logging.getLogger(__name__)

SERVICE = "/sdcwatch.v1.PeerStore/"
CHUNK_BYTES = 2 << 20            # bytes per message (the agent accepts 4 MiB messages by default)
READ_CHUNK_BYTES = 3 << 20       # GetBlob message size asked for (the server's largest: fewer, cheaper messages)
PARALLEL_MIN_BYTES = 16 << 20    # a readinto at least this large is split over the store's streams
MAX_MESSAGE_BYTES = 64 << 20     # this side's gRPC message limits (responses are chunked by the server)
SCHEMES = ("grpcs", "grpc", "unix")
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://(?P<rest>.*)$")
_HOSTPORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")


class PeerStoreError(SdcwatchError, OSError):
    """A peer's store could not be used: unreachable, refused (token, TLS), full, or it failed. Transient
    when the peer was unreachable or slow (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message, transient=code in _TRANSIENT_CODES)
        self.code = code


_TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclasses.dataclass(frozen=True, slots=True)
class PeerCredentials:
    tls_ca: str = ""           # PEM CA file for grpcs:// ('' = the system roots)
    token_file: str = ""       # bearer token sent on TCP ('' = none)
    insecure: bool = False     # allow grpc:// (plain TCP)

    @classmethod
    def from_env(cls) -> "PeerCredentials":
        return cls(os.environ.get("SDCWATCH_PEER_TLS_CA", ""), os.environ.get("SDCWATCH_PEER_TOKEN_FILE", ""),
                   os.environ.get("SDCWATCH_PEER_INSECURE", "") in ("1", "true", "yes"))


@dataclasses.dataclass(frozen=True, slots=True)
class PeerTransport:
    """How bytes move to and from one peer: `streams` connections, at most `max_bytes_per_s` (0: no cap)."""

    streams: int = 4
    max_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise InvalidInputError(f"peer streams must be an int in 1..64, got {self.streams!r}")
        if not self.max_bytes_per_s >= 0:
            raise InvalidInputError(f"peer max_bytes_per_s must be >= 0, got {self.max_bytes_per_s!r}")


_creds: PeerCredentials | None = None
_transport = PeerTransport()
_stores: dict[tuple[str, PeerCredentials, PeerTransport], "GrpcBlobStore"] = {}
_lock = threading.Lock()


def set_credentials(creds: PeerCredentials | None) -> None:
    """This process's credentials for peer URLs (None: back to the environment's). Closes cached channels."""
    global _creds
    with _lock:
        _creds = creds
        stores = list(_stores.values())
        _stores.clear()
    for s in stores:
        s.close()


def set_transport(transport: PeerTransport | None) -> None:
    """This process's streams and cap per peer (None: the defaults). Closes cached channels."""
    global _transport
    with _lock:
        _transport = transport or PeerTransport()
        stores = list(_stores.values())
        _stores.clear()
    for s in stores:
        s.close()


def credentials() -> PeerCredentials:
    return _creds if _creds is not None else PeerCredentials.from_env()


class RateLimit:
    """At most `rate` bytes per second over all callers, with `burst_s` seconds of credit: `take(n)`
    returns after the n bytes fit (a virtual clock: each take books n / rate seconds). `clock` and `sleep`
    are injectable for tests."""

    def __init__(self, rate: float, burst_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate > 0:
            raise InvalidInputError(f"a rate limit must be positive, got {rate!r}")
        self.rate, self.burst_s = float(rate), burst_s
        self._clock, self._sleep = clock, sleep
        self._t = clock()
        self._lock = threading.Lock()
        self.waited_s = 0.0

    def take(self, n: int) -> float:
        """Book `n` bytes; sleeps while over the rate. Returns the seconds slept."""
        with self._lock:
            now = self._clock()
            self._t = max(self._t, now) + n / self.rate
            delay = self._t - now - self.burst_s
        if delay > 0:
            self._sleep(delay)
            self.waited_s += delay
            return delay
        return 0.0


def is_peer_url(location: str) -> bool:
    m = _URL.match(location)
    return bool(m) and m.group("scheme") in SCHEMES


def parse_location(location: str) -> tuple[str, str]:
    """'grpcs://h:1' -> ('grpcs', 'h:1'); 'unix:///p/a.sock' -> ('unix', 'unix:///p/a.sock'). InvalidInputError
    for another scheme, a missing port, a relative socket path, or anything after the address."""
    m = _URL.match(location)
    if not m:
        raise InvalidInputError(f"{location!r} is not a URL (grpcs://HOST:PORT, unix:///PATH, grpc://HOST:PORT)")
    scheme, rest = m.group("scheme"), m.group("rest")
    if scheme == "unix":
        if not rest.startswith("/") or rest.startswith("//") or len(rest) < 2:
            raise InvalidInputError(f"{location!r}: a unix socket URL is unix:///absolute/path.sock")
        return scheme, f"unix://{rest}"
    if scheme not in ("grpc", "grpcs"):
        raise InvalidInputError(f"{location!r}: scheme {scheme!r} is not a peer transport "
                                "(grpcs://, unix://, grpc://)")
    hp = _HOSTPORT.match(rest)
    if not hp or not 0 < int(hp.group("port")) < 65536:
        raise InvalidInputError(f"{location!r}: expected {scheme}://HOST:PORT (a port in 1-65535, no path)")
    return scheme, rest


def grpc_store_for(location: str) -> "GrpcBlobStore":
    """The (cached, thread-safe) store for a peer URL under this process's credentials."""
    creds = credentials()
    with _lock:
        tr = _transport
        store = _stores.get((location, creds, tr))
        if store is None:
            store = _stores[(location, creds, tr)] = GrpcBlobStore(
                location, credentials=creds, streams=tr.streams, max_bytes_per_s=tr.max_bytes_per_s)
        return store


# ---- wire codec for the bulk messages (proto3 wire format, see peer.proto) ---------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_put(data: memoryview, key: str = "", total_bytes: int | None = None, finish: bool = False) -> bytes:
    """A serialized `PutBlobRequest`; `data` is copied once, into the message."""
    head = bytearray()
    if key:
        k = key.encode()
        head += b"\x0a" + _varint(len(k)) + k
    if total_bytes:
        head += b"\x10" + _varint(total_bytes)
    tail = b"\x20\x01" if finish else b""
    if not len(data):
        return bytes(head) + tail
    return b"".join((head, b"\x1a", _varint(len(data)), data, tail))


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def chunk_frame(offset: int, n: int, blob_bytes: int = 0) -> tuple[bytes, bytes]:
    """The wire bytes before and after `n` data bytes of a serialized `BlobChunk`, so a sender can read the
    data straight into the message between them (daemon/peer_store_service.py)."""
    head = (b"\x08" + _varint(offset)) if offset else b""
    tail = (b"\x18" + _varint(blob_bytes)) if blob_bytes else b""
    return (head + b"\x12" + _varint(n) if n else head), tail


def encode_chunk(offset: int, data: bytes | memoryview, blob_bytes: int = 0) -> bytes:
    """A serialized `BlobChunk`; `data` is copied once, into the message."""
    head, tail = chunk_frame(offset, len(data), blob_bytes)
    if not len(data):
        return head + tail
    return b"".join((head, data, tail))


def _fields(raw: bytes, what: str) -> tuple[dict[int, int], dict[int, memoryview]]:
    """Parse proto3 wire bytes: (varint fields, length-delimited fields as views into `raw`); the last
    occurrence of a field wins, as in protobuf. ValueError for malformed input."""
    ints, spans = _spans(raw, what)
    buf = memoryview(raw)
    return ints, {f: buf[a:b] for f, (a, b) in spans.items()}


def _spans(raw: bytes, what: str) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """`_fields` with the length-delimited fields as (start, end) indices into `raw`."""
    buf = memoryview(raw)
    ints: dict[int, int] = {}
    blobs: dict[int, tuple[int, int]] = {}
    i = 0
    try:
        while i < len(buf):
            tag, i = _read_varint(buf, i)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                ints[field], i = _read_varint(buf, i)
            elif wire == 2:
                n, i = _read_varint(buf, i)
                if i + n > len(buf):
                    raise IndexError
                blobs[field] = (i, i + n)
                i += n
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            else:
                raise ValueError(f"malformed {what}: wire type {wire}")
    except IndexError:
        raise ValueError(f"malformed {what}: truncated") from None
    if i != len(buf):
        raise ValueError(f"malformed {what}: truncated")
    return ints, blobs


def decode_chunk(raw: bytes) -> tuple[int, memoryview, int]:
    """A serialized `BlobChunk` -> (offset, data, blob_bytes); `data` is a view into `raw`, not a copy."""
    try:
        ints, blobs = _fields(raw, "BlobChunk")
    except ValueError as e:
        raise PeerStoreError(f"{e} (from the peer)") from None
    return ints.get(1, 0), blobs.get(2, memoryview(b"")), ints.get(3, 0)


def decode_chunk_span(raw: bytes) -> tuple[int, int, int]:
    """A serialized `BlobChunk` -> (offset, where its data starts in `raw`, its length): the reader copies
    the data from `raw` into place itself (`rawbytes.copy_into`)."""
    try:
        ints, spans = _spans(raw, "BlobChunk")
    except ValueError as e:
        raise PeerStoreError(f"{e} (from the peer)") from None
    a, b = spans.get(2, (0, 0))
    return ints.get(1, 0), a, b - a


@dataclasses.dataclass(frozen=True, slots=True)
class PutMessage:
    key: str
    total_bytes: int
    data: memoryview
    finish: bool


def decode_put(raw: bytes) -> PutMessage:
    """A serialized `PutBlobRequest`; `data` is a view into `raw`. ValueError for malformed bytes."""
    ints, blobs = _fields(raw, "PutBlobRequest")
    try:
        key = bytes(blobs[1]).decode() if 1 in blobs else ""
    except UnicodeDecodeError:
        raise ValueError("malformed PutBlobRequest: the key is not UTF-8") from None
    total = ints.get(2, 0)
    if total >= 1 << 63:
        raise ValueError("malformed PutBlobRequest: negative total_bytes")
    return PutMessage(key, total, blobs.get(3, memoryview(b"")), bool(ints.get(4, 0)))


# ---- the store ----------------------------------------------------------------------------------------------
class GrpcBlobStore:
    """A `BlobStore` over a peer agent's PeerStore service (see the module docstring)."""

    def __init__(self, location: str, *, credentials: PeerCredentials | None = None,
                 chunk_bytes: int = CHUNK_BYTES, timeout_s: float = 30.0, stream_timeout_s: float = 600.0,
                 streams: int = 1, max_bytes_per_s: float = 0.0, read_chunk_bytes: int = 0) -> None:
        PeerTransport(streams, max_bytes_per_s)   # validates
        self.location = location
        self.streams = streams
        self.limit = RateLimit(max_bytes_per_s) if max_bytes_per_s > 0 else None
        self.scheme, self.target = parse_location(location)
        creds = credentials if credentials is not None else PeerCredentials()
        self.chunk_bytes = chunk_bytes
        # reads ask for the server's largest messages unless a chunk size was chosen (tests: many messages)
        self.read_chunk_bytes = read_chunk_bytes or (
            READ_CHUNK_BYTES if chunk_bytes == CHUNK_BYTES else chunk_bytes)
        self.timeout_s = timeout_s
        self.stream_timeout_s = stream_timeout_s
        self._metadata: tuple[tuple[str, str], ...] = ()
        if creds.token_file and self.scheme != "unix":
            with open(creds.token_file) as f:
                self._metadata = (("authorization", f"Bearer {f.read().strip()}"),)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        if self.scheme == "grpc":
            if not creds.insecure:
                raise InvalidInputError(f"{location}: plain-TCP grpc:// needs the insecure setting "
                                        "(peers.insecure = true, or SDCWATCH_PEER_INSECURE=1); use grpcs://")
            _warn_insecure(location)
        # the token travels as per-call metadata (above), not channel credentials: a grpc:// peer that asks
        # for one gets it over plain TCP, which the insecure setting accepted
        ident = lambda b: b  # noqa: E731 - raw wire bytes in and out for the bulk messages
        self._lanes: list[tuple[Any, Any, Any]] = []   # (channel, PutBlob, GetBlob) per connection
        for i in range(streams):
            # a subchannel pool of its own: each channel is its own TCP (TLS) connection
            own = [("grpc.use_local_subchannel_pool", 1), ("sdcwatch.lane", i)]
            opts = options + (own if streams > 1 else [])
            ch = agent_channel(self.target, tls_ca=(creds.tls_ca or None) if self.scheme == "grpcs" else None,
                               insecure=self.scheme == "grpc", options=opts)
            self._lanes.append((ch, ch.stream_unary(SERVICE + "PutBlob", request_serializer=ident,
                                                    response_deserializer=pb.PutBlobResponse.FromString),
                                ch.unary_stream(SERVICE + "GetBlob", request_serializer=pb.GetBlobRequest.
                                                SerializeToString, response_deserializer=ident)))
        self._turn = itertools.count()
        self._parts: concurrent.futures.ThreadPoolExecutor | None = None
        self._parts_lock = threading.Lock()
        self._reading = 0   # readinto calls running now
        self._channel, self._put, self._get = self._lanes[0]
        self._pb = pb
        self._stat = self._channel.unary_unary(SERVICE + "StatBlob", request_serializer=pb.StatBlobRequest.
                                               SerializeToString, response_deserializer=pb.StatBlobResponse.FromString)
        self._list = self._channel.unary_unary(SERVICE + "ListBlobs", request_serializer=pb.ListBlobsRequest.
                                               SerializeToString,
                                               response_deserializer=pb.ListBlobsResponse.FromString)
        self._delete = self._channel.unary_unary(SERVICE + "DeleteBlob", request_serializer=pb.DeleteBlobRequest.
                                                 SerializeToString,
                                                 response_deserializer=pb.DeleteBlobResponse.FromString)
        self._sums = self._channel.unary_unary(SERVICE + "ChecksumBlob",
                                               request_serializer=pb.ChecksumBlobRequest.SerializeToString,
                                               response_deserializer=pb.ChecksumBlobResponse.FromString)

    def __repr__(self) -> str:
        return f"GrpcBlobStore({self.location!r})"

    def close(self) -> None:
        for ch, _, _ in self._lanes:
            ch.close()
        if self._parts is not None:
            self._parts.shutdown(wait=False)

    def _lane(self) -> tuple[Any, Any, Any]:
        return self._lanes[next(self._turn) % len(self._lanes)]

    # ---- BlobStore ----------------------------------------------------------------------------------------
    def put(self, key: str, data: Data) -> int:
        validate_key(key)
        total = None
        if isinstance(data, (bytes, bytearray, memoryview)):
            total = memoryview(data).nbytes
        elif isinstance(data, (list, tuple)):
            total = sum(memoryview(b).nbytes for b in data)
        _, put, _ = self._lane()
        resp = self._call(put, self._requests(key, data, total), key, timeout=self.stream_timeout_s)
        return int(resp.bytes)

    def _requests(self, key: str, data: Data, total: int | None) -> Iterator[bytes]:
        first = True
        step = self.chunk_bytes
        limit = self.limit
        for buf in as_buffers(data):
            for i in range(0, len(buf), step):
                part = buf[i:i + step]
                if limit is not None:
                    limit.take(len(part))
                yield encode_put(part, key if first else "", total if first else None)
                first = False
        yield encode_put(memoryview(b""), key if first else "", total if first else None, finish=True)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        out = bytearray()
        for _off, data in self._chunks(key, offset, length):
            out += data
        return bytes(out)

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        """A large read alone on the store is split over the streams; reads that run together (a restore's
        chunks, read by a thread pool) already fill them: each takes one stream, in turn, unsplit (no size
        lookup, no extra calls per chunk)."""
        view = memoryview(buf).cast("B")
        with self._parts_lock:
            self._reading += 1
            alone = self._reading == 1
        try:
            if self.streams > 1 and len(view) >= PARALLEL_MIN_BYTES and alone:
                return self._readinto_parallel(key, offset, view)
            return self._readinto_one(key, offset, view, self._lane()[2])
        finally:
            with self._parts_lock:
                self._reading -= 1

    def _readinto_one(self, key: str, offset: int, view: memoryview, get: Any) -> int:
        """Each message's bytes copied once, from the message into `view`, the GIL released (the streams of
        a parallel read copy at the same time)."""
        n = 0
        for raw in self._raw_chunks(key, offset, len(view), get):
            off, start, size = decode_chunk_span(raw)
            if off != offset + n or n + size > len(view):
                raise PeerStoreError(f"{self.location}: GetBlob {key!r} sent bytes out of order")
            copy_into(view[n:n + size], raw, start)
            n += size
        return n

    def _readinto_parallel(self, key: str, offset: int, view: memoryview) -> int:
        """One ranged GetBlob per stream, each on its own connection, run together. Short reads behave as
        one stream's would: the bytes up to the blob's end."""
        size = self.size(key)
        want = max(0, min(len(view), size - offset))
        if want < PARALLEL_MIN_BYTES:
            return self._readinto_one(key, offset, view, self._get)
        part = -(-want // self.streams)
        part = -(-part // self.read_chunk_bytes) * self.read_chunk_bytes   # whole messages per range
        ranges = [(a, min(part, want - a)) for a in range(0, want, part)]
        with self._parts_lock:
            if self._parts is None:
                self._parts = concurrent.futures.ThreadPoolExecutor(self.streams,
                                                                    thread_name_prefix="sdcw-peer-get")
        futs = [self._parts.submit(self._readinto_one, key, offset + a, view[a:a + n],
                                   self._lanes[i % len(self._lanes)][2])
                for i, (a, n) in enumerate(ranges)]
        got = [f.result() for f in futs]
        for (a, n), g in zip(ranges, got):
            if g != n:
                raise PeerStoreError(f"{self.location}: GetBlob {key!r} range at {offset + a} returned "
                                     f"{g} of {n} bytes (the blob changed under the read?)")
        return want

    def _chunks(self, key: str, offset: int, length: int | None,
                get: Any = None) -> Iterator[tuple[int, memoryview]]:
        for raw in self._raw_chunks(key, offset, length, get):
            off, data, _size = decode_chunk(raw)
            yield off, data

    def _raw_chunks(self, key: str, offset: int, length: int | None, get: Any = None) -> Iterator[bytes]:
        """The GetBlob response messages as received, paced by the cap."""
        validate_key(key)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"bad range offset={offset} length={length} for {key!r}")
        req = self._pb.GetBlobRequest(key=key, offset=offset, length=length or 0, to_end=length is None,
                                      chunk_bytes=self.read_chunk_bytes)
        get = get if get is not None else self._lane()[2]
        limit = self.limit
        try:
            for raw in get(req, timeout=self.stream_timeout_s, metadata=self._metadata):
                if limit is not None:
                    limit.take(len(raw))
                yield raw
        except grpc.RpcError as e:
            raise self._error(e, key) from None

    def exists(self, key: str) -> bool:
        validate_key(key)
        return bool(self._call(self._stat, self._pb.StatBlobRequest(key=key), key).exists)

    def size(self, key: str) -> int:
        validate_key(key)
        r = self._call(self._stat, self._pb.StatBlobRequest(key=key), key)
        if not r.exists:
            raise KeyError(f"no blob {key!r} at {self.location}")
        return int(r.size)

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        return list(self._call(self._list, self._pb.ListBlobsRequest(prefix=prefix), prefix).keys)

    def delete(self, key: str) -> bool:
        validate_key(key)
        return bool(self._call(self._delete, self._pb.DeleteBlobRequest(key=key), key).deleted)

    def checksums(self, key: str, ranges: list[tuple[int, int]]) -> tuple[int, list[str]]:
        """(the blob's size, xxh3-128 hex of each range) computed by the peer from what it stored: a copy
        checked without reading it back. NotImplementedError from an agent that predates the call."""
        validate_key(key)
        req = self._pb.ChecksumBlobRequest(key=key, ranges=[self._pb.ByteRange(offset=o, length=n)
                                                            for o, n in ranges])
        try:
            r = self._sums(req, timeout=self.stream_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise NotImplementedError(f"{self.location} has no ChecksumBlob (an older agent)") from None
            raise self._error(e, key) from None
        return int(r.size), list(r.checksums)

    # ---- helpers ------------------------------------------------------------------------------------------
    def _call(self, method: Any, request: Any, key: str, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, key) from None

    def _error(self, e: grpc.RpcError, key: str) -> Exception:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if code == grpc.StatusCode.NOT_FOUND:
            return KeyError(f"no blob {key!r} at {self.location}: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidInputError(f"{self.location} refused {key!r}: {details}")
        if code == grpc.StatusCode.OUT_OF_RANGE:
            return ValueError(f"{self.location}: {details}")
        name = code.name if code is not None else "UNKNOWN"
        return PeerStoreError(f"peer store {self.location}: {name}: {details}", code)


_warned: set[str] = set()


def _warn_insecure(location: str) -> None:
    if location not in _warned:
        _warned.add(location)
        log.warning("peer transport to %s is PLAIN TCP (peers.insecure): checkpoint bytes and the token "
                    "travel unencrypted", location)
