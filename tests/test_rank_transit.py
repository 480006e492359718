"""What ranks send each other through torch's object collectives (checksums.rank_transit): torch pickles a
tensor through its legacy typed storage, which the unsigned dtypes wider than a byte lack, so a uint64
tensor (a fused attention op's RNG seed and offset on a GPU: the H200 run of 2026-12-05 broke in the op
witness's exchange on the attention case) or a batch of uint16 token ids failed to unpickle on the receiving
rank. They now travel as their bits in the signed twin and arrive bit for bit, over real gloo collectives:
the op witness's `exchange`, a replay's `fetch` and an audit's `fetch_audited` (point to point, around
the ring of ranks, also inside a process group of some ranks). A batch that cannot be pickled stops the
replays on every rank at once instead of leaving the others waiting in the transfer."""
from __future__ import annotations

import collections
import dataclasses
import io
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from rank_spawn import spawn

from checksums.rank_transit import portable, restored

Pair = collections.namedtuple("Pair", "ids mask")


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    name: str = "b"


def _values() -> dict:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 2**62, (6,), generator=g)
    return {"u64": raw.view(torch.uint64), "u32": raw[:3].to(torch.int32).view(torch.uint32),
            "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
            "u8": torch.tensor([255], dtype=torch.uint8),
            "f": torch.randn(3, generator=g), "pair": Pair(torch.tensor([7], dtype=torch.uint16), [1, "x"]),
            "dc": Batch(torch.tensor([0, 1, 2**32 - 1]).to(torch.int32).view(torch.uint32)),
            "scalar": torch.tensor(5, dtype=torch.uint64)}


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def _pickled(obj):
    f = io.BytesIO()
    pickle.Pickler(f).dump(obj)
    return pickle.Unpickler(io.BytesIO(f.getvalue())).load()


def test_unsigned_tensors_round_trip_bit_for_bit_in_their_containers() -> None:
    values = _values()
    _same(restored(_pickled(portable(values))), values)
    assert restored(portable(7)) == 7 and restored(portable(None)) is None


def _ranks(rank: int, world: int, init: str, out: str) -> None:
    from torch import nn

    from checksums.op_witness import exchange
    from checksums.replay import Replayer
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mine = _values() if rank == 1 else {"rank": 0}
        got = exchange(mine, None, torch.device("cpu"))
        _same(got[1], _values())
        assert got[0] == {"rank": 0}
        # a retained batch of uint16 token ids (a loader's own dtype), fetched by the other rank for a replay
        replayer = Replayer(nn.Linear(2, 2), None, lambda m, b: m(b["x"]).sum(), device=torch.device("cpu"))
        ids = torch.tensor([rank, 40000 + rank, 65535], dtype=torch.int32).to(torch.int16).view(torch.uint16)
        replayer.retain({"x": torch.ones(1, 2), "ids": ids})
        fetched = replayer.fetch(1)     # in the step (a kept step's own `Retained` travels the same way)
        sent = torch.tensor([1, 40001, 65535], dtype=torch.int32).to(torch.int16).view(torch.uint16)
        _same(fetched.micro[0][0], {"x": torch.ones(1, 2), "ids": sent})
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_unsigned_tensors_cross_real_gloo_collectives(tmp_path: Path) -> None:
    spawn(_ranks, (2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def _ring(rank: int, world: int, init: str, out: str) -> None:
    from torch import nn

    from checksums.replay import Replayer
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        def replayer(group: object = None) -> Replayer:
            r = Replayer(nn.Linear(2, 2), None, lambda m, b: m(b["x"]).sum(), device=torch.device("cpu"),
                         group=group)
            ids = torch.tensor([rank, 40000 + rank, 65535], dtype=torch.int32).to(torch.int16)
            r.retain({"x": torch.full((1, 2), float(rank)), "ids": ids.view(torch.uint16)})
            return r

        def ids_of(r: int) -> torch.Tensor:
            return torch.tensor([r, 40000 + r, 65535], dtype=torch.int32).to(torch.int16).view(torch.uint16)

        # every rank holds the batch it audits, its neighbour's (r + 1) % W, and only that one
        got, nxt = replayer().fetch_audited(), (rank + 1) % world
        _same(got.micro[0][0], {"x": torch.full((1, 2), float(nxt)), "ids": ids_of(nxt)})
        # a group of ranks 1 and 2 (a job's data-parallel group): its ranks are the group's, not the world's
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            r = replayer(sub)
            other = 3 - rank
            got = r.fetch_audited()
            _same(got.micro[0][0], {"x": torch.full((1, 2), float(other)), "ids": ids_of(other)})
            _same(r.fetch(1).micro[0][0], {"x": torch.full((1, 2), 2.0), "ids": ids_of(2)})   # group rank 1
        Path(out, f"ring{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_an_audits_batches_go_round_the_ring_of_ranks_and_inside_a_group(tmp_path: Path) -> None:
    spawn(_ring, (3, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3)
    assert all((tmp_path / f"ring{r}").exists() for r in range(3))


def _unsendable(rank: int, world: int, init: str, out: str) -> None:
    import threading

    import pytest
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    from checksums.replay import Replayer, ReplayFailed
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # a batch that holds an object pickle refuses (a lock) on rank 1 only: every rank raises at once,
        # none waits in the transfer for ever
        replayer = Replayer(nn.Linear(2, 2), None, lambda m, b: m(b["x"]).sum(), device=torch.device("cpu"))
        replayer.retain({"x": torch.ones(1, 2), "lock": threading.Lock() if rank == 1 else None})
        with pytest.raises(ReplayFailed) as got:
            replayer.fetch(1)
        assert ("cannot pickle" in str(got.value)) == (rank == 1), str(got.value)
        with pytest.raises(ReplayFailed):
            replayer.fetch_audited()
        assert replayer.fetch(0).micro[0][0]["lock"] is None       # rank 0's batch crosses as before
        # the user's path: the checks' first step replays rank 0's batch; every rank goes on training, and
        # GetStatus's mode says why replays are off
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)

        def loss_fn(m: nn.Module, b: dict) -> torch.Tensor:
            return ((m(b["x"]) - b["y"]) ** 2).mean()
        checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, audit_every=3, warmup=4)
        lock = threading.Lock()
        for _ in range(8):
            b = {"x": torch.randn(4, 8), "y": torch.randn(4, 1), "lock": lock}
            checks.retain(b)
            opt.zero_grad()
            loss_fn(ddp, b).backward()
            opt.step()
        mode = checks.mode()
        checks.close()
        assert mode.startswith("unreproducible: ") and "could not cross ranks" in mode, mode
        Path(out, f"unsendable{rank}").write_text(mode)
    finally:
        dist.destroy_process_group()


def test_a_batch_that_cannot_cross_to_another_rank_stops_replays_on_every_rank_without_a_hang(
        tmp_path: Path) -> None:
    """Before, rank 0 raised in the transfer at the first step's check (a lock in the batch) and rank 1
    waited in it for ever."""
    spawn(_unsendable, (2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2)
    assert "cannot pickle" in (tmp_path / "unsendable0").read_text()
    assert "another rank" in (tmp_path / "unsendable1").read_text()
