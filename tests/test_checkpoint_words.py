"""A source-checksummed shard committed as its layout and its pieces' fingerprint words (issue 21): the agent
renders the manifest the rank would have rendered (checkpoint/shard_layout.py). The layout goes once and
again after an agent restart; bad layouts and words are refused with INVALID_ARGUMENT; a released agent
(which needs manifest_json) gets the manifest rendered on the rank."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from agent_harness import AgentProcess
from checkpoint.agent_link import GrpcAgentLink
from checkpoint.client import CheckpointClient
from checkpoint.errors import InvalidInputError
from checkpoint.manifest import ShardManifest
from checkpoint.shard_layout import ShardLayout
from checkpoint.shm_store import default_shm_root
from checkpoint.snapshot import SnapshotConfig, layout
from checkpoint.state_tree import dtype_name, flatten
from ckpt_support import assert_same, job_id, state_dict
from proto.sdcwatch.v1 import checkpoint_pb2 as pb
from proto.sdcwatch.v1 import checkpoint_pb2_grpc as pb_grpc

CHUNK = 4096


def _layout(job: str = "j", rank: int = 0, world: int = 2) -> ShardLayout:
    """A state's layout as a rank makes it (state_tree, snapshot.layout): tensors across chunk boundaries,
    plain values with the awkward JSON cases (tuples, NaN, None)."""
    sd = state_dict(rank, 7, size=3000)
    sd["group"] = {"lr": 1e-3, "nan": math.nan, "pair": (1, [2, 3]), "none": None}
    tree, named = flatten(sd)
    offsets, total = layout([t for _, t in named])
    entries = [(path, dtype_name(t.dtype), tuple(t.shape), off, t.numel() * t.element_size())
               for (path, t), off in zip(named, offsets)]
    return ShardLayout(job, rank, world, total, CHUNK, entries, tree, "rs")


def _words(layout: ShardLayout, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-2**62, 2**62, size=(layout.n_pieces, 2), dtype=np.int64)


def test_the_agents_layout_renders_the_ranks_text() -> None:
    """Sent as JSON and read back (the agent's side), a layout renders the very manifest the rank renders,
    which parses as a valid manifest; its id is the sha256 of its JSON; words survive the bytes."""
    mine = _layout()
    theirs = ShardLayout.from_json(mine.json)
    assert theirs.id == mine.id == hashlib.sha256(mine.json.encode()).hexdigest()
    words = _words(mine)
    back = theirs.words_from_bytes(ShardLayout.words_to_bytes(words))
    assert np.array_equal(back.view(np.int64), words)
    a = mine.render(5, "j/000000000005/rank-00000.bin", words, 1.5)
    b = theirs.render(5, "j/000000000005/rank-00000.bin", back, 1.5)
    assert a == b
    m = ShardManifest.from_json(a)
    assert (m.job_id, m.step, m.rank, m.world_size, m.nbytes) == ("j", 5, 0, 2, mine.nbytes)
    assert [t.path for t in m.tensors] == [e[0] for e in mine.entries] and len(m.chunks) > 2
    assert mine.render(6, "b", _words(mine, 1), 1.5) != a               # the words are the checksums


@pytest.mark.parametrize("change, why", [
    (lambda d: "not json{", "not JSON"),
    (lambda d: json.dumps([1, 2]), "JSON object"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "tree"}), "lacks 'tree'"),
    (lambda d: json.dumps({**d, "chunk_bytes": 4097}), "multiple of 4"),
    (lambda d: json.dumps({**d, "rank": -1}), "rank must be an integer"),
    (lambda d: json.dumps({**d, "entries": [["a", "float32", [4], 0]]}), "entry 0"),
    (lambda d: json.dumps({**d, "entries": [["a", "float32", [4], 0, 16], ["b", "float32", [4], 8, 16]]}),
     "do not fit"),                                                      # overlapping
    (lambda d: json.dumps({**d, "entries": [["a", "float32", [4], 0, 16000]]}), "do not fit"),  # past the end
    (lambda d: json.dumps({**d, "nbytes": 1 << 40, "chunk_bytes": 4}), "chunks"),   # plans too big to build
])
def test_a_malformed_layout_is_refused_with_a_reason(change, why) -> None:
    d = json.loads(_layout().json)
    with pytest.raises(InvalidInputError, match=why):
        ShardLayout.from_json(change(d))


def test_words_of_another_length_are_refused() -> None:
    layout = _layout()
    with pytest.raises(InvalidInputError, match="piece fingerprints"):
        layout.words_from_bytes(b"\0" * (16 * layout.n_pieces - 16))
    with pytest.raises(InvalidInputError, match="piece fingerprints"):
        layout.render(1, "b", np.zeros((layout.n_pieces + 1, 2), dtype=np.int64), 1.0)


def _connect(agent: AgentProcess, job: str, rank: int = 0, world: int = 1) -> CheckpointClient:
    return CheckpointClient.connect(job, rank, world, target=agent.target, deadline_s=20,
                                    config=SnapshotConfig(chunk_bytes=CHUNK, checksums="source"))


def test_saves_commit_as_words_through_the_real_agent_and_across_its_restart(short_tmp: Path) -> None:
    """The rank sends its layout with the first commit only; the agent renders and commits every save;
    after the agent restarts (same state dir) it no longer knows the layout, says so, and the rank sends
    it again: every save COMMITTED, every restore bit for bit."""
    state = short_tmp / f"words-{uuid.uuid4().hex[:8]}"
    job = job_id("words")
    try:
        with AgentProcess(state) as agent:
            client = _connect(agent, job)
            try:
                for step in (10, 11, 12):
                    res = client.save(step, state_dict(0, step)).result(30)
                    assert res.error == "" and res.state == "COMMITTED" and res.checksums == "source", res
                assert len(client.link._layouts_sent) == 1            # one layout, sent once
                assert_same(client.restore(12, resume=False), state_dict(0, 12))
                agent.stop()
                agent.start()
                res = client.save(13, state_dict(0, 13)).result(30)   # the layout again, to the new agent
                assert res.error == "" and res.state == "COMMITTED", res
                assert_same(client.restore(13, resume=False), state_dict(0, 13))
                assert_same(client.restore(11, resume=False), state_dict(0, 11))
            finally:
                client.close()
    finally:
        shutil.rmtree(default_shm_root(state).parent, ignore_errors=True)


def test_the_agent_refuses_bad_words_and_unknown_layouts_with_a_status(short_tmp: Path) -> None:
    state = short_tmp / f"wordsbad-{uuid.uuid4().hex[:8]}"
    job = job_id("wordsbad")
    try:
        with AgentProcess(state) as agent:
            link = GrpcAgentLink.connect(agent.target, deadline_s=20)
            stub = pb_grpc.CheckpointsStub(link.channel)
            try:
                link.begin(job, 1, 0, 2)
                layout = _layout(job, 0, 2)
                words = ShardLayout.words_to_bytes(_words(layout))

                def commit(**kw):
                    req = pb.CommitShardRequest(job_id=job, step=1, rank=0, world_size=2, created=1.0, **kw)
                    with pytest.raises(grpc.RpcError) as e:
                        stub.CommitShard(req, timeout=20)
                    return e.value.code(), e.value.details()

                code, msg = commit(layout_id=layout.id, piece_words=words)               # never sent
                assert code == grpc.StatusCode.FAILED_PRECONDITION and "unknown shard layout" in msg
                code, msg = commit(layout_id="0" * 64, layout_json=layout.json, piece_words=words)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in msg
                code, msg = commit(layout_id=layout.id, layout_json=layout.json, piece_words=words[:-16])
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "piece fingerprints" in msg
                other = _layout(job, 1, 2)                                              # rank 1's layout
                code, msg = commit(layout_id=other.id, layout_json=other.json, piece_words=words)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 1/2" in msg
                bad = '{"job_id": 1}'
                code, msg = commit(layout_id=hashlib.sha256(bad.encode()).hexdigest(), layout_json=bad,
                                   piece_words=words)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "layout" in msg
                assert [i.step for i in link.list(job)] == [1] and link.list(job)[0].state == "PENDING"
            finally:
                link.close()
    finally:
        shutil.rmtree(default_shm_root(state).parent, ignore_errors=True)


def test_the_agent_keeps_the_newest_layouts_within_its_bounds(redis_server, tmp_path: Path, monkeypatch) -> None:
    """Layouts are kept by count and by their tensors in all, the oldest dropped first, the newest always
    (a client cannot make the agent hold more than the bound, however large its layouts)."""
    import daemon.checkpoint_service as svc
    from ckpt_support import node

    co = node(redis_server.port, tmp_path, "n0")
    service = svc.CheckpointService(co)
    per = len(_layout().entries)
    monkeypatch.setattr(svc, "LAYOUT_ENTRIES_KEPT", 2 * per)     # room for two of these layouts
    for rank in range(4):
        layout = _layout("jobk", rank, 4)
        req = pb.CommitShardRequest(layout_id=layout.id, layout_json=layout.json,
                                    piece_words=ShardLayout.words_to_bytes(_words(layout)), created=1.0)
        text = service._render_words("jobk", 3, rank, 4, req)
        assert ShardManifest.from_json(text).rank == rank
    assert [k[1] for k in service._layouts] == [2, 3]               # the newest two
    monkeypatch.setattr(svc, "LAYOUT_ENTRIES_KEPT", 1)               # below one layout: the newest still kept
    layout = _layout("jobk", 0, 4)
    service._render_words("jobk", 3, 0, 4, pb.CommitShardRequest(
        layout_id=layout.id, layout_json=layout.json, piece_words=ShardLayout.words_to_bytes(_words(layout))))
    assert [k[1] for k in service._layouts] == [0]


def test_a_commits_time_that_is_no_time_becomes_the_agents(redis_server, tmp_path: Path) -> None:
    import daemon.checkpoint_service as svc
    from ckpt_support import node

    service = svc.CheckpointService(node(redis_server.port, tmp_path, "n0"), clock=lambda: 1234.5)
    layout = _layout("jobt", 0, 1)
    for created in (math.nan, math.inf, -1.0, 0.0):
        req = pb.CommitShardRequest(layout_id=layout.id, layout_json=layout.json, created=created,
                                    piece_words=ShardLayout.words_to_bytes(_words(layout)))
        assert ShardManifest.from_json(service._render_words("jobt", 1, 0, 1, req)).created == 1234.5
