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

Streams and the cap (issue 21 item 6), same run, same endpoints: the link's reference is a plain TLS stream
(Python `ssl` socket, the same certificate, `sendall` of the same bytes to a peer-side sink); then
`GrpcBlobStore` puts with 1 stream (one blob), with --streams connections (the shards of a step, --streams
blobs of N/--streams MiB put together, as the agent replicates them), the parallel ranged read of one blob,
and a put capped at half the link (`max_bytes_per_s`). Target: the parallel rows >= 80% of the plain TLS
stream.

The streams table also gives CPU seconds per GB of this process (all its threads, getrusage) and of the peer
process (/proc/PID/stat) for each row: on a loaded host wall-clock rates are noise, CPU per GB is not, and
it says which side a transfer is bound on; "cores" is CPU seconds per wall second (near 1.0: one thread,
a GIL or an event loop, is the limit). `--streams-only`: that table alone. The restore-shaped row reads the
blob as a restore does (checkpoint/shard_reader.py): 16 MiB chunks from a pool of threads, each verified.

    python bench/bench_peer_transport.py --streams 4 --netns            # peer in its own network namespace,
    python bench/bench_peer_transport.py --streams 4 --netns --rate-gbit 10   # veth pair (root), tc cap

--netns needs root (ip netns, veth); the certificate then names the peer's address.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import ipaddress
import os
import resource
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MiB = 1 << 20
TOKEN = "bench-token"


def tls_sink(host: str, cert: str, key: str, tls: bool = True) -> int:
    """A plain TLS (or, `tls` False, TCP) server that reads each connection to its end, then answers the byte
    count (8 bytes): the reference for what one stream between these endpoints carries. Returns its port."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    srv = socket.create_server((host, 0))
    port = srv.getsockname()[1]

    def one(conn: socket.socket) -> None:
        with (ctx.wrap_socket(conn, server_side=True) if tls else conn) as c:
            want = int.from_bytes(c.recv(8), "big")
            buf = bytearray(4 * MiB)
            got = 0
            while got < want:
                n = c.recv_into(buf)
                if not n:
                    break
                got += n
            c.sendall(got.to_bytes(8, "big"))

    def loop() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return port


def tls_send(host: str, port: int, cafile: str, data: memoryview, tls: bool = True) -> None:
    ctx = ssl.create_default_context(cafile=cafile)
    with socket.create_connection((host, port)) as raw, \
            (ctx.wrap_socket(raw, server_hostname="localhost") if tls else raw) as c:
        c.sendall(len(data).to_bytes(8, "big"))
        for i in range(0, len(data), 2 * MiB):
            c.sendall(data[i:i + 2 * MiB])
        assert int.from_bytes(c.recv(8), "big") == len(data)


def write_cert(tmp: Path, addresses: list[str]) -> tuple[Path, Path]:
    """A self-signed certificate for `localhost` and the given IP addresses."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = [x509.DNSName("localhost")] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(key, hashes.SHA256()))
    cp, kp = tmp / "cert.pem", tmp / "key.pem"
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return cp, kp


