"""Issue 21 item 4: nothing is lost across agent restarts. The embedded Redis persists its index in the state
dir and the memory tier outlives the agent, so a restarted agent (SIGTERM or kill -9, same state dir) lists
every checkpoint it had committed and restores it bit-identical (chunk checksums and tensor fingerprints
checked on the way).

The 100-cycle test alternates SIGTERM and kill -9 while a client saves. Most cycles restart the agent's
checkpoint side in this process: a clean stop (the service closed, the redis-server stopped), or a "kill -9"
(nothing closed; the thread that started the redis-server exits, so the kernel sends it the SIGTERM that
a killed agent's redis-server gets, sdcwatch/proc.py; every other time the redis-server is SIGKILLed
instead, which a crash of Redis itself does); the last `REAL_CYCLES` start a real agent process
and kill -9 it while a client saves from another thread (a real SIGTERM stop comes first and last).

tests/test_redis_supervised.py SIGKILLs the redis-server itself; bench/bench_redis_persist.py counts what each
persistence mode loses then."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from pathlib import Path

from agent_harness import AgentProcess
from checkpoint.client import CheckpointClient
from checkpoint.coordinator_config import CoordinatorConfig
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import assert_same, job_id, node, state_dict
from daemon.checkpoint_service import build_checkpoint_service
from daemon.redis_embedded import EmbeddedRedis
from deadlines import scaled, wait_until

CYCLES = 100
REAL_CYCLES = 10          # of which real agent processes, each killed with SIGKILL while a client saves
KEEP = 100_000            # retention never evicts here: every committed checkpoint must stay
SIZE = 48                 # elements per tensor: small payloads, many cycles
SNAP = SnapshotConfig(chunk_bytes=4096)


class _Starter:
    """Starts the redis-server from a thread of its own and keeps it alive until `die()`: like the agent's
    thread, whose exit (the agent killed) makes the kernel send the server SIGTERM (PR_SET_PDEATHSIG)."""

    def __init__(self, redis: EmbeddedRedis) -> None:
        self.redis = redis
        self.started, self.exit = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="redis-starter", daemon=True)
        self.thread.start()
        assert self.started.wait(scaled(30)), "the redis-server did not start"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            self.redis.start()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            self.error = e
        self.started.set()
        self.exit.wait()

    def die(self) -> None:
        self.exit.set()
        self.thread.join(scaled(10))
        proc = self.redis.proc
        if proc is not None:
            assert proc.wait(scaled(30)) is not None


def _sd(step: int) -> dict:
    return state_dict(0, step, SIZE)


def _committed(client: CheckpointClient) -> set[int]:
    return {i.step for i in client.list() if i.state in ("COMMITTED", "VERIFIED")}


def test_reconcile_drops_copies_whose_bytes_are_gone(redis_server, tmp_path: Path) -> None:
    """After a restart the index and the memory dir are compared: a checkpoint whose blob vanished (a node
    reboot cleared /dev/shm) is evicted with the reason; the others stay restorable."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=10, key_prefix=f"{job_id('rc')}:"), job_id()
    client = CheckpointClient(co, job, 0, 1, config=SNAP)
    try:
        for step in (1, 2):
            assert client.save(step, _sd(step)).result(30).state == "COMMITTED"
        plan = co.restore_plan(job, 1, 0)
        co.store.delete(plan.shards[0].manifest.blob)
        assert co.reconcile_local(now=1.0) == {job: [1]}
        infos = {i.step: i for i in co.list(job)}
        assert set(infos) == {2}
        assert co.reconcile_local(now=2.0) == {}, "nothing more to drop"
        assert_same(client.restore(2), _sd(2))
    finally:
        client.close()


