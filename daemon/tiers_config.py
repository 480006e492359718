"""`[tiers]`: where the agent copies committed checkpoints after memory (checkpoint/drainer.py).

    [tiers]
    nvme_dir = ""              # default <state_dir>/tiers/nvme; "off" disables the NVMe tier
    flash_dir = "/lustre/ckpt" # a shared filesystem; empty: no flash tier
    flash_every_n = 5
    s3_url = "s3://bucket/sdcwatch?endpoint_url=https://s3.example:9000&region=us-east-1"
    s3_every_s = 1800

Every key is also a flag: `--tiers-flash-dir`, `--tiers-s3-every-s`, ... Each tier: which checkpoints go
there (`*_every_n`: every Nth, 0 off; `*_every_s`: at least every T seconds, 0 off; the newest VERIFIED
always), how fast (`*_concurrency`, `*_bandwidth_mib_s`, 0 unlimited), how many stay (`*_keep`: newest K;
`*_keep_every_steps`: steps that are multiples of P; `*_keep_age_s`: younger than this; the tier's newest
VERIFIED copy always), and `*_max_backlog_mib` (the bound on bytes waiting; 0 unbounded).
"""
from __future__ import annotations

import dataclasses
import re

from daemon.errors import ConfigError

TIER_NAMES = ("nvme", "flash", "s3")


@dataclasses.dataclass(kw_only=True, slots=True)
class TiersConfig:
    enabled: bool = True
    interval_s: float = 2.0              # plan this often (and at once after each commit)
    orphan_ttl_s: float = 3600.0         # blobs no manifest names are deleted after this long
    hop_timeout_s: float = 900.0         # a copy running longer marks its tier HUNG

    nvme_dir: str = ""                   # "" -> <state_dir>/tiers/nvme; "off" disables
    nvme_every_n: int = 1
    nvme_every_s: float = 0.0
    nvme_keep: int = 3
    nvme_keep_every_steps: int = 0
    nvme_keep_age_s: float = 0.0
    nvme_concurrency: int = 2
    nvme_bandwidth_mib_s: float = 0.0
    nvme_max_backlog_mib: int = 0
    nvme_fsync: bool = True

    flash_dir: str = ""                  # a shared filesystem mount; "" disables
    flash_every_n: int = 5
    flash_every_s: float = 0.0
    flash_keep: int = 3
    flash_keep_every_steps: int = 0
    flash_keep_age_s: float = 0.0
    flash_concurrency: int = 2
    flash_bandwidth_mib_s: float = 0.0
    flash_max_backlog_mib: int = 0
    flash_fsync: bool = True

    s3_url: str = ""                     # s3://bucket/prefix?endpoint_url=...&region=...; "" disables
    s3_every_n: int = 0
    s3_every_s: float = 1800.0
    s3_keep: int = 3
    s3_keep_every_steps: int = 0
    s3_keep_age_s: float = 0.0
    s3_concurrency: int = 4
    s3_bandwidth_mib_s: float = 0.0
    s3_max_backlog_mib: int = 65536
    s3_part_mib: int = 16
    s3_max_attempts: int = 8
    s3_verify: str = "store"             # "store": S3's checksum of what it stored; "readback": download

    def validate(self) -> None:
        for key in ("interval_s", "orphan_ttl_s", "hop_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"tiers.{key}", f"must be > 0, got {getattr(self, key)!r}")
        for t in TIER_NAMES:
            for suffix in ("every_n", "every_s", "keep_every_steps", "keep_age_s", "bandwidth_mib_s",
                           "max_backlog_mib"):
                v = getattr(self, f"{t}_{suffix}")
                if v != v or v < 0:
                    raise ConfigError(f"tiers.{t}_{suffix}", f"must be >= 0, got {v!r}")
            for suffix in ("keep", "concurrency"):
                if getattr(self, f"{t}_{suffix}") < 1:
                    raise ConfigError(f"tiers.{t}_{suffix}", f"must be >= 1, got {getattr(self, f'{t}_{suffix}')!r}")
        if self.s3_url and not re.match(r"^s3://[^/?]+", self.s3_url):
            raise ConfigError("tiers.s3_url", f"expected s3://bucket[/prefix][?endpoint_url=..&region=..], "
                              f"got {self.s3_url!r}")
        if self.s3_part_mib < 5:
            raise ConfigError("tiers.s3_part_mib", f"S3 parts are at least 5 MiB, got {self.s3_part_mib}")
        if self.s3_max_attempts < 1:
            raise ConfigError("tiers.s3_max_attempts", f"must be >= 1, got {self.s3_max_attempts}")
        if self.s3_verify not in ("store", "readback"):
            raise ConfigError("tiers.s3_verify", f"expected store or readback, got {self.s3_verify!r}")
        if self.flash_dir and self.flash_dir == self.nvme_dir:
            raise ConfigError("tiers.flash_dir", "must differ from tiers.nvme_dir")
