"""`S3Store`: a BlobStore on any S3-compatible object store (boto3), the durable tier.

    store = S3Store("bucket", prefix="sdcwatch/", endpoint_url="https://s3.example:9000", region="us-east-1")
    store = S3Store.from_url("s3://bucket/sdcwatch?endpoint_url=http://127.0.0.1:9000&region=us-east-1")

Credentials come from the usual AWS sources (environment, shared config/credentials files, instance or
pod roles): boto3's default chain; nothing is stored here.

- **Atomic**: an object appears only whole (PutObject, or CompleteMultipartUpload for large blobs); a
  failed multipart upload is aborted, and `sweep_temp` aborts uploads left by a killed agent.
- **Multipart with concurrency**: blobs over `part_bytes` go up in parts, `concurrency` parts in flight
  (memory bound: concurrency x part_bytes).
- **Checksums** (S3's flexible checksums): every PutObject / UploadPart carries our CRC64NVME of its bytes
  (`x-amz-checksum-crc64nvme`; `checksum=` CRC32C or CRC32 for a store without CRC64NVME; "auto" falls back
  to CRC32 where awscrt, the `s3` extra's, is missing), so the service rejects
  bytes that changed on the way; a multipart upload is a FULL_OBJECT checksum upload, completed with our CRC
  of the whole object, and the service's checksum of the stored object is compared with ours
  (`last_checksum`, `verify_stored`): how the drainer verifies the written copy without a download. A whole
  GET asks for the checksum (`ChecksumMode=ENABLED`) and botocore checks the body against it.
- **Retries**: botocore's own (`retries={"mode": "standard" | "adaptive", "max_attempts": N}`, `RetryPolicy`):
  throttling (503 SlowDown, 429), 5xx, timeouts and connection errors, with its jittered backoff (and, in
  adaptive mode, client-side rate limiting). Exhausted -> `TierUnavailableError` (transient). A response
  body that fails part-way (a read timeout, a connection reset, fewer bytes than announced) is not botocore's
  to retry: `get` asks again for the range from the last good byte, at most `max_attempts` times, and never
  returns a partial body.
- **Listings** go through botocore's paginators (list_objects_v2, list_multipart_uploads): every page, past
  the 1,000 keys or uploads of one.
- **Spread key prefixes**: S3 partitions by key prefix; keys of many jobs and steps starting with the same
  characters would share one hot partition. A key `job/step/name` is stored as
  `<prefix><2 hex digits of xxh32("job/step")>/job/step/name`, so the shards of one checkpoint stay together
  (one partition lists them) and checkpoints spread over 256 prefixes.
- **Ranged reads**: `get(key, offset, length)` / `readinto` issue a Range GET.
"""
from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import logging
import threading
import urllib.parse
import zlib
from typing import Any, Callable, Iterator, TypeVar

import xxhash

from checkpoint.blobstore import Data, as_buffers, check_range
from checkpoint.errors import CheckpointError, InvalidInputError
from checkpoint.names import validate_key, validate_prefix
from sdcwatch import errors

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_PART_BYTES = 5 << 20           # S3's minimum for every part but the last
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "TooManyRequests",
                    "RequestLimitExceeded", "OperationAborted"}
_READ_BYTES = 1 << 20              # a GET body is read this much at a time


class TierUnavailableError(CheckpointError):
    """A tier's store cannot be reached or keeps failing transiently (S3 down, throttled past the retries)."""

    transient = True


class StoredChecksumMismatch(CheckpointError):
    """The object store holds something other than what was sent (its checksum differs from ours); sending it
    again may succeed."""

    transient = True


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """botocore's retry mode and attempts per request (the first try included); `max_attempts` also bounds
    the re-reads of a GET body that failed part-way."""

    max_attempts: int = 8
    mode: str = "standard"          # or "adaptive" (client-side rate limiting on throttling)

    def __post_init__(self) -> None:
        if self.mode not in ("standard", "adaptive", "legacy"):
            raise InvalidInputError(f"retry mode must be standard, adaptive or legacy, got {self.mode!r}")
        if self.max_attempts < 1:
            raise InvalidInputError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def botocore(self) -> dict[str, Any]:
        return {"mode": self.mode, "max_attempts": self.max_attempts}


ALGORITHMS = ("CRC64NVME", "CRC32C", "CRC32")   # S3's full-object flexible checksums


