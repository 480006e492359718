"""`S3Store`: a BlobStore on any S3-compatible object store (boto3), the durable tier.

    store = S3Store("bucket", prefix="sdcwatch/", endpoint_url="https://s3.example:9000", region="us-east-1")
    store = S3Store.from_url("s3://bucket/sdcwatch?endpoint_url=http://127.0.0.1:9000&region=us-east-1")

Credentials come from the usual AWS sources (environment, shared config/credentials files, instance or
pod roles): boto3's default chain; nothing is stored here.

- **Atomic**: an object appears only whole (PutObject, or CompleteMultipartUpload for large blobs); a
  failed multipart upload is aborted, and `sweep_temp` aborts uploads left by a killed agent.
- **Multipart with concurrency**: blobs over `part_bytes` go up in parts, `concurrency` parts in flight
  (memory bound: concurrency x part_bytes).
- **Checksums**: every PutObject / UploadPart carries its SHA-256 (`x-amz-checksum-sha256`), so the service
  rejects bytes that changed on the way; the service's composite checksum returned on completion is
  compared with ours (`last_checksum`), which is how the drainer verifies the written copy without a
  download.
- **Retries**: throttling (503 SlowDown, 429), 5xx, timeouts and connection errors are retried with full
  jitter exponential backoff (`retry_policy.backoff_s`), up to `max_attempts`; botocore's own retries are
  off so the schedule is ours. Exhausted -> `TierUnavailableError` (transient).
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
import hashlib
import logging
import random
import threading
import time
import urllib.parse
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


class TierUnavailableError(CheckpointError):
    """A tier's store cannot be reached or keeps failing transiently (S3 down, throttled past the retries)."""

    transient = True


class StoredChecksumMismatch(CheckpointError):
    """The object store holds something other than what was sent (its checksum differs from ours); sending it
    again may succeed."""

    transient = True


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 8
    base_s: float = 0.1
    cap_s: float = 20.0

    def backoff_s(self, attempt: int, rnd: Callable[[], float] = random.random) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)) before retry number `attempt` (0-based)."""
        return rnd() * min(self.cap_s, self.base_s * (2 ** attempt))


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


def _sha256_b64(buf: Any) -> tuple[bytes, str]:
    d = hashlib.sha256(buf).digest()
    return d, base64.b64encode(d).decode()


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None, endpoint_url: str | None = None,
                 region: str | None = None, part_bytes: int = 16 << 20, concurrency: int = 4,
                 retry: RetryPolicy | None = None, spread: bool = True, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 60.0, sleep: Callable[[float], None] = time.sleep) -> None:
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
        self.sleep = sleep
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region,
                config=Config(retries={"total_max_attempts": 1}, max_pool_connections=max(10, 2 * concurrency),
                              connect_timeout=connect_timeout_s, read_timeout=read_timeout_s))
        self.client = client
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="sdcw-s3-part")
        self._local = threading.local()
        self._sent: dict[str, str] = {}       # key -> the checksum we computed at put (bounded)
        self._sent_lock = threading.Lock()
        self.retries = 0            # transient failures retried (all calls)

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

    # ---- retries -------------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], **kw: Any) -> T:
        last: BaseException | None = None
        for attempt in range(self.retry_policy.max_attempts):
            try:
                return fn(**kw)
            except Exception as e:  # noqa: BLE001 - classified below
                if _not_found(e) or not is_transient(e):
                    raise
                last = e
                self.retries += 1
                if attempt + 1 < self.retry_policy.max_attempts:
                    delay = self.retry_policy.backoff_s(attempt)
                    log.info("S3 %s %s: transient error (%s), retry %d in %.2fs", what, self.bucket, e,
                             attempt + 1, delay)
                    self.sleep(delay)
        raise TierUnavailableError(
            f"S3 {what} on bucket {self.bucket!r} failed {self.retry_policy.max_attempts} times: {last}") from last

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
                digest, b64 = _sha256_b64(buf)
                resp = self._call("put", self.client.put_object, Bucket=self.bucket, Key=okey, Body=bytes(buf),
                                  ChecksumSHA256=b64)
                self._check_service_checksum(key, b64, resp.get("ChecksumSHA256"))
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
        """(our SHA-256 or composite checksum, the service's) of this thread's last put."""
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
        return theirs.split("-")[0] == ours.split("-")[0]

    def stored_checksum(self, key: str) -> str | None:
        """The service's SHA-256 checksum of the stored object (composite `...-N` for multipart), if it keeps one."""
        resp = self._call("head", self.client.head_object, Bucket=self.bucket, Key=self.object_key(key),
                          ChecksumMode="ENABLED")
        return resp.get("ChecksumSHA256")

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        okey = self.object_key(key)
        size = self.size(key)
        off, n = check_range(offset, length, size, key)
        if n == 0:
            return b""
        try:
            resp = self._call("get", self.client.get_object, Bucket=self.bucket, Key=okey,
                              Range=f"bytes={off}-{off + n - 1}")
        except Exception as e:
            if _not_found(e):
                raise KeyError(f"no blob {key!r} in {self.location}") from None
            raise
        return self._call("read", resp["Body"].read)

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        data = self.get(key, offset, len(view))
        view[: len(data)] = data
        return len(data)

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
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": s3_prefix}
            if token:
                kw["ContinuationToken"] = token
            resp = self._call("list", self.client.list_objects_v2, **kw)
            yield from resp.get("Contents", [])
            if not resp.get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")

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
        """Abort multipart uploads under this prefix begun more than `older_than_s` ago (a killed agent's)."""
        resp = self._call("list_uploads", self.client.list_multipart_uploads, Bucket=self.bucket, Prefix=self.prefix)
        n = 0
        for u in resp.get("Uploads", []):
            started = u.get("Initiated")
            if started is not None and now - started.timestamp() > older_than_s:
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
    """One multipart upload: parts go up on the store's pool, at most `concurrency` in flight."""

    def __init__(self, store: S3Store, okey: str) -> None:
        self.store, self.okey = store, okey
        resp = store._call("create_upload", store.client.create_multipart_upload, Bucket=store.bucket, Key=okey,
                           ChecksumAlgorithm="SHA256")
        self.upload_id = resp["UploadId"]
        self.futures: list[concurrent.futures.Future[dict[str, Any]]] = []
        self.digests: list[bytes] = []
        self.slots = threading.Semaphore(store.concurrency)

    def add(self, body: bytes) -> None:
        number = len(self.futures) + 1
        digest, b64 = _sha256_b64(body)
        self.digests.append(digest)
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
        resp = s._call("upload_part", s.client.upload_part, Bucket=s.bucket, Key=self.okey, UploadId=self.upload_id,
                       PartNumber=number, Body=body, ChecksumSHA256=b64)
        theirs = resp.get("ChecksumSHA256")
        if theirs is not None and theirs != b64:
            raise StoredChecksumMismatch(f"S3 part {number} of {self.okey}: stored checksum {theirs}, sent {b64}")
        return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": b64}

    def complete(self, key: str) -> None:
        s = self.store
        parts = [f.result() for f in self.futures]
        resp = s._call("complete_upload", s.client.complete_multipart_upload, Bucket=s.bucket, Key=self.okey,
                       UploadId=self.upload_id, MultipartUpload={"Parts": parts})
        ours = base64.b64encode(hashlib.sha256(b"".join(self.digests)).digest()).decode() + f"-{len(parts)}"
        theirs = resp.get("ChecksumSHA256")
        s._check_service_checksum(key, ours, theirs if theirs is None or "-" in theirs else theirs + f"-{len(parts)}")

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
