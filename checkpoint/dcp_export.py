"""Export a checkpoint as a stock DCP directory, and import one into the tiers (the training side: torch).

    sdcwatch ckpt export STEP --job J --dcp DIR [--force] [--rank R]
    sdcwatch ckpt import DIR --job J --step N          (both run `python -m checkpoint.dcp_export`)

Export reads the checkpoint the way a rank restores it (the agent's restore plan, every chunk checksum and
tensor fingerprint verified) and writes it with DCP's own `FileSystemWriter`, in one process: full tensors,
non-tensor values as DCP writes them (`torch.save` bytes), the `.metadata` file last. The result is a plain
DCP directory: `torch.distributed.checkpoint.load(state_dict, checkpoint_id=DIR)` reads it without sdcwatch
installed, into any world size and sharding (DCP reshards full tensors like any others). The nesting of the
saved state dict is kept (DCP's planner data), so DCP's own tools (`format_utils.dcp_to_torch_save`) work too.
A checkpoint saved through DCP exports whole; one saved with `CheckpointClient` holds one state dict per
rank: world size 1 exports as is, otherwise `--rank R` names the rank whose state dict to export.

Import reads a directory written by `torch.distributed.checkpoint.save` with `FileSystemWriter` and saves it
as step N of job J through `SdcwStorageWriter` (world size 1; `dcp.load` reshards it like any DCP checkpoint).
It is COMMITTED, never VERIFIED: no rank sdcwatch watched saved those bytes and no in-step check or replica
vote covered them (its manifest's `origin` says "import:DIR"; `sdcwatch ckpt show` gives the reason). Stock
DCP is pickle: `.metadata` is read with an unpickler that builds only DCP's metadata classes (anything else is
refused, nothing of it runs), tensors with `torch.load(weights_only=True)` (DCP's reader does), non-tensor
items with `torch.load(weights_only=True)` allowing `bytes` and `io.BytesIO` only. The data file names come
from `.metadata` and are checked (plain names inside DIR) before anything is opened.

Exit codes (`main`): 0 done; 2 bad input: no such directory, not a DCP directory or a partial one, step not
found, output directory not empty without --force, an object that is not data, agent unreachable...; 1 the
checkpoint's bytes failed verification (no good copy).
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, StorageMeta,
                                                   TensorStorageMetadata)

from checkpoint.agent_link import GrpcAgentLink
from checkpoint.blobstore import BlobStore
from checkpoint.dcp import META, SdcwStorageReader, SdcwStorageWriter, put_loaded_value
from checkpoint.errors import (AgentUnavailableError, CheckpointError, CorruptCheckpointError,
                               InvalidInputError, UnknownCheckpointError)
from checkpoint.locations import dir_store_for
from checkpoint.manifest import MAX_ORIGIN_CHARS
from checkpoint.names import validate_job_id, validate_step
from checkpoint.records import LATEST, LATEST_VERIFIED
from checkpoint.restore import restore_from_plan
from checkpoint.state_tree import DTYPES

EXIT_OK, EXIT_BAD_COPY, EXIT_USAGE = 0, 1, 2
METADATA = ".metadata"
_DATA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")

# What a stock `.metadata` pickle may name: DCP's metadata dataclasses and the torch values inside them.
_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = ({(_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                "_MEM_FORMAT_ENCODING")}
            | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("collections", "OrderedDict")}
            | {("torch", n) for n in DTYPES})


# ---- export --------------------------------------------------------------------------------------------
def export_dcp(link: Any, job_id: str, target: int | str, out: str | os.PathLike, *, force: bool = False,
               rank: int | None = None,
               store_for: Callable[[str], BlobStore] = dir_store_for) -> dict[str, Any]:
    """Write checkpoint `target` of `job_id` into `out` as a stock DCP directory; returns a summary."""
    validate_job_id(job_id)
    out = Path(out)
    _check_out_dir(out, force)
    plan = link.restore_plan(job_id, target, None)
    step = plan.checkpoint.step
    is_dcp = any(isinstance(s.manifest.tree, dict) and META in s.manifest.tree for s in plan.shards)
    if is_dcp:
        if rank is not None:
            raise InvalidInputError(f"job {job_id} step {step} was saved through DCP: it exports whole "
                                    "(drop --rank)")
        state = _dcp_state(link, job_id, step, store_for)
    else:
        world = plan.checkpoint.world_size
        if rank is None and world != 1:
            raise InvalidInputError(
                f"job {job_id} step {step} was saved by CheckpointClient on {world} ranks, each its own "
                "state dict: pass --rank R to export one of them")
        rank = 0 if rank is None else rank
        if not any(s.rank == rank for s in plan.shards):
            raise InvalidInputError(f"job {job_id} step {step} has no rank {rank} (world size {world})")
        state = restore_from_plan(plan, rank, store_for, "cpu")
    _write_stock(state, out)
    return {"job_id": job_id, "step": step, "state": plan.checkpoint.state, "dir": str(out),
            "source": "dcp" if is_dcp else f"rank {rank}", "bytes": _dir_bytes(out)}


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InvalidInputError(f"{out} exists and is not empty: pick a new directory, or pass --force to "
                                f"write into it (its {METADATA} is replaced last)")


def _dcp_state(link: Any, job_id: str, step: int, store_for: Callable[[str], BlobStore]) -> Any:
    reader = SdcwStorageReader(link, job_id, store_for=store_for)
    reader.reset(step)
    md = reader.read_metadata()
    flat = _skeleton(md, f"job {job_id} step {step}")
    dcp.load(flat, storage_reader=SdcwStorageReader(link, job_id, store_for=store_for), checkpoint_id=step,
             no_dist=True)
    return _nest(flat, md.planner_data)


def _write_stock(state: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / METADATA).unlink(missing_ok=True)   # --force: no stale marker over new data while this runs
    dcp.save(state, storage_writer=FileSystemWriter(str(out), single_file_per_rank=True, sync_files=True),
             no_dist=True)


def _dir_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


# ---- import --------------------------------------------------------------------------------------------
def import_dcp(link: Any, job_id: str, step: int, src: str | os.PathLike, *,
               store_for: Callable[[str], BlobStore] = dir_store_for) -> dict[str, Any]:
    """Save the stock DCP directory `src` as step `step` of `job_id` (world size 1; COMMITTED, never
    VERIFIED)."""
    validate_job_id(job_id)
    validate_step(step)
    src = Path(src)
    md = read_stock_metadata(src)
    check_stock_files(src, md)
    have = {i.step: i.state for i in link.list(job_id)}
    if step in have:
        raise InvalidInputError(f"job {job_id} already has a checkpoint at step {step} ({have[step]}): "
                                "import it as another --step")
    flat = _skeleton(md, str(src))
    dcp.load(flat, storage_reader=_StockReader(src, md), planner=_NoPickleLoadPlanner(), no_dist=True)
    state = _nest(flat, md.planner_data)
    origin = f"import:{src.resolve()}"[:MAX_ORIGIN_CHARS]
    writer = SdcwStorageWriter(link, job_id, rank=0, world_size=1, store_for=store_for, origin=origin)
    try:
        dcp.save(state, storage_writer=writer, checkpoint_id=step, no_dist=True)
    finally:
        writer.close()
    info = next((i for i in link.list(job_id) if i.step == step), None)
    return {"job_id": job_id, "step": step, "state": info.state if info else "?", "dir": str(src),
            "items": len(md.state_dict_metadata), "bytes": info.nbytes if info else 0}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, where: Path) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise InvalidInputError(f"{self.where} names {module}.{name}, which DCP metadata does not hold: "
                                "refused (nothing of it was run)")


def read_stock_metadata(src: Path) -> Metadata:
    """The `.metadata` of a stock DCP directory, unpickled with only DCP's metadata classes allowed."""
    if not src.exists():
        raise InvalidInputError(f"{src}: no such directory")
    if not src.is_dir():
        raise InvalidInputError(f"{src} is not a directory")
    path = src / METADATA
    if not path.is_file():
        raise InvalidInputError(f"{src} is not a complete DCP checkpoint: it has no {METADATA} (DCP writes "
                                "it last: a save that did not finish, or not a DCP directory)")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except InvalidInputError:
        raise
    except Exception as e:  # noqa: BLE001 - any damage in the file: said with its name
        raise InvalidInputError(f"{path} is not readable DCP metadata: {type(e).__name__}: "
                                f"{str(e)[:200]}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise InvalidInputError(f"{path} is not DCP metadata (it holds a {type(md).__name__})")
    return md


def check_stock_files(src: Path, md: Metadata) -> None:
    """Every item's data file is a plain name inside `src`, present, and long enough: else a partial or
    hostile directory, refused before anything is read."""
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or not _DATA_NAME.fullmatch(name) or ".." in name:
            raise InvalidInputError(f"{src}/{METADATA}: item {index.fqn!r} points at {name!r}, not a file "
                                    "name inside the directory: refused")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise InvalidInputError(f"{src}/{METADATA}: item {index.fqn!r} has a bad byte range")
        if getattr(info, "transform_descriptors", None):
            raise InvalidInputError(f"{src}: item {index.fqn!r} was written with storage transforms "
                                    f"{info.transform_descriptors!r}: not supported by import")
        if name not in sizes:
            p = src / name
            if not p.is_file():
                raise InvalidInputError(f"{src} is a partial DCP checkpoint: {name} is missing")
            sizes[name] = p.stat().st_size
        if offset + length > sizes[name]:
            raise InvalidInputError(f"{src} is a partial DCP checkpoint: {name} has {sizes[name]} bytes, "
                                    f"item {index.fqn!r} needs bytes up to {offset + length}")
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata) and m.properties.dtype not in DTYPES.values():
            raise InvalidInputError(f"{src}: tensor {fqn!r} has dtype {m.properties.dtype}, which sdcwatch "
                                    "checkpoints do not hold")


