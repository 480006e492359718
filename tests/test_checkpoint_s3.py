"""S3Store against moto's S3 over HTTP: multipart, checksums, spread prefixes, throttling and outages."""
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
    ours, _ = s.last_checksum
    assert ours.endswith("-3")                                   # composite of three parts
    assert s.verify_stored("job/000000000007/rank-00000.bin") is True
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


def test_throttling_is_retried_with_backoff(moto_s3: MotoS3) -> None:
    slept: list[float] = []
    s = moto_s3.store(retry=RetryPolicy(max_attempts=6, base_s=0.01, cap_s=1.0), sleep=slept.append)
    t = Throttler(s.client, 3)
    s.put("t/000000000001/rank-00000.bin", b"abc")
    assert t.sent == 3 and s.retries == 3 and len(slept) == 3
    assert all(0 <= d < 0.01 * 2 ** i for i, d in enumerate(slept))  # full jitter under the doubling cap
    assert s.get("t/000000000001/rank-00000.bin") == b"abc"
    Throttler(s.client, 100)
    with pytest.raises(TierUnavailableError, match="failed 6 times"):
        s.put("t/000000000002/rank-00000.bin", b"abc")


def test_s3_down_is_a_transient_tier_error() -> None:
    from conftest import free_port

    s = S3Store("bucket", "p", endpoint_url=f"http://127.0.0.1:{free_port()}", region="us-east-1",
                retry=RetryPolicy(max_attempts=2, base_s=0.001), connect_timeout_s=0.5)
    with pytest.raises(TierUnavailableError) as e:
        s.put("a/000000000001/b", b"x")
    assert e.value.transient and is_transient(e.value.__cause__)


def test_retry_policy_backoff_is_full_jitter() -> None:
    p = RetryPolicy(base_s=0.5, cap_s=4.0)
    assert p.backoff_s(0, lambda: 0.999) < 0.5
    assert p.backoff_s(10, lambda: 1.0) == 4.0
    assert p.backoff_s(3, lambda: 0.0) == 0.0


def test_from_url_round_trips_location(moto_s3: MotoS3) -> None:
    s = moto_s3.store()
    again = S3Store.from_url(s.location)
    assert (again.bucket, again.prefix, again.endpoint_url, again.region) == (s.bucket, s.prefix, s.endpoint_url,
                                                                              s.region)
    with pytest.raises(ValueError):
        S3Store.from_url("http://x/y")
