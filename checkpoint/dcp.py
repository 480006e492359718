"""`torch.distributed.checkpoint` (DCP) over the in-memory store: `dcp.save`, `dcp.async_save`, `dcp.load`.

    from checkpoint.dcp import SdcwStorageWriter, SdcwStorageReader
    writer = SdcwStorageWriter(link, job_id)                  # link: GrpcAgentLink (or a Coordinator)
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)
    dcp.load(state_dict, storage_reader=SdcwStorageReader(link, job_id), checkpoint_id=step)  # or "latest_verified"

A DCP checkpoint here is an ordinary sdcwatch checkpoint (job, step) with one shard per rank: listed by
`sdcwatch ckpt ls`, VERIFIED by replica votes, kept and evicted by retention, replicated to peers, and
every chunk checksum and tensor fingerprint verified on load. DCP provides the planning, so loading into
a different world size or sharding (resharding) works as with its file system storage.

StorageWriter lifecycle (DCP calls, in order): reset(checkpoint_id) -> set_up_storage_writer -> prepare_local_plan
-> prepare_global_plan -> write_data (each rank: its tensors go through `Snapshotter.save`, i.e. a staging
slot in node memory, chunk checksums, fingerprints, Begin/CommitShard) -> finish (the coordinator only: the
global DCP metadata, as JSON, rides in the coordinator's shard manifest, whose CommitShard is sent last, so
the checkpoint becomes COMMITTED only once the metadata is stored: data first, marker last).

StorageReader lifecycle: reset(checkpoint_id) -> read_metadata (the restore plan from the agent; metadata
from the JSON) -> set_up_storage_reader -> prepare_local_plan -> prepare_global_plan -> read_data (each shard
it needs read once, verified, then narrowed to the requested piece).

The whole training state, no pickle. Besides tensors, a training state holds plain values (an optimizer's
param groups, an LR scheduler's and a data loader's state: numbers, strings, lists, tuples, dicts) and bytes
(torchtitan keeps `io.BytesIO` items). DCP's own file storage writes these "bytes" items with `torch.save`
and its default load planner reads them back with `torch.load(..., weights_only=False)`: full unpickling,
i.e. running code chosen by whoever wrote the bytes. Here each such item is encoded by
`checkpoint.plain_values` instead (JSON with exact ints and bit-exact floats, tuples kept as tuples; bytes and
BytesIO raw) and stored in the rank's shard blob as a uint8 tensor: it gets chunk checksums and a fingerprint
like every tensor. Its kind rides in the DCP storage data. On load the value is decoded (never unpickled)
and put in the state dict where the default planner's `load_bytes` would put it (a BytesIO comes back as a
BytesIO); a planner with its own `load_bytes` gets a BytesIO that `torch.save` made, here, from the decoded
value (so it holds only the plain types above). Anything else (an arbitrary object) is refused on save with
an error naming the key and saying what to do. Loading at another world size or sharding works for these
items as for tensors: DCP writes each once (deduplicated across ranks) and every rank that asks reads it.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import time
from torch.futures import Future
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from checkpoint.blobstore import BlobStore
from checkpoint.errors import CorruptCheckpointError, InvalidInputError, UnknownCheckpointError
from checkpoint.locations import dir_store_for
from checkpoint.manifest import ShardManifest
from checkpoint.names import validate_job_id, validate_step
from checkpoint.plain_values import KINDS, decode_item, encode_item
from checkpoint.records import LATEST, LATEST_VERIFIED, CommitResult, RestorePlan
from checkpoint.restore import restore_shard
from checkpoint.shard_reader import copies_for
from checkpoint.snapshot import Snapshotter, SnapshotConfig
from checkpoint.state_tree import DTYPES, dtype_name

log = logging.getLogger(__name__)

ITEMS = "dcp_items"
META = "dcp_metadata"
FORMAT = "sdcwatch.dcp.v1"


def _step_of(checkpoint_id: Any) -> int:
    if isinstance(checkpoint_id, bool):
        raise InvalidInputError(f"checkpoint_id must be a step (int >= 0), got {checkpoint_id!r}")
    if isinstance(checkpoint_id, int):
        return validate_step(checkpoint_id)
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return int(checkpoint_id)
    raise InvalidInputError(f"checkpoint_id must be a step (int >= 0), got {checkpoint_id!r}")


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- metadata as JSON ------------------------------------------------------------------------------
def metadata_to_json(md: Metadata) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sd[fqn] = {"bytes": True}
            continue
        sd[fqn] = {"dtype": dtype_name(m.properties.dtype), "size": list(m.size),
                   "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    storage = [[i.fqn, None if i.offset is None else list(i.offset), list(v)]
               for i, v in (md.storage_data or {}).items()]
    planner = None
    if isinstance(md.planner_data, dict) and all(
            isinstance(v, (tuple, list)) and all(isinstance(x, (str, int)) for x in v)
            for v in md.planner_data.values()):
        planner = {k: list(v) for k, v in md.planner_data.items()}
    return {"format": FORMAT, "state_dict": sd, "storage": storage, "planner": planner,
            "version": md.version}


def metadata_from_json(obj: Any) -> Metadata:
    try:
        if obj.get("format") != FORMAT:
            raise InvalidInputError(f"not a {FORMAT} metadata record")
        sd: dict[str, Any] = {}
        for fqn, m in obj["state_dict"].items():
            if m.get("bytes"):
                sd[fqn] = BytesStorageMetadata()
                continue
            if m["dtype"] not in DTYPES:
                raise InvalidInputError(f"DCP metadata for {fqn!r}: unsupported dtype {m['dtype']!r}")
            sd[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=DTYPES[m["dtype"]]), torch.Size(m["size"]),
                [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in m["chunks"]])
        storage = {MetadataIndex(fqn, None if off is None else torch.Size(off)): _storage_entry(fqn, v)
                   for fqn, off, v in obj["storage"]}
        planner = {k: tuple(v) for k, v in obj["planner"].items()} if obj.get("planner") else None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, InvalidInputError):
            raise
        raise InvalidInputError(f"malformed DCP metadata in the checkpoint manifest: {e}") from None
    return Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage,
                    version=obj.get("version"))


def _storage_entry(fqn: str, v: Any) -> tuple[Any, ...]:
    """(rank, index in the shard's items) for a tensor, (rank, index, kind) for a non-tensor item."""
    if len(v) == 3:
        if v[2] not in KINDS:
            raise InvalidInputError(f"DCP metadata for {fqn!r}: unknown value kind {v[2]!r}")
        return int(v[0]), int(v[1]), str(v[2])
    if len(v) != 2:
        raise InvalidInputError(f"DCP metadata for {fqn!r}: bad storage entry {v!r}")
    return int(v[0]), int(v[1])


def _item_object(planner: SavePlanner, item: Any) -> Any:
    """The value behind a BYTE_IO write item, as the user gave it (not DCP's torch.save bytes of it)."""
    lookup = getattr(planner, "lookup_object", None)   # DefaultSavePlanner and its subclasses
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):   # a planner that only hands out torch.save bytes: plain values only
        try:
            return torch.load(io.BytesIO(data.getvalue()), weights_only=True)
        except Exception as e:  # noqa: BLE001 - said below, with the key
            raise InvalidInputError(
                f"DCP item {item.index.fqn!r}: the save planner {type(planner).__name__} has no "
                "lookup_object() "
                f"and its torch.save bytes do not load with weights_only=True ({type(e).__name__}); use "
                "DefaultSavePlanner or a subclass of it") from None
    return data


