"""Shard manifests: what a rank stored, as JSON (never pickle: a checkpoint read back is data, not code).

A state dict is split into
- `tensors`: one `TensorEntry` per tensor (dtype, shape, byte range in the shard blob, fingerprint);
- `tree`: the state dict's structure as JSON, with each tensor replaced by {"__sdcw_tensor__": index},
  each tuple by {"__sdcw_tuple__": [...]}, and each tensor-free part (plain values, bytes, BytesIO) by
  {"__sdcw_value__": {"__sdcw_tensor__": index}, "kind": "json" | "bytes" | "bytesio"}: its bytes
  (checkpoint.plain_values) are a uint8 entry of `tensors`, so they are checksummed, fingerprinted and
  compared across replicas like a tensor's. (Manifests written before held plain values inline in the tree;
  they still restore.)

`ShardManifest.from_json` validates everything it reads (names, ranges, chunk coverage, references),
so a damaged or hostile manifest fails with `InvalidInputError`, never deep inside a restore.

Torch-free: dtypes are names here (`DTYPE_SIZES`), so the agent reads and checks manifests without torch;
splitting a state dict into tensors and a tree, and back, is checkpoint.state_tree (the training side).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from checkpoint.chunks import ALGORITHM, ALGORITHMS, Chunk
from checkpoint.errors import InvalidInputError
from checkpoint.names import shown, validate_job_id, validate_key, validate_rank, validate_step
from checksums.fingerprint_host import ITEMSIZE

FORMAT = "sdcwatch.ckpt.shard.v1"
TENSOR_MARK = "__sdcw_tensor__"
TUPLE_MARK = "__sdcw_tuple__"
ITEMS_MARK = "__sdcw_items__"  # a dict with non-str (int) keys: [[key, value], ...]
# {VALUE_MARK: {TENSOR_MARK: index}, KIND_KEY: kind}: a non-tensor value stored as uint8 bytes. The index sits
# in an ordinary tensor reference so that a 0.1.0 agent, which knows only those, still finds every tensor
# referenced and accepts the manifest (docs/wire-compat.md: manifest_json is a contract too).
VALUE_MARK = "__sdcw_value__"
KIND_KEY = "kind"
VALUE_KINDS = ("json", "bytes", "bytesio")   # checkpoint.plain_values
MAX_MANIFEST_CHARS = 256 << 20
MAX_REPLICA_SET_CHARS = 256
MAX_ORIGIN_CHARS = 1024

# The tensor dtypes a checkpoint holds (torch's names) and their item sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    name: ITEMSIZE[name]
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                 "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                 "uint64")
}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    path: str                    # where it sits in the state dict, for messages: "model/layers.0.weight"
    dtype: str
    shape: tuple[int, ...]
    offset: int                  # byte offset in the shard blob
    nbytes: int
    fingerprint: tuple[int, ...]  # checksums.fingerprint words of the tensor

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "fingerprint": list(self.fingerprint)}

    @classmethod
    def from_json(cls, obj: Any) -> "TensorEntry":
        if not isinstance(obj, dict):
            raise InvalidInputError(f"tensor entry must be an object, got {type(obj).__name__}")
        try:
            path, dt, shape = obj["path"], obj["dtype"], obj["shape"]
            offset, nbytes, fp = obj["offset"], obj["nbytes"], obj["fingerprint"]
        except KeyError as e:
            raise InvalidInputError(f"tensor entry lacks field {e}") from None
        if not isinstance(path, str):
            raise InvalidInputError(f"tensor path must be a string, got {shown(path)}")
        if dt not in DTYPE_SIZES:
            raise InvalidInputError(f"tensor {shown(path)}: unsupported dtype {shown(dt)}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise InvalidInputError(f"tensor {shown(path)}: bad shape {shown(shape)}")
        if not all(isinstance(x, int) and x >= 0 for x in (offset, nbytes)):
            raise InvalidInputError(f"tensor {shown(path)}: bad offset/nbytes {shown(offset)}/{shown(nbytes)}")
        if not isinstance(fp, list) or not fp or not all(isinstance(w, int) for w in fp):
            raise InvalidInputError(f"tensor {shown(path)}: bad fingerprint {shown(fp)}")
        itemsize = DTYPE_SIZES[dt]
        if math.prod(shape) * itemsize != nbytes:
            raise InvalidInputError(f"tensor {shown(path)}: nbytes {nbytes} != prod{tuple(shape)} * {itemsize}")
        return cls(path, dt, tuple(shape), offset, nbytes, tuple(fp))


@dataclasses.dataclass(frozen=True, slots=True)
class ShardManifest:
    job_id: str
    step: int
    rank: int
    world_size: int
    blob: str                    # store key of the shard's bytes
    nbytes: int
    chunk_bytes: int
    chunks: tuple[Chunk, ...]
    tensors: tuple[TensorEntry, ...]
    tree: Any                    # JSON structure of the state dict with tensor references
    created: float
    algorithm: str = ALGORITHM
    replica_set: str = ""        # the ranks that must have saved identical bytes (checkpoint.replica_bytes);
                                 # "" when this shard has no replica
    origin: str = ""             # "" when a watched rank saved it; "import:<where from>" for bytes brought
                                 # in (`sdcwatch ckpt import`): never VERIFIED (replica_bytes.IMPORTED)

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "job_id": self.job_id, "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "blob": self.blob, "nbytes": self.nbytes,
            "chunk_bytes": self.chunk_bytes, "algorithm": self.algorithm,
            "chunks": [c.to_json() for c in self.chunks], "tensors": [t.to_json() for t in self.tensors],
            "tree": self.tree, "created": self.created, "replica_set": self.replica_set,
            **({"origin": self.origin} if self.origin else {}),
        }, separators=(",", ":"), allow_nan=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ShardManifest":
        if len(text) > MAX_MANIFEST_CHARS:
            raise InvalidInputError(f"manifest is {len(text)} chars, over the {MAX_MANIFEST_CHARS} limit")
        try:
            obj = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: nested too deep
            raise InvalidInputError(f"manifest is not valid JSON: {shown(str(e))}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise InvalidInputError(f"not a {FORMAT} manifest "
                                    f"(format={shown(obj.get('format') if isinstance(obj, dict) else None)})")
        try:
            job_id = validate_job_id(obj["job_id"])
            step = validate_step(obj["step"])
            rank, world = validate_rank(obj["rank"], obj["world_size"])
            blob = validate_key(obj["blob"])
            nbytes, chunk_bytes = obj["nbytes"], obj["chunk_bytes"]
            algorithm = obj["algorithm"]
            chunks = tuple(Chunk.from_json(c) for c in obj["chunks"])
            tensors = tuple(TensorEntry.from_json(t) for t in obj["tensors"])
            tree, created = obj["tree"], obj["created"]
            replica_set = obj.get("replica_set", "")   # absent in manifests written before it existed
            origin = obj.get("origin", "")
        except KeyError as e:
            raise InvalidInputError(f"manifest lacks field {shown(str(e))}") from None
        except (TypeError, AttributeError) as e:   # a field of the wrong kind (a number where a list goes, ...)
            raise InvalidInputError(f"manifest has a field of the wrong type: {shown(str(e))}") from None
        except TypeError as e:
            raise InvalidInputError(f"manifest has a field of the wrong type: {e}") from None
        if algorithm not in ALGORITHMS:
            raise InvalidInputError(f"manifest checksum algorithm {shown(algorithm)} is not one of "
                                    f"{', '.join(ALGORITHMS)}")
        if algorithm != ALGORITHM:
            chunks = tuple(dataclasses.replace(c, algorithm=algorithm) for c in chunks)
        if not (isinstance(nbytes, int) and nbytes >= 0 and isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise InvalidInputError(f"manifest has bad nbytes/chunk_bytes {shown(nbytes)}/{shown(chunk_bytes)}")
        if not isinstance(replica_set, str) or len(replica_set) > MAX_REPLICA_SET_CHARS:
            raise InvalidInputError(f"manifest has a bad replica_set {shown(replica_set)} (a string of at most "
                                    f"{MAX_REPLICA_SET_CHARS} chars)")
        if not isinstance(origin, str) or len(origin) > MAX_ORIGIN_CHARS:
            raise InvalidInputError(f"manifest has a bad origin {shown(origin)} (a string of at most "
                                    f"{MAX_ORIGIN_CHARS} chars)")
        if not isinstance(created, (int, float)):
            raise InvalidInputError(f"manifest has bad created time {shown(created)}")
        pos = 0
        for c in chunks:
            if c.offset != pos or c.length == 0:
                raise InvalidInputError(f"manifest chunks do not tile the blob: chunk at {c.offset}, expected {pos}")
            pos += c.length
        if pos != nbytes:
            raise InvalidInputError(f"manifest chunks cover {pos} bytes, blob has {nbytes}")
        for t in tensors:
            if t.offset + t.nbytes > nbytes:
                raise InvalidInputError(f"tensor {shown(t.path)} runs past the end of the blob")
        refs, values = _tree_refs(tree)
        if sorted(refs) != list(range(len(tensors))):
            raise InvalidInputError("manifest tree must reference every tensor, and only those")
        for i in values:
            if tensors[i].dtype != "uint8" or len(tensors[i].shape) != 1:
                raise InvalidInputError(f"manifest value {shown(tensors[i].path)} is not stored as 1-D uint8 bytes")
        return cls(job_id, step, rank, world, blob, nbytes, chunk_bytes, chunks, tensors, tree,
                   float(created), algorithm, replica_set, origin)


def _tree_refs(tree: Any) -> tuple[list[int], set[int]]:
    """(the tensor indices the tree references, sorted, each once; those that hold values)."""
    refs: list[int] = []
    values: set[int] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            is_value = set(obj) == {VALUE_MARK, KIND_KEY}
            if set(obj) == {TENSOR_MARK} or is_value:
                ref = obj[VALUE_MARK] if is_value else obj
                i = ref.get(TENSOR_MARK) if isinstance(ref, dict) and set(ref) == {TENSOR_MARK} else None
                if not isinstance(i, int) or isinstance(i, bool):
                    raise InvalidInputError(f"manifest tree has a bad tensor reference {shown(ref)}")
                if is_value:
                    if obj[KIND_KEY] not in VALUE_KINDS:
                        raise InvalidInputError(f"manifest tree has a value of unknown kind {shown(obj[KIND_KEY])}")
                    values.add(i)
                refs.append(i)
                return
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(tree)
    return sorted(set(refs)), values
