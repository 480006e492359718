"""The agent's resident memory while PutBlob streams a large blob into its memory tier (issue 20: +320 MB RSS
was reported after 35 rounds of 12 concurrent 4 MiB puts, not released).

  python -m bench.putblob_rss [--mib 512] [--chunk-mib 2] [--rounds 35 --concurrent 12 --blob-mib 4]
                              [--json OUT]

Starts the real agent (`python -m daemon.cli run`, embedded defaults, a temp state dir, canary off), waits
until it is SERVING, warms PutBlob up with one small put, then:

1. `large`: one blob of `--mib` MiB streamed in `--chunk-mib` MiB messages by the peer client
   (`checkpoint.grpc_store.GrpcBlobStore` over the agent's unix socket; the client sends slices of one
   chunk-sized buffer, so the client holds no more than that either);
2. `rounds`: `--rounds` rounds of `--concurrent` concurrent puts of `--blob-mib` MiB each (the issue's form).

The agent's VmRSS (bench/agent_rss.py's /proc reader) is sampled every 20 ms during each phase. Printed, as
JSON: the baseline, the peak and the settled RSS of each phase, and the peak growth as a multiple of the
chunk size (what the streaming path holds at once: a message in the writer thread, the next one read ahead,
gRPC's receive buffers). Blob bytes land in tmpfs pages, which are not the agent's RSS. The blobs are
deleted after each phase. Exit 0; the numbers are for docs/BENCHMARKS.md, the suite's bound is in
tests/test_putblob_memory.py.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2_grpc  # noqa: E402

from bench.agent_rss import status_kib, wait_serving  # noqa: E402

MIB = 1 << 20


class RssSampler:
    """VmRSS of `pid` every `interval_s` in a thread; `peak_mib` since the last `reset`."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_kib(self) -> int:
        return status_kib(self.pid)["VmRSS"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak_kib = max(self.peak_kib, self.rss_kib())
            except (OSError, KeyError):
                return

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def reset(self) -> int:
        now = self.rss_kib()
        self.peak_kib = now
        return now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _buffers(total: int, chunk: bytes) -> list[memoryview]:
    view = memoryview(chunk)
    out = [view] * (total // len(chunk))
    if total % len(chunk):
        out.append(view[:total % len(chunk)])
    return out


def measure(sock: Path, pid: int, *, mib: int, chunk_mib: float, rounds: int, concurrent: int,
            blob_mib: int, settle_s: float = 1.0, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Both phases against the agent on `sock` (pid `pid`); returns the numbers (module docstring)."""
    from checkpoint.grpc_store import GrpcBlobStore

    chunk_bytes = int(chunk_mib * MIB)
    store = GrpcBlobStore(f"unix://{sock}", chunk_bytes=chunk_bytes, stream_timeout_s=1800.0)
    chunk = bytes(range(256)) * (chunk_bytes // 256) + b"\x01" * (chunk_bytes % 256)
    sampler = RssSampler(pid).start()
    out: dict[str, Any] = {"chunk_mib": chunk_mib}
    try:
        store.put("bench/warmup", _buffers(4 * chunk_bytes, chunk))
        store.delete("bench/warmup")
        time.sleep(settle_s)

        base = sampler.reset()
        t0 = time.monotonic()
        n = store.put("bench/large", _buffers(mib * MIB, chunk))
        took = time.monotonic() - t0
        time.sleep(settle_s)
        after = sampler.rss_kib()
        peak = sampler.peak_kib
        store.delete("bench/large")
        out["large"] = {"mib": mib, "bytes": n, "seconds": round(took, 2), "mib_s": round(mib / took, 1),
                        "rss_before_mb": round(base / 1024, 1), "rss_peak_mb": round(peak / 1024, 1),
                        "rss_after_mb": round(after / 1024, 1),
                        "peak_growth_mb": round((peak - base) / 1024, 1),
                        "peak_growth_chunks": round((peak - base) * 1024 / chunk_bytes, 1),
                        "kept_mb": round((after - base) / 1024, 1)}
        log(f"large: {out['large']}")

        if rounds:
            base = sampler.reset()
            per_round = []
            with ThreadPoolExecutor(concurrent) as ex:
                for r in range(rounds):
                    keys = [f"bench/r{r}/{i}" for i in range(concurrent)]
                    list(ex.map(lambda k: store.put(k, _buffers(blob_mib * MIB, chunk)), keys))
                    for k in keys:
                        store.delete(k)
                    per_round.append(round(sampler.rss_kib() / 1024, 1))
            time.sleep(settle_s)
            after = sampler.rss_kib()
            out["rounds"] = {"rounds": rounds, "concurrent": concurrent, "blob_mib": blob_mib,
                             "rss_before_mb": round(base / 1024, 1),
                             "rss_peak_mb": round(sampler.peak_kib / 1024, 1),
                             "rss_after_mb": round(after / 1024, 1),
                             "kept_mb": round((after - base) / 1024, 1),
                             "rss_per_round_mb": per_round}
            log(f"rounds: {out['rounds']}")
    finally:
        sampler.stop()
        store.close()
    return out


class Agent:
    """The real agent on a temp state dir, for this bench and tests/test_putblob_memory.py."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="sdcw-putrss-"))
        self.sock = self.state / "agent.sock"
        self.cmd = [sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(self.state),
                    "--metrics-listen", "off", "--no-canary-enabled", *extra]
        self.log_path = self.state.parent / f"{self.state.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "Agent":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.sock.exists() and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
        with grpc.insecure_channel(f"unix:{self.sock}") as ch:
            wait_serving(health_pb2_grpc.HealthStub(ch), self.proc, deadline)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        from checkpoint.shm_store import default_shm_root
        from sdcwatch.safe_fs import remove_tree
        remove_tree(default_shm_root(self.state).parent)   # the memory dir the agent keeps for a restart
        shutil.rmtree(self.state, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="the large blob, MiB")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per PutBlob message, MiB")
    ap.add_argument("--rounds", type=int, default=35, help="rounds of concurrent puts (0: none)")
    ap.add_argument("--concurrent", type=int, default=12, help="puts per round")
    ap.add_argument("--blob-mib", type=int, default=4, help="each concurrent put, MiB")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    with Agent() as agent:
        assert agent.proc is not None
        result = {"command": " ".join(sys.argv), "agent": " ".join(agent.cmd),
                  **measure(agent.sock, agent.proc.pid, mib=args.mib, chunk_mib=args.chunk_mib,
                            rounds=args.rounds, concurrent=args.concurrent, blob_mib=args.blob_mib,
                            log=lambda s: print(s, file=sys.stderr, flush=True))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
