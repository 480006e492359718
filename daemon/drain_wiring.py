"""Connects the tier drainer (checkpoint/drainer.py) to the agent: NVMe, flash and S3 tiers from `[tiers.nvme]`,
`[tiers.flash]` and `[tiers.s3]`.

    from daemon import drain_wiring
    drain_wiring.start(agent)        # after _start_checkpoints(): needs agent.checkpoints

The drainer runs as one asyncio task (planning) with each tier's copies on that tier's threads; tier
maintenance (retention, orphans) runs in the Checkpoints service's maintenance round; `sdcwatch ckpt`
and restore plans see the tiers through `agent.checkpoints.drainer`.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.tiers_config import TierRuleConfig, TiersConfig

if TYPE_CHECKING:
    from checkpoint.drainer import Drainer, Tier
    from checkpoint.tier_policy import TierRule

log = logging.getLogger(__name__)
_MIB = 1 << 20


def _rule(name: str, t: TierRuleConfig) -> "TierRule":
    from checkpoint.tier_policy import TierRule

    return TierRule(name, every_n=t.every_n, every_s=t.every_s, keep_newest=t.keep,
                    keep_every_steps=t.keep_every_steps, keep_age_s=t.keep_age_s,
                    max_backlog_bytes=t.max_backlog_mib * _MIB)


def build_tiers(cfg: TiersConfig, state_dir: str | Path) -> list["Tier"]:
    """The configured tiers, fastest first (NVMe, flash, S3)."""
    from checkpoint.drainer import Tier
    from checkpoint.shm_store import DirStore

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
        from checkpoint.s3_store import RetryPolicy, S3Store

        store = S3Store.from_url(s3.url, part_bytes=s3.part_mib * _MIB, concurrency=s3.concurrency,
                                 retry=RetryPolicy(max_attempts=s3.max_attempts))
        tiers.append(Tier("s3", store, store.location, _rule("s3", s3), shared=True, verify=s3.verify,
                          concurrency=max(1, s3.concurrency // 2),
                          bandwidth_bytes_s=s3.bandwidth_mib_s * _MIB, hop_timeout_s=cfg.hop_timeout_s))
    return tiers


def build_drainer(service: Any, cfg: TiersConfig, state_dir: str | Path) -> "Drainer":
    """A Drainer over the service's coordinator, attached to the service (restore plans, ls, verify)."""
    from checkpoint.drainer import Drainer

    drainer = Drainer(service.coordinator, build_tiers(cfg, state_dir), publish=service.coordinator.publish,
                      interval_s=cfg.interval_s, orphan_ttl_s=cfg.orphan_ttl_s)
    service.drainer = drainer
    service.coordinator.retention_hold = drainer.hold
    return drainer


def start(agent: Any) -> "Drainer | None":
    """Start the drainer task in the running agent (no-op when disabled or without checkpoints)."""
    cfg = agent.config.tiers
    service = agent.checkpoints
    if not cfg.enabled or service is None:
        return None
    drainer = build_drainer(service, cfg, agent.state_dir)
    if not drainer.tiers:
        return None
    agent._tasks.append(asyncio.create_task(drainer.run(), name="checkpoint-drainer"))
    log.info("checkpoint tiers: %s", ", ".join(f"{rt.tier.name}={rt.tier.location}" for rt in drainer.tiers))
    return drainer
