"""The agent process: one asyncio loop, the grpc.aio servers, one task per probe, the event journal.

The agent is built from its collaborators, each passed in (daemon/compose.py builds them from the config with
production defaults; a test may pass its own): the event bus and its journals, the GPU table, the job
tracker, the GPU probes, the checkpoint service and its job-event feed, the rollback planner, the alert
dispatcher, the health answers, the metrics, and the `Background` that owns every task and closer.

Lifecycle (`run()`):
  start: lock the state dir -> journal -> Redis (embedded or URL) -> metrics -> checkpoints (and the embedded
         Redis's supervisor, daemon/redis_supervisor.py) -> servers (health NOT_SERVING) -> GPU discovery and
         probes -> ready: health SERVING (and `sdcwatch.v1.Checkpoints`), `agent.json` written.
  stop (SIGTERM/SIGINT): health NOT_SERVING -> servers stop with grace (in-flight RPCs drain) ->
         background tasks cancelled -> journal flushed -> embedded Redis stopped -> socket, lock removed
         (each step bounded: a Redis failing over or gone never holds the stop up; daemon/background.py).

ReportStep (`handle_report`, called by daemon/service.py after validation): the job tracker accounts the
report and says what to do (`JobTracker.report`, daemon/jobs.py: None for the usual report), the agent does
it (`_act_on`: journal the findings, feed the checkpoint coordinator, attach evidence to this node's GPUs,
plan rollbacks), the step log queues the record, and the rank gets its directives.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import google.protobuf
import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from checkpoint.redis_connect import connect_async
from sdcwatch import __version__
from sdcwatch.channels import read_token
from sdcwatch import event_kinds as ek
from daemon import checkpoint_service, grpc_logging
from daemon.alerts import AlertDispatcher
from daemon.background import Background
from daemon.checkpoint_feed import CheckpointFeed
from daemon.checkpoint_service import CheckpointService
from daemon.config import Config, parse_hostport
from daemon.errors import ConfigError
from sdcwatch.errors import FatalError
from daemon.events import Event, EventBus
from daemon.gpus import GpuRegistry
from daemon.health import NodeHealth
from daemon.watchdog import Watchdog
from daemon.interceptors import AgentInterceptor, MeteredServer
from daemon.jobs import JobTracker, ReportOutcome
from daemon.journal import Journal, JournalOpenError
from daemon.metrics import AgentMetrics, start_http
from daemon.nvml_wiring import GpuProbes
from daemon.redis_embedded import EmbeddedRedis
from daemon.redis_supervisor import CHECKPOINTS_HEALTH, RedisSupervisor
from daemon.rollback import RollbackPlanner
from daemon.service import AgentService, probe_state_pb
from daemon.state_dir import StateDir, claim_socket
from daemon.step_log import StepLog
from sdcwatch.types import Evidence, State
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_STOP_STEP_S = 3.0   # the most each shutdown step waits (tasks, the checkpoint service, the Redis stream)


class Agent:
    def __init__(self, config: Config, *, journal: Journal, steps: Journal, step_log: StepLog, bus: EventBus,
                 gpus: GpuRegistry, jobs: JobTracker, probes: GpuProbes, checkpoints: CheckpointService,
                 checkpoint_feed: CheckpointFeed, rollbacks: RollbackPlanner, alerts: AlertDispatcher,
                 health: NodeHealth, metrics: AgentMetrics, background: Background, redis_url: str,
                 embedded_redis: EmbeddedRedis | None, versions: Mapping[str, str]) -> None:
        self.config = config
        self.state_dir = Path(config.agent.state_dir)
        self.host = config.agent.hostname
        self.journal = journal
        self.steps = steps
        self.step_log = step_log
        self.bus = bus
        self.gpus = gpus
        self.jobs = jobs
        self.probes = probes
        self.checkpoints = checkpoints
        self.checkpoint_feed = checkpoint_feed
        self.rollbacks = rollbacks
        self.alerts = alerts
        self.health = health
        self.metrics = metrics
        self.background = background
        self.redis_url = redis_url
        self.embedded_redis = embedded_redis
        self.versions = dict(versions)   # besides sdcwatch, python, grpc, protobuf: e.g. the event loop
        self.started_at = time.time()
        self.ready = False
        self.stopping = False
        self.addresses: dict[str, str] = {}
        # opened by start()
        self.redis: aioredis.Redis | None = None
        self._servers: list[grpc.aio.Server] = []
        self._state_dir = StateDir(self.state_dir, mode=config.agent.state_dir_mode(), gid=config.agent.group_id())
        self._metrics_server: Any = None
        self._stop_event: asyncio.Event | None = None
        self.redis_supervisor: RedisSupervisor | None = None   # the embedded redis-server's, from start()
        self._owns_state = False

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._prepare_state_dir()
        try:
            self.journal.open()
            self.steps.open()
        except JournalOpenError as exc:   # exit 2 (a setting to fix), with the reason
            raise ConfigError("agent.state_dir", str(exc)) from None
        self.step_log.start()
        self.bus.bind_loop(loop)
        await self.alerts.start(self.bus, since_seq=self.bus.last_seq)
        await self._start_redis()
        self._start_metrics()
        await self.checkpoints.open()
        self.checkpoints.start(self.background)
        if self.embedded_redis is not None:   # restarted when it dies (daemon/redis_supervisor.py)
            self.redis_supervisor = RedisSupervisor(self.embedded_redis, publish=self.bus.publish,
                                                    set_health=self._set_health, on_restarted=self.checkpoints.open)
            self.redis_supervisor.start(self.background)
        self.checkpoint_feed.start(self.background)
        await self._start_servers()
        self.bus.publish(ek.AGENT_STARTING, "node",
                         f"sdcwatch {__version__} starting on {self.host}",
                         {"pid": os.getpid(), "version": __version__, "state_dir": str(self.state_dir),
                          "redis": "embedded" if self.embedded_redis else "external"})
        await self.probes.start(self.background)
        self.health.start(self.background)
        watchdog = Watchdog(self.probes.loops, publish=self.bus.publish, health=self.health,
                            on_change=self.probes.on_loop_stale)
        self.background.start(watchdog.run_forever(), name="watchdog")
        self.background.start(self._housekeeping(), name="housekeeping")
        self.background.start(self._stream_events(), name="redis-stream")
        # Everything long-lived exists now (protobuf, the servers, the probes): move it out of the cyclic GC's
        # reach, so collections on the request path scan only new objects, not the whole heap.
        gc.collect()
        gc.freeze()
        self.ready = True
        self.metrics.ready.set(1)
        await self.health.set_serving(True)
        await self._set_health(CHECKPOINTS_HEALTH, True)
        self._write_runtime_info()
        self.bus.publish(ek.AGENT_READY, "node", f"agent ready on {self.addresses.get('socket')}",
                         {"addresses": dict(self.addresses)})

    async def _set_health(self, service: str, serving: bool) -> None:
        await self.health.servicer.set(service, health_pb2.HealthCheckResponse.SERVING if serving
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _prepare_state_dir(self) -> None:
        """The state dir created and checked, its lock taken, the socket path free (daemon/state_dir.py)."""
        self._state_dir.lock()
        self._owns_state = True
        claim_socket(self.config.agent.socket)

    async def _start_redis(self) -> None:
        if self.embedded_redis is not None:
            await asyncio.to_thread(self.embedded_redis.start)
        self.redis = connect_async(self.redis_url, self.config.redis.options())
        try:
            await asyncio.wait_for(self.redis.ping(), self.config.redis.connect_timeout_s)
        except Exception as exc:
            raise FatalError(f"cannot reach Redis at {_redact(self.redis_url)}: {exc}") from exc
        self.addresses["redis"] = _redact(self.redis_url)

    def _start_metrics(self) -> None:
        listen = self.config.agent.metrics_listen
        if listen == "off":
            return
        host, port = parse_hostport("agent.metrics_listen", listen)
        try:
            server, _thread = start_http(self.metrics.registry, host, port)
        except OSError as exc:
            raise FatalError(f"cannot serve metrics on {listen}: {exc}") from exc
        self._metrics_server = server
        self.addresses["metrics"] = f"{host}:{server.server_port}"

    def _server_options(self) -> list[tuple[str, Any]]:
        limit = self.config.agent.max_message_bytes
        return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0)]

    def _make_server(self, token: str | None) -> grpc.aio.Server:
        # The token (TCP only) is checked by an interceptor; the RPC metrics wrap each handler once, at
        # registration (MeteredServer), so the unix socket's calls go through no interceptor at all.
        grpc_logging.install()   # a client gone before a call's end is one INFO line, not an ERROR traceback
        server = grpc.aio.server(interceptors=[AgentInterceptor(token)] if token else None,
                                 options=self._server_options())
        metered: Any = MeteredServer(server, self.metrics)
        pb_grpc.add_AgentServicer_to_server(AgentService(self), metered)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, metered)
        checkpoint_service.register(metered, self.checkpoints)   # Checkpoints and PeerStore
        reflection.enable_server_reflection([
            pb.DESCRIPTOR.services_by_name["Agent"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
            *checkpoint_service.SERVICE_NAMES], server)
        return server

    async def _start_servers(self) -> None:
        cfg = self.config.agent
        await self.health.not_serving()
        # unix socket: local trust (file mode), no token
        server = self._make_server(token=None)
        old_umask = os.umask(0o777 & ~cfg.socket_mode_int())   # the mode at bind: no chmod through a link
        try:
            server.add_insecure_port(f"unix:{cfg.socket}")
            await server.start()
        finally:
            os.umask(old_umask)
        if cfg.group_id() >= 0:
            os.chown(cfg.socket, -1, cfg.group_id(), follow_symlinks=False)
        self._servers.append(server)
        self.addresses["socket"] = cfg.socket
        if cfg.listen:
            try:   # an empty token file never means "no authentication" (config validation refuses it too)
                token = read_token(cfg.token_file)
            except (OSError, ValueError) as exc:
                raise ConfigError("agent.token_file", str(exc)) from None
            tcp = self._make_server(token=token)
            if cfg.tls_cert:
                creds = grpc.ssl_server_credentials(
                    [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())],
                    root_certificates=Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None,
                    require_client_auth=bool(cfg.tls_client_ca))
                port = tcp.add_secure_port(cfg.listen, creds)
            else:
                log.warning("serving the API on %s over PLAIN TCP (--insecure): anyone who can reach it "
                            "can read status and send reports", cfg.listen)
                port = tcp.add_insecure_port(cfg.listen)
            if port == 0:
                raise FatalError(f"cannot listen on {cfg.listen}")
            await tcp.start()
            self._servers.append(tcp)
            self.addresses["listen"] = f"{parse_hostport('agent.listen', cfg.listen)[0]}:{port}"
        if cfg.health_listen:
            hs = grpc.aio.server(options=self._server_options())
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, hs)
            reflection.enable_server_reflection([health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                                 reflection.SERVICE_NAME], hs)
            port = hs.add_insecure_port(cfg.health_listen)
            if port == 0:
                raise FatalError(f"cannot listen on {cfg.health_listen}")
            await hs.start()
            self._servers.append(hs)
            self.addresses["health"] = f"{parse_hostport('agent.health_listen', cfg.health_listen)[0]}:{port}"

    def _write_runtime_info(self) -> None:
        info = {"pid": os.getpid(), "version": __version__, "started_at": self.started_at,
                "host": self.host, **self.addresses}
        tmp = self.state_dir / "agent.json.tmp"
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, self.state_dir / "agent.json")

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop."""
        loop = asyncio.get_running_loop()
        try:
            await self.start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            assert self._stop_event is not None
            await self._stop_event.wait()
        finally:
            await self.stop()

    def request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    async def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        if not self._owns_state:
            return  # never got the state dir: nothing of ours to clean up
        self.ready = False
        self.metrics.ready.set(0)
        self.health.serving = False
        await self.health.servicer.enter_graceful_shutdown()
        if self.journal.is_open:
            self.bus.flush_folds()   # the repeat counts still in their windows
            self.bus.publish(ek.AGENT_STOPPING, "node", "agent stopping")
        await self.bus.close()
        with contextlib.suppress(Exception):
            await self.alerts.stop(flush_timeout_s=2.0)
        grace = self.config.agent.shutdown_grace_s
        await asyncio.gather(*(s.stop(grace) for s in self._servers), return_exceptions=True)
        # every step below is bounded: a Redis that is failing over (or gone) never holds the stop up
        await self.background.cancel(_STOP_STEP_S)
        self.probes.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.checkpoints.close(timeout_s=_STOP_STEP_S), 2 * _STOP_STEP_S)
        self.background.run_closers()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush_stream(), _STOP_STEP_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.redis.aclose(), _STOP_STEP_S)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.step_log.close()
        if self.journal.is_open:
            self.journal.close()
        if self.embedded_redis is not None:
            await asyncio.to_thread(self.embedded_redis.stop)
        ours = [Path(self.config.agent.socket)] if "socket" in self.addresses else []   # bound by us
        for path in (*ours, self.state_dir / "agent.json"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._state_dir.release()

    # -- background tasks --------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                now = time.time()
                self.bus.tick()   # repeat counts of the fold windows that closed
                self.gpus.refresh(now)
                for job in self.jobs.expire(now):
                    self.metrics.forget_job(job)
                    self.bus.publish(ek.JOB_FORGOTTEN, f"job/{job}",
                                     f"job {job} sent no report for {self.config.jobs.job_idle_s:.0f}s")
                self.health.update_node_metrics()
                await self.health.check_pools(time.monotonic())
            except Exception:  # one failure never kills the loop
                log.exception("housekeeping failed")

    async def _stream_events(self) -> None:
        """Append every event to the Redis stream `sdcwatch:events:<host>` (bounded, drops counted)."""
        assert self.bus.stream_queue is not None and self.redis is not None
        key = f"sdcwatch:events:{self.host}"
        while True:
            event = await self.bus.stream_queue.get()
            try:
                await self.redis.xadd(key, _stream_fields(event), maxlen=self.config.redis.stream_maxlen,
                                      approximate=True)
            except Exception as exc:
                self.metrics.events_dropped.labels("redis").inc()
                log.warning("redis stream append failed: %s", exc)
                await asyncio.sleep(1.0)

    async def _flush_stream(self) -> None:
        q = self.bus.stream_queue
        if q is None or self.redis is None:
            return
        key = f"sdcwatch:events:{self.host}"
        while not q.empty():
            event = q.get_nowait()
            await asyncio.wait_for(self.redis.xadd(key, _stream_fields(event),
                                                   maxlen=self.config.redis.stream_maxlen, approximate=True), 1.0)

    # -- the API (daemon/service.py's AgentApi) ------------------------------------------------------
    def handle_report(self, req: pb.ReportStepRequest, now: float, late: bool = False) -> list[pb.Directive]:
        """One accepted ReportStep: the job tracker says what to do, the agent does it; the step log queues
        the record; returns the rank's directives (usually none). A `late` report (its rank gave up on it and
        counts it as dropped) moves nothing along: only what VERIFIED depends on is used (`report_late`)."""
        if late:
            self.metrics.reports_late.inc()
            late_out = self.jobs.report_late(req, now)
            if late_out is not None:
                self._act_on(req.job_id, late_out, now)
            return []
        out = self.jobs.report(req, now)
        if self.config.journal.step_log:
            self.step_log.add(req, now)  # formatted and written by the step log's thread (daemon/step_log.py)
        if out is None:
            return []
        self._act_on(req.job_id, out, now)
        return out.directives

    def _act_on(self, job: str, out: ReportOutcome, now: float) -> None:
        for gone in out.evicted:
            self.metrics.forget_job(gone)
        if out.dropped_delta:
            self.metrics.job_dropped.labels(job).inc(out.dropped_delta)
        if out.mismatch:
            self.metrics.job_mismatches.labels(job).inc()
        events = [self.bus.publish_finding(finding) for finding in out.findings]
        for step, kind, reason in out.job_events:
            self.checkpoint_feed.put(job, step, kind, reason)
            if kind == "rollback" and step is not None:   # the records it left go now, not behind the feed
                self.checkpoints.cut_history(job, step, now)
        # a rollback (loss anomaly or replica mismatch alike) is planned once the coordinator has taken every
        # event so far (this report's too): the VERIFIED steps the plan reads are the job's as of the anomaly,
        # however far behind the feed runs (the votes that verify the checkpoint before it; the vote gate holds
        # the updates of a mismatching job meanwhile)
        mark = self.checkpoint_feed.mark()
        for index, ev in out.rollbacks:
            event = events[index]   # None: folded into a repeat count, the directive then names seq 0
            self.rollbacks.request(job, ev, event.seq if event is not None else 0, self.checkpoint_feed.handed(mark))
        for uuid, host, ev in out.evidence:
            self._attach_job_evidence(uuid, host, ev, now)

    def _attach_job_evidence(self, uuid: str, host: str, ev: Evidence, now: float) -> None:
        """Evidence about a GPU named by a rank: kept only if NVML found that GPU on this node. A report never
        creates a GPU record (a client could invent any number); evidence about another GPU (another node's,
        or one no probe saw) stays in the job's events."""
        if uuid and uuid in self.gpus.gpus:
            self.gpus.add_evidence(uuid, [ev], now)

    def report_rejected(self) -> None:
        self.metrics.reports_rejected.inc()

    def watch(self, since_seq: int, follow: bool) -> AsyncIterator[Event]:
        return self.bus.watch(since_seq, follow)

    def has_gpu(self, uuid: str) -> bool:
        return uuid in self.gpus.gpus

    def clear_gpu(self, uuid: str, who: str, reason: str) -> tuple[State, State]:
        now = time.time()
        before, after, removed = self.gpus.clear(uuid, now, by=who, why=reason)
        self.bus.publish(ek.GPU_CLEARED, f"gpu/{uuid}",
                         f"GPU {uuid} cleared by {who}: {reason} ({before.name} -> {after.name})",
                         {"uuid": uuid, "who": who, "reason": reason, "from": before.name, "to": after.name,
                          "removed_evidence": [f"{e.source}:{e.signal}" for e in removed]})
        self.health.changed.set()
        return before, after

    def status_pb(self) -> pb.GetStatusResponse:
        now = time.time()
        node_state, node_reason = self.gpus.node_state()
        resp = pb.GetStatusResponse(
            node_state=int(node_state), node_reason=node_reason, hostname=self.host,
            nvml_available=self.gpus.nvml_available, nvml_reason=self.gpus.nvml_reason,
            started_at=self.started_at, uptime_s=now - self.started_at, last_event_seq=self.bus.last_seq,
            ready=self.ready,
            versions={"sdcwatch": __version__, "python": platform.python_version(), "grpc": grpc.__version__,
                      "protobuf": google.protobuf.__version__, **self.versions, **self.probes.versions})
        for rec in self.gpus.gpus.values():
            g = resp.gpus.add(uuid=rec.uuid, pci_bus_id=rec.pci_bus_id, name=rec.name, index=rec.index,
                              state=int(rec.state), reason=rec.reason, state_since=rec.state_since,
                              unsupported_fields=rec.unsupported)
            for ev in rec.store.current(now):
                g.evidence.add(source=ev.source, signal=ev.signal, value=ev.value, implies=int(ev.implies),
                               reason=ev.reason, time=ev.time, count=ev.count)
        for runner in self.probes.runners.values():
            st = runner.status
            stale = self.health.stale_loops.get(st.name)   # the watchdog's reason wins: the loop is not running
            resp.probes.add(name=st.name, state=probe_state_pb("FAILING" if stale else st.state),
                            last_run=st.last_run, last_duration_s=st.last_duration_s,
                            last_error=stale or st.last_error, runs=st.runs, failures=st.failures)
        if self.redis_supervisor is not None:
            st = self.redis_supervisor.status
            resp.probes.add(name=st.name, state=probe_state_pb(st.state), last_run=st.last_run,
                            last_duration_s=st.last_duration_s, last_error=st.last_error, runs=st.runs,
                            failures=st.failures)
        for name, (state, error) in self.probes.static.items():
            resp.probes.add(name=name, state=probe_state_pb(state), last_error=error)
        resp.checkpoints.extend(self.checkpoints.summaries())
        for job in self.jobs.jobs.values():
            resp.jobs.add(job_id=job.job_id, ranks=sorted(job.ranks)[:1024], last_step=job.last_step,
                          last_report=job.last_report, steps_seen=job.steps_seen,
                          dropped_reports=min(job.dropped_reports, _U64), state=int(job.state), reason=job.reason,
                          compute_checks=job.compute_checks, vote_unavailable=job.vote_unavailable,
                          stage_errors=min(sum(job.stage_errors.values()), _U64))
        return resp


_U64 = (1 << 64) - 1   # a uint64 field's largest value: counts saturate there


def _stream_fields(event: Any) -> dict[str, str]:
    return {"seq": str(event.seq), "time": f"{event.time:.6f}", "kind": event.kind,
            "severity": event.severity.name.lower(), "subject": event.subject, "message": event.message,
            "details": json.dumps(dict(event.details), default=str), "host": event.host}


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url