def _tensor_of(payload: bytes) -> torch.Tensor:
    if not payload:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _put_value(planner: LoadPlanner, req: Any, value: Any) -> None:
    """Where DefaultLoadPlanner.load_bytes would put `value`, without its torch.load(weights_only=False)."""
    if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:   # the planner's own load_bytes
        buf = io.BytesIO()
        torch.save(value, buf)   # made here from the decoded plain value: nothing read from storage is in it
        buf.seek(0)
        planner.load_bytes(req, buf)
        return
    put_loaded_value(planner, req, value)


def put_loaded_value(planner: Any, req: Any, value: Any) -> None:
    """Set a loaded non-tensor value in a DefaultLoadPlanner's state dict, as its load_bytes does."""
    fqn = req.dest_index.fqn
    if not getattr(planner, "flatten_state_dict", False):
        planner.state_dict[fqn] = value
        return
    path = planner.mappings[fqn]
    node: Any = planner.original_state_dict
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


# ---- writer ----------------------------------------------------------------------------------------
class _DeferredCommitLink:
    """The coordinator's sink: Begin goes through; its CommitShard is held until `finish` adds the DCP
    metadata to the manifest (so the checkpoint commits only with its metadata)."""

    def __init__(self, link: Any) -> None:
        self.link = link
        self.held: tuple[Any, ...] | None = None

    def begin(self, *a: Any, **kw: Any) -> Any:
        return self.link.begin(*a, **kw)     # restored= (the rank's last restore) goes through

    def commit_shard(self, job_id: str, step: int, rank: int, world_size: int, manifest_json: str,
                     **kw: Any) -> Any:
        self.held = (job_id, step, rank, world_size, manifest_json, kw)
        return CommitResult("PENDING", False, 0)


