"""The network transport for peer replicas: PeerStore (daemon/peer_store_service.py) and GrpcBlobStore
(checkpoint/grpc_store.py), with real gRPC servers (unix socket, TLS TCP with a bearer token), real agents
and a real redis-server; no mocks."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from agent_harness import AgentProcess
from checkpoint.blobstore import BlobStore
from checkpoint.client import CheckpointClient
from checkpoint.errors import CorruptCheckpointError, InvalidInputError
from checkpoint.grpc_store import (GrpcBlobStore, PeerCredentials, PeerStoreError, encode_put, grpc_store_for,
                                   parse_location, set_credentials)
from checkpoint.locations import dir_store_for
from checkpoint.shard_reader import RestoreReport
from checkpoint.shm_store import DirStore, default_shm_root
from ckpt_support import assert_same, flip_bit, job_id, save_on_two_nodes, state_dict, wait_for
from conftest import free_port
from daemon.errors import ConfigError
from daemon.interceptors import AgentInterceptor
from daemon.peer_store_service import PeerStoreService, register
from daemon.peers_config import PeersConfig, parse_nodes
from daemon.peers_wiring import check_own_url, replicator_factory
from proto.sdcwatch.v1 import peer_pb2 as pb
from proto.sdcwatch.v1 import peer_pb2_grpc as pb_grpc
from support import write_self_signed

TOKEN = "s3cret-peer-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = write_self_signed(d)
    token = d / "token"
    token.write_text(TOKEN + "\n")
    wrong = d / "wrong-token"
    wrong.write_text("not-the-token\n")
    return {"cert": cert, "key": key, "token": token, "wrong": wrong}


class PeerServer:
    """PeerStore over a DirStore in a grpc.aio server on its own loop: a unix socket (no token) and a TLS
    TCP port on 127.0.0.1 (the agent's interceptor, bearer token required)."""

    def __init__(self, root: Path, sock: Path, tls: dict[str, Path], **kw: Any) -> None:
        self.store = DirStore(root)
        self.service = PeerStoreService(self.store, **kw)
        self.sock = sock
        self.tls = tls
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list[Any] = []

    def __enter__(self) -> "PeerServer":
        self._thread.start()

        async def up() -> None:
            unix = grpc.aio.server()
            register(unix, self.service)
            unix.add_insecure_port(f"unix:{self.sock}")
            tcp = grpc.aio.server(interceptors=[AgentInterceptor(TOKEN)])
            register(tcp, self.service)
            creds = grpc.ssl_server_credentials([(self.tls["key"].read_bytes(), self.tls["cert"].read_bytes())])
            self.port = tcp.add_secure_port("127.0.0.1:0", creds)
            for s in (unix, tcp):
                await s.start()
                self._servers.append(s)

        asyncio.run_coroutine_threadsafe(up(), self._loop).result(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        async def down() -> None:
            for s in self._servers:
                await s.stop(0)

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def unix_url(self) -> str:
        return f"unix://{self.sock}"

    @property
    def tls_url(self) -> str:
        return f"grpcs://localhost:{self.port}"

    def tls_channel(self) -> grpc.Channel:
        return grpc.secure_channel(f"localhost:{self.port}", grpc.ssl_channel_credentials(self.tls["cert"].read_bytes()))


@pytest.fixture()
def peer(short_tmp: Path, tls: dict[str, Path]) -> Iterator[PeerServer]:
    with PeerServer(short_tmp / "mem", short_tmp / "peer.sock", tls) as s:
        yield s


def _creds(tls: dict[str, Path], token: str = "token") -> PeerCredentials:
    return PeerCredentials(str(tls["cert"]), str(tls[token]))


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


# ---- the store over both transports ---------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["unix", "tls"])
def test_grpc_store_follows_the_blobstore_protocol(peer: PeerServer, tls: dict[str, Path], transport: str) -> None:
    url = peer.unix_url if transport == "unix" else peer.tls_url
    store = GrpcBlobStore(url, credentials=_creds(tls), chunk_bytes=64 << 10)
    try:
        assert isinstance(store, BlobStore)
        blob = os.urandom(300_000)
        assert store.put("job-1/step-3/rank-0.bin", blob) == len(blob)
        assert store.put("job-1/step-3/rank-1.bin", (blob[:1000], memoryview(blob)[1000:])) == len(blob)
        assert store.put("job-1/step-3/empty", b"") == 0
        assert peer.store.get("job-1/step-3/rank-0.bin") == blob                   # really on the peer's tier
        assert store.get("job-1/step-3/rank-1.bin") == blob
        assert store.get("job-1/step-3/rank-0.bin", 70_000, 100_000) == blob[70_000:170_000]
        assert store.get("job-1/step-3/rank-0.bin", 299_990, 50) == blob[299_990:]
        assert store.get("job-1/step-3/empty") == b""
        buf = bytearray(150_000)
        assert store.readinto("job-1/step-3/rank-0.bin", 200_000, memoryview(buf)) == 100_000
        assert bytes(buf[:100_000]) == blob[200_000:]
        assert store.exists("job-1/step-3/rank-0.bin") and not store.exists("job-1/step-9/rank-0.bin")
        assert store.size("job-1/step-3/rank-0.bin") == len(blob)
        assert store.list("job-1/") == ["job-1/step-3/empty", "job-1/step-3/rank-0.bin", "job-1/step-3/rank-1.bin"]
        with pytest.raises(KeyError):
            store.get("job-1/step-9/rank-0.bin")
        with pytest.raises(KeyError):
            store.size("job-1/step-9/rank-0.bin")
        with pytest.raises(ValueError):
            store.get("job-1/step-3/rank-0.bin", len(blob) + 1)
        assert store.delete("job-1/step-3/rank-0.bin") and not store.delete("job-1/step-3/rank-0.bin")
        with pytest.raises(InvalidInputError):                                   # checked before any RPC
            store.put("../x", b"x")
    finally:
        store.close()


def test_server_validates_every_key(peer: PeerServer, tls: dict[str, Path]) -> None:
    """The server checks keys itself (a client need not be ours): traversal and bad names are refused."""
    md = (("authorization", f"Bearer {TOKEN}"),)
    with peer.tls_channel() as ch:
        stub = pb_grpc.PeerStoreStub(ch)
        for key in ("../x", "/etc/passwd", "a/../../x", "a//b", ".hidden", "a/b.tmp-1-2", "", "a\\b"):
            code, msg = _code(lambda: stub.PutBlob(iter([pb.PutBlobRequest(key=key, data=b"x", finish=True)]),
                                                   metadata=md, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "key" in msg, (key, code, msg)
            code, msg = _code(lambda: list(stub.GetBlob(pb.GetBlobRequest(key=key, to_end=True), metadata=md,
                                                        timeout=10)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "key" in msg, (key, code, msg)
            for rpc, req in ((stub.StatBlob, pb.StatBlobRequest(key=key)), (stub.DeleteBlob,
                                                                           pb.DeleteBlobRequest(key=key))):
                assert _code(lambda: rpc(req, metadata=md, timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.ListBlobs(pb.ListBlobsRequest(prefix="../"), metadata=md,
                                            timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
        code, msg = _code(lambda: list(stub.GetBlob(pb.GetBlobRequest(key="no/such", to_end=True), metadata=md,
                                                    timeout=10)))
        assert code == grpc.StatusCode.NOT_FOUND and "no/such" in msg
        code, _ = _code(lambda: stub.PutBlob(iter([]), metadata=md, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert not (peer.store.root.parent / "x").exists() and peer.store.list() == []


def test_wrong_or_missing_token_is_unauthenticated(peer: PeerServer, tls: dict[str, Path]) -> None:
    peer.store.put("a/b", b"bytes")
    for creds in (_creds(tls, "wrong"), PeerCredentials(str(tls["cert"]))):
        store = GrpcBlobStore(peer.tls_url, credentials=creds)
        try:
            for call in (lambda: store.get("a/b"), lambda: store.put("a/c", b"x" * 100_000),
                         lambda: store.exists("a/b"), lambda: store.list(), lambda: store.delete("a/b")):
                with pytest.raises(PeerStoreError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, e.value
        finally:
            store.close()
    assert peer.store.list() == ["a/b"]                                         # nothing written or deleted
    # a client that does not trust the peer's certificate never talks to it
    store = GrpcBlobStore(peer.tls_url, credentials=PeerCredentials("", str(tls["token"])), timeout_s=5)
    try:
        with pytest.raises(PeerStoreError) as e:
            store.exists("a/b")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        store.close()


def test_a_broken_or_unfinished_put_leaves_nothing(peer: PeerServer, tls: dict[str, Path]) -> None:
    store = GrpcBlobStore(peer.unix_url, chunk_bytes=64 << 10)
    try:
        store.put("k/blob", b"old" * 1000)

        def failing() -> Iterator[bytes]:
            yield b"n" * 200_000
            raise RuntimeError("the sender died")

        with pytest.raises(Exception):
            store.put("k/blob", failing())
        with pytest.raises(Exception):
            store.put("k/other", failing())
        with pytest.raises(InvalidInputError, match="finishing"):               # stream ended, no `finish`
            store._call(store._put, iter([encode_put(memoryview(b"x" * 10), "k/other")]), "k/other")
        with pytest.raises(InvalidInputError, match="declared"):                # fewer bytes than declared
            store._call(store._put, iter([encode_put(memoryview(b"x" * 10), "k/other", 20, finish=True)]),
                        "k/other")
        wait_for(lambda: not [f for f in peer.store.root.rglob("*") if ".tmp-" in f.name])
        assert store.get("k/blob") == b"old" * 1000                             # the older blob untouched
        assert peer.store.list() == ["k/blob"]
    finally:
        store.close()


def test_size_limit_and_a_missing_memory_tier(short_tmp: Path, tls: dict[str, Path]) -> None:
    with PeerServer(short_tmp / "mem", short_tmp / "p.sock", tls, max_blob_bytes=100_000) as peer:
        store = GrpcBlobStore(peer.unix_url, chunk_bytes=64 << 10)
        try:
            for data in (b"x" * 100_001, iter([b"x" * 60_000, b"x" * 60_000])):   # declared, or streamed
                with pytest.raises(PeerStoreError, match="limit") as e:
                    store.put("big/blob", data)
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert store.put("ok/blob", b"x" * 100_000) == 100_000
            shutil.rmtree(peer.store.root)                                      # the node's memory tier is gone
            with pytest.raises(PeerStoreError) as e:
                store.put("ok/again", b"x")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert not peer.store.root.exists()                                 # never re-created by a peer
        finally:
            store.close()


def test_store_lookup_by_location(peer: PeerServer, tls: dict[str, Path], short_tmp: Path) -> None:
    try:
        set_credentials(_creds(tls))
        s = dir_store_for(peer.tls_url)
        assert isinstance(s, GrpcBlobStore) and s is grpc_store_for(peer.tls_url)
        s.put("a/b", b"hello")
        assert dir_store_for(peer.unix_url).get("a/b") == b"hello"
        assert isinstance(dir_store_for(str(short_tmp)), DirStore)
        with pytest.raises(InvalidInputError, match="insecure"):                # grpc:// needs the opt-in
            dir_store_for(f"grpc://localhost:{peer.port}")
    finally:
        set_credentials(None)


# ---- configuration --------------------------------------------------------------------------------------
def test_peers_config_accepts_urls_and_refuses_bad_entries(tls: dict[str, Path], tmp_path: Path) -> None:
    nodes = parse_nodes("a=grpcs://node-a.example:7000, b=unix:///run/sdcw/agent.sock,c=/dev/shm/c,"
                        "d=grpcs://[fd00::1]:7000,e=grpc://10.0.0.5:7000", insecure=True)
    assert [(n.name, n.location, n.is_url) for n in nodes] == [
        ("a", "grpcs://node-a.example:7000", True), ("b", "unix:///run/sdcw/agent.sock", True),
        ("c", "/dev/shm/c", False), ("d", "grpcs://[fd00::1]:7000", True), ("e", "grpc://10.0.0.5:7000", True)]
    assert parse_location("unix:///run/a.sock") == ("unix", "unix:///run/a.sock")
    assert parse_location("grpcs://h:1") == ("grpcs", "h:1")
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    ok = dict(nodes="a=grpcs://h1:7000,b=grpcs://h2:7000", replication_factor=2)
    PeersConfig(**ok, tls_ca=str(tls["cert"]), token_file=str(tls["token"])).validate()
    PeersConfig(nodes="a=grpc://h1:1,b=grpc://h2:1", replication_factor=2, insecure=True).validate()
    bad = [
        (dict(nodes="a=/x,b=grpc://h:1", replication_factor=2), "peers.insecure"),
        (dict(nodes="a=/x,b=grpcs://h", replication_factor=2), "HOST:PORT"),
        (dict(nodes="a=/x,b=grpcs://h:0", replication_factor=2), "port"),
        (dict(nodes="a=/x,b=grpcs://h:70000", replication_factor=2), "port"),
        (dict(nodes="a=/x,b=grpcs://h:1/path", replication_factor=2), "no path"),
        (dict(nodes="a=/x,b=grpcs://:1", replication_factor=2), "HOST:PORT"),
        (dict(nodes="a=/x,b=http://h:1", replication_factor=2), "not a peer transport"),
        (dict(nodes="a=/x,b=unix://rel.sock", replication_factor=2), "absolute"),
        (dict(nodes="a=/x,b=s3://bucket/x", replication_factor=2), "not a peer transport"),
        (dict(**ok, tls_ca=str(tmp_path / "missing.pem")), "file not found"),
        (dict(**ok, token_file=str(empty)), "empty"),
    ]
    for kw, why in bad:
        with pytest.raises(ConfigError, match=why):
            PeersConfig(**kw).validate()


def test_peers_flags_and_own_url_rule(tls: dict[str, Path], short_tmp: Path) -> None:
    import argparse

    from daemon.config import add_flags, build

    ap = argparse.ArgumentParser()
    add_flags(ap)
    cfg = build(ap.parse_args(["--peers-nodes", "a=grpc://localhost:7001,b=grpc://localhost:7002",
                               "--peers-replication-factor", "2", "--peers-insecure", "--peers-tls-ca",
                               str(tls["cert"]), "--peers-token-file", str(tls["token"]),
                               "--state-dir", str(short_tmp / "s")]))
    assert cfg.peers.insecure and cfg.peers.tls_ca == str(tls["cert"]) and cfg.peers.token_file == str(tls["token"])
    check_own_url("grpcs://localhost:7000")
    check_own_url("grpcs://127.0.0.1:7000")
    check_own_url(f"unix://{short_tmp}/agent.sock")
    with pytest.raises(ConfigError, match="not an address of this machine"):
        check_own_url("grpcs://192.0.2.1:7000")                                  # TEST-NET-1: never local
    with pytest.raises(ConfigError, match="does not exist"):
        check_own_url("unix:///no/such/dir/agent.sock")
    from types import SimpleNamespace

    try:
        cfg = PeersConfig(nodes="a=grpcs://localhost:7000,b=grpcs://localhost:7000x", replication_factor=2)
        with pytest.raises(ConfigError):
            cfg.validate()
        cfg = PeersConfig(nodes="a=grpcs://192.0.2.1:7000,b=grpcs://localhost:7001", replication_factor=2)
        build_a = replicator_factory(cfg, "a")
        assert build_a is not None
        with pytest.raises(ConfigError, match="not an address of this machine"):
            build_a(SimpleNamespace(node="a", location=str(short_tmp), stats={}))
        cfg = PeersConfig(nodes=f"a=unix://{short_tmp}/a.sock,b=/dev/shm/b", replication_factor=2)
        rep = replicator_factory(cfg, "a")(SimpleNamespace(node="a", location=str(short_tmp), stats={}))
        assert [(p.node, p.location) for p in rep.peers] == [("b", "/dev/shm/b")]
    finally:
        set_credentials(None)


# ---- two real agents over TLS TCP ------------------------------------------------------------------------
def test_two_agents_replicate_over_tls_and_a_lost_node_restores_over_the_network(
        redis_server: Any, short_tmp: Path, tls: dict[str, Path]) -> None:
    tag = uuid.uuid4().hex[:6]
    states = {n: short_tmp / f"{n}-{tag}" for n in ("node-a", "node-b", "node-c")}
    mem = {n: default_shm_root(s) for n, s in states.items()}
    ports = {n: free_port() for n in ("node-a", "node-b")}
    url = {n: f"grpcs://localhost:{p}" for n, p in ports.items()}
    nodes = ",".join(f"{n}={url[n]}" for n in ("node-a", "node-b"))
    common = ["--redis-url", redis_server.url, "--no-nvml-enabled", "--no-canary-enabled", "--no-tiers-enabled"]
    tcp = ["--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"]), "--token-file", str(tls["token"])]
    peers = ["--peers-nodes", nodes, "--peers-replication-factor", "2", "--peers-tls-ca", str(tls["cert"]),
             "--peers-token-file", str(tls["token"])]
    agents = {n: AgentProcess(states[n], *common, *tcp, "--listen", f"127.0.0.1:{ports[n]}", "--hostname", n,
                              *peers).start(wait=False) for n in ("node-a", "node-b")}
    job = job_id("netpeers")
    clients: list[CheckpointClient] = []
    try:
        save_on_two_nodes(agents, job, clients)
        plan = clients[0].link.restore_plan(job, 3, 0)
        m0 = plan.shards[0].manifest
        m1 = clients[1].link.restore_plan(job, 3, 1).shards[0].manifest
        for m in (m0, m1):   # the copy went over the network into the other agent's memory tier
            assert (mem["node-a"] / m.blob).read_bytes() == (mem["node-b"] / m.blob).read_bytes()
        assert {(c.node, c.location) for c in plan.shards[0].copies} == {("node-a", str(mem["node-a"])),
                                                                         ("node-b", url["node-b"])}

        # node-b's agent: wrong token, bad keys over its TCP listener
        for token in ("wrong", "token"):
            store = GrpcBlobStore(url["node-b"], credentials=_creds(tls, token))
            try:
                if token == "wrong":
                    for call in (lambda: store.get(m0.blob), lambda: store.put("x/y", b"z")):
                        with pytest.raises(PeerStoreError) as e:
                            call()
                        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                else:
                    assert store.size(m0.blob) == m0.nbytes
                    md = (("authorization", f"Bearer {TOKEN}"),)
                    stub = pb_grpc.PeerStoreStub(store._channel)
                    for call in (lambda: stub.PutBlob(iter([pb.PutBlobRequest(key="../x", data=b"z", finish=True)]),
                                                      metadata=md, timeout=10),
                                 lambda: list(stub.GetBlob(pb.GetBlobRequest(key="../x", to_end=True), metadata=md,
                                                           timeout=10))):
                        assert _code(call)[0] == grpc.StatusCode.INVALID_ARGUMENT
            finally:
                store.close()

        # node-a is lost: its agent killed, its memory gone; rank 0 comes back on node-c (no copies of its
        # own, no shared directory) and reads its shard from node-b over TLS with the token
        clients[0].close()
        clients = clients[1:]
        agents["node-a"].stop(signal.SIGKILL)
        shutil.rmtree(mem["node-a"].parent)
        agents["node-c"] = AgentProcess(states["node-c"], *common, "--hostname", "node-c").start()
        set_credentials(_creds(tls))
        rank0 = CheckpointClient.connect(job, 0, 2, target=agents["node-c"].target, deadline_s=10)
        clients.append(rank0)
        rep = RestoreReport()
        assert_same(rank0.restore(3, report=rep), state_dict(0, 3))
        assert rep.source == f"peer@node-b:{url['node-b']}", rep.sources
        assert rep.chunks == len(m0.chunks)

        # a flipped bit in node-b's copy (now the only one) is detected, naming the tensor and the copy
        flip_bit(mem["node-b"] / m0.blob, m0.tensors[0].offset + 5)
        with pytest.raises(CorruptCheckpointError) as e:
            rank0.restore(3)
        msg = str(e.value)
        assert m0.tensors[0].path in msg and f"peer@node-b:{url['node-b']}" in msg and "checksum mismatch" in msg
    finally:
        set_credentials(None)
        for c in clients:
            c.close()
        for a in agents.values():
            a.stop()
        for m in mem.values():
            shutil.rmtree(m.parent, ignore_errors=True)
