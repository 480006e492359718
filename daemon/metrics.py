"""The agent's own Prometheus metrics (GPU metrics live in daemon/gpu_metrics.py).

Naming follows Prometheus conventions: `sdcwatch_` prefix, `_total` counters, seconds and bytes.
Label values come from a bounded set (RPC method names, probe names, event kinds and severities,
job ids capped by `jobs.max_jobs`), so the registry's size stays bounded.
"""
from __future__ import annotations

import bisect
import platform
import time
from typing import Any, Iterator

import grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from daemon.events import Event
from daemon.jobs import JobTracker
from sdcwatch import __version__

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class AgentMetrics:
    """`jobs`: the job tracker whose jobs' numbers are read at scrape time (and which bounds the job labels of
    the event counts); without it, no job series."""

    def __init__(self, registry: CollectorRegistry | None = None, *, jobs: JobTracker | None = None) -> None:
        # prometheus_client's process-wide switch: no `<counter>_created` / `<histogram>_created` series (a
        # quarter of the agent's samples, which no rule or dashboard reads); the agent owns its process
        disable_created_metrics()
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
        self.rpc = RpcStats(_LATENCY_BUCKETS)
        r.register(self.rpc)
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
        self.job_dropped = Counter("sdcwatch_job_reports_dropped_total",
                                   "Reports the ranks dropped because the agent was slow or down", ["job_id"],
                                   registry=r)
        self.job_mismatches = Counter("sdcwatch_job_replica_mismatches_total",
                                      "Steps whose replica vote disagreed", ["job_id"], registry=r)
        self.job_events = Counter("sdcwatch_job_events_total",
                                  "Job-level events (loss anomalies, NaN, replica mismatch, frozen-parameter "
                                  "changes, rollbacks) by kind and severity", ["job_id", "kind", "severity"],
                                  registry=r)
        self.step_log_lost = Counter("sdcwatch_step_log_lost",
                                     "Step-log records not written (a failing disk, or the writer too far behind)",
                                     registry=r)
        self.reports_rejected = Counter("sdcwatch_reports_rejected_total",
                                        "ReportStep calls rejected as invalid", registry=r)
        self.reports_late = Counter("sdcwatch_reports_late_total",
                                    "ReportStep calls whose deadline passed before the agent got to them (the "
                                    "rank counts them as dropped): only their votes and non-finite values used",
                                    registry=r)
        self.jobs = jobs
        if jobs is not None:   # each tracked job's step count, newest step and fingerprint checks
            r.register(_JobStats(jobs))

    def count_event(self, event: Event) -> None:
        """Every journaled event by kind and severity, as the occurrences it stands for (repeats folded into
        it included); a tracked job's also by job (the bus's `on_event`)."""
        severity = event.severity.name.lower()
        self.events.labels(event.kind, severity).inc(event.occurrences)
        if self.jobs is not None and event.subject.startswith("job/"):
            job = event.subject.split("/", 2)[1]
            if job in self.jobs.jobs:  # bounded: only jobs the tracker holds
                self.job_events.labels(job, event.kind, severity).inc(event.occurrences)

    def observe_probe(self, name: str, seconds: float, ok: bool) -> None:
        self.probe_seconds.labels(name).observe(seconds)
        self.probe_runs.labels(name).inc()
        if not ok:
            self.probe_failures.labels(name).inc()

    def forget_job(self, job: str) -> None:
        for metric in (self.job_dropped, self.job_mismatches):
            try:
                metric.remove(job)
            except KeyError:
                pass
        for labels in [k for k in self.job_events._metrics if k[0] == job]:  # noqa: SLF001
            self.job_events.remove(*labels)