class SdcwStorageWriter(StorageWriter):
    """See the module docstring. One writer per rank, reused across saves (its staging slots are)."""

    def __init__(self, link: Any, job_id: str, *, rank: int | None = None, world_size: int | None = None,
                 config: SnapshotConfig | None = None,
                 store_for: Callable[[str], BlobStore] = dir_store_for, timeout_s: float = 600.0,
                 origin: str = "") -> None:
        super().__init__()
        self.link = link
        self.origin = origin   # the coordinator shard's ShardManifest.origin ("import:...": dcp_export)
        self.job_id = validate_job_id(job_id)
        self._rank, self._world = rank, world_size
        self.config = config or SnapshotConfig()
        self.store_for = store_for
        self.timeout_s = timeout_s
        self.step: int | None = None
        self.is_coordinator = False
        self._deferred = _DeferredCommitLink(link)
        self._snap: Snapshotter | None = None
        self._snap_key: tuple[int, int, bool] | None = None
        self._restored: tuple[int, float] | None = None

    def note_restore(self, step: int, at: float | None = None) -> None:
        """This rank loaded checkpoint `step` into its training state (a rollback, a resume), the load begun at
        `at` (time.time(); default now). Every save after it tells the agent in its begin, and the agent cuts
        the job's history there first: the redone steps are saved again, never refused as "already
        COMMITTED" because the agent had not yet heard of the rollback (`Coordinator.cut_at_restore`)."""
        validate_step(step)
        self._restored = (step, time.time() if at is None else float(at))
        if self._snap is not None:
            self._snap.note_restore(*self._restored)

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is None:
            raise InvalidInputError("pass checkpoint_id=<step> to dcp.save / dcp.async_save")
        self.step = _step_of(checkpoint_id)
        self._deferred.held = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def _snapshotter(self) -> Snapshotter:
        rank, world = _dist_rank_world()
        rank = self._rank if self._rank is not None else rank
        world = self._world if self._world is not None else world
        key = (rank, world, self.is_coordinator)
        if self._snap is None or self._snap_key != key:
            if self._snap is not None:
                self._snap.close()
            sink = self._deferred if self.is_coordinator else self.link
            self._snap = Snapshotter(sink, self.job_id, rank, world, self.config, self.store_for)
            self._snap_key = key
            if self._restored is not None:
                self._snap.note_restore(*self._restored)
        return self._snap

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.step is None:
            raise InvalidInputError("reset(checkpoint_id) was not called")
        snap = self._snapshotter()
        tensors: list[torch.Tensor] = []
        slot_of: dict[int, int] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:   # a plain value or bytes: encoded, stored as uint8 bytes
                kind, payload = encode_item(_item_object(planner, item), item.index.fqn)
                tensors.append(_tensor_of(payload))
                results.append(WriteResult(index=item.index, size_in_bytes=len(payload),
                                           storage_data=(snap.rank, len(tensors) - 1, kind)))
                continue
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise InvalidInputError(f"DCP item {item.index.fqn!r} resolved to {type(t).__name__}, not a tensor")
            t = t.detach()
            if id(t) not in slot_of:
                slot_of[id(t)] = len(tensors)
                tensors.append(t if t.is_contiguous() else t.contiguous())
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data=(snap.rank, slot_of[id(t)])))
        handle = snap.save(self.step, {ITEMS: tensors})
        res = handle.result(self.timeout_s) if handle is not None else None
        if res is None or res.error:
            raise CorruptCheckpointError(f"DCP shard of rank {snap.rank} for step {self.step} was not stored: "
                                         f"{res.error if res else 'skipped'}")
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        for rank_results in results:
            storage.update({wr.index: wr.storage_data for wr in rank_results})
        metadata.storage_data = storage
        held = self._deferred.held
        if held is None:
            raise CorruptCheckpointError(f"DCP step {self.step}: the coordinator's shard was never written")
        job, step, rank, world, manifest_json, kw = held
        m = ShardManifest.from_json(manifest_json)
        tree = dict(m.tree)
        tree[META] = metadata_to_json(metadata)
        m = dataclasses.replace(m, tree=tree, origin=self.origin)
        commit = self.link.commit_shard(job, step, rank, world, m.to_json(), **kw)
        self._deferred.held = None
        log.info("DCP checkpoint job %s step %d: coordinator shard committed (%s)", job, step, commit.state)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step) if self.step is not None else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            _step_of(checkpoint_id)
            return True
        except InvalidInputError:
            return False

    def close(self) -> None:
        if self._snap is not None:
            self._snap.close()
            self._snap = None


