"""`build_agent(config)`: the agent and its collaborators, built in dependency order from the config with
production defaults. Nothing here does I/O beyond creating directories; the agent's `start()` opens, binds
and connects (daemon/agent.py).

Order: the background owner -> the job tracker -> metrics -> the journals and the event bus (every event
counted by the metrics) -> Redis (embedded or the configured URL) -> the checkpoint service (memory tier,
peer replicas, durable tiers) and the feed of job events to it -> the GPU table, whose state changes publish,
update the GPU metrics, tell the checkpoints and wake the health sync -> the health answers -> the GPU probes
-> the rollback planner -> the alert dispatcher. A test builds the same with its own parts through `Agent`.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Mapping

from daemon import drain_wiring, k8s_nodes, peers_wiring
from daemon.nvsentinel import NvsentinelEvents
from daemon.agent import Agent
from daemon.alerts import AlertDispatcher
from daemon.background import Background
from daemon.checkpoint_feed import CheckpointFeed
from daemon.checkpoint_metrics import CheckpointMetrics
from daemon.checkpoint_service import build_checkpoint_service
from daemon.config import Config
from daemon.events import EventBus
from daemon.gpu_metrics import GpuMetrics
from daemon.gpu_transitions import GpuTransitions
from daemon.gpus import GpuRegistry
from daemon.health import AgentHealthServicer, HealthFollower, NodeHealth
from daemon.jobs import JobTracker
from daemon.journal import Journal
from daemon.metrics import AgentMetrics
from daemon.pools import WorkPool
from daemon.nvml_wiring import GpuProbes
from daemon.redis_embedded import EmbeddedRedis
from daemon.rollback import RollbackPlanner
from daemon.step_log import StepLog


def build_agent(config: Config, *, versions: Mapping[str, str] | None = None) -> Agent:
    """`versions`: extra entries for GetStatus's versions (e.g. the event loop the CLI chose)."""
    state_dir = Path(config.agent.state_dir)
    host = config.agent.hostname
    background = Background()
    jobs = JobTracker(max_jobs=config.jobs.max_jobs, idle_s=config.jobs.job_idle_s, loss_config=config.loss,
                      rollback=config.rollback if config.jobs.rollback else None,
                      compute_stop=config.jobs.stop_on_compute_fault)
    metrics = AgentMetrics(jobs=jobs)
    jc = config.journal
    journal = Journal(state_dir / "journal", max_bytes=jc.max_bytes, keep_files=jc.keep_files)
    steps = Journal(state_dir / "steps", prefix="steps", max_bytes=jc.max_bytes, keep_files=jc.keep_files,
                    flush_each=False)
    bus = EventBus(journal, ring_size=jc.memory_events, host=host, on_event=metrics.count_event,
                   on_journal_lost=metrics.events_dropped.labels("journal").inc,
                   read_pool=WorkPool("journal-reads", workers=2, wedged_after_s=config.agent.pool_wedged_s))

    embedded_redis = None if config.redis.url else EmbeddedRedis(state_dir, config.redis.binary)
    redis_url = embedded_redis.url if embedded_redis is not None else config.redis.url
    checkpoints = build_checkpoint_service(
        redis_url, state_dir, bus.publish, node=host, config=config.checkpoints,
        own_index=embedded_redis is not None, gid=config.agent.group_id(),
        redis_options=config.redis.options(),
        replicator_factory=peers_wiring.replicator_factory(config.peers, host,
                                                           shared_redis=embedded_redis is None),
        replicate_timeout_s=config.peers.timeout_s,
        drainer_factory=drain_wiring.drainer_factory(config.tiers, state_dir),
        metrics=CheckpointMetrics(metrics.registry), workers=config.agent.service_workers,
        wedged_after_s=config.agent.pool_wedged_s)
    feed = CheckpointFeed(checkpoints, dropped=metrics.events_dropped, publish=bus.publish)

    rollback_pool = WorkPool("rollback-planning", workers=2, wedged_after_s=config.agent.pool_wedged_s)
    gpu_metrics = GpuMetrics(metrics.registry, hostname=host) if config.nvml.enabled else None
    health_changed = asyncio.Event()
    gpus = GpuRegistry(on_transition=GpuTransitions(publisher=bus, jobs=jobs, checkpoints=feed,
                                                    gpu_metrics=gpu_metrics, health_changed=health_changed))
    followers: list[HealthFollower] = []
    if config.kubernetes.node_conditions:
        followers.append(k8s_nodes.build(config.kubernetes, host, gpus))
    if config.nvsentinel.socket:
        followers.append(NvsentinelEvents(config.nvsentinel, config.kubernetes.node_name or host, gpus))
    health = NodeHealth(AgentHealthServicer(), gpus, metrics, health_changed,
                        pools=(*checkpoints.local_pools(), bus.read_pool, rollback_pool), followers=followers)
    probes = GpuProbes(config.nvml, config.canary, gpus=gpus, publisher=bus, metrics=metrics,
                       gpu_metrics=gpu_metrics, state_dir=state_dir)
    rollbacks = RollbackPlanner(config.rollback, checkpoints=checkpoints, jobs=jobs, publisher=bus,
                                background=background, pool=rollback_pool)
    alerts = AlertDispatcher(config.alerts, node=host, registry=metrics.registry)
    step_log = StepLog(steps, on_lost=metrics.step_log_lost.inc)
    return Agent(config, journal=journal, steps=steps, step_log=step_log, bus=bus, gpus=gpus,
                 jobs=jobs, probes=probes, checkpoints=checkpoints, checkpoint_feed=feed, rollbacks=rollbacks,
                 alerts=alerts, health=health, metrics=metrics, background=background, redis_url=redis_url,
                 embedded_redis=embedded_redis, versions=versions or {})
