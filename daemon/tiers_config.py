"""`[tiers]`: where the agent copies committed checkpoints after memory (checkpoint/drainer.py), one table
per tier:

    [tiers]
    interval_s = 2.0
    [tiers.nvme]
    dir = ""                   # default <state_dir>/tiers/nvme; "off" disables the NVMe tier
    [tiers.flash]
    dir = "/lustre/ckpt"       # a shared filesystem; empty: no flash tier
    every_n = 5
    [tiers.s3]
    url = "s3://bucket/sdcwatch?endpoint_url=https://s3.example:9000&region=us-east-1"
    every_s = 1800

Every key is also a flag (`--tiers-flash-dir`, `--tiers-s3-every-s`, ...) and an environment variable
(`SDCWATCH_TIERS_FLASH_DIR`, ...). Each tier: which checkpoints go there (`every_n`: every Nth, 0 off;
`every_s`: at least every T seconds, 0 off; the newest VERIFIED always), how fast (`concurrency`,
`bandwidth_mib_s`, 0 unlimited), how many stay (`keep`: newest K; `keep_every_steps`: steps that are
multiples of P; `keep_age_s`: younger than this; the tier's newest VERIFIED copy always), and
`max_backlog_mib` (the bound on bytes waiting; 0 unbounded). The flat keys of earlier versions
(`[tiers] nvme_dir`) are refused with the new key's name.
"""
from __future__ import annotations

import dataclasses
import re

from daemon.errors import ConfigError
from sdcwatch.settings import setting


@dataclasses.dataclass(kw_only=True, slots=True)
class TierRuleConfig:
    """What every tier has: which checkpoints go there, how fast, how many stay (checkpoint/tier_policy.py)."""

    every_n: int = setting(1, "copy every Nth checkpoint (0: off)")
    every_s: float = setting(0.0, "copy a checkpoint at least this often, in seconds (0: off)")
    keep: int = setting(3, "newest checkpoints kept on the tier")
    keep_every_steps: int = setting(0, "also keep checkpoints whose step is a multiple of this (0: off)")
    keep_age_s: float = setting(0.0, "also keep checkpoints younger than this, in seconds (0: off)")
    concurrency: int = setting(2, "copies running at once (S3: parallel part uploads, half as many shards)")
    bandwidth_mib_s: float = setting(0.0, "copy bandwidth cap in MiB/s (0: unlimited)")
    max_backlog_mib: int = setting(0, "bytes waiting to be copied, at most, in MiB (0: unbounded)")

    def validate(self, section: str) -> None:
        for key, v in (("every_n", self.every_n), ("every_s", self.every_s),
                       ("keep_every_steps", self.keep_every_steps), ("keep_age_s", self.keep_age_s),
                       ("bandwidth_mib_s", self.bandwidth_mib_s), ("max_backlog_mib", self.max_backlog_mib)):
            if not v >= 0:   # also NaN
                raise ConfigError(f"{section}.{key}", f"must be >= 0, got {v!r}")
        for key, n in (("keep", self.keep), ("concurrency", self.concurrency)):
            if n < 1:
                raise ConfigError(f"{section}.{key}", f"must be >= 1, got {n!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class DirTierConfig(TierRuleConfig):
    """`[tiers.nvme]` (node-local) and `[tiers.flash]` (a filesystem the nodes share): a directory."""

    dir: str = setting("", "the tier's directory (nvme: default <state_dir>/tiers/nvme, \"off\" disables it; "
                       "flash: empty disables it)")
    fsync: bool = setting(True, "fsync each file before it counts as stored")


@dataclasses.dataclass(kw_only=True, slots=True)
class S3TierConfig(TierRuleConfig):
    """`[tiers.s3]`: an S3-compatible object store, the last tier."""

    url: str = setting("", "s3://bucket/prefix?endpoint_url=...&region=... (empty: no S3 tier)")
    part_mib: int = setting(16, "multipart upload part size in MiB (S3's minimum is 5)")
    max_attempts: int = setting(8, "attempts per S3 request before the copy fails (botocore's retries; also the "
                                   "re-reads of a GET body that broke part-way)")
    checksum: str = setting("auto", "flexible checksum of uploads: auto (CRC64NVME, or CRC32 without awscrt), "
                                    "CRC64NVME, CRC32C or CRC32 (for an S3-compatible store without CRC64NVME)")
    retry_mode: str = setting("standard", "botocore's retry mode: standard, or adaptive (also rate-limits the "
                                          "client while S3 throttles)")
    verify: str = setting("store", "store: trust S3's checksum of what it stored; readback: download and compare")

    def validate(self, section: str) -> None:
        TierRuleConfig.validate(self, section)   # (no bare super() in a slots dataclass)
        if self.url and not re.match(r"^s3://[^/?]+", self.url):
            raise ConfigError(f"{section}.url", f"expected s3://bucket[/prefix][?endpoint_url=..&region=..], "
                              f"got {self.url!r}")
        if self.part_mib < 5:
            raise ConfigError(f"{section}.part_mib", f"S3 parts are at least 5 MiB, got {self.part_mib}")
        if self.max_attempts < 1:
            raise ConfigError(f"{section}.max_attempts", f"must be >= 1, got {self.max_attempts}")
        if self.checksum not in ("auto", "CRC64NVME", "CRC32C", "CRC32"):
            raise ConfigError(f"{section}.checksum", f"expected auto, CRC64NVME, CRC32C or CRC32, got {self.checksum!r}")
        if self.retry_mode not in ("standard", "adaptive"):
            raise ConfigError(f"{section}.retry_mode", f"expected standard or adaptive, got {self.retry_mode!r}")
        if self.verify not in ("store", "readback"):
            raise ConfigError(f"{section}.verify", f"expected store or readback, got {self.verify!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class TiersConfig:
    """`[tiers]`: the drainer, and one table per tier."""

    enabled: bool = setting(True, "copy committed checkpoints to the durable tiers")
    interval_s: float = setting(2.0, "plan copies this often, in seconds (and at once after each commit)")
    orphan_ttl_s: float = setting(3600.0, "tier files no manifest names are deleted after this long, in seconds")
    hop_timeout_s: float = setting(900.0, "a copy running longer marks its tier HUNG, in seconds")
    nvme: DirTierConfig = setting(factory=DirTierConfig, help="the NVMe tier: node-local, first after memory")
    flash: DirTierConfig = setting(factory=lambda: DirTierConfig(every_n=5),
                                   help="the flash tier: a filesystem the nodes share (Lustre, GPFS, NFS)")
    s3: S3TierConfig = setting(factory=lambda: S3TierConfig(every_n=0, every_s=1800.0, concurrency=4,
                                                            max_backlog_mib=65536),
                               help="the S3 tier: an S3-compatible object store, the last")

    def validate(self) -> None:
        for key, v in (("interval_s", self.interval_s), ("orphan_ttl_s", self.orphan_ttl_s),
                       ("hop_timeout_s", self.hop_timeout_s)):
            if not v > 0:
                raise ConfigError(f"tiers.{key}", f"must be > 0, got {v!r}")
        self.nvme.validate("tiers.nvme")
        self.flash.validate("tiers.flash")
        self.s3.validate("tiers.s3")
        if self.flash.dir and self.flash.dir == self.nvme.dir:
            raise ConfigError("tiers.flash.dir", "must differ from tiers.nvme.dir")
