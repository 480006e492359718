"""Helpers for the tier tests (not a test module): moto's S3 server over HTTP, throttling, checkpoints."""
from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
import logging  # noqa: E402
from deadlines import scaled

logging.getLogger("werkzeug").setLevel(logging.WARNING)


class MotoS3:
    """moto's S3 as a real HTTP server on 127.0.0.1:<free port>; `stop()`/`start()` keep its data (moto's
    backend lives in this process), so a test can take S3 down and bring it back on the same port."""

    def __init__(self) -> None:
        self.port = 0
        self.server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "MotoS3":
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        import boto3

        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")
        deadline = time.monotonic() + scaled(10)
        while True:
            try:
                client.list_buckets()
                return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def bucket(self) -> str:
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def store(self, **kw: Any) -> Any:
        from checkpoint.s3_store import RetryPolicy, S3Store

        kw.setdefault("retry", RetryPolicy(max_attempts=4))
        kw.setdefault("part_bytes", 5 << 20)
        return S3Store(self.bucket(), "ckpt", endpoint_url=self.url, region="us-east-1", **kw)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    s3 = MotoS3().start()
    try:
        yield s3
    finally:
        s3.stop()


class Throttler:
    """Make the next `n` S3 requests of a client answer 503 SlowDown (a botocore before-send hook: the
    request never reaches the server; our retry path sees a real throttling response)."""

    BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")

    def __init__(self, client: Any, n: int, status: int = 503) -> None:
        self.left, self.status, self.sent = n, status, 0
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3.*", self._hook)

    def _hook(self, request: Any, **_: Any) -> Any:
        from botocore.awsrequest import AWSResponse

        with self._lock:
            if self.left <= 0:
                return None
            self.left -= 1
            self.sent += 1

        class _Raw:
            def __init__(self, body: bytes) -> None:
                self.body = body

            def stream(self, **_kw: Any) -> Iterator[bytes]:
                yield self.body

            def read(self, *_a: Any) -> bytes:
                return self.body

        return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, _Raw(self.BODY))


def tmpfs(path: Path, size: str = "1m") -> bool:
    """Mount a small tmpfs at `path` (root only); False when this machine does not allow it."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def umount(path: Path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)