# ---- reader ----------------------------------------------------------------------------------------
class SdcwStorageReader(StorageReader):
    """See the module docstring. `checkpoint_id`: a step, "latest" or "latest_verified"."""

    def __init__(self, link: Any, job_id: str, *,
                 store_for: Callable[[str], BlobStore] = dir_store_for) -> None:
        super().__init__()
        self.link = link
        self.job_id = validate_job_id(job_id)
        self.store_for = store_for
        self.target: int | str = LATEST_VERIFIED
        self.plan: RestorePlan | None = None
        self.storage_data: dict[MetadataIndex, tuple[int, int]] = {}

    @property
    def loaded_step(self) -> int | None:
        """The step the last `dcp.load` through this reader read ("latest_verified" resolved), else None: what
        a writer's `note_restore` takes after a rollback or a resume."""
        return self.plan.checkpoint.step if self.plan is not None else None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id in (LATEST, LATEST_VERIFIED):
            self.target = checkpoint_id
        elif checkpoint_id is not None:
            self.target = _step_of(checkpoint_id)
        self.plan = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.plan = self.link.restore_plan(self.job_id, self.target, None)
        found = [s for s in self.plan.shards if isinstance(s.manifest.tree, dict) and META in s.manifest.tree]
        if not found:
            raise UnknownCheckpointError(
                f"job {self.job_id} step {self.plan.checkpoint.step} was not saved with DCP (no DCP metadata)")
        md = metadata_from_json(found[0].manifest.tree[META])
        md.storage_meta = StorageMeta(checkpoint_id=str(self.plan.checkpoint.step))
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if self.plan is None:  # a rank that did not read the metadata itself
            self.plan = self.link.restore_plan(self.job_id, self.target, None)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        assert self.plan is not None
        shards = {s.rank: s for s in self.plan.shards}
        loaded: dict[int, list[torch.Tensor]] = {}
        for req in plan.items:
            try:
                rank, idx, *kind = self.storage_data[req.storage_index]
            except KeyError:
                raise UnknownCheckpointError(f"DCP item {req.storage_index} is not in the checkpoint") from None
            if rank not in loaded:
                shard = shards.get(rank)
                if shard is None:
                    raise UnknownCheckpointError(f"checkpoint step {self.plan.checkpoint.step} has no shard {rank}")
                loaded[rank] = restore_shard(shard.manifest, copies_for(shard, self.store_for), "cpu")[ITEMS]
            stored = loaded[rank][idx]
            if req.type == LoadItemType.BYTE_IO:
                if not kind:
                    raise CorruptCheckpointError(f"DCP item {req.storage_index.fqn!r} is stored as a tensor, "
                                                 "the load plan wants a non-tensor value")
                _put_value(planner, req, decode_item(kind[0], stored.numpy().tobytes()))
                continue
            if kind:
                raise CorruptCheckpointError(f"DCP item {req.storage_index.fqn!r} is stored as a {kind[0]} value, "
                                             "the load plan wants a tensor")
            piece = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise CorruptCheckpointError(
                    f"DCP item {req.storage_index.fqn!r}: stored piece {tuple(piece.size())} does not fit the "
                    f"target {tuple(target.size())}")
            target.copy_(piece)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        if checkpoint_id in (LATEST, LATEST_VERIFIED):
            return True
        try:
            _step_of(checkpoint_id)
            return True
        except InvalidInputError:
            return False
