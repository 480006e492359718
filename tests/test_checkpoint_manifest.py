"""Chunks, manifests and the pure policies (verification, retention, stale saves)."""
from __future__ import annotations

import io
import json
import random

import pytest
import torch

from checkpoint import policy, replica_bytes
from checkpoint.chunks import Chunk, checksum, checksum_chunks, chunk_ranges, chunks_covering, verify
from checkpoint.errors import InvalidInputError
from checkpoint.manifest import ShardManifest, TensorEntry
from checkpoint.state_tree import Flattener, flatten, unflatten


def test_chunk_ranges_tile_the_blob() -> None:
    assert chunk_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_ranges(0, 4) == []
    with pytest.raises(InvalidInputError):
        chunk_ranges(10, 0)


def test_chunk_checksums_detect_a_flipped_bit() -> None:
    data = bytearray(random.Random(0).randbytes(1000))
    chunks = checksum_chunks(memoryview(data), 256)
    assert [c.length for c in chunks] == [256, 256, 256, 232]
    assert all(verify(data[c.offset:c.offset + c.length], c) for c in chunks)
    data[300] ^= 0x10
    bad = [c for c in chunks if not verify(data[c.offset:c.offset + c.length], c)]
    assert [c.offset for c in bad] == [256]
    assert chunks_covering(chunks, 250, 10) == chunks[:2]


def test_chunk_json_round_trip_and_validation() -> None:
    c = Chunk(0, 5, checksum(b"hello"))
    assert Chunk.from_json(json.loads(json.dumps(c.to_json()))) == c
    with pytest.raises(InvalidInputError):
        Chunk.from_json([0, 5, "nothex" * 6])


def _state() -> dict:
    w = torch.randn(3, 4)
    return {"model": {"w": w, "tied": w, "b": torch.arange(5, dtype=torch.bfloat16)},
            "step": 7, "rng": (3, [1, 2, 3], None), "cfg": {"lr": 0.1, "name": "x", "on": True},
            "empty": torch.empty(0, 2)}


def test_flatten_unflatten_round_trip_keeps_structure_and_ties() -> None:
    sd = _state()
    tree, named = flatten(sd)
    assert [p for p, _ in named] == ["state_dict/model/w", "state_dict/model/b", "state_dict/empty",
                                     "state_dict/step", "state_dict/rng", "state_dict/cfg"]
    # the plain values are bytes of the blob (checksummed, fingerprinted, compared across replicas)
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for _, t in named[3:])
    text = json.dumps(tree)
    back = unflatten(json.loads(text), [t for _, t in named])
    assert back["model"]["w"] is back["model"]["tied"]
    assert back["rng"] == (3, [1, 2, 3], None)
    assert back["cfg"] == sd["cfg"] and back["step"] == 7


@pytest.mark.parametrize("bad, where", [
    ({"x": {1, 2}}, "state_dict/x"),
    ({"x": {"y": object()}}, "state_dict/x/y"),
    ({"x": [1, object()]}, r"state_dict/x\[1\]: builtins.object is not supported"),
    ({"x": {"y": [torch.zeros(1), {"z": {1.5}}]}}, r"state_dict/x/y\[1\]/z"),
    ({"x": {(1, 2): torch.zeros(1)}}, "keys must be str or int"),
    ({"x": {True: torch.zeros(1)}}, "keys must be str or int"),
    ({"__sdcw_tensor__": 1}, "reserved"),
])
def test_flatten_rejects_unsupported_objects_with_the_path(bad: dict, where: str) -> None:
    with pytest.raises(InvalidInputError, match=where):
        flatten(bad)


def _same_flat(got: tuple, want: tuple) -> None:
    """Two flatten results are the same: the tree, the paths, each tensor (the object itself, or for a
    plain value its bytes)."""
    assert got[0] == want[0]
    assert [p for p, _ in got[1]] == [p for p, _ in want[1]]
    for (_, a), (_, b) in zip(got[1], want[1]):
        assert a is b or (a.dtype == b.dtype == torch.uint8 and torch.equal(a, b))


def _flattens_as_flatten(fl: Flattener, sd: dict) -> tuple:
    """`fl(sd)` gives what `flatten(sd)` gives: the tree, the tensors, the plain values' indices."""
    values: list[int] = []
    got = fl(sd, values)
    want_values: list[int] = []
    _same_flat(got, flatten(sd, want_values))
    assert values == want_values
    return got