class _StockReader(FileSystemReader):
    """DCP's file reader with the metadata already read (by `read_stock_metadata`, not `pickle.load`)."""

    def __init__(self, path: Path, md: Metadata) -> None:
        super().__init__(str(path))
        self._md = md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._md, "storage_meta", None) is None:
            self._md.storage_meta = StorageMeta()
        self._md.storage_meta.load_id = self.load_id
        return self._md


class _NoPickleLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item is loaded with torch.load(weights_only=True) (plain
    values, plus bytes and BytesIO), never unpickled freely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals([io.BytesIO, bytes]):
                obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - said with the item's name
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidInputError(
                f"DCP item {fqn!r} is a pickled object that is not plain data ({first[:200]}): refused, "
                "nothing of it was run; import takes tensors, plain values (numbers, strings, lists, dicts), "
                "bytes and BytesIO") from None
        put_loaded_value(self, read_item, obj)


# ---- shared --------------------------------------------------------------------------------------------
def _skeleton(md: Metadata, where: str) -> dict[str, Any]:
    """A flat state dict DCP loads into: an empty full tensor per tensor item, None per bytes item."""
    flat: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            flat[fqn] = None
        elif isinstance(m, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        else:
            raise InvalidInputError(f"{where}: item {fqn!r} has metadata of type {type(m).__name__}")
    return flat


def _nest(flat: dict[str, Any], mappings: Any) -> Any:
    """The state dict as it was saved, from DCP's flat one and its planner data (fqn -> path of keys; an int
    is a list index, as DCP's own `set_element` reads it). Without usable planner data, the flat dict."""
    def usable(p: Any) -> bool:
        return isinstance(p, (tuple, list)) and bool(p) and isinstance(p[0], str) and all(
            isinstance(k, (str, int)) and not isinstance(k, bool) for k in p)

    if not (isinstance(mappings, dict) and set(mappings) == set(flat)
            and all(map(usable, mappings.values()))):
        return flat
    root: dict[str, Any] = {}
    try:
        for fqn, path in mappings.items():
            node: Any = root
            for k, nxt in zip(path[:-1], path[1:]):
                fresh: Any = [] if isinstance(nxt, int) else {}
                if isinstance(node, dict):
                    node = node.setdefault(k, fresh)
                else:
                    node.extend([None] * (k + 1 - len(node)))
                    if node[k] is None:
                        node[k] = fresh
                    node = node[k]
            last = path[-1]
            if isinstance(node, list):
                node.extend([None] * (last + 1 - len(node)))
            node[last] = flat[fqn]
    except (TypeError, IndexError, KeyError):   # paths that do not nest consistently: keep the flat keys
        return flat
    return root


def _unwrap(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


# ---- command line (sdcwatch ckpt export / import run this in a child: the CLI never imports torch) ------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoint.dcp_export")
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export")
    ex.add_argument("target")
    ex.add_argument("--job", required=True)
    ex.add_argument("--dcp", required=True)
    ex.add_argument("--force", action="store_true")
    ex.add_argument("--rank", type=int, default=None)
    im = sub.add_parser("import")
    im.add_argument("dir")
    im.add_argument("--job", required=True)
    im.add_argument("--step", type=int, required=True)
    for s in (ex, im):
        s.add_argument("--socket", required=True, help="the agent's unix socket")
        s.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    what = f"{args.cmd} of job {args.job}"
    try:
        link = GrpcAgentLink.connect(f"unix:{args.socket}", args.timeout)
        if args.cmd == "export":
            target: int | str = args.target
            if target not in (LATEST, LATEST_VERIFIED):
                if not target.isdigit():
                    raise InvalidInputError(f"STEP must be a step number, {LATEST!r} or {LATEST_VERIFIED!r}, "
                                            f"got {target!r}")
                target = int(target)
            r = export_dcp(link, args.job, target, args.dcp, force=args.force, rank=args.rank)
            print(f"job {r['job_id']} step {r['step']} ({r['state']}, {r['source']}) -> {r['dir']}: stock "
                  f"DCP, {r['bytes']} bytes; load with torch.distributed.checkpoint.load(state_dict, "
                  f"checkpoint_id={r['dir']!r})")
        else:
            r = import_dcp(link, args.job, args.step, args.dir)
            print(f"{r['dir']} -> job {r['job_id']} step {r['step']} ({r['state']}, {r['items']} items, "
                  f"{r['bytes']} bytes); never VERIFIED: imported bytes were checked by no training step")
        link.close()
        return EXIT_OK
    except (CheckpointException, CheckpointError, OSError, ValueError) as exc:
        e = _unwrap(exc)
        code = EXIT_BAD_COPY if isinstance(e, CorruptCheckpointError) else EXIT_USAGE
        if isinstance(e, (AgentUnavailableError, UnknownCheckpointError, InvalidInputError)):
            code = EXIT_USAGE
        print(f"sdcwatch: {what}: {str(e).strip() or type(e).__name__}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
