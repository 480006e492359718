"""S3Store against moto's S3 over HTTP: multipart, flexible checksums, spread prefixes, botocore's retries on
throttling and outages, GET bodies that die part-way, listings past 1,000 keys and uploads."""
from __future__ import annotations

import os

import pytest

from checkpoint.s3_store import RetryPolicy, S3Store, TierUnavailableError, is_transient
from tier_support import MotoS3, Throttler, moto_s3  # noqa: F401 - fixture


def test_multipart_round_trip_with_service_checksum(moto_s3: MotoS3) -> None:
    s = moto_s3.store(concurrency=3)
    data = os.urandom((12 << 20) + 123)
    # streamed in odd pieces: parts are re-cut at 5 MiB, 3 in flight
    pieces = [memoryview(data)[i:i + 3_000_001] for i in range(0, len(data), 3_000_001)]
    assert s.put("job/000000000007/rank-00000.bin", pieces) == len(data)
    assert s.get("job/000000000007/rank-00000.bin") == data
    assert s.get("job/000000000007/rank-00000.bin", (5 << 20) - 3, 10) == data[(5 << 20) - 3:(5 << 20) + 7]
    ours, theirs = s.last_checksum
    assert s.algorithm == "CRC64NVME" and theirs in (None, ours)  # moto answers no checksum on completion
    assert s.verify_stored("job/000000000007/rank-00000.bin") is True
    head = s.client.head_object(Bucket=s.bucket, Key=s.object_key("job/000000000007/rank-00000.bin"),
                                ChecksumMode="ENABLED")
    assert head["ChecksumCRC64NVME"] == ours and head.get("ChecksumType") in (None, "FULL_OBJECT")
    assert not s.client.list_multipart_uploads(Bucket=s.bucket).get("Uploads")


def test_failed_multipart_is_aborted_and_nothing_listed(moto_s3: MotoS3) -> None:
    s = moto_s3.store()

    def dies():
        yield b"x" * (6 << 20)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError):
        s.put("j/000000000001/rank-00000.bin", dies())
    assert s.list("j/") == []
    assert not s.client.list_multipart_uploads(Bucket=s.bucket).get("Uploads")


def test_keys_spread_over_prefixes_and_one_checkpoint_stays_together(moto_s3: MotoS3) -> None:
    s = moto_s3.store()
    for step in range(12):
        for r in range(2):
            s.put(f"job/{step:012d}/rank-{r:05d}.bin", b"1")
    objs = [o["Key"] for o in s.client.list_objects_v2(Bucket=s.bucket)["Contents"]]
    parts = {k.split("/")[1] for k in objs}
    assert len(parts) >= 6                                       # 12 checkpoints over many partitions
    for step in range(12):
        assert len({k.split("/")[1] for k in objs if f"/{step:012d}/" in k}) == 1
    assert s.list("job/000000000003/") == ["job/000000000003/rank-00000.bin", "job/000000000003/rank-00001.bin"]
    assert len(s.list("job/")) == 24


def test_throttling_is_retried_by_botocore(moto_s3: MotoS3) -> None:
    s = moto_s3.store(retry=RetryPolicy(max_attempts=3))
    t = Throttler(s.client, 2)
    s.put("t/000000000001/rank-00000.bin", b"abc")
    assert t.sent == 2 and s.retries == 2                        # botocore's standard mode retried the 503s
    assert s.get("t/000000000001/rank-00000.bin") == b"abc"
    Throttler(s.client, 100)
    with pytest.raises(TierUnavailableError, match="after 3 attempt"):
        s.put("t/000000000002/rank-00000.bin", b"abc")


def test_s3_down_is_a_transient_tier_error() -> None:
    from conftest import free_port

    s = S3Store("bucket", "p", endpoint_url=f"http://127.0.0.1:{free_port()}", region="us-east-1",
                retry=RetryPolicy(max_attempts=1), connect_timeout_s=0.5)
    with pytest.raises(TierUnavailableError) as e:
        s.put("a/000000000001/b", b"x")
    assert e.value.transient and is_transient(e.value.__cause__)


def test_retry_policy_is_botocores() -> None:
    assert RetryPolicy(5, "adaptive").botocore() == {"mode": "adaptive", "max_attempts": 5}
    with pytest.raises(ValueError, match="retry mode"):
        RetryPolicy(mode="sometimes")
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_from_url_round_trips_location(moto_s3: MotoS3) -> None:
    s = moto_s3.store()
    again = S3Store.from_url(s.location)
    assert (again.bucket, again.prefix, again.endpoint_url, again.region) == (s.bucket, s.prefix, s.endpoint_url,
                                                                              s.region)
    with pytest.raises(ValueError):
        S3Store.from_url("http://x/y")