def _opt_like(w: torch.Tensor, lr: float) -> dict:
    m = {"model": {"w": w, "b": torch.zeros(3)},
         "optim": {"state": {0: {"step": torch.tensor(1.0), "m": torch.zeros(3, 4)}, 1: {"m": torch.ones(3)}},
                   "param_groups": [{"lr": lr, "params": [0, 1]}]},
         "blob": b"abc", "rng": (3, [1, 2]), "mixed": [torch.ones(2), {"k": 1}]}
    return m


def test_the_flattener_replays_the_last_structure_and_falls_back_on_any_change() -> None:
    """Issue 21: `Flattener` (a save's walk at every step) gives exactly what `flatten` gives: from the kept
    skeleton while the structure stays (the plain values re-encoded each time), through `flatten` at any
    change, and with flatten's errors for anything unsupported."""
    fl = Flattener()
    w = torch.randn(3, 4)
    states = [_opt_like(w, 0.1), _opt_like(w, 0.2), _opt_like(torch.randn(3, 4), 0.3)]
    changed = [
        {**_opt_like(w, 0.1), "extra": 1},                               # a new key
        {**_opt_like(w, 0.1), "blob": io.BytesIO(b"abc")},               # a value's kind
        {**_opt_like(w, 0.1), "rng": (3, [1, b"x"])},                    # bytes inside a plain part
        {**_opt_like(w, 0.1), "rng": (3, [1, torch.zeros(1)])},          # a tensor inside a plain part
        {**_opt_like(w, 0.1), "model": {"w": w, "b": w}},                # a tensor twice (tied)
        {**_opt_like(w, 0.1), "model": {"w": w, "b": torch.zeros(3, dtype=torch.float16)}},
        {**_opt_like(w, 0.1), "rng": [3, [1, 2]]},                       # a tuple now a list
    ]
    fast = 0
    for sd in states + changed + states:
        got = _flattens_as_flatten(fl, sd)
        assert unflatten(got[0], [t for _, t in got[1]])["rng"] == sd["rng"]
        fast = fl.fast
    assert fast >= 4   # the repeated structures came from the skeleton
    for bad in ({**_opt_like(w, 0.1), "model": {"w": w, "b": {1, 2}}},
                {**_opt_like(w, 0.1), "optim": {"state": {True: {"m": w}}, "param_groups": []}}):
        fl(_opt_like(w, 0.1))
        with pytest.raises(InvalidInputError):
            fl(bad)
    fl(_opt_like(w, 0.1))
    with pytest.raises(InvalidInputError, match="only dense strided"):
        fl({**_opt_like(w, 0.1), "model": {"w": w, "b": torch.zeros(3).to_sparse()}})


def _adam_like(n: int, lr: float = 0.1) -> dict:
    ps = [torch.randn(2, 3) for _ in range(n)]
    return {"model": {f"p{i}": p for i, p in enumerate(ps)},
            "optim": {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.ones_like(p)} for i, p in enumerate(ps)},
                      "param_groups": [{"lr": lr, "betas": (0.9, 0.99), "params": list(range(n))}]}}


def test_the_flattener_takes_an_optimizers_per_parameter_state_at_once_and_equals_flatten() -> None:
    """Issue 21: the optimizer's per-parameter state (a dict of dicts of tensors, all with the same keys) is
    replayed for all parameters at once; every change to it (a parameter's state with another key, another
    order, a value not a tensor, a mapping that is not a dict, a bool key) gives exactly what flatten gives,
    or flatten's error."""
    import types
    fl = Flattener()
    base = _adam_like(5)
    variants = [_adam_like(5, 0.2), base]
    extra = _adam_like(5)
    extra["optim"]["state"][3]["max_exp_avg_sq"] = torch.zeros(2, 3)            # one more key in one
    order = _adam_like(5)
    s2 = order["optim"]["state"][2]
    order["optim"]["state"][2] = {"exp_avg": s2["exp_avg"], "step": s2["step"], "exp_avg_sq": s2["exp_avg_sq"]}
    plain = _adam_like(5)
    plain["optim"]["state"][1]["step"] = 7                                       # a plain value, not a tensor
    proxy = _adam_like(5)
    proxy["optim"]["state"][4] = types.MappingProxyType(proxy["optim"]["state"][4])   # a read-only mapping
    fewer = _adam_like(4)
    for sd in [base, *variants, extra, base, order, base, plain, base, proxy, proxy, base, fewer, base]:
        _flattens_as_flatten(fl, sd)
    assert fl.fast >= 5
    bad = _adam_like(5)
    bad["optim"]["state"] = {True: bad["optim"]["state"][0], **{i: bad["optim"]["state"][i] for i in (2, 3, 4)}}
    fl(base)
    with pytest.raises(InvalidInputError, match="keys must be str or int"):
        fl(bad)


