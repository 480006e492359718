"""The tier drainer (checkpoint/drainer.py) for the agent: NVMe, flash and S3 tiers from `[tiers.nvme]`,
`[tiers.flash]` and `[tiers.s3]`.

    svc = build_checkpoint_service(..., drainer_factory=drain_wiring.drainer_factory(config.tiers, state_dir))

The drainer runs as one asyncio task (planning, started by `CheckpointService.start`) with each tier's copies
on that tier's threads; tier maintenance (retention, orphans) and the drainer's hold on memory retention run
in the Checkpoints service's maintenance round; `sdcwatch ckpt` and restore plans see the tiers through the
service's drainer.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from checkpoint.coordinator import Coordinator
from checkpoint.drainer import Drainer, Tier
from checkpoint.s3_store import RetryPolicy, S3Store
from checkpoint.shm_store import DirStore
from checkpoint.tier_policy import TierRule
from daemon.tiers_config import TierRuleConfig, TiersConfig

log = logging.getLogger(__name__)
_MIB = 1 << 20


def _rule(name: str, t: TierRuleConfig) -> TierRule:
    return TierRule(name, every_n=t.every_n, every_s=t.every_s, keep_newest=t.keep,
                    keep_every_steps=t.keep_every_steps, keep_age_s=t.keep_age_s,
                    max_backlog_bytes=t.max_backlog_mib * _MIB)


def build_tiers(cfg: TiersConfig, state_dir: str | Path) -> list[Tier]:
    """The configured tiers, fastest first (NVMe, flash, S3)."""
    tiers: list[Tier] = []
    nvme, flash, s3 = cfg.nvme, cfg.flash, cfg.s3
    if nvme.dir != "off":
        d = Path(nvme.dir) if nvme.dir else Path(state_dir) / "tiers" / "nvme"
        tiers.append(Tier("nvme", DirStore(d, fsync=nvme.fsync), str(d), _rule("nvme", nvme),
                          concurrency=nvme.concurrency, bandwidth_bytes_s=nvme.bandwidth_mib_s * _MIB,
                          hop_timeout_s=cfg.hop_timeout_s))
    if flash.dir:
        d = Path(flash.dir)
        tiers.append(Tier("flash", DirStore(d, fsync=flash.fsync), str(d), _rule("flash", flash), shared=True,
                          concurrency=flash.concurrency, bandwidth_bytes_s=flash.bandwidth_mib_s * _MIB,
                          hop_timeout_s=cfg.hop_timeout_s))
    if s3.url:
        store = S3Store.from_url(s3.url, part_bytes=s3.part_mib * _MIB, concurrency=s3.concurrency,
                                 retry=RetryPolicy(max_attempts=s3.max_attempts, mode=s3.retry_mode),
                                 checksum=s3.checksum)
        tiers.append(Tier("s3", store, store.location, _rule("s3", s3), shared=True, verify=s3.verify,
                          concurrency=max(1, s3.concurrency // 2),
                          bandwidth_bytes_s=s3.bandwidth_mib_s * _MIB, hop_timeout_s=cfg.hop_timeout_s))
    return tiers


def drainer_factory(cfg: TiersConfig, state_dir: str | Path) -> Callable[[Coordinator], Drainer | None]:
    """For `build_checkpoint_service(drainer_factory=...)`: a Drainer over the coordinator's memory tier to the
    configured tiers (no task runs when none is configured), or None when the tiers are disabled."""
    def build(coordinator: Coordinator) -> Drainer | None:
        if not cfg.enabled:
            return None
        return Drainer(coordinator, build_tiers(cfg, state_dir), publish=coordinator.publish,
                       interval_s=cfg.interval_s, orphan_ttl_s=cfg.orphan_ttl_s)

    return build
