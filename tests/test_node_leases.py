"""Issue 21 item 6: a dead node's copies leave restore plans as soon as its agent is known gone (its lease ran
out, or it said goodbye on a clean stop), and come back when its agent renews the lease. The policy is pure
(checkpoint/node_leases.py, time passed in); the coordinator reads leases and time from the Redis server."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from checkpoint.client import CheckpointClient
from checkpoint.errors import NotInMemoryError
from checkpoint.node_leases import Lease, dead_nodes, live_copies
from checkpoint.records import Copy
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import job_id, node, state_dict
from daemon.checkpoint_service import CheckpointService


def test_dead_nodes_is_pure_and_only_says_gone_when_known() -> None:
    leases = {
        "alive": Lease(renewed_at=100.0, lease_s=30.0),
        "expired": Lease(renewed_at=60.0, lease_s=30.0),
        "goodbye": Lease(renewed_at=99.0, lease_s=30.0, gone=True),
        "me": Lease(renewed_at=0.0, lease_s=1.0, gone=True),     # never dead to itself
        "damaged": Lease.from_json("{not json"),                 # unreadable: not proof of death
    }
    assert dead_nodes(leases, now=100.0, me="me") == {"expired", "goodbye"}
    assert dead_nodes(leases, now=90.0, me="me") == {"goodbye"}      # exactly at the limit: still alive
    assert dead_nodes({}, now=1e9) == set()                          # no lease: not known to be gone
    assert Lease.from_json(Lease(1.5, 30.0, True).to_json()) == Lease(1.5, 30.0, True)
    copies = [Copy(0, "a", "/m/a"), Copy(0, "b", "/m/b"), Copy(0, "b", "s3://x/y", "s3"), Copy(0, "b", "/n", "nvme")]
    assert live_copies(copies, {"b"}) == (copies[0], copies[2], copies[3])   # only b's memory copy is dropped


def _two_nodes(redis_server, tmp_path: Path, lease_s: float = 30.0):
    prefix = f"{job_id('lease')}:"
    n0 = node(redis_server.port, tmp_path, "n0", key_prefix=prefix, node_lease_s=lease_s)
    n1 = node(redis_server.port, tmp_path, "n1", key_prefix=prefix, node_lease_s=lease_s)
    return n0, n1


def _save_on_n1_with_copy_on_n0(n0, n1, job: str) -> None:
    """Rank 0's shard committed on n1, copied to n0 (what peer replication records)."""
    client = CheckpointClient(n1, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096))
    try:
        assert client.save(1, state_dict(0, 1, 64)).result(30).state == "COMMITTED"
    finally:
        client.close()
    m = n1.shard_manifest(job, 1, 0)
    n0.store.put(m.blob, n1.store.get(m.blob))
    n1.add_copy(job, 1, 0, "n0", n0.location)


def test_copies_of_a_node_that_said_goodbye_or_whose_lease_ran_out_leave_the_plan(redis_server,
                                                                                  tmp_path: Path) -> None:
    n0, n1 = _two_nodes(redis_server, tmp_path)
    job = job_id()
    _save_on_n1_with_copy_on_n0(n0, n1, job)
    n0.renew_lease()
    n1.renew_lease()

    def planned(co) -> list[str]:
        return [c.node for c in co.restore_plan(job, 1, 0).shards[0].copies]

    assert planned(n0) == ["n0", "n1"]                     # both alive: this node's copy first
    n1.say_goodbye()                                       # a clean stop of n1's agent
    assert planned(n0) == ["n0"] and n0.dead_nodes() == {"n1"}
    assert planned(n1) == ["n1", "n0"], "a node is never dead to itself"
    n1.renew_lease()                                       # its agent is back (the memory tier survived)
    assert planned(n0) == ["n0", "n1"]
    # n1's agent killed: its lease runs out (written as the server's time minus more than the lease)
    stale = Lease(n0._server_time() - 31.0, 30.0)
    n0.redis.hset(n0.config.key_prefix + "nodes", "n1", stale.to_json())
    assert planned(n0) == ["n0"]
    # and n0 gone too, seen from n1: rank 0 has no live copy left there but its own
    n0.say_goodbye()
    assert planned(n1) == ["n1"]


def test_a_shard_whose_every_copy_is_on_dead_nodes_is_not_in_memory(redis_server, tmp_path: Path) -> None:
    n0, n1 = _two_nodes(redis_server, tmp_path)
    job = job_id()
    client = CheckpointClient(n1, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096))
    try:
        assert client.save(1, state_dict(0, 1, 64)).result(30).state == "COMMITTED"
    finally:
        client.close()
    assert [c.node for c in n0.restore_plan(job, 1).shards[0].copies] == ["n1"]   # no lease yet: kept
    n1.say_goodbye()
    with pytest.raises(NotInMemoryError, match="whose agent is gone \\(n1\\)"):
        n0.restore_plan(job, "latest")


def test_the_service_renews_at_open_and_says_goodbye_on_close(redis_server, tmp_path: Path) -> None:
    n0, n1 = _two_nodes(redis_server, tmp_path)
    svc = CheckpointService(n1)
    asyncio.run(svc.open())
    assert n0.dead_nodes() == set()
    raw = n0.redis.hget(n0.config.key_prefix + "nodes", "n1")
    assert raw is not None and not Lease.from_json(raw).gone
    asyncio.run(svc.close())
    assert n0.dead_nodes() == {"n1"}
    again = CheckpointService(n1)                          # the next agent on n1
    asyncio.run(again.open())
    assert n0.dead_nodes() == set()
    again.pool.shutdown()
    again.peer_store.pool.shutdown()