@pytest.mark.parametrize("value, want", [
    ([0, 1, 2], "[0,1,2]"),
    (["a", "b"], '["a","b"]'),
    ([1, True, None], '[1,true,null]'),                       # bool stays a bool
    ([1, 2.5, float("inf")], None),                           # a non-finite float: marked, not bare
])
def test_a_list_of_plain_atoms_encodes_as_before(value: list, want: str | None) -> None:
    import enum

    from checkpoint.plain_values import decode_json, encode_json
    text = encode_json(value, "v").decode()
    if want is not None:
        assert text == want
    assert decode_json(text.encode()) == value
    class Small(enum.IntEnum):
        A = 1
    assert encode_json([Small.A, 2], "v") == b"[1,2]"            # an int subclass: as an int, as before


def _manifest(**over: object) -> ShardManifest:
    tree = {"a": {"__sdcw_tensor__": 0}, "n": 1}   # plain values inline: the format before values were bytes
    base = dict(job_id="j", step=1, rank=0, world_size=2, blob="j/000000000001/rank-00000.bin", nbytes=16,
                chunk_bytes=8, chunks=(Chunk(0, 8, "0" * 32), Chunk(8, 8, "1" * 32)),
                tensors=(TensorEntry("state_dict/a", "float32", (4,), 0, 16, (1, 2)),), tree=tree, created=1.0)
    base.update(over)
    return ShardManifest(**base)  # type: ignore[arg-type]


def test_manifest_json_round_trip() -> None:
    m = _manifest()
    assert ShardManifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("over, msg", [
    (dict(job_id="../x"), "job id"),
    (dict(blob="../../etc/passwd"), "store key"),
    (dict(chunks=(Chunk(0, 8, "0" * 32),)), "cover 8 bytes"),
    (dict(tensors=(TensorEntry("a", "float32", (5,), 0, 16, (1, 2)),)), "nbytes"),
    (dict(tensors=(TensorEntry("a", "float32", (4,), 8, 16, (1, 2)),)), "past the end"),
    (dict(rank=2), "rank"),
])
def test_manifest_rejects_bad_content(over: dict, msg: str) -> None:
    with pytest.raises(InvalidInputError, match=msg):
        ShardManifest.from_json(_manifest(**over).to_json())


def test_manifest_rejects_non_json_and_pickle() -> None:
    import pickle

    with pytest.raises(InvalidInputError):
        ShardManifest.from_json(pickle.dumps({"format": "x"}))
    with pytest.raises(InvalidInputError, match="format"):
        ShardManifest.from_json(json.dumps({"format": "other"}))


def test_verified_steps_rule() -> None:
    ok = {k: replica_bytes.AGREED for k in (10, 20, 30, 40)}
    assert policy.verified_steps([10, 20, 30, 40], ok, 40, []) == {10, 20, 30, 40}
    # a bad event at step 25 blocks every checkpoint at or after it
    assert policy.verified_steps([10, 20, 30, 40], ok, 40, [25]) == {10, 20}
    # checks clean only through 20: 30 and 40 wait (a fault at 30 may still be on its way)
    assert policy.verified_steps([10, 20, 30, 40], ok, 20, []) == {10, 20}
    assert policy.verified_steps([10, 20], ok, None, []) == set()  # no check reported, no verification
    # bytes, not step numbers: replicas that saved different bytes at 20 never verify it; unreplicated
    # shards are vouched for by their own fingerprints and the clean checks; not yet compared: not verified
    mixed = {10: replica_bytes.UNREPLICATED, 20: replica_bytes.MISMATCH, 40: replica_bytes.AGREED}
    assert policy.verified_steps([10, 20, 30, 40], mixed, 40, []) == {10, 40}


def R(step: int, state: str, n: int = 10) -> policy.Record:
    return policy.Record(step, state, n)


