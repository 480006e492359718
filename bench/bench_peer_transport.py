"""Peer transport benchmark: the same N MiB written to a peer's memory tier over the network transport
(checkpoint/grpc_store.py -> daemon/peer_store_service.py) and read back, next to a plain local directory
copy of the same bytes, side by side in one run.

    python bench/bench_peer_transport.py              # 512 MiB, median of 3
    python bench/bench_peer_transport.py --mib 1024 --repeat 5

The peer is a separate process (its own GIL, as a real peer agent): PeerStore over a DirStore in /dev/shm,
served on a unix socket and on TLS TCP on 127.0.0.1 behind the agent's interceptor (bearer token), with
the agent's default 4 MiB message limit. Rows:
- put: `GrpcBlobStore.put` of one N MiB buffer (2 MiB messages, atomic rename on the peer) vs `DirStore.put`
  of the same buffer into a local /dev/shm directory (the same-host directory transport);
- get: `GrpcBlobStore.readinto` of the whole blob vs `DirStore.readinto` from the local directory.
Ratio: network throughput / local directory throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MiB = 1 << 20
TOKEN = "bench-token"


def serve(root: str, sock: str, cert: str, key: str) -> None:
    """The peer side: PeerStore on `sock` and on TLS 127.0.0.1:<free port>; prints the port, runs until stdin
    closes."""
    import grpc

    from checkpoint.shm_store import ShmStore
    from daemon.interceptors import AgentInterceptor
    from daemon.peer_store_service import PeerStoreService, register

    async def main() -> None:
        service = PeerStoreService(ShmStore(root))
        opts = [("grpc.max_receive_message_length", 4 * MiB), ("grpc.max_send_message_length", 4 * MiB)]
        unix = grpc.aio.server(options=opts)
        register(unix, service)
        unix.add_insecure_port(f"unix:{sock}")
        tcp = grpc.aio.server(interceptors=[AgentInterceptor(TOKEN)], options=opts)
        register(tcp, service)
        port = tcp.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [(Path(key).read_bytes(), Path(cert).read_bytes())]))
        await unix.start()
        await tcp.start()
        print(port, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await tcp.stop(0)
        await unix.stop(0)

    asyncio.run(main())


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--serve", nargs=4, metavar=("ROOT", "SOCK", "CERT", "KEY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(*args.serve)

    from checkpoint.grpc_store import GrpcBlobStore, PeerCredentials
    from checkpoint.shm_store import ShmStore
    from support import write_self_signed

    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="sdcw-bench-peer-", dir=shm))
    tmp = Path(tempfile.mkdtemp(prefix="sdcw-bp-", dir="/tmp"))
    cert, key = write_self_signed(tmp)
    (tmp / "token").write_text(TOKEN)
    sock = tmp / "peer.sock"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(work / "peer"), str(sock), str(cert), str(key)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = int(proc.stdout.readline())
        data = memoryview(bytearray(os.urandom(MiB)) * args.mib)
        nbytes = len(data)
        local = ShmStore(work / "local", spares=0)
        stores = {
            "unix socket": GrpcBlobStore(f"unix://{sock}"),
            "TLS TCP 127.0.0.1": GrpcBlobStore(f"grpcs://localhost:{port}", credentials=PeerCredentials(
                str(cert), str(tmp / "token"))),
        }
        buf = memoryview(bytearray(nbytes))
        rows = []
        key_ = "bench/step-1/rank-0.bin"

        def put_local() -> None:
            local.put(key_, data)
            local.delete(key_)

        def get_local() -> None:
            assert local.readinto(key_, 0, buf) == nbytes

        base_put = timed(put_local, args.repeat)
        local.put(key_, data)
        base_get = timed(get_local, args.repeat)
        for name, store in stores.items():
            def put() -> None:
                store.put(key_, data)
                store.delete(key_)

            def get() -> None:
                assert store.readinto(key_, 0, buf) == nbytes

            store.put(key_, data[: 4 * MiB])   # warm the channel (TLS handshake)
            t_put = timed(put, args.repeat)
            store.put(key_, data)
            t_get = timed(get, args.repeat)
            assert bytes(buf[:MiB]) == bytes(data[:MiB]) and bytes(buf[-MiB:]) == bytes(data[-MiB:])
            store.delete(key_)
            rows.append((f"put  {name}", t_put, base_put))
            rows.append((f"get  {name}", t_get, base_get))
            store.close()
        gb = nbytes / 1e9
        print(f"{args.mib} MiB, median of {args.repeat}; baseline: the same bytes to/from a local directory "
              f"({work})")
        print(f"| {'transfer':<24} | {'network GB/s':>12} | {'local dir GB/s':>14} | {'ratio':>6} |")
        print(f"|{'-' * 26}|{'-' * 13}:|{'-' * 15}:|{'-' * 7}:|")
        for name, t, base in rows:
            print(f"| {name:<24} | {gb / t:>12.2f} | {gb / base:>14.2f} | {base / t:>6.2f} |")
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