class _Crc:
    """The running checksum of an upload: CRC64NVME (S3's default) or CRC32C (both need awscrt), or CRC32
    (zlib)."""

    def __init__(self, algorithm: str) -> None:
        if algorithm == "CRC32":
            self._fn: Callable[[Any, int], int] = zlib.crc32
        else:
            from awscrt import checksums   # ImportError without the s3 extra's awscrt

            self._fn = checksums.crc64nvme if algorithm == "CRC64NVME" else checksums.crc32c
        self.algorithm, self.width = algorithm, 8 if algorithm == "CRC64NVME" else 4
        self.value = 0

    def update(self, buf: Any) -> "_Crc":
        self.value = self._fn(buf, self.value)
        return self

    def b64(self) -> str:
        return base64.b64encode(self.value.to_bytes(self.width, "big")).decode()

    @classmethod
    def of(cls, algorithm: str, buf: Any) -> "_Crc":
        return cls(algorithm).update(buf)


def checksum_algorithm(wanted: str = "auto") -> str:
    """The flexible checksum to upload with: `wanted`, or for "auto" CRC64NVME with awscrt, else CRC32.
    InvalidInputError for an unknown name, or CRC64NVME / CRC32C without awscrt."""
    if wanted not in ("auto", *ALGORITHMS):
        raise InvalidInputError(f"S3 checksum must be auto or one of {', '.join(ALGORITHMS)}, got {wanted!r}")
    try:
        import awscrt.checksums  # noqa: F401
        have_crt = True
    except ImportError:
        have_crt = False
    if wanted == "auto":
        return "CRC64NVME" if have_crt else "CRC32"
    if wanted != "CRC32" and not have_crt:
        raise InvalidInputError(f"the S3 checksum {wanted} needs awscrt (pip install 'sdcwatch[s3]'); or use CRC32")
    return wanted


def _body_failed(exc: BaseException) -> bool:
    """A GET body read that broke part-way: worth asking again for the rest."""
    from botocore.exceptions import (ConnectionClosedError, IncompleteReadError, ReadTimeoutError,
                                     ResponseStreamingError)

    return isinstance(exc, (ReadTimeoutError, ResponseStreamingError, IncompleteReadError, ConnectionClosedError,
                            ConnectionError, TimeoutError))