def test_retention_keeps_newest_k_and_newest_verified() -> None:
    recs = [R(1, "VERIFIED"), R(2, "COMMITTED"), R(3, "COMMITTED"), R(4, "COMMITTED"), R(5, "PENDING")]
    assert policy.plan_retention(recs, keep_committed=2, memory_cap_bytes=None) == [2]


def test_retention_under_cap_evicts_oldest_unverified_never_only_verified() -> None:
    recs = [R(1, "VERIFIED"), R(2, "COMMITTED"), R(3, "COMMITTED")]
    # 30 bytes held, cap 15: evict 2 then 3 (unverified, oldest first); 1 is the only verified copy
    assert policy.plan_retention(recs, keep_committed=3, memory_cap_bytes=15) == [2, 3]
    assert policy.plan_retention(recs, keep_committed=3, memory_cap_bytes=1) == [2, 3]
    two_verified = [R(1, "VERIFIED"), R(2, "VERIFIED"), R(3, "COMMITTED")]
    assert policy.plan_retention(two_verified, keep_committed=3, memory_cap_bytes=10) == [1, 3]


def test_next_to_verify_is_the_oldest_that_can_still_be_verified() -> None:
    A, M = replica_bytes.AGREED, replica_bytes.MISMATCH
    asked: list[int] = []

    def _next(verdicts: dict, *rest):   # the verdicts as the coordinator gives them: asked for one by one
        return policy.next_to_verify(verdicts, lambda k: (asked.append(k), verdicts[k])[1], *rest)
    # after the newest VERIFIED (10); 20's bytes differ; 30 waits for the checks
    assert _next({20: M, 30: A, 40: None}, [10], 15, []) == 30
    assert _next({20: None, 30: A}, [10], 15, []) == 20     # not compared yet: may vouch
    assert _next({5: A, 30: A}, [10], 15, []) == 30         # older than a VERIFIED one
    assert _next({30: A, 40: A}, [], 15, [30]) is None      # a bad event at 30 blocks it
    assert _next({30: A, 40: A}, [], 15, [35]) == 30
    assert _next({30: A}, [], None, []) is None             # no check ever reported
    assert _next({20: M, 30: replica_bytes.IMPORTED}, [], 15, []) is None
    assert _next({}, [10], 15, []) is None
    asked.clear()
    assert _next({20: M, 30: A, 40: A, 50: A}, [10], 15, []) == 30 and asked == [20, 30]   # read until found
    # retention keeps it as it keeps a held step; a memory cap still evicts it first
    recs = [R(30, "COMMITTED"), R(40, "COMMITTED"), R(50, "COMMITTED"), R(60, "COMMITTED")]
    assert policy.plan_retention(recs, keep_committed=2, memory_cap_bytes=None, hold={30}) == [40]
    assert policy.plan_retention(recs, keep_committed=2, memory_cap_bytes=20, hold={30}) == [30, 40]


def test_stale_pending() -> None:
    recs = [policy.Record(1, "PENDING", 0, begun_at=0.0), policy.Record(2, "COMMITTED", 0, 50.0),
            policy.Record(3, "PENDING", 0, begun_at=90.0)]
    assert policy.stale_pending(recs, now=100.0, timeout_s=60.0) == [1]
    assert policy.stale_pending(recs, now=200.0, timeout_s=60.0) == [1, 3]


def test_retention_keeps_a_verified_checkpoint_behind_the_rollback_span():
    from checkpoint import policy

    # run retention after every save, as the agent does, and check that a rollback target older than
    # any anomaly start inside the span always survives
    span, live = 100, []
    for step in range(0, 600, 10):
        live.append(policy.Record(step, policy.VERIFIED, 10, float(step)))
        evict = set(policy.plan_retention(live, keep_committed=2, memory_cap_bytes=None, rollback_span_steps=span))
        live = [r for r in live if r.step not in evict]
        assert len(live) <= 5
        for start in range(max(1, step - span + 1), step + 1):
            older = [r.step for r in live if r.step < start]
            assert older, f"no checkpoint older than {start} at step {step}"
            assert start - max(older) <= 2 * span + 10
    recs = [policy.Record(s, policy.VERIFIED, 10, float(s)) for s in range(0, 300, 10)]
    assert policy.plan_retention(recs, keep_committed=2, memory_cap_bytes=None) == list(range(0, 280, 10))