class NetNs:
    """A network namespace for the peer joined to this one by a veth pair (10.213.x.1 here, .2 there),
    optionally with a tc token-bucket rate on both ends (the emulated link)."""

    def __init__(self, rate_gbit: float = 0.0) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns, self.a, self.b = f"sdcwbp{tag}", f"vbpa{tag}", f"vbpb{tag}"
        self.here, self.there = "10.213.7.1", "10.213.7.2"
        cmds = [f"ip netns add {self.ns}", f"ip link add {self.a} type veth peer name {self.b}",
                f"ip link set {self.b} netns {self.ns}", f"ip addr add {self.here}/30 dev {self.a}",
                f"ip link set {self.a} up",
                f"ip netns exec {self.ns} ip addr add {self.there}/30 dev {self.b}",
                f"ip netns exec {self.ns} ip link set {self.b} up",
                f"ip netns exec {self.ns} ip link set lo up"]
        if rate_gbit > 0:
            tbf = f"tbf rate {rate_gbit}gbit burst 4mb latency 100ms"
            cmds += [f"tc qdisc add dev {self.a} root {tbf}",
                     f"ip netns exec {self.ns} tc qdisc add dev {self.b} root {tbf}"]
        try:
            for c in cmds:
                subprocess.run(c.split(), check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            self.close()
            raise SystemExit(f"--netns: {' '.join(e.cmd)} failed ({e.stderr.decode().strip()}); needs root")

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.a], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def serve(root: str, sock: str, cert: str, key: str, host: str = "127.0.0.1") -> None:
    """The peer side: PeerStore on `sock` and on TLS `host`:<free port>, and a plain TLS sink; prints both
    ports, runs until stdin closes."""
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
        port = tcp.add_secure_port(f"{host}:0", grpc.ssl_server_credentials(
            [(Path(key).read_bytes(), Path(cert).read_bytes())]))
        await unix.start()
        await tcp.start()
        print(port, tls_sink(host, cert, key), tls_sink(host, cert, key, tls=False), flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await tcp.stop(0)
        await unix.stop(0)

    asyncio.run(main())


PEER_PID = 0     # the peer process, for its CPU time (/proc/PID/stat)
CPU: dict[str, tuple[float, float]] = {}   # row name -> (this process's, the peer's CPU seconds per run)


def cpu_s() -> tuple[float, float]:
    """(CPU seconds of this process, all threads; of the peer process): wall-clock rates on a loaded host are
    noise, CPU seconds per GB are not."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    peer = 0.0
    if PEER_PID:
        with open(f"/proc/{PEER_PID}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        peer = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return r.ru_utime + r.ru_stime, peer


def timed(fn, repeat: int, name: str = "") -> float:
    times = []
    c0 = cpu_s()
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    c1 = cpu_s()
    if name:
        CPU[name] = ((c1[0] - c0[0]) / repeat, (c1[1] - c0[1]) / repeat)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4, help="parallel streams (connections), streams rows")
    ap.add_argument("--streams-only", action="store_true", help="only the streams table (no local/unix rows)")
    ap.add_argument("--netns", action="store_true", help="the peer in its own network namespace, over veth")
    ap.add_argument("--rate-gbit", type=float, default=0.0, help="--netns: tc rate of the veth (0: none)")
    ap.add_argument("--serve", nargs=5, metavar=("ROOT", "SOCK", "CERT", "KEY", "HOST"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(*args.serve)

    from checkpoint.grpc_store import GrpcBlobStore, PeerCredentials
    from checkpoint.shm_store import ShmStore

    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="sdcw-bench-peer-", dir=shm))
    tmp = Path(tempfile.mkdtemp(prefix="sdcw-bp-", dir="/tmp"))
    ns = NetNs(args.rate_gbit) if args.netns else None
    host = ns.there if ns is not None else "127.0.0.1"
    cert, key = write_cert(tmp, [host])
    (tmp / "token").write_text(TOKEN)
    sock = tmp / "peer.sock"
    proc = subprocess.Popen((ns.prefix() if ns is not None else []) + [
        sys.executable, __file__, "--serve", str(work / "peer"), str(sock), str(cert), str(key), host],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    global PEER_PID
    PEER_PID = proc.pid
    try:
        port, sink_port, tcp_port = (int(x) for x in proc.stdout.readline().split())
        data = memoryview(bytearray(os.urandom(MiB)) * args.mib)
        nbytes = len(data)
        local = ShmStore(work / "local", spares=0)
        creds = PeerCredentials(str(cert), str(tmp / "token"))
        url = f"grpcs://{host}:{port}"
        stores = {} if ns is not None else {"unix socket": GrpcBlobStore(f"unix://{sock}")}
        stores[f"TLS TCP {host}"] = GrpcBlobStore(url, credentials=creds)
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
        for name, store in (stores.items() if not args.streams_only else ()):
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
        streams = stream_rows(url, creds, host, sink_port, str(cert), data, args.streams, args.repeat)
        tcp_name = "plain TCP stream (no TLS): the link without encryption"
        streams.insert(1, (tcp_name, timed(lambda: tls_send(host, tcp_port, str(cert), data, tls=False),
                                           args.repeat, tcp_name)))
        gb = nbytes / 1e9
        print(f"\nStreams and cap ({args.mib} MiB, median of {args.repeat}; {host}"
              + (", own network namespace over veth"
                 + (f", tc {args.rate_gbit:g} Gbit/s" if args.rate_gbit else "")
                 if ns is not None else ", loopback") + f"; {os.cpu_count()} cores)")
        link = streams[0][1]
        print(f"| {'transfer':<58} | {'GB/s':>6} | {'x TLS stream':>12} | {'CPU s/GB here':>13} "
              f"| {'CPU s/GB peer':>13} | {'cores here':>10} | {'cores peer':>10} |")
        print(f"|{'-' * 60}|{'-' * 7}:|{'-' * 13}:|{'-' * 14}:|{'-' * 14}:|{'-' * 11}:|{'-' * 11}:|")
        for name, t in streams:
            cpu = CPU.get(name)
            here, there = (f"{c / gb:.2f}" for c in cpu) if cpu else ("", "")
            ch, cp = (f"{c / t:.2f}" for c in cpu) if cpu else ("", "")
            print(f"| {name:<58} | {gb / t:>6.2f} | {link / t:>12.2f} | {here:>13} | {there:>13} | {ch:>10} "
                  f"| {cp:>10} |")
        print()
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
        if ns is not None:
            ns.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def stream_rows(url: str, creds, host: str, sink_port: int, cafile: str, data: memoryview, streams: int,
                repeat: int) -> list[tuple[str, float]]:
    """(name, median seconds for all of `data`) for: the plain TLS stream (first: the reference), our put
    on 1 stream, the same bytes as `streams` shards put together over `streams` connections, the parallel
    ranged read, and a put capped at half the plain stream's rate."""
    from checkpoint.chunks import checksum
    from checkpoint.grpc_store import GrpcBlobStore

    nbytes = len(data)
    rows = []
    tls_send(host, sink_port, cafile, data[:4 * MiB])
    name = "plain TLS stream (python ssl), the reference"
    t_link = timed(lambda: tls_send(host, sink_port, cafile, data), repeat, name)
    rows.append((name, t_link))
    one = GrpcBlobStore(url, credentials=creds, streams=1)
    many = GrpcBlobStore(url, credentials=creds, streams=streams)
    key = "bench/000000000001/rank-00000.bin"
    part = -(-nbytes // streams)
    keys = [f"bench/000000000002/rank-{i:05d}.bin" for i in range(streams)]
    pool = concurrent.futures.ThreadPoolExecutor(streams)
    def row(name: str, fn) -> None:
        rows.append((name, timed(fn, repeat, name)))

    try:
        for s in (one, many):
            s.put(key, data[:4 * MiB])
        row("ours: put, 1 stream, one blob", lambda: one.put(key, data))

        def put_shards() -> None:
            list(pool.map(lambda i: many.put(keys[i], data[i * part:(i + 1) * part]), range(len(keys))))
        row(f"ours: put, {streams} shards over {streams} streams", put_shards)

        def put_shards_one_conn() -> None:
            list(pool.map(lambda i: one.put(keys[i], data[i * part:(i + 1) * part]), range(len(keys))))
        row(f"ours: put, {streams} shards over 1 connection", put_shards_one_conn)
        one.put(key, data)
        buf = memoryview(bytearray(nbytes))
        row("ours: get, 1 stream", lambda: one.readinto(key, 0, buf))
        row(f"ours: get, {streams} ranged streams", lambda: many.readinto(key, 0, buf))
        assert bytes(buf[-MiB:]) == bytes(data[-MiB:])
        chunks = [(o, min(16 * MiB, nbytes - o)) for o in range(0, nbytes, 16 * MiB)]
        io = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1))

        def restore_shaped() -> None:   # as checkpoint/shard_reader.read_verified: chunks on a pool, verified
            def one(c: tuple[int, int]) -> None:
                o, n = c
                assert many.readinto(key, o, buf[o:o + n]) == n
                checksum(buf[o:o + n])
            list(io.map(one, chunks))
        try:
            row(f"ours: get, restore-shaped: 16 MiB chunks, {io._max_workers} threads, xxh3", restore_shaped)
        finally:
            io.shutdown()
        assert bytes(buf[-MiB:]) == bytes(data[-MiB:])
        ranges = [(o, min(16 * MiB, nbytes - o)) for o in range(0, nbytes, 16 * MiB)]
        rows.append(("ours: replica = put + checksums on the peer (ChecksumBlob)",
                     timed(lambda: (one.put(key, data), one.checksums(key, ranges)), repeat)))
        rows.append(("ours: replica = put + read back (an older peer)",
                     timed(lambda: (one.put(key, data), one.readinto(key, 0, buf)), repeat)))
        cap = nbytes / t_link / 2
        capped = GrpcBlobStore(url, credentials=creds, streams=streams, max_bytes_per_s=cap)
        try:
            rows.append((f"ours: put, {streams} shards, capped at {cap / 1e9:.2f} GB/s (half the link)",
                         timed(lambda: list(pool.map(
                             lambda i: capped.put(keys[i], data[i * part:(i + 1) * part]), range(len(keys)))),
                             repeat)))
        finally:
            capped.close()
    finally:
        pool.shutdown()
        one.close()
        many.close()
    return rows


if __name__ == "__main__":
    main()
