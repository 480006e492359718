"""Agent process lifecycle: shutdown cleanliness, restart after kill -9, config errors, Redis modes, TCP."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_harness import AgentProcess, cli
from conftest import free_port
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from deadlines import scaled

SERVING = health_pb2.HealthCheckResponse.SERVING


def redis_pids_for(state_dir: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"{state_dir}/redis.sock"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def events(target: str, since: int = 0) -> list[pb.Event]:
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.AgentStub(ch).WatchEvents(pb.WatchEventsRequest(since_seq=since), timeout=10))


def test_sigterm_leaves_nothing_behind(short_tmp):
    agent = AgentProcess(short_tmp / "s").start()
    assert redis_pids_for(agent.state_dir), "embedded redis-server should be running"
    assert agent.stop(signal.SIGTERM) == 0
    assert not agent.socket.exists()
    assert not (agent.state_dir / "redis.sock").exists()
    assert not (agent.state_dir / "agent.json").exists()
    deadline = time.monotonic() + scaled(5)
    while redis_pids_for(agent.state_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert redis_pids_for(agent.state_dir) == []
    journal = "".join(p.read_text() for p in sorted((agent.state_dir / "journal").glob("*.jsonl")))
    assert '"agent.stopping"' in journal


def test_kill9_then_restart_on_same_state_dir(short_tmp):
    state = short_tmp / "s"
    first = AgentProcess(state).start()
    with grpc.insecure_channel(first.target) as ch:
        pb_grpc.AgentStub(ch).ReportStep(pb.ReportStepRequest(job_id="j", step=1), timeout=5)
    before = events(first.target)
    first.stop(signal.SIGKILL)
    assert first.socket.exists(), "a kill -9 leaves the socket behind: the next agent must cope"
    second = AgentProcess(state).start()
    try:
        after = events(second.target)
        seqs = [e.seq for e in after]
        assert seqs == list(range(1, len(seqs) + 1)), "sequence numbers continue without gaps"
        assert seqs[-1] > before[-1].seq
        assert [e.kind for e in after[: len(before)]] == [e.kind for e in before]
        assert len(redis_pids_for(state)) == 1, "exactly one embedded redis-server (the stale one is gone)"
    finally:
        second.stop()
    assert redis_pids_for(state) == []


def test_second_agent_on_same_state_dir_refuses(agent):
    second = AgentProcess(agent.state_dir)
    second.start(wait=False)
    assert second.proc.wait(30) == 1
    assert "another agent" in second.log()
    # the first one is unharmed
    agent.wait_serving(5)


@pytest.mark.parametrize("toml,key", [
    ("[agent]\nlisten = 'nonsense'\n", "agent.listen"),
    ("[agent]\nlisten = '127.0.0.1:5555'\n", "agent.listen"),       # TCP without TLS or --insecure
    ("[redis]\nurl = 'http://x'\n", "redis.url"),
    ("[nvml]\npoll_interval_s = -1\n", "nvml.poll_interval_s"),
    ("[nvml]\npoll_interval_s = 'fast'\n", "nvml.poll_interval_s"),
    ("[journal]\nbogus = 1\n", "journal.bogus"),
    ("[nope]\nx = 1\n", "nope"),
    ("[agent\n", "config"),
])
def test_bad_config_exits_2_naming_the_key(short_tmp, toml, key):
    path = short_tmp / "bad.toml"
    path.write_text(toml)
    out = cli("run", "--config", str(path), "--state-dir", str(short_tmp / "s"))
    assert out.returncode == 2, out.stderr
    assert f"config error: {key}" in out.stderr


def test_bad_flag_exits_2(short_tmp):
    out = cli("run", "--state-dir", str(short_tmp / "s"), "--metrics-listen", "localhost")
    assert out.returncode == 2 and "agent.metrics_listen" in out.stderr
    out = cli("run", "--no-such-flag")
    assert out.returncode == 2


def test_config_file_and_flag_override(short_tmp):
    path = short_tmp / "ok.toml"
    path.write_text("[agent]\nhostname = 'from-file'\n[nvml]\nenabled = true\n")
    agent = AgentProcess(short_tmp / "s", "--config", str(path), "--no-nvml-enabled").start()
    try:
        assert agent.runtime_info()["host"] == "from-file"
        with grpc.insecure_channel(agent.target) as ch:
            st = pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
        assert "disabled by configuration" in st.nvml_reason
    finally:
        agent.stop()


def test_external_redis_gets_the_event_stream(short_tmp, redis_server):
    agent = AgentProcess(short_tmp / "s", "--redis-url", redis_server.url, "--hostname", "node-ext").start()
    try:
        assert not redis_pids_for(agent.state_dir), "no embedded redis with --redis-url"
        client = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + scaled(5)
        entries = []
        while time.monotonic() < deadline:
            entries = client.xrange("sdcwatch:events:node-ext")
            if any(f[b"kind"] == b"agent.ready" for _, f in entries):
                break
            time.sleep(0.05)
        kinds = [f[b"kind"].decode() for _, f in entries]
        assert "agent.ready" in kinds and "agent.starting" in kinds
    finally:
        agent.stop()


def test_unreachable_redis_url_fails_clearly(short_tmp):
    port = free_port()
    out = cli("run", "--state-dir", str(short_tmp / "s"), "--redis-url", f"redis://127.0.0.1:{port}/0",
              "--redis-connect-timeout-s", "1", "--metrics-listen", "off")
    assert out.returncode == 1
    assert "cannot reach Redis" in out.stderr


def test_health_listen_plaintext_tcp_serves_health_only(short_tmp):
    agent = AgentProcess(short_tmp / "s", "--health-listen", "127.0.0.1:0").start()  # port 0: no race
    port = int(agent.runtime_info()["health"].rsplit(":", 1)[1])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == SERVING
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        agent.stop()
    # after shutdown nothing listens
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from support import write_self_signed

    return write_self_signed(tmp)


def test_tcp_needs_tls_and_token(short_tmp):
    cert, key = _self_signed(short_tmp)
    token = short_tmp / "token"
    token.write_text("s3cret-token\n")
    agent = AgentProcess(short_tmp / "s", "--listen", "127.0.0.1:0", "--tls-cert", str(cert),
                         "--tls-key", str(key), "--token-file", str(token)).start()
    port = int(agent.runtime_info()["listen"].rsplit(":", 1)[1])
    try:
        common = ["--address", f"localhost:{port}", "--tls-ca", str(cert)]
        out = cli("status", *common, "--token-file", str(token))
        assert out.returncode == 3, out.stderr  # reached; no GPUs here: UNKNOWN
        wrong = short_tmp / "wrong"
        wrong.write_text("nope")
        out = cli("status", *common, "--token-file", str(wrong))
        assert out.returncode == 2 and "UNAUTHENTICATED" in out.stderr
        out = cli("status", *common)
        assert out.returncode == 2 and "UNAUTHENTICATED" in out.stderr
        # the unix socket needs no token
        out = cli("status", "--socket", str(agent.socket))
        assert out.returncode == 3
        # plain TCP to a TLS port fails
        out = cli("status", "--address", f"127.0.0.1:{port}", "--insecure", "--timeout", "1")
        assert out.returncode == 2
    finally:
        agent.stop()


def test_insecure_tcp_needs_the_flag_and_warns(short_tmp):
    agent = AgentProcess(short_tmp / "s", "--listen", "127.0.0.1:0", "--insecure").start()
    port = int(agent.runtime_info()["listen"].rsplit(":", 1)[1])
    try:
        out = cli("status", "--address", f"127.0.0.1:{port}", "--insecure")
        assert out.returncode == 3, out.stderr
        assert "PLAIN TCP" in agent.log()
    finally:
        agent.stop()