def test_int_keys_round_trip_through_json():
    """Optimizer state dicts key their per-parameter state by int: kept exactly (not stringified)."""
    import json

    sd = {"optim": {"state": {0: {"exp_avg": torch.ones(2)}, 1: {"step": torch.tensor(3.0)}},
                    "param_groups": [{"params": [0, 1], "betas": (0.9, 0.95)}]}}
    tree, named = flatten(sd)
    back = unflatten(json.loads(json.dumps(tree)), [t for _, t in named])
    assert set(back["optim"]["state"]) == {0, 1}
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], torch.ones(2))
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_the_torch_free_dtype_table_matches_torch() -> None:
    """The manifest checks sizes by dtype name without torch; the names and sizes are torch's own."""
    from checkpoint.manifest import DTYPE_SIZES
    from checkpoint.state_tree import DTYPES, dtype_name

    assert set(DTYPES) == set(DTYPE_SIZES)
    for name, dt in DTYPES.items():
        assert torch.empty((), dtype=dt).element_size() == DTYPE_SIZES[name] and dtype_name(dt) == name


def test_values_round_trip_exactly_and_bytes_stay_bytes() -> None:
    import io
    import struct

    nan = struct.unpack(">d", bytes.fromhex("7ff4000000000abc"))[0]
    sd = {"w": torch.ones(2), "meta": {"big": 2 ** 70, "f": 0.1, "neg0": -0.0, "nan": nan, "inf": float("inf"),
                                        "t": (1, [2, (3,)]), "ids": {3: "a", 7: "b"}},
          "blob": io.BytesIO(b"\x00\xff"), "raw": bytearray(b"xy"), "nested": [torch.zeros(1), b"z", None]}
    tree, named = flatten(sd)
    back = unflatten(json.loads(json.dumps(tree)), [t.clone() for _, t in named])
    m = back["meta"]
    assert m["big"] == 2 ** 70 and type(m["big"]) is int and m["t"] == (1, [2, (3,)]) and m["ids"] == {3: "a", 7: "b"}
    assert [struct.pack(">d", m[k]) for k in ("f", "neg0", "nan", "inf")] == \
        [struct.pack(">d", x) for x in (0.1, -0.0, nan, float("inf"))]
    assert isinstance(back["blob"], io.BytesIO) and back["blob"].getvalue() == b"\x00\xff"
    assert back["raw"] == b"xy" and back["nested"][1:] == [b"z", None]
    assert unflatten(*[x for x in (flatten({"only": 1})[0], [t for _, t in flatten({"only": 1})[1]])]) == {"only": 1}


def test_manifest_value_refs_are_checked() -> None:
    bad = _manifest(tree={"a": {"__sdcw_value__": {"__sdcw_tensor__": 0}, "kind": "pickle"}})
    with pytest.raises(InvalidInputError, match="unknown kind"):
        ShardManifest.from_json(bad.to_json())
    with pytest.raises(InvalidInputError, match="uint8"):   # a value must be stored as bytes
        ShardManifest.from_json(_manifest(tree={"a": {"__sdcw_value__": {"__sdcw_tensor__": 0},
                                                      "kind": "json"}}).to_json())
    with pytest.raises(InvalidInputError, match="bad tensor reference"):
        ShardManifest.from_json(_manifest(tree={"a": {"__sdcw_value__": 0, "kind": "json"}}).to_json())


def test_a_0_1_0_agent_accepts_manifests_with_values() -> None:
    """manifest_json is a wire contract (docs/wire-compat.md). 0.1.0's ShardManifest.from_json counted only
    {"__sdcw_tensor__": i} objects, walking into every other dict and list, and required exactly
    range(len(tensors)): a manifest with values (each index inside an ordinary tensor reference) passes."""
    def refs_0_1_0(tree: object) -> set:
        refs: set = set()

        def walk(obj: object) -> None:
            if isinstance(obj, dict):
                if set(obj) == {"__sdcw_tensor__"}:
                    refs.add(obj["__sdcw_tensor__"])
                    return
                for v in obj.values():
                    walk(v)
            elif isinstance(obj, list):
                for v in obj:
                    walk(v)

        walk(tree)
        return refs

    import io

    sd = {"model": {"w": torch.ones(3)}, "optim": {"state": {0: {"step": torch.tensor(1.0)}},
                                                   "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
          "loader": {"pos": 3}, "extra": io.BytesIO(b"x"), "step": 4}
    tree, named = flatten(sd)
    assert len(named) == 6 and sorted(refs_0_1_0(json.loads(json.dumps(tree)))) == list(range(len(named)))