class DyingBodies:
    """Failure injection: the next `n` GetObject bodies of a client die after `after` bytes, as a connection
    reset does (urllib3's ProtocolError under botocore's StreamingBody) or a read timeout (`timeout=True`).
    A botocore after-call hook swaps the parsed body's raw stream; the bytes before the failure are real."""

    def __init__(self, client, n: int, after: int, timeout: bool = False) -> None:
        self.left, self.after, self.timeout, self.died = n, after, timeout, 0
        client.meta.events.register("after-call.s3.GetObject", self._hook)

    def _hook(self, parsed, **_kw) -> None:
        if self.left <= 0 or "Body" not in parsed:
            return
        self.left -= 1
        body = parsed["Body"]
        body._raw_stream = _Dying(body._raw_stream, self.after, self)


class _Dying:
    def __init__(self, raw, after: int, owner: DyingBodies) -> None:
        self.raw, self.left, self.owner = raw, after, owner

    def read(self, amt=None):
        from urllib3.exceptions import ProtocolError, ReadTimeoutError

        if self.left <= 0:
            self.owner.died += 1
            if self.owner.timeout:
                raise ReadTimeoutError(None, None, "Read timed out.")
            raise ProtocolError("Connection broken: connection reset by peer")
        chunk = self.raw.read(min(amt or self.left, self.left))
        self.left -= len(chunk)
        return chunk

    def __getattr__(self, name):
        return getattr(self.raw, name)


@pytest.mark.parametrize("timeout", [False, True], ids=["reset", "read-timeout"])
def test_a_body_that_dies_part_way_is_read_again_from_the_last_good_byte(moto_s3: MotoS3, timeout: bool) -> None:
    """The old retry read the same broken body again and returned its tail with no error; now the range from
    the last good byte is asked for again, and the bytes are whole (or an error, never a partial body)."""
    s = moto_s3.store(retry=RetryPolicy(max_attempts=4))
    data = os.urandom((3 << 20) + 17)
    key = "d/000000000001/rank-00000.bin"
    s.put(key, data)
    inject = DyingBodies(s.client, n=2, after=700_001, timeout=timeout)
    assert s.get(key) == data
    assert inject.died == 2 and s.retries >= 2
    DyingBodies(s.client, n=2, after=5)
    buf = bytearray(1 << 20)
    assert s.readinto(key, 1000, memoryview(buf)) == len(buf) and bytes(buf) == data[1000:1000 + len(buf)]
    DyingBodies(s.client, n=100, after=100_000)       # every read dies: an error, not a short body
    with pytest.raises(TierUnavailableError, match="body failed 4 times"):
        s.get(key)


def test_a_corrupt_whole_body_fails_botocores_checksum_and_is_read_again(moto_s3: MotoS3) -> None:
    """A whole-object GET asks for the service's CRC (ChecksumMode=ENABLED): a body that changed on the way
    fails botocore's check and is read again from the start."""
    s = moto_s3.store(retry=RetryPolicy(max_attempts=3))
    data = os.urandom(200_000)
    key = "c/000000000001/rank-00000.bin"
    s.put(key, data)
    flips = {"left": 1}

    def flip(parsed, **_kw) -> None:
        if flips["left"] <= 0 or "Body" not in parsed:
            return
        flips["left"] -= 1
        assert type(parsed["Body"]).__name__ == "StreamingChecksumBody"   # botocore checks the CRC as it reads
        raw = parsed["Body"]._raw_stream

        class Flipped:
            def __init__(self) -> None:
                self.first = True

            def read(self, amt=None):
                chunk = raw.read(amt)
                if self.first and chunk:
                    self.first = False
                    return bytes([chunk[0] ^ 1]) + chunk[1:]
                return chunk

            def __getattr__(self, name):
                return getattr(raw, name)

        parsed["Body"]._raw_stream = Flipped()

    s.client.meta.events.register("after-call.s3.GetObject", flip)
    assert s.get(key) == data and flips["left"] == 0 and s.retries >= 1


def test_listings_page_past_1000_objects_and_uploads(moto_s3: MotoS3) -> None:
    """list_objects_v2 and list_multipart_uploads answer 1,000 at most per page: every page is read."""
    import concurrent.futures
    import time

    s = moto_s3.store()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s.client.put_object(Bucket=s.bucket, Key=s.object_key(f"many/{i:012d}/r"),
                                                    Body=b"x"), range(1005)))
        list(pool.map(lambda i: s.client.create_multipart_upload(Bucket=s.bucket, Key=f"{s.prefix}tmp/{i}"),
                      range(1003)))
    assert len(s.list("many/")) == 1005
    assert s.sweep_temp(older_than_s=-60, now=time.time()) == 1003
    assert not s.client.list_multipart_uploads(Bucket=s.bucket).get("Uploads")


def test_crc32_for_a_store_without_crc64nvme_and_bad_names_refused(moto_s3: MotoS3) -> None:
    s = moto_s3.store(checksum="CRC32")
    data = os.urandom((5 << 20) + 99)                  # two parts: a FULL_OBJECT CRC32 upload
    key = "k/000000000001/rank-00000.bin"
    s.put(key, data)
    assert s.algorithm == "CRC32" and s.verify_stored(key) is True and s.get(key) == data
    with pytest.raises(ValueError, match="S3 checksum must be"):
        moto_s3.store(checksum="MD5")
