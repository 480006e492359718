"""Peer replicas across two real agents: two agent processes sharing one coordination Redis (a real
redis-server) are two nodes of one job, each with its own memory tier. Every shard is copied to the other
node's memory; node-a is lost (agent killed, memory gone) and rank 0 restores from node-b's copy through a
replacement node's agent, bit for bit; a flipped bit in that copy is detected."""
from __future__ import annotations

import shutil
import signal
import uuid
from pathlib import Path

import pytest

from agent_harness import AgentProcess
from checkpoint.client import CheckpointClient
from checkpoint.errors import CorruptCheckpointError
from checkpoint.shard_reader import RestoreReport
from checkpoint.shm_store import default_shm_root
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import assert_same, flip_bit, job_id, save_on_two_nodes, state_dict
from daemon.errors import ConfigError
from daemon.peers_config import PeersConfig, parse_nodes
from daemon.peers_wiring import plan_peers, replicator_factory
from deadlines import wait_until

def test_two_agents_replicate_and_a_lost_node_restores_from_its_peer(redis_server, short_tmp: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    states = {n: short_tmp / f"{n}-{tag}" for n in ("node-a", "node-b", "node-c")}
    mem = {n: default_shm_root(s) for n, s in states.items()}
    nodes = ",".join(f"{n}={mem[n]}" for n in ("node-a", "node-b"))
    common = ["--redis-url", redis_server.url, "--no-nvml-enabled", "--no-canary-enabled", "--no-tiers-enabled",
              "--checkpoints-node-lease-s", "6"]
    agents = {n: AgentProcess(states[n], *common, "--hostname", n, "--peers-nodes", nodes,
                              "--peers-replication-factor", "2", "--peers-stride", "1").start(wait=False)
              for n in ("node-a", "node-b")}
    job = job_id("peers")
    clients: list[CheckpointClient] = []
    try:
        info = save_on_two_nodes(agents, job, clients)  # rank 0 on node-a, rank 1 on node-b; small chunks
        assert info.shards == 2
        # each shard is in both memory tiers, the same bytes; the copies are recorded where they are
        plan = clients[0].link.restore_plan(job, 3, 0)
        m0 = plan.shards[0].manifest
        m1 = clients[1].link.restore_plan(job, 3, 1).shards[0].manifest
        for m in (m0, m1):
            assert (mem["node-a"] / m.blob).read_bytes() == (mem["node-b"] / m.blob).read_bytes()
        assert {(c.node, c.location) for c in plan.shards[0].copies} == {("node-a", str(mem["node-a"])),
                                                                         ("node-b", str(mem["node-b"]))}

        # node-a is lost: its agent killed, its memory gone
        clients[0].close()
        clients = clients[1:]
        agents["node-a"].stop(signal.SIGKILL)
        shutil.rmtree(mem["node-a"].parent)
        # rank 0 comes back on a replacement node (same job, same shared Redis, no copies of its own)
        agents["node-c"] = AgentProcess(states["node-c"], *common, "--hostname", "node-c").start()
        rank0 = CheckpointClient.connect(job, 0, 2, target=agents["node-c"].target, deadline_s=10)
        clients.append(rank0)
        rep = RestoreReport()
        assert_same(rank0.restore(3, report=rep), state_dict(0, 3))
        assert rep.source == f"peer@node-b:{mem['node-b']}", rep.sources
        assert rep.chunks == len(m0.chunks) and all("node-a" in f and "missing" in f for f in rep.failures)
        assert_same(clients[0].restore("latest"), state_dict(1, 3))        # rank 1's own copy still serves
        # node-a's lease runs out (6 s, no goodbye from a kill -9): its copies leave the plan (issue 21 item 6)
        wait_until(lambda: [c.node for c in rank0.link.restore_plan(job, 3, 0).shards[0].copies] == ["node-b"],
                   60, "node-a's copy left the restore plan")
        rep = RestoreReport()
        assert_same(rank0.restore(3, report=rep), state_dict(0, 3))
        assert rep.source == f"peer@node-b:{mem['node-b']}" and rep.failures == [], rep.failures

        # a flipped bit in the peer copy (now the only one) is detected, naming the tensor and the copies
        flip_bit(mem["node-b"] / m0.blob, m0.tensors[0].offset + 5)
        with pytest.raises(CorruptCheckpointError) as e:
            rank0.restore(3)
        msg = str(e.value)
        assert m0.tensors[0].path in msg and "peer@node-b" in msg and "checksum mismatch" in msg
    finally:
        for c in clients:
            c.close()
        for a in agents.values():
            a.stop()
        for m in mem.values():
            shutil.rmtree(m.parent, ignore_errors=True)


def test_peers_config_is_validated_and_placement_is_the_clique() -> None:
    cfg = PeersConfig(nodes="n0=/m/0, n1=/m/1,n2=/m/2,n3=/m/3", replication_factor=3, stride=1)
    cfg.validate()
    assert [p.name for p in plan_peers(cfg, "n3")] == ["n0", "n1"]
    cfg = PeersConfig(nodes=cfg.nodes, replication_factor=2, stride=2)
    cfg.validate()
    assert [(p.name, p.location) for p in plan_peers(cfg, "n1")] == [("n3", "/m/3")]
    assert replicator_factory(PeersConfig(), "n0") is None                     # F=1: no peers
    with pytest.raises(ConfigError, match="not listed"):
        plan_peers(cfg, "n9")
    with pytest.raises(ConfigError, match="shared coordination Redis"):
        replicator_factory(cfg, "n0", shared_redis=False)
    bad = [
        (dict(nodes="a=/x,b=/y", replication_factor=3), "replication_factor"),
        (dict(nodes="a=/x,b=/y", replication_factor=2, stride=2), "two copies"),
        (dict(nodes="a=/x,a=/y", replication_factor=2), "twice"),
        (dict(nodes="a=/x,b=grpc://h:1", replication_factor=2), "network transport"),
        (dict(nodes="a=/x,b=rel/dir", replication_factor=2), "absolute"),
        (dict(nodes="a=/x,b", replication_factor=2), "NAME=LOCATION"),
        (dict(nodes="a=/x,b/c=/y", replication_factor=2), "node name"),
        (dict(replication_factor=0), "replication_factor"),
        (dict(stride=0), "stride"),
    ]
    for kw, why in bad:
        with pytest.raises(ConfigError, match=why):
            PeersConfig(**kw).validate()
    assert [n.name for n in parse_nodes(" a=/x/ , b=/y ")] == ["a", "b"]


def test_factory_refuses_a_node_listed_at_another_memory_dir(tmp_path: Path) -> None:
    from types import SimpleNamespace

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = PeersConfig(nodes=f"a={tmp_path / 'a'},b={tmp_path / 'b'}", replication_factor=2)
    cfg.validate()
    build = replicator_factory(cfg, "a")
    assert build is not None
    with pytest.raises(ConfigError, match="memory tier is"):
        build(SimpleNamespace(node="a", location=str(tmp_path / "b"), stats={}))


def test_replicator_skips_an_unreachable_peer_and_never_recreates_its_dir(redis_server, tmp_path: Path) -> None:
    from checkpoint.peers import Peer, Replicator
    from checkpoint.snapshot import Snapshotter
    from ckpt_support import node

    events: list[tuple] = []
    a = node(redis_server.port, tmp_path, "a", publish=lambda *e: events.append(e))
    b = node(redis_server.port, tmp_path, "b")
    job = job_id()
    snap = Snapshotter(a, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    assert snap.save(4, state_dict(0, 4)).result(30).state == "COMMITTED"
    snap.close()
    gone = tmp_path / "lost" / "memory"
    rep = Replicator(a, [Peer("lost", None, str(gone)), Peer("b", None, b.location)])
    assert rep.replicate(job, 4, 0) == ["b"]
    assert not gone.parent.exists()                                         # a lost node's dir stays gone
    assert {c.node for c in a.info(job, 4).copies} == {"a", "b"}            # no record for the failed peer
    assert [e[0].name for e in events].count("checkpoint.replication_failed") == 1
    assert a.stats["replicas"] == 1 and a.stats["replication_failures"] == 1
    assert rep.replicate(job, 4, 0) == ["b"] and a.stats["replicas"] == 1  # recorded already: not copied again
    # a corrupt source chunk is never propagated
    m = a.shard_manifest(job, 4, 0)
    (Path(b.location) / m.blob).unlink()
    flip_bit(Path(a.location) / m.blob, m.chunks[-1].offset)
    c = node(redis_server.port, tmp_path, "c")
    assert Replicator(a, [Peer("c", None, c.location)]).replicate(job, 4, 0) == []
    assert not (Path(c.location) / m.blob).exists()