class RpcStats(Collector):
    """`sdcwatch_rpc_requests_total{method,code}` and `sdcwatch_rpc_duration_seconds{method}`, kept as plain
    counts that the registry reads at scrape time.

    Every RPC updates them on the event loop, the one thread that writes them; prometheus_client's own
    metrics take a lock per update (a histogram: two), which cost the loop several microseconds per call
    inside the gRPC server. A scrape reads the counts from the HTTP thread: the histogram's count is the sum
    of its buckets, so it is consistent whatever the loop does meanwhile."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        self._le = (*(floatToGoString(b) for b in self.bounds), "+Inf")
        self.methods: dict[str, MethodStats] = {}

    def method(self, name: str) -> "MethodStats":
        stats = self.methods.get(name)
        if stats is None:
            stats = self.methods[name] = MethodStats(self.bounds)
        return stats

    def collect(self) -> Iterator[Any]:
        calls = CounterMetricFamily("sdcwatch_rpc_requests", "gRPC requests handled", labels=["method", "code"])
        seconds = HistogramMetricFamily("sdcwatch_rpc_duration_seconds", "gRPC handler latency (unary calls)",
                                        labels=["method"])
        for name, stats in list(self.methods.items()):
            for code, n in list(stats.codes.items()):
                calls.add_metric([name, code], n)
            counts = list(stats.buckets)
            if not any(counts):
                continue
            cumulative, buckets = 0, []
            for bound, n in zip(self._le, counts):
                cumulative += n
                buckets.append((bound, cumulative))
            seconds.add_metric([name], buckets, stats.seconds)
        yield calls
        yield seconds

    def describe(self) -> Iterator[Any]:   # names only: the registry checks them for clashes without collecting
        yield CounterMetricFamily("sdcwatch_rpc_requests", "gRPC requests handled", labels=["method", "code"])
        yield HistogramMetricFamily("sdcwatch_rpc_duration_seconds", "gRPC handler latency (unary calls)",
                                    labels=["method"])


class MethodStats:
    """One method's calls by status code and its latency histogram (written by the event loop only)."""

    __slots__ = ("bounds", "buckets", "seconds", "codes")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)   # the last one is +Inf
        self.seconds = 0.0
        self.codes: dict[str, int] = {}

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, seconds)] += 1   # le: a value on a bound is in it
        self.seconds += seconds

    def count(self, code: str) -> None:
        self.codes[code] = self.codes.get(code, 0) + 1


class _JobStats(Collector):
    """`sdcwatch_job_steps_total`, `sdcwatch_job_last_step` and `sdcwatch_job_fingerprint_checks_total` (each
    by job_id) from the job tracker: the numbers ReportStep keeps anyway, so a report updates no metric of its
    own. The checks are the sum over the job's ranks of each rank's own running count (`checks_run`). An
    evicted job's series go with it."""

    def __init__(self, tracker: JobTracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[Any]:
        steps = CounterMetricFamily("sdcwatch_job_steps", "ReportStep calls accepted", labels=["job_id"])
        last = GaugeMetricFamily("sdcwatch_job_last_step", "Newest step reported by a job", labels=["job_id"])
        checks = CounterMetricFamily("sdcwatch_job_fingerprint_checks", "Fingerprint checks run by the job's ranks",
                                     labels=["job_id"])
        no_vote = GaugeMetricFamily("sdcwatch_job_replica_vote_unavailable", "1 when the job's ranks cannot vote "
                                    "across replicas (plain FSDP: no replica of a shard)", labels=["job_id"])
        stage = CounterMetricFamily("sdcwatch_job_stage_errors", _STAGE_HELP, labels=["job_id"])
        for job in list(self.tracker.jobs.values()):
            steps.add_metric([job.job_id], job.steps_seen)
            if job.last_step >= 0:
                last.add_metric([job.job_id], job.last_step)
            if job.checks_run:
                checks.add_metric([job.job_id], sum(list(job.checks_run.values())))
            no_vote.add_metric([job.job_id], 1.0 if job.vote_unavailable else 0.0)
            stage.add_metric([job.job_id], sum(list(job.stage_errors.values())))
        yield steps
        yield last
        yield checks
        yield no_vote
        yield stage

    def describe(self) -> Iterator[Any]:
        yield CounterMetricFamily("sdcwatch_job_steps", "ReportStep calls accepted", labels=["job_id"])
        yield GaugeMetricFamily("sdcwatch_job_last_step", "Newest step reported by a job", labels=["job_id"])
        yield CounterMetricFamily("sdcwatch_job_fingerprint_checks", "Fingerprint checks run by the job's ranks",
                                  labels=["job_id"])
        yield GaugeMetricFamily("sdcwatch_job_replica_vote_unavailable", "1 when the job's ranks cannot vote "
                                "across replicas (plain FSDP: no replica of a shard)", labels=["job_id"])
        yield CounterMetricFamily("sdcwatch_job_stage_errors", _STAGE_HELP, labels=["job_id"])


_STAGE_HELP = ("Checks around the job's optimizer steps that raised (step-guard stage failures, the sum of "
               "each rank's running count; see the rank.stage_failed event)")


def start_http(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, Any]:
    """Serve /metrics; returns (server, thread). `server.server_port` is the bound port."""
    return start_http_server(port, addr=host, registry=registry)