def is_transient(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts and connection failures: worth retrying (and what sdcwatch's own errors
    say of themselves, `sdcwatch.errors.is_transient`)."""
    from botocore.exceptions import (BotoCoreError, ClientError, ConnectionClosedError, ConnectTimeoutError,
                                     EndpointConnectionError, ReadTimeoutError)

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return err.get("Code", "") in _TRANSIENT_CODES or status >= 500 or status == 429
    if isinstance(exc, (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError, ReadTimeoutError)):
        return True
    return isinstance(exc, BotoCoreError) or errors.is_transient(exc)


def _not_found(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code in ("404", "NoSuchKey", "NotFound") or status == 404


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None, endpoint_url: str | None = None,
                 region: str | None = None, part_bytes: int = 16 << 20, concurrency: int = 4,
                 retry: RetryPolicy | None = None, spread: bool = True, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 60.0, checksum: str = "auto") -> None:
        if not bucket or "/" in bucket:
            raise InvalidInputError(f"S3 bucket name must be non-empty without '/', got {bucket!r}")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if part_bytes < MIN_PART_BYTES:
            raise InvalidInputError(f"part_bytes must be >= {MIN_PART_BYTES} (S3's minimum), got {part_bytes}")
        if concurrency < 1:
            raise InvalidInputError(f"concurrency must be >= 1, got {concurrency}")
        self.bucket, self.prefix, self.spread = bucket, prefix, spread
        self.endpoint_url, self.region = endpoint_url, region
        self.part_bytes, self.concurrency = part_bytes, concurrency
        self.retry_policy = retry or RetryPolicy()
        self.algorithm = checksum_algorithm(checksum)
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region,
                config=Config(retries=self.retry_policy.botocore(),   # type: ignore[arg-type]
                              max_pool_connections=max(10, 2 * concurrency),
                              connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                              request_checksum_calculation="when_supported",
                              response_checksum_validation="when_supported"))
        self.client = client
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="sdcw-s3-part")
        self._local = threading.local()
        self._sent: dict[str, str] = {}       # key -> the checksum we computed at put (bounded)
        self._sent_lock = threading.Lock()
        self.retries = 0            # requests botocore retried, and GET bodies read again from the last good byte

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> "S3Store":
        """`s3://bucket/prefix?endpoint_url=...&region=...` (the location a restore plan carries)."""
        u = urllib.parse.urlsplit(url)
        if u.scheme != "s3" or not u.netloc:
            raise InvalidInputError(f"not an s3:// URL: {url!r}")
        q = dict(urllib.parse.parse_qsl(u.query))
        return cls(u.netloc, u.path.lstrip("/"), endpoint_url=q.get("endpoint_url") or None,
                   region=q.get("region") or None, **kw)

    @property
    def location(self) -> str:
        q = {k: v for k, v in (("endpoint_url", self.endpoint_url), ("region", self.region)) if v}
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}" + (f"?{urllib.parse.urlencode(q)}" if q else "")

    def __repr__(self) -> str:
        return f"S3Store({self.location!r})"

    # ---- keys ----------------------------------------------------------------------------------------
    def _partition(self, key: str) -> str:
        segs = key.split("/")
        head = "/".join(segs[:2]) if len(segs) >= 3 else "/".join(segs[:-1])
        return f"{xxhash.xxh32_intdigest(head.encode()) & 0xFF:02x}/" if self.spread else ""

    def object_key(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}{self._partition(key)}{key}"

    def _store_key(self, object_key: str) -> str | None:
        rest = object_key[len(self.prefix):]
        if self.spread:
            part, _, rest = rest.partition("/")
            if len(part) != 2 or not rest:
                return None
        return rest

    # ---- calls -------------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], **kw: Any) -> T:
        """One API call; botocore retries it (`RetryPolicy`). Its retries are counted; a transient failure
        that outlived them is a `TierUnavailableError`."""
        try:
            resp = fn(**kw)
        except Exception as e:  # noqa: BLE001 - classified below
            err = self._failed(what, e)
            if err is e:
                raise
            raise err from e
        self._count_retries(resp)
        return resp

    def _failed(self, what: str, e: Exception) -> Exception:
        """What a failed call raises: `e` itself (not found, or not transient), else `TierUnavailableError`."""
        self._count_retries(getattr(e, "response", None))
        if _not_found(e) or not is_transient(e):
            return e
        return TierUnavailableError(f"S3 {what} on bucket {self.bucket!r} failed after "
                                    f"{self.retry_policy.max_attempts} attempt(s): {e}")

    def _count_retries(self, resp: Any) -> None:
        if isinstance(resp, dict):
            self.retries += int(resp.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)

    # ---- BlobStore -----------------------------------------------------------------------------------
    def put(self, key: str, data: Data) -> int:
        """Store atomically; returns the bytes written. `last_checksum` (thread-local) holds the service's
        checksum of the object and whether it matched ours."""
        okey = self.object_key(key)
        size = 0
        buf = bytearray()
        upload: _Multipart | None = None
        try:
            for piece in as_buffers(data):
                view = piece
                while len(view):
                    take = min(len(view), self.part_bytes - len(buf))
                    buf += view[:take]
                    view = view[take:]
                    size += take
                    if len(buf) == self.part_bytes:
                        if upload is None:
                            upload = _Multipart(self, okey)
                        upload.add(bytes(buf))
                        buf = bytearray()
            if upload is None:
                b64 = _Crc.of(self.algorithm, buf).b64()
                resp = self._call("put", self.client.put_object, Bucket=self.bucket, Key=okey, Body=bytes(buf),
                                  ChecksumAlgorithm=self.algorithm, **{f"Checksum{self.algorithm}": b64})
                self._check_service_checksum(key, b64, resp.get(f"Checksum{self.algorithm}"))
                return size
            if buf:
                upload.add(bytes(buf))
            upload.complete(key)
            upload = None
            return size
        except BaseException:
            if upload is not None:
                upload.abort()
            raise

    def _check_service_checksum(self, key: str, ours: str, theirs: str | None) -> None:
        self._local.last = (ours, theirs)
        with self._sent_lock:
            self._sent[key] = ours
            while len(self._sent) > 4096:
                self._sent.pop(next(iter(self._sent)))
        if theirs is not None and theirs != ours:
            raise StoredChecksumMismatch(f"S3 stored {key!r} with checksum {theirs}, we sent {ours}")

    @property
    def last_checksum(self) -> tuple[str, str | None] | None:
        """(our full-object CRC, the service's) of this thread's last put."""
        return getattr(self._local, "last", None)

    def verify_stored(self, key: str) -> bool | None:
        """Does the service's checksum of `key` equal the one this store computed when it put it? None when
        either is unknown (the service keeps none, or this process did not write it)."""
        with self._sent_lock:
            ours = self._sent.get(key)
        if ours is None:
            return None
        theirs = self.stored_checksum(key)
        if theirs is None:
            return None
        return theirs == ours

    def stored_checksum(self, key: str) -> str | None:
        """The service's full-object checksum of the stored object (our algorithm), if it keeps one."""
        resp = self._call("head", self.client.head_object, Bucket=self.bucket, Key=self.object_key(key),
                          ChecksumMode="ENABLED")
        return resp.get(f"Checksum{self.algorithm}")

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        okey = self.object_key(key)
        size = self.size(key)
        off, n = check_range(offset, length, size, key)
        if n == 0:
            return b""
        out = bytearray(n)
        self._read_range(key, okey, off, memoryview(out), whole=off == 0 and n == size)
        return bytes(out)

    def _read_range(self, key: str, okey: str, off: int, out: memoryview, whole: bool) -> None:
        """Fill `out` with the object's bytes from `off`: a body that breaks part-way is asked again for the
        range from the last good byte (botocore retries requests, not bodies), at most `max_attempts` times.
        A whole-object GET has botocore check the service's checksum (a mismatch: read it all again)."""
        from botocore.exceptions import FlexibleChecksumError

        n, got, attempts = len(out), 0, 0
        while got < n:
            attempts += 1
            kw: dict[str, Any] = {"Bucket": self.bucket, "Key": okey}
            if whole and got == 0:
                kw["ChecksumMode"] = "ENABLED"   # S3 sends the checksum with whole GETs only, never with a Range
            else:
                kw["Range"] = f"bytes={off + got}-{off + n - 1}"
            try:
                resp = self._call("get", self.client.get_object, **kw)
            except Exception as e:
                if _not_found(e):
                    raise KeyError(f"no blob {key!r} in {self.location}") from None
                raise
            body, start = resp["Body"], got
            try:
                while got < n:
                    chunk = body.read(min(_READ_BYTES, n - got))
                    if not chunk:
                        break
                    out[got:got + len(chunk)] = chunk
                    got += len(chunk)
                if "ChecksumMode" in kw:
                    body.read()   # at the end: botocore compares the body with the service's checksum
            except FlexibleChecksumError as e:
                got = 0           # the whole body is suspect: read it all again
                err: BaseException = e
            except Exception as e:  # noqa: BLE001 - classified below
                if not _body_failed(e):
                    raise
                err = e
            else:
                if got == n:
                    return
                err = ConnectionError(f"the body ended after {got - start} of {n - start} bytes")
            finally:
                body.close()
            if attempts >= self.retry_policy.max_attempts:
                if isinstance(err, FlexibleChecksumError):
                    raise StoredChecksumMismatch(f"S3 {key!r}: the body never matched the service's checksum "
                                                 f"in {attempts} reads: {err}") from err
                raise TierUnavailableError(f"S3 get of {key!r}: the body failed {attempts} times "
                                           f"({got} of {n} bytes read): {err}") from err
            self.retries += 1
            log.info("S3 get %s: body failed at byte %d of %d (%s); reading again from there", key, got, n, err)

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        size = self.size(key)
        off, n = check_range(offset, len(view), size, key)
        if n:
            self._read_range(key, self.object_key(key), off, view[:n], whole=off == 0 and n == size)
        return n

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except KeyError:
            return False

    def size(self, key: str) -> int:
        try:
            resp = self._call("head", self.client.head_object, Bucket=self.bucket, Key=self.object_key(key))
        except Exception as e:
            if _not_found(e):
                raise KeyError(f"no blob {key!r} in {self.location}") from None
            raise
        return int(resp["ContentLength"])

    def _iter_objects(self, s3_prefix: str) -> Iterator[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=s3_prefix)
        for page in self._pages("list", pages):
            yield from page.get("Contents", [])

    def _pages(self, what: str, pages: Any) -> Iterator[dict[str, Any]]:
        it = iter(pages)
        while True:
            try:
                page = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 - classified by _failed
                err = self._failed(what, e)
                if err is e:
                    raise
                raise err from e
            self._count_retries(page)
            yield page

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        if prefix.count("/") >= 2:  # two whole segments named: one partition holds every match
            first = prefix.rsplit("/", 1)[0] + "/x"
            s3_prefix = self.object_key(first)[:-1] + prefix.rsplit("/", 1)[1]
        else:
            s3_prefix = self.prefix
        out = []
        for obj in self._iter_objects(s3_prefix):
            k = self._store_key(obj["Key"])
            if k is not None and k.startswith(prefix):
                out.append(k)
        return sorted(out)

    def delete(self, key: str) -> bool:
        if not self.exists(key):
            return False
        self._call("delete", self.client.delete_object, Bucket=self.bucket, Key=self.object_key(key))
        return True

    def sweep_temp(self, older_than_s: float, now: float) -> int:
        """Abort multipart uploads under this prefix begun more than `older_than_s` ago (a killed agent's);
        every page of the listing (more than 1,000 uploads)."""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.prefix)
        stale = [u for page in self._pages("list_uploads", pages) for u in page.get("Uploads", [])
                 if u.get("Initiated") is not None and now - u["Initiated"].timestamp() > older_than_s]
        n = 0
        for u in stale:
            try:
                self._call("abort", self.client.abort_multipart_upload, Bucket=self.bucket, Key=u["Key"],
                           UploadId=u["UploadId"])
                n += 1
            except Exception as e:  # noqa: BLE001 - best effort
                log.info("aborting stale upload %s failed: %s", u.get("Key"), e)
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Multipart:
    """One multipart upload with a FULL_OBJECT checksum: parts go up on the store's pool, at most
    `concurrency` in flight, each with its own CRC; the completion carries our CRC of the whole object."""

    def __init__(self, store: S3Store, okey: str) -> None:
        self.store, self.okey = store, okey
        resp = store._call("create_upload", store.client.create_multipart_upload, Bucket=store.bucket, Key=okey,
                           ChecksumAlgorithm=store.algorithm, ChecksumType="FULL_OBJECT")
        self.upload_id = resp["UploadId"]
        self.futures: list[concurrent.futures.Future[dict[str, Any]]] = []
        self.whole = _Crc(store.algorithm)
        self.slots = threading.Semaphore(store.concurrency)

    def add(self, body: bytes) -> None:
        number = len(self.futures) + 1
        self.whole.update(body)
        b64 = _Crc.of(self.store.algorithm, body).b64()
        self.slots.acquire()
        for f in self.futures:  # fail early when a part already failed
            if f.done() and f.exception() is not None:
                self.slots.release()
                raise f.exception()  # type: ignore[misc]
        fut = self.store._pool.submit(self._upload, number, body, b64)
        fut.add_done_callback(lambda _f: self.slots.release())
        self.futures.append(fut)

    def _upload(self, number: int, body: bytes, b64: str) -> dict[str, Any]:
        s = self.store
        field = f"Checksum{s.algorithm}"
        resp = s._call("upload_part", s.client.upload_part, Bucket=s.bucket, Key=self.okey, UploadId=self.upload_id,
                       PartNumber=number, Body=body, ChecksumAlgorithm=s.algorithm, **{field: b64})
        theirs = resp.get(field)
        if theirs is not None and theirs != b64:
            raise StoredChecksumMismatch(f"S3 part {number} of {self.okey}: stored checksum {theirs}, sent {b64}")
        return {"PartNumber": number, "ETag": resp["ETag"], field: b64}

    def complete(self, key: str) -> None:
        s = self.store
        field = f"Checksum{s.algorithm}"
        parts = [f.result() for f in self.futures]
        ours = self.whole.b64()
        resp = s._call("complete_upload", s.client.complete_multipart_upload, Bucket=s.bucket, Key=self.okey,
                       UploadId=self.upload_id, MultipartUpload={"Parts": parts}, ChecksumType="FULL_OBJECT",
                       **{field: ours})
        s._check_service_checksum(key, ours, resp.get(field))

    def abort(self) -> None:
        for f in self.futures:
            f.cancel()
        concurrent.futures.wait(self.futures)
        try:
            self.store.client.abort_multipart_upload(Bucket=self.store.bucket, Key=self.okey, UploadId=self.upload_id)
        except Exception as e:  # noqa: BLE001 - sweep_temp retries later
            log.info("aborting upload of %s failed: %s", self.okey, e)


_by_url: dict[str, S3Store] = {}
_by_url_lock = threading.Lock()


def s3_store_for(url: str) -> S3Store:
    """One S3Store per location URL in this process (restore plans name S3 copies by URL)."""
    with _by_url_lock:
        store = _by_url.get(url)
        if store is None:
            store = _by_url[url] = S3Store.from_url(url)
        return store