def test_100_restarts_alternating_sigterm_and_kill9_lose_nothing(short_tmp: Path) -> None:
    state = short_tmp / f"rs-{uuid.uuid4().hex[:6]}"
    job = job_id("restart")
    committed: list[int] = []            # every step a save reported COMMITTED, in order
    verified_upto = 0                    # committed[:verified_upto] were restored bit-identical already
    next_step = [0]

    def check(client: CheckpointClient) -> None:
        nonlocal verified_upto
        missing = set(committed) - _committed(client)
        assert not missing, f"committed before the restart, not listed after it: {sorted(missing)}"
        for step in committed[verified_upto:]:
            assert_same(client.restore(step), _sd(step))
        verified_upto = len(committed)

    def save_one(client: CheckpointClient) -> None:
        next_step[0] += 1
        step = next_step[0]
        res = client.save(step, _sd(step)).result(scaled(60))
        if res.error == "" and res.state in ("COMMITTED", "VERIFIED"):
            committed.append(step)

    agent = AgentProcess(state, "--checkpoints-keep-committed", str(KEEP), "--no-nvml-enabled")
    agent.start()                        # the first start creates the state dir and names the node
    host = agent.runtime_info()["host"]
    agent.stop(signal.SIGTERM)

    # -- in-process cycles: the agent's embedded Redis and checkpoint service, restarted ------------------------
    for cycle in range(CYCLES - REAL_CYCLES):
        redis = EmbeddedRedis(state)
        starter = _Starter(redis)
        svc = build_checkpoint_service(redis.url, state, node=host, own_index=True, workers=2,
                                       config=CoordinatorConfig(keep_committed=KEEP))
        asyncio.run(svc.open())
        client = CheckpointClient(svc.coordinator, job, 0, 1, config=SNAP)
        try:
            check(client)
            save_one(client)
        finally:
            client.close()
        if cycle % 4 == 3:   # nothing closed, and the redis-server SIGKILLed (what the supervisor restarts)
            assert redis.proc is not None
            os.kill(redis.proc.pid, signal.SIGKILL)
            starter.die()
            svc.pool.shutdown()
            svc.peer_store.pool.shutdown()
        elif cycle % 2:
            starter.die()   # nothing closed: the redis-server learns of its parent's death from the kernel
            svc.pool.shutdown()
            svc.peer_store.pool.shutdown()
        else:
            asyncio.run(svc.close())
            redis.stop()
            starter.die()
    assert len(committed) == CYCLES - REAL_CYCLES, f"a save failed: {committed}"

    # -- real agent processes, killed while a client saves ----------------------------------------------------
    for cycle in range(REAL_CYCLES + 1):
        agent.start()
        client = CheckpointClient.connect(job, 0, 1, target=agent.target, deadline_s=scaled(10), config=SNAP)
        try:
            check(client)
            if cycle == REAL_CYCLES:
                break
            before = len(committed)
            stop = threading.Event()

            def saver() -> None:
                while not stop.is_set():
                    save_one(client)

            t = threading.Thread(target=saver, name="saver", daemon=True)
            t.start()
            wait_until(lambda: len(committed) >= before + 2, 60, "two saves committed in this cycle")
            agent.stop(signal.SIGKILL)   # a save may be in flight
            stop.set()
            t.join(scaled(60))
            assert not t.is_alive(), "a save hung on the dead agent"
        finally:
            client.close()
    try:
        assert verified_upto == len(committed) >= CYCLES
    finally:
        agent.stop(signal.SIGTERM)


def test_a_damaged_index_file_is_moved_aside_and_the_server_starts_empty(short_tmp: Path) -> None:
    """A persisted file Redis refuses (e.g. damaged by a power loss) must not keep the agent down: it is
    moved aside (`<name>.bad-<time>`) and the server starts empty."""
    import redis as redis_py

    state = short_tmp / "dmg"
    server = EmbeddedRedis(state)
    server.start()
    redis_py.Redis(unix_socket_path=str(server.socket)).set("k", "v")
    server.stop()
    files = server.persisted()
    assert files, "the index is persisted in the state dir"
    for path in files:
        for f in ([path] if path.is_file() else sorted(path.iterdir())):
            f.write_bytes(b"this is no AOF\n")
    try:
        server.start()
        client = redis_py.Redis(unix_socket_path=str(server.socket))
        assert client.dbsize() == 0 and client.set("k2", "v2")
        assert [p.name.split(".bad-")[0] for p in state.iterdir() if ".bad-" in p.name] == [p.name for p in files]
    finally:
        server.stop()
