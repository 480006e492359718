"""Helpers shared by the checkpoint tests (not a test module): state dicts, nodes, an agent server."""
from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import redis
import torch

from checkpoint.coordinator import Coordinator, CoordinatorConfig
from checkpoint.shm_store import DirStore
from deadlines import wait_until


def job_id(tag: str = "job") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def state_dict(rank: int, step: int, size: int = 2000) -> dict[str, Any]:
    """Deterministic per (rank, step): bf16 + fp32 tensors and JSON-safe extras."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "model": {"w": torch.randn(size, generator=g), "h": torch.randn(size // 2, generator=g).to(torch.bfloat16),
                  "i": torch.randint(0, 100, (3, 5), generator=g)},
        "step": step, "rng": (1, [rank, step], None), "loader": {"epoch": 0, "pos": step * 10},
    }


def assert_same(a: Any, b: Any) -> None:
    """Bit-for-bit equality of two state dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8) if t.numel() and t.dtype != torch.bool else t
        assert torch.equal(raw(a), raw(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def assert_slots_pinned(client: Any) -> None:
    """The client's saves copied into staging slots the device could pin, as in a node's memory dir on tmpfs:
    a slot it could not pin is copied into synchronously, and a GPU test of the save's ordering would then race
    nothing (the suite's tmp_path is on tmpfs on a GPU machine, tests/conftest.py)."""
    ring = client.snapshotter._ring
    assert ring is not None and ring.slots, "the saves used no staging slot"
    assert all(s.registered for s in ring.slots), [(s.path, s.registered) for s in ring.slots]


def node(redis_port: int, root: Path, name: str, publish: Callable[..., None] | None = None,
         **config: Any) -> Coordinator:
    store = DirStore(root / name)
    client = redis.Redis(port=redis_port, socket_timeout=5)
    return Coordinator(client, store, node=name, location=str(root / name),
                       config=CoordinatorConfig(**config), publish=publish)


def flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


class AgentServer:
    """The Checkpoints servicer in a grpc.aio server on a unix socket, on its own thread and loop."""

    def __init__(self, service: Any, socket_path: Path) -> None:
        self.service = service
        self.target = f"unix:{socket_path}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: Any = None

    def start(self) -> "AgentServer":
        import grpc

        from daemon.checkpoint_service import register

        self._thread.start()

        async def up() -> None:
            self._server = grpc.aio.server()
            register(self._server, self.service)
            self._server.add_insecure_port(self.target)
            await self._server.start()

        asyncio.run_coroutine_threadsafe(up(), self._loop).result(10)
        return self

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def stop(self) -> None:
        async def down() -> None:
            await self._server.stop(0)
            await self.service.close()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def pid() -> int:
    return os.getpid()


def wait_for(pred: Callable[[], Any], timeout: float = 20.0) -> Any:
    """pred()'s first truthy value, polled every 50 ms; AssertionError after `timeout` seconds on an idle
    machine (scaled by the suite's slowdown: tests/deadlines.py)."""
    return wait_until(pred, timeout)


def save_on_two_nodes(agents: dict[str, Any], job: str, clients: list[Any], step: int = 3) -> Any:
    """Rank 0 on node-a's agent, rank 1 on node-b's (appended to `clients`, which the caller closes), each saves
    `step` in small chunks; returns the CheckpointInfo once it is COMMITTED with both shards on both nodes."""
    from checkpoint.client import CheckpointClient
    from checkpoint.snapshot import SnapshotConfig

    for a in agents.values():
        a.wait_serving()
    clients += [CheckpointClient.connect(job, r, 2, target=agents[n].target, deadline_s=10,
                                        config=SnapshotConfig(chunk_bytes=4096))
                for r, n in enumerate(("node-a", "node-b"))]
    results = [c.save(step, state_dict(c.rank, step)).result(30) for c in clients]
    assert all(r.error == "" for r in results), results
    both = {(0, "node-a"), (0, "node-b"), (1, "node-a"), (1, "node-b")}
    return wait_for(lambda: next((i for i in clients[1].list() if i.step == step and i.state == "COMMITTED"
                                  and {(c.rank, c.node) for c in i.copies} == both), None))


class Late:
    """What `side_stream_late` held back: `sleeps` grows by one a sleep; `fingerprint_args` holds the
    arguments of each `_enqueue_fingerprints` call."""

    def __init__(self) -> None:
        self.sleeps: list[int] = []
        self.fingerprint_args: list[tuple[Any, ...]] = []


def side_stream_late(monkeypatch: Any, ms: float = 50.0, copies: bool = True) -> Late:
    """Each save's side stream sleeps on the device before its fingerprints and (`copies`) before each group
    of device copies (the early group the current stream waits for at once, then the group only the update
    waits for): the training's next update, enqueued at once, then reaches the device before the late work
    unless it waits for it. Without the delay a missing wait went unseen (H200, 2026-12-04: with the update's
    waits cut out these tests passed; the copies were done before the update came)."""
    import checkpoint.gather as gather_mod
    import checkpoint.snapshot as snapshot_mod
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * ms)   # clock_rate: kHz
    late = Late()

    def sleep() -> None:   # on the calling thread's current stream: the side stream, where all three run
        late.sleeps.append(1)
        torch.cuda._sleep(cycles)
    real_fp, real_copy = snapshot_mod._enqueue_fingerprints, snapshot_mod.copy_all
    real_run = gather_mod.GatherPlan.run

    def fingerprints(*args: Any) -> None:
        late.fingerprint_args.append(args)
        sleep()
        real_fp(*args)

    def copy_all(dsts: Any, srcs: Any, idx: Any) -> None:
        idx = list(idx)
        if any(srcs[i].is_cuda for i in idx):   # not a CPU state's host copies (no stream of the save)
            sleep()
        real_copy(dsts, srcs, idx)

    def run(self: Any, k: int, arena: Any, bounce: Any, tensors: Any, non_blocking: bool = True) -> None:
        if bounce is not None or any(t.is_cuda for t in tensors):
            sleep()
        real_run(self, k, arena, bounce, tensors, non_blocking)
    monkeypatch.setattr(snapshot_mod, "_enqueue_fingerprints", fingerprints)
    if copies:
        monkeypatch.setattr(snapshot_mod, "copy_all", copy_all)
        monkeypatch.setattr(gather_mod.GatherPlan, "run", run)
    return late
