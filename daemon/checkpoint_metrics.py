"""Prometheus metrics of the in-memory checkpoints (`sdcwatch_checkpoint_*`).

    metrics = CheckpointMetrics(agent.metrics.registry)
    metrics.update(service)      # after each maintenance round (cheap: no I/O, reads cached state)

Counters follow the coordinator's cumulative `stats()` (incremented by the difference since the last
update, so they never go backwards); histograms are fed from the samples the coordinator buffers
(rank-side blocking/safe/stall times arrive with each CommitShard, restore times with ReportRestore);
per-job gauges come from the service's cached summaries. Job label values are the jobs with live
checkpoints in the agent's Redis; series of jobs that have none left are removed.

Alert on `time() - sdcwatch_checkpoint_last_verified_timestamp_seconds > N`: the job has had no
VERIFIED checkpoint for N seconds (a rollback would lose that much work, or verification is failing).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# coordinator stats key -> (metric name, help)
_COUNTERS = {
    "checkpoints_committed": ("sdcwatch_checkpoint_committed_total", "Checkpoints globally committed"),
    "shards_committed": ("sdcwatch_checkpoint_shards_committed_total", "Shard commits accepted"),
    "bytes_committed": ("sdcwatch_checkpoint_committed_bytes_total", "Bytes of checkpoints committed"),
    "verified": ("sdcwatch_checkpoint_verified_total", "Checkpoints that became VERIFIED"),
    "revoked": ("sdcwatch_checkpoint_revoked_total", "VERIFIED checkpoints revoked by a later bad event"),
    "evictions": ("sdcwatch_checkpoint_evictions_total", "Checkpoints evicted by retention or rollback"),
    "aborted": ("sdcwatch_checkpoint_aborted_total", "Saves aborted (a rank never finished)"),
    "checksum_failures": ("sdcwatch_checkpoint_checksum_failures_total",
                          "Chunks that failed their checksum (on commit, or on a copy read by a restore)"),
    "saves_skipped": ("sdcwatch_checkpoint_saves_skipped_total",
                      "Saves a rank skipped because its previous save was still writing"),
    "restores": ("sdcwatch_checkpoint_restores_total", "Restores reported by ranks"),
    "replicas": ("sdcwatch_checkpoint_replicas_total", "Shard copies written to a peer node's memory tier"),
    "replica_bytes": ("sdcwatch_checkpoint_replica_bytes_total", "Bytes copied to peer nodes' memory tiers"),
    "replication_failures": ("sdcwatch_checkpoint_replication_failures_total",
                             "Shard copies to a peer that failed (the peer is skipped, the others still get it)"),
    "restores_failed": ("sdcwatch_checkpoint_restores_failed_total", "Restores that failed"),
    "restore_fallbacks": ("sdcwatch_checkpoint_restore_fallbacks_total",
                          "Chunks a restore read from another copy than the first"),
    "slots_swept": ("sdcwatch_checkpoint_slots_swept_total", "Staging slots of dead ranks removed"),
    "scrubbed_bytes": ("sdcwatch_checkpoint_scrubbed_bytes_total",
                       "Bytes of shards checksummed at the source that the scrub checked in node memory"),
    "scrub_failures": ("sdcwatch_checkpoint_scrub_failures_total",
                       "Shards whose bytes in node memory differ from their source checksums (never VERIFIED)"),
}

# observation name -> (metric name, help)
_HISTOGRAMS = {
    "save_blocking": ("sdcwatch_checkpoint_save_blocking_seconds", "Time save() blocked the training loop"),
    "save_safe": ("sdcwatch_checkpoint_save_safe_seconds",
                  "From save() returning until the shard was in node memory"),
    "save_stall": ("sdcwatch_checkpoint_save_stall_seconds",
                   "Time a save waited for the rank's previous save, still writing (only stalls)"),
    "save_commit": ("sdcwatch_checkpoint_save_commit_seconds",
                    "From the first rank's Begin until the checkpoint was COMMITTED"),
    "restore": ("sdcwatch_checkpoint_restore_seconds", "Restore time reported by a rank (verified)"),
}


class CheckpointMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.counters = {key: Counter(name.removesuffix("_total"), help_, registry=r)
                         for key, (name, help_) in _COUNTERS.items()}
        self.histograms = {key: Histogram(name, help_, buckets=_SECONDS, registry=r)
                           for key, (name, help_) in _HISTOGRAMS.items()}
        self.stalls = Counter("sdcwatch_checkpoint_save_stalls", "Saves that waited for the previous save",
                              registry=r)
        self.memory_bytes = Gauge("sdcwatch_checkpoint_memory_bytes",
                                  "Bytes in this node's checkpoint memory tier (blobs, slots, spares)", registry=r)
        self.job_bytes = Gauge("sdcwatch_checkpoint_bytes", "Bytes of a job's live checkpoints (all ranks)",
                               ["job_id"], registry=r)
        # not `_count`: promtool reserves that suffix for histograms and summaries
        self.job_count = Gauge("sdcwatch_checkpoints", "A job's live checkpoints (pending, committed, "
                               "verified)", ["job_id"], registry=r)
        self.latest_step = Gauge("sdcwatch_checkpoint_latest_step", "Newest restorable checkpoint step; -1 none",
                                 ["job_id"], registry=r)
        self.latest_verified_step = Gauge("sdcwatch_checkpoint_latest_verified_step",
                                          "Newest VERIFIED checkpoint step; -1 none", ["job_id"], registry=r)
        self.last_verified = Gauge("sdcwatch_checkpoint_last_verified_timestamp_seconds",
                                   "Unix time the job's newest VERIFIED checkpoint was verified; 0 none",
                                   ["job_id"], registry=r)
        self._seen: dict[str, int] = {}
        self._jobs: set[str] = set()
        self.tiers = TierMetrics(r)
        self.restore_source = Counter("sdcwatch_checkpoint_restore_source", "Restores by the tier that served "
                                      "most of the bytes (memory, peer, nvme, flash, s3)", ["tier"], registry=r)
        self._sources: dict[str, int] = {}

    def update(self, service: Any) -> None:
        """Bring the metrics up to date from a `CheckpointService` (or anything with `stats()`,
        `summaries()`, `memory_bytes()` and `coordinator.observations`)."""
        stats = service.stats()
        for key, counter in self.counters.items():
            now = int(stats.get(key, 0))
            delta = now - self._seen.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._seen[key] = max(now, self._seen.get(key, 0))
        obs = getattr(getattr(service, "coordinator", None), "observations", None)
        while obs:
            name, value = obs.popleft()
            h = self.histograms.get(name)
            if h is not None:
                h.observe(value)
            if name == "save_stall":
                self.stalls.inc()
        mem = getattr(service, "memory_bytes", None)
        if mem is not None:
            self.memory_bytes.set(mem())
        jobs = set()
        for s in service.summaries():
            jobs.add(s.job_id)
            self.job_bytes.labels(s.job_id).set(s.bytes)
            self.job_count.labels(s.job_id).set(s.count)
            self.latest_step.labels(s.job_id).set(s.latest_step)
            self.latest_verified_step.labels(s.job_id).set(s.latest_verified_step)
            self.last_verified.labels(s.job_id).set(s.latest_verified_at)
        for gone in self._jobs - jobs:
            for g in (self.job_bytes, self.job_count, self.latest_step, self.latest_verified_step,
                      self.last_verified):
                try:
                    g.remove(gone)
                except KeyError:
                    pass
        self._jobs = jobs
        coord = getattr(service, "coordinator", None)
        for tier, n in dict(getattr(coord, "restore_sources", {}) or {}).items():
            delta = n - self._sources.get(tier, 0)
            if delta > 0:
                self.restore_source.labels(tier).inc(delta)
            self._sources[tier] = max(n, self._sources.get(tier, 0))
        drainer = getattr(service, "drainer", None)
        if drainer is not None:
            self.tiers.update(drainer)


_TIER_COUNTERS = {
    "bytes": ("sdcwatch_checkpoint_tier_bytes_total", "Bytes copied to a tier (verified)"),
    "hops": ("sdcwatch_checkpoint_tier_copies_total", "Checkpoint copies committed to a tier"),
    "failures": ("sdcwatch_checkpoint_tier_copy_failures_total", "Copies to a tier that failed (not committed)"),
    "errors": ("sdcwatch_checkpoint_tier_errors_total",
               "Failed reads/writes/verifications of a tier (copies, scans, maintenance, verify)"),
    "verify_failures": ("sdcwatch_checkpoint_tier_verify_failures_total",
                        "Copies whose written bytes did not verify (checksum mismatch, truncation)"),
    "retention_deletions": ("sdcwatch_checkpoint_tier_retention_deletions_total",
                            "Checkpoint copies a tier's retention deleted"),
    "orphans_deleted": ("sdcwatch_checkpoint_tier_orphans_deleted_total",
                        "Blobs of interrupted copies (no manifest) deleted"),
}


class TierMetrics:
    """Per durable tier (label `tier`: nvme, flash, s3): bytes, copies, failures, backlog, health."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.counters = {key: Counter(name.removesuffix("_total"), help_, ["tier"], registry=r)
                         for key, (name, help_) in _TIER_COUNTERS.items()}
        self.backlog = Gauge("sdcwatch_checkpoint_drain_backlog_bytes",
                             "Bytes of checkpoints waiting to be copied to a tier (planned or in flight)", ["tier"],
                             registry=r)
        self.healthy = Gauge("sdcwatch_checkpoint_tier_healthy", "1 when the tier's last copy worked, 0 when it is "
                             "failing (disk full, read-only, unreachable, hung)", ["tier"], registry=r)
        self.held = Gauge("sdcwatch_checkpoint_tier_checkpoints", "This node's committed checkpoint copies on a tier",
                          ["tier"], registry=r)
        self.held_bytes = Gauge("sdcwatch_checkpoint_tier_stored_bytes", "Bytes of this node's copies on a tier",
                                ["tier"], registry=r)
        self.throughput = Gauge("sdcwatch_checkpoint_tier_throughput_bytes_per_second",
                                "Throughput of the last copy to a tier (read, verify, write, verify)", ["tier"],
                                registry=r)
        self.duration = Histogram("sdcwatch_checkpoint_tier_copy_seconds", "Time to copy one checkpoint to a tier",
                                  ["tier"], buckets=_SECONDS, registry=r)
        self._seen: dict[tuple[str, str], int] = {}

    def update(self, drainer: Any) -> None:
        for tier, st in drainer.stats().items():
            for key, counter in self.counters.items():
                now = int(getattr(st, key))
                delta = now - self._seen.get((tier, key), 0)
                if delta > 0:
                    counter.labels(tier).inc(delta)
                self._seen[(tier, key)] = max(now, self._seen.get((tier, key), 0))
            self.backlog.labels(tier).set(st.backlog_bytes)
            self.healthy.labels(tier).set(1 if st.healthy else 0)
            self.held.labels(tier).set(st.held)
            self.held_bytes.labels(tier).set(st.held_bytes)
            self.throughput.labels(tier).set(st.last_throughput)
        obs = drainer.observations
        while obs:
            tier, seconds, _nbytes = obs.popleft()
            self.duration.labels(tier).observe(seconds)
