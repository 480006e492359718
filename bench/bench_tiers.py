"""Tier benchmark: drain throughput per tier against a plain copy of the same bytes, and restore time per tier.

    python bench/bench_tiers.py                     # 256 MiB checkpoint, dirs under /var/tmp, moto S3
    python bench/bench_tiers.py --mib 1024 --nvme-dir /nvme/x --flash-dir /lustre/x

One committed checkpoint (one rank, in the node memory tier in /dev/shm) is copied to each tier by the
drainer (read from memory + xxh3 verify per chunk, atomic write with fsync of file and directory, read-back
verify of every chunk for directories / the S3 service's SHA-256 for S3, then the tier manifest), and the
same bytes by the plain baseline in the same run: `cp` + `sync` for the directories, boto3 `upload_file`
for S3 (moto's server over HTTP on 127.0.0.1 unless --s3-url). Median of --repeat runs, alternating.
Restore: the verified restore (every chunk checksum + every tensor fingerprint) from each tier alone, next
to a plain read of the same bytes (`cat` to /dev/null after dropping the page cache when allowed; boto3
`download_fileobj`). Ratios: ours / baseline time (drain target: throughput >= 0.8x, i.e. time <= 1.25x).
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MiB = 1 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nvme-dir", default="")
    ap.add_argument("--flash-dir", default="")
    ap.add_argument("--s3-url", default="", help="s3://bucket/prefix?endpoint_url=..: a real endpoint (default moto)")
    args = ap.parse_args()

    from checkpoint.coordinator import Coordinator, CoordinatorConfig
    from checkpoint.drainer import Drainer, Tier
    from checkpoint.restore import restore_shard
    from checkpoint.s3_store import S3Store
    from checkpoint.shm_store import DirStore, ShmStore
    from checkpoint.snapshot import Snapshotter, SnapshotConfig
    from checkpoint.tier_manifest import manifest_key
    from checkpoint.tier_policy import TierRule
    from conftest import RedisServer
    import redis as redis_mod
    import tier_support

    work = Path(tempfile.mkdtemp(prefix="sdcw-bench-tiers-", dir="/var/tmp"))
    nvme_dir = Path(args.nvme_dir or work / "nvme")
    flash_dir = Path(args.flash_dir or work / "flash")
    shm = Path(tempfile.mkdtemp(prefix="sdcw-bench-mem-", dir="/dev/shm"))
    rs = RedisServer(work).start()
    moto = None
    if args.s3_url:
        s3 = S3Store.from_url(args.s3_url)
    else:
        moto = tier_support.MotoS3().start()
        s3 = moto.store(part_bytes=16 * MiB, concurrency=4)
    try:
        co = Coordinator(redis_mod.Redis(port=rs.port), ShmStore(shm), node="bench", location=str(shm),
                         config=CoordinatorConfig(key_prefix=f"bench{os.getpid()}:"))
        n = args.mib * MiB // 4
        sd = {"w": torch.randn(n // 2), "v": torch.randn(n - n // 2)}
        snap = Snapshotter(co, "bench", 0, 1, SnapshotConfig())
        assert not snap.save(1, sd).result(600).error
        snap.close()
        m = co.shard_manifest("bench", 1, 0)
        src = shm / m.blob
        nbytes = m.nbytes
        tiers = [Tier("nvme", DirStore(nvme_dir, fsync=True), str(nvme_dir), TierRule("nvme")),
                 Tier("flash", DirStore(flash_dir, fsync=True), str(flash_dir), TierRule("flash"), shared=True),
                 Tier("s3", s3, s3.location, TierRule("s3"), shared=True, verify="store")]
        dr = Drainer(co, tiers)
        dr.start()

        def ours(rt) -> float:
            store = rt.tier.store
            store.delete(manifest_key("bench", 1, "bench"))
            store.delete(m.blob)
            t0 = time.perf_counter()
            dr.drain_one(rt, "bench", 1)
            return time.perf_counter() - t0

        def plain_dir(d: Path) -> float:
            dst = d / "plain.bin"
            dst.unlink(missing_ok=True)
            t0 = time.perf_counter()
            subprocess.run(["cp", str(src), str(dst)], check=True)
            subprocess.run(["sync"], check=True)
            return time.perf_counter() - t0

        def plain_s3() -> float:
            t0 = time.perf_counter()
            s3.client.upload_file(str(src), s3.bucket, s3.prefix + "plain.bin")
            return time.perf_counter() - t0

        plain = {"nvme": lambda: plain_dir(nvme_dir), "flash": lambda: plain_dir(flash_dir), "s3": plain_s3}
        drain_rows = []
        for rt in dr.tiers:
            a, b = [], []
            for i in range(args.repeat):
                if i % 2:
                    a.append(ours(rt)), b.append(plain[rt.tier.name]())
                else:
                    b.append(plain[rt.tier.name]()), a.append(ours(rt))
            drain_rows.append((rt.tier.name, statistics.median(a), statistics.median(b)))

        # restore per tier, each alone; baseline: a plain read of the same bytes
        def plain_read(name: str) -> float:
            if name == "s3":
                t0 = time.perf_counter()
                s3.client.download_fileobj(s3.bucket, s3.object_key(m.blob), io.BytesIO())
                return time.perf_counter() - t0
            path = {"memory": src, "nvme": nvme_dir / m.blob, "flash": flash_dir / m.blob}[name]
            if name != "memory":
                drop_caches()
            t0 = time.perf_counter()
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            return time.perf_counter() - t0

        cold = drop_caches()
        stores = {"memory": co.store, "nvme": tiers[0].store, "flash": tiers[1].store, "s3": s3}
        restore_rows = []
        for name, store in stores.items():
            a, b = [], []
            for _ in range(args.repeat):
                b.append(plain_read(name))
                if name in ("nvme", "flash"):
                    drop_caches()
                t0 = time.perf_counter()
                out = restore_shard(m, [(name, store)], "cpu")
                a.append(time.perf_counter() - t0)
                del out
            restore_rows.append((name, statistics.median(a), statistics.median(b)))

        gb = nbytes / 1e9
        print(f"\ncheckpoint: {nbytes / MiB:.0f} MiB, 1 shard, chunks {m.chunk_bytes // MiB} MiB; dirs under "
              f"{nvme_dir.parent} ({'page cache dropped before disk reads' if cold else 'page cache NOT dropped'}); "
              f"S3: {'moto on 127.0.0.1' if moto else args.s3_url}")
        print("\n| tier | drain (ours) | plain copy | ours GB/s | plain GB/s | throughput ratio (target >= 0.8) |")
        print("|---|---|---|---|---|---|")
        for name, a, b in drain_rows:
            base = "cp + sync" if name != "s3" else "boto3 upload_file"
            print(f"| {name} | {a:.3f} s | {b:.3f} s ({base}) | {gb / a:.2f} | {gb / b:.2f} | {b / a:.2f}x |")
        print("\n| tier | verified restore (ours) | plain read | ours GB/s | ratio ours/plain time |")
        print("|---|---|---|---|---|")
        for name, a, b in restore_rows:
            base = "cat" if name != "s3" else "boto3 download_fileobj"
            print(f"| {name} | {a:.3f} s | {b:.3f} s ({base}) | {gb / a:.2f} | {a / b:.2f}x |")
        dr.close()
    finally:
        rs.stop()
        if moto is not None:
            moto.stop()
        subprocess.run(["rm", "-rf", str(work), str(shm)])


if __name__ == "__main__":
    main()
