"""Tensor-parallel lanes: the compute checks of an FSDP2 (or HSDP) model that tensor parallelism also splits.

A tensor-parallel (tp) group computes one data-parallel replica's step together: every forward and backward
is a collective of its ranks, each holding a shard of the weights (a lane). So the checks treat a tp group as
one data-parallel rank, a "dp index": its rows are its lanes' rows side by side (lane-major: [lanes * B, 4]),
compared with the other dp indices' as one rank's buckets are. Every decision is taken from rows gathered
over every rank of the mesh (the default group: the mesh must span the job), so every rank takes it alike:
which step is replayed, which batch, how often. A replay is a collective of the whole mesh: each tp group replays the batch it is given, each lane
its own shard of the gradient, and the tp groups' collectives inside the forward pair up as the step's did.
Batches and RNG states travel within a lane (`dp_group`: the ranks holding the same shard), from the rank
of the same lane in the sending tp group, which ran the same batch.

Naming: replays tell which tp group computed wrong, not which of its GPUs (the group's forward mixes its
lanes: a fault on one lane reaches every lane's gradient), so a finding names every GPU of that group,
marked `one_of` (the agent makes them SUSPECT, never FAILED, on that evidence; a persistent fault still
stops the job).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class Lanes:
    """Where this rank sits in a (data-parallel x tensor-parallel) mesh (`find_lanes`)."""

    dp: int                      # the tp groups (data-parallel replicas or shards)
    lanes: int                   # ranks in one tp group
    dp_rank: int                 # this rank's tp group
    lane: int                    # this rank's place in it
    ranks: tuple[int, ...]       # global ranks in (dp index, lane) order (the mesh spans the default group)
    dp_group: Any                # this lane's data-parallel group (rank d = dp index d)
    dims: tuple[str, ...]        # the mesh dims the model is split over besides data parallelism
    # `ranks` on each device it was used on: made once, not a host-to-device copy every step
    _index: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        return self.dp * self.lanes

    def members(self, d: int) -> tuple[int, ...]:
        """The global ranks of tp group `d`, lane by lane."""
        return self.ranks[d * self.lanes:(d + 1) * self.lanes]

    def merge(self, gathered: torch.Tensor) -> torch.Tensor:
        """Rows gathered over the default group, [size, *pre, B, W] in global rank order, as the dp indices':
        [dp, *pre, lanes * B, W] (each tp group's lanes side by side)."""
        index = self._index.get(gathered.device)
        if index is None:
            index = self._index[gathered.device] = torch.tensor(self.ranks, device=gathered.device)
        x = gathered.index_select(0, index)
        x = x.reshape(self.dp, self.lanes, *gathered.shape[1:]).movedim(1, -3)
        return x.reshape(self.dp, *gathered.shape[1:-2], self.lanes * gathered.shape[-2], gathered.shape[-1])


def lane_table(grid: torch.Tensor, dp_dims: list[int], world: int) -> list[list[int]]:
    """The tp groups of a mesh (`grid`: its global ranks, one dim per mesh dim; `dp_dims`: the data-parallel
    ones), row d the ranks of tp group d lane by lane. A lane's ranks (a column) must rise with d, as every
    process group numbers its ranks (a lane's group rank is then its dp index), and the mesh must hold every
    rank of the job once; ValueError otherwise. Pure."""
    tp_dims = [d for d in range(grid.ndim) if d not in dp_dims]
    dp = math.prod(grid.shape[d] for d in dp_dims)
    table = [[int(r) for r in row] for row in grid.permute(*dp_dims, *tp_dims).reshape(dp, -1).tolist()]
    if sorted(r for row in table for r in row) != list(range(world)):
        raise ValueError(f"ComputeChecks: the model's mesh holds {grid.numel()} ranks, not every rank of the "
                         f"job ({world}) once: tensor parallelism is checked on a mesh of the whole job")
    if any(table[d][lane] >= table[d + 1][lane] for d in range(dp - 1) for lane in range(len(table[0]))):
        raise ValueError("ComputeChecks: the mesh orders a lane's data-parallel ranks unlike their global "
                         "ranks (a custom mesh): its tp groups cannot be numbered alike in every lane")
    return table


def find_lanes(module: Any, fsdp_mesh: Any, dims: list[str], group: Any = None) -> Lanes:
    """The lanes of an FSDP2 `module` whose DTensor parameters are also split over mesh `dims` (names from
    `checksums.grad_checks.model_parallel_dims`); `fsdp_mesh` is FSDP's own mesh (its dims are the
    data-parallel ones). A collective of every rank (it may make the lanes' data-parallel groups). `group`:
    the caller's data-parallel group, which must be this lane's. ValueError for a layout it cannot check."""
    from checksums.fingerprint import DTENSOR
    split = [p.device_mesh for p in module.parameters()
             if DTENSOR is not None and isinstance(p, DTENSOR) and p.device_mesh.ndim > fsdp_mesh.ndim]
    meshes = {(tuple(m.mesh.reshape(-1).tolist()), tuple(m.mesh.shape), m.mesh_dim_names): m for m in split}
    if not meshes:
        raise ValueError("ComputeChecks: no parameter's mesh holds both the data-parallel and the "
                         f"{dims} dims")
    if len(meshes) > 1:         # expert parallelism's experts on a mesh of their own, say: not one layout
        raise ValueError(f"ComputeChecks: the parameters are split over {len(meshes)} different meshes "
                         f"({sorted({str(k[2]) for k in meshes})}): the checks take one (data-parallel x "
                         "tensor-parallel) mesh; expert parallelism is not supported")
    mesh = next(iter(meshes.values()))
    names = tuple(mesh.mesh_dim_names or ())
    dp_names = tuple(fsdp_mesh.mesh_dim_names or ())
    if names and dp_names:
        dp_dims = [d for d in range(mesh.ndim) if names[d] in dp_names]
    else:                                          # FSDP2's mesh first, then the model's own dims
        dp_dims = list(range(fsdp_mesh.ndim))
    table = lane_table(mesh.mesh, dp_dims, dist.get_world_size())
    dp, lanes = len(table), len(table[0])
    ranks = tuple(r for row in table for r in row)
    columns = [[row[lane] for row in table] for lane in range(lanes)]
    me = ranks.index(dist.get_rank())
    dp_rank, lane = divmod(me, lanes)
    if fsdp_mesh.ndim == 1:                        # FSDP2's own group is this lane's
        dp_group = fsdp_mesh.get_group()
    else:                                          # HSDP: each lane's (replicate, shard) ranks, made here
        dp_group, _ = dist.new_subgroups_by_enumeration(columns)
    if dist.get_process_group_ranks(dp_group) != columns[lane]:
        raise ValueError("ComputeChecks: FSDP's group does not hold this lane's data-parallel ranks in mesh "
                         "order")
    if group is not None and dist.get_process_group_ranks(group) != columns[lane]:
        raise ValueError(f"ComputeChecks: group= holds ranks {dist.get_process_group_ranks(group)}, not this "
                         f"rank's data-parallel ranks {columns[lane]} (the ranks holding the same shard)")
    return Lanes(dp=dp, lanes=lanes, dp_rank=dp_rank, lane=lane, ranks=ranks,
                 dp_group=group if group is not None else dp_group, dims=tuple(dims))
