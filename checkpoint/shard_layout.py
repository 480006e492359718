"""`ShardLayout`: what a source-checksummed shard's manifest says that stays from save to save. Torch-free.

A rank that checkpoints every step writes the same layout every time: the same tensors (paths, dtypes,
shapes, offsets), the same tree of plain values' places, the same chunks. Only the step, the blob, the
time and the checksums change, and the checksums follow from the pieces' fingerprint words
(checkpoint.source_sums). So the rank sends the layout once (`to_json`, named by `id`, its sha256) and then,
per save, only the words (16 bytes a piece); the agent renders the manifest (`render`): the very text the
rank would have rendered, parsed and validated by the agent as any manifest is. The rank's background
thread then spends no time rendering a 100+ KB JSON under the training process's GIL (issue 21).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from typing import Any

import numpy as np

from checkpoint.errors import InvalidInputError
from checkpoint.source_sums import CombinePlan, ManifestTemplate, Piece, pieces

MAX_ENTRIES = 1 << 20     # tensors in one layout (a bound on what a client can make the agent build)
MAX_PIECES = 1 << 22      # pieces, and chunks, in one layout (the plan's arrays and JSON fragments)
WORD_BYTES = 16           # a piece's two fingerprint words, little-endian


class ShardLayout:
    """One shard's layout; `render` fills in one save. `entries`: (path, dtype name, shape, offset, nbytes)
    per tensor, offsets in the shard blob; `tree`: the manifest's tree (JSON-safe)."""

    def __init__(self, job_id: str, rank: int, world_size: int, nbytes: int, chunk_bytes: int,
                 entries: list[tuple[str, str, tuple[int, ...], int, int]], tree: Any,
                 replica_set: str = "", cut: list[Piece] | None = None) -> None:
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.nbytes, self.chunk_bytes, self.replica_set = nbytes, chunk_bytes, replica_set
        self.entries = entries
        self.tree = tree
        self.cut = cut if cut is not None else pieces([e[3] for e in entries], [e[4] for e in entries], chunk_bytes)
        self.plan = CombinePlan(self.cut, nbytes, chunk_bytes, [(dt, shape) for _, dt, shape, _, _ in entries])
        self.template = ManifestTemplate(job_id, rank, world_size, nbytes, chunk_bytes, self.plan.ranges,
                                         entries, tree, replica_set)

    @property
    def n_pieces(self) -> int:
        return len(self.cut)

    @functools.cached_property
    def json(self) -> str:
        return json.dumps({"job_id": self.job_id, "rank": self.rank, "world_size": self.world_size,
                           "nbytes": self.nbytes, "chunk_bytes": self.chunk_bytes,
                           "replica_set": self.replica_set,
                           "entries": [[p, dt, list(shape), off, n] for p, dt, shape, off, n in self.entries],
                           "tree": self.tree}, separators=(",", ":"), allow_nan=True)

    @functools.cached_property
    def id(self) -> str:
        return hashlib.sha256(self.json.encode()).hexdigest()

    def check_for(self, job_id: str, rank: int, world_size: int) -> None:
        """InvalidInputError unless this layout is for that job, rank and world size."""
        if (self.job_id, self.rank, self.world_size) != (job_id, rank, world_size):
            raise InvalidInputError(f"layout is for job {self.job_id} rank {self.rank}/{self.world_size}, "
                                    f"request says job {job_id} rank {rank}/{world_size}")

    def render(self, step: int, blob: str, words: np.ndarray, created: float) -> str:
        """The manifest JSON of one save: `words` [pieces, 2] (int64 or uint64) in this layout's piece order."""
        chunk_words, tensor_words = self.plan.run(words)
        return self.template.render(step, blob, chunk_words, tensor_words, created)

    def words_from_bytes(self, raw: bytes) -> np.ndarray:
        """The pieces' words sent as bytes (`words_to_bytes`), checked against this layout's piece count."""
        if len(raw) != WORD_BYTES * self.n_pieces:
            raise InvalidInputError(f"{len(raw)} bytes of piece fingerprints for a layout of {self.n_pieces} "
                                    f"pieces ({WORD_BYTES} bytes each)")
        return np.frombuffer(raw, dtype="<u8").reshape(self.n_pieces, 2)

    @staticmethod
    def words_to_bytes(words: np.ndarray) -> bytes:
        return np.ascontiguousarray(words).view(np.uint64).astype("<u8", copy=False).tobytes()

    @classmethod
    def from_json(cls, text: str) -> "ShardLayout":
        """A layout a client sent; InvalidInputError (naming what is wrong) for anything malformed."""
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise InvalidInputError(f"layout is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise InvalidInputError("layout must be a JSON object")
        try:
            job, rank, world = d["job_id"], d["rank"], d["world_size"]
            nbytes, chunk, rs, raw, tree = (d["nbytes"], d["chunk_bytes"], d.get("replica_set", ""),
                                            d["entries"], d["tree"])
        except KeyError as e:
            raise InvalidInputError(f"layout lacks {e.args[0]!r}") from None
        ints = {"rank": rank, "world_size": world, "nbytes": nbytes, "chunk_bytes": chunk}
        for k, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidInputError(f"layout {k} must be an integer >= 0, got {v!r}")
        if not isinstance(job, str) or not isinstance(rs, str):
            raise InvalidInputError("layout job_id and replica_set must be strings")
        if chunk <= 0 or chunk % 4:
            raise InvalidInputError(f"layout chunk_bytes must be a positive multiple of 4, got {chunk}")
        if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
            raise InvalidInputError(f"layout entries must be a list of at most {MAX_ENTRIES}")
        if -(-nbytes // chunk) > MAX_PIECES:
            raise InvalidInputError(f"layout of {nbytes} bytes in chunks of {chunk} is over {MAX_PIECES} chunks")
        entries: list[tuple[str, str, tuple[int, ...], int, int]] = []
        end = 0
        n_pieces = 0
        for i, e in enumerate(raw):
            ok = (isinstance(e, list) and len(e) == 5 and isinstance(e[0], str) and isinstance(e[1], str)
                  and isinstance(e[2], list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                     for x in e[2])
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in e[3:]))
            if not ok:
                raise InvalidInputError(f"layout entry {i} must be [path, dtype, [dims], offset, nbytes]")
            path, dt, shape, off, n = e
            if off < end or off % 4 or n < 0 or off + n > nbytes or n > 8 * max(1, math.prod(shape)):
                raise InvalidInputError(f"layout entry {i} ({path!r}): bytes [{off}, {off + n}) do not fit "
                                        f"the shard of {nbytes} bytes in order, 4-aligned")
            end = off + n
            n_pieces += (off + n - 1) // chunk - off // chunk + 1 if n else 0
            if n_pieces > MAX_PIECES:
                raise InvalidInputError(f"layout cuts into more than {MAX_PIECES} pieces")
            entries.append((path, dt, tuple(shape), off, n))
        try:
            return cls(job, rank, world, nbytes, chunk, entries, tree, rs)
        except InvalidInputError:
            raise
        except (ValueError, TypeError, KeyError, OverflowError) as e:
            raise InvalidInputError(f"layout rejected: {type(e).__name__}: {e}") from None
