"""The agent's own Prometheus metrics (GPU metrics live in daemon/gpu_metrics.py).

Naming follows Prometheus conventions: `sdcwatch_` prefix, `_total` counters, seconds and bytes.
Label values come from a bounded set (RPC method names, probe names, event kinds and severities,
job ids capped by `jobs.max_jobs`), so the registry's size stays bounded.
"""
from __future__ import annotations

import platform
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from daemon import __version__

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        import grpc

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.build = Info("sdcwatch_build", "Agent build: version, python and grpc versions", registry=r)
        self.build.info({"version": __version__, "python": platform.python_version(), "grpc": grpc.__version__})
        self.start_time = Gauge("sdcwatch_agent_start_time_seconds", "Unix time the agent started",
                                registry=r)
        self.start_time.set(time.time())
        self.uptime = Gauge("sdcwatch_agent_uptime_seconds", "Seconds since the agent started", registry=r)
        started = time.monotonic()
        self.uptime.set_function(lambda: time.monotonic() - started)
        self.ready = Gauge("sdcwatch_agent_ready", "1 when the agent is ready and serving", registry=r)
        self.node_state = Gauge("sdcwatch_node_state", "Node state: 1 when the node is in this state",
                                ["state"], registry=r)
        self.rpc_total = Counter("sdcwatch_rpc_requests_total", "gRPC requests handled",
                                 ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("sdcwatch_rpc_duration_seconds", "gRPC handler latency (unary calls)",
                                     ["method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.probe_seconds = Histogram("sdcwatch_probe_duration_seconds", "Duration of one probe run",
                                       ["probe"], buckets=_LATENCY_BUCKETS, registry=r)
        self.probe_runs = Counter("sdcwatch_probe_runs_total", "Probe runs", ["probe"], registry=r)
        self.probe_failures = Counter("sdcwatch_probe_failures_total", "Probe runs that failed or timed out",
                                      ["probe"], registry=r)
        self.probe_hung = Gauge("sdcwatch_probe_hung", "1 while a probe call is hung", ["probe"], registry=r)
        self.events = Counter("sdcwatch_events_total", "Events journaled", ["kind", "severity"], registry=r)
        self.events_dropped = Counter("sdcwatch_events_dropped_total",
                                      "Events not delivered to a sink (queue full or sink down)",
                                      ["sink"], registry=r)
        self.job_steps = Counter("sdcwatch_job_steps_total", "ReportStep calls accepted", ["job_id"], registry=r)
        self.job_last_step = Gauge("sdcwatch_job_last_step", "Newest step reported by a job", ["job_id"],
                                   registry=r)
        self.job_dropped = Counter("sdcwatch_job_reports_dropped_total",
                                   "Reports the ranks dropped because the agent was slow or down", ["job_id"],
                                   registry=r)
        self.job_checks = Counter("sdcwatch_job_fingerprint_checks_total",
                                  "Fingerprint checks run by the job's ranks", ["job_id"], registry=r)
        self.job_mismatches = Counter("sdcwatch_job_replica_mismatches_total",
                                      "Steps whose replica vote disagreed", ["job_id"], registry=r)
        self.job_events = Counter("sdcwatch_job_events_total",
                                  "Job-level events (loss anomalies, NaN, replica mismatch, frozen-parameter "
                                  "changes, rollbacks) by kind and severity", ["job_id", "kind", "severity"],
                                  registry=r)
        self._job_kids: dict[str, tuple[Any, Any]] = {}
        self.reports_rejected = Counter("sdcwatch_reports_rejected_total",
                                        "ReportStep calls rejected as invalid", registry=r)

    def job_children(self, job: str) -> tuple[Any, Any]:
        """The per-job step counter and last-step gauge, cached (label lookups cost on the hot path)."""
        kids = self._job_kids.get(job)
        if kids is None:
            kids = self._job_kids[job] = (self.job_steps.labels(job), self.job_last_step.labels(job))
        return kids

    def observe_probe(self, name: str, seconds: float, ok: bool) -> None:
        self.probe_seconds.labels(name).observe(seconds)
        self.probe_runs.labels(name).inc()
        if not ok:
            self.probe_failures.labels(name).inc()

    def forget_job(self, job: str) -> None:
        self._job_kids.pop(job, None)
        for metric in (self.job_steps, self.job_last_step, self.job_dropped, self.job_checks,
                       self.job_mismatches):
            try:
                metric.remove(job)
            except KeyError:
                pass
        for labels in [k for k in self.job_events._metrics if k[0] == job]:  # noqa: SLF001
            self.job_events.remove(*labels)


def start_http(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, Any]:
    """Serve /metrics; returns (server, thread). `server.server_port` is the bound port."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=registry)
