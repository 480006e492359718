"""Connects the tier drainer (checkpoint/drainer.py) to the agent: NVMe, flash and S3 tiers from `[tiers]`.

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

from daemon.tiers_config import TiersConfig

if TYPE_CHECKING:
    from checkpoint.drainer import Drainer, Tier

log = logging.getLogger(__name__)
_MIB = 1 << 20


def build_tiers(cfg: TiersConfig, state_dir: str | Path) -> list["Tier"]:
    """The configured tiers, fastest first (NVMe, flash, S3)."""
    from checkpoint.drainer import Tier
    from checkpoint.shm_store import DirStore
    from checkpoint.tier_policy import TierRule

    def rule(name: str) -> TierRule:
        g = lambda k: getattr(cfg, f"{name}_{k}")  # noqa: E731
        return TierRule(name, every_n=g("every_n"), every_s=g("every_s"), keep_newest=g("keep"),
                        keep_every_steps=g("keep_every_steps"), keep_age_s=g("keep_age_s"),
                        max_backlog_bytes=int(g("max_backlog_mib")) * _MIB)

    tiers: list[Tier] = []
    if cfg.nvme_dir != "off":
        d = Path(cfg.nvme_dir) if cfg.nvme_dir else Path(state_dir) / "tiers" / "nvme"
        tiers.append(Tier("nvme", DirStore(d, fsync=cfg.nvme_fsync), str(d), rule("nvme"),
                          concurrency=cfg.nvme_concurrency, bandwidth_bytes_s=cfg.nvme_bandwidth_mib_s * _MIB,
                          hop_timeout_s=cfg.hop_timeout_s))
    if cfg.flash_dir:
        d = Path(cfg.flash_dir)
        tiers.append(Tier("flash", DirStore(d, fsync=cfg.flash_fsync), str(d), rule("flash"), shared=True,
                          concurrency=cfg.flash_concurrency, bandwidth_bytes_s=cfg.flash_bandwidth_mib_s * _MIB,
                          hop_timeout_s=cfg.hop_timeout_s))
    if cfg.s3_url:
        from checkpoint.s3_store import RetryPolicy, S3Store

        store = S3Store.from_url(cfg.s3_url, part_bytes=cfg.s3_part_mib * _MIB, concurrency=cfg.s3_concurrency,
                                 retry=RetryPolicy(max_attempts=cfg.s3_max_attempts))
        tiers.append(Tier("s3", store, store.location, rule("s3"), shared=True, verify=cfg.s3_verify,
                          concurrency=max(1, cfg.s3_concurrency // 2),
                          bandwidth_bytes_s=cfg.s3_bandwidth_mib_s * _MIB, hop_timeout_s=cfg.hop_timeout_s))
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
    cfg = getattr(agent.config, "tiers", None) or TiersConfig()
    service = agent.checkpoints
    if not cfg.enabled or service is None:
        return None
    drainer = build_drainer(service, cfg, agent.state_dir)
    if not drainer.tiers:
        return None
    agent._tasks.append(asyncio.create_task(drainer.run(), name="checkpoint-drainer"))
    log.info("checkpoint tiers: %s", ", ".join(f"{rt.tier.name}={rt.tier.location}" for rt in drainer.tiers))
    return drainer
