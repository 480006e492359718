"""The lane witness: which GPU of a tensor- or context-parallel group computed wrong.

Replays name a tp (cp) group, not its GPU: a fault on one lane reaches every lane's gradient through the
group's collectives (checksums.tp_lanes). Once the replays have found a group whose GPUs repeat a wrong
result (persistent) while another group agrees with the rest, every rank replays the faulty group's batch
under the op witness's trace (checksums.op_witness `OpTrace`: each op's inputs and outputs fingerprinted on
the device). Lane l of the faulty group and lane l of the good group run the same ops on the same shard of
the weights and the same chunk of the batch, so their traces agree op for op until the fault: in the lane
whose GPU computed wrong, the first op whose inputs are equal on both and whose outputs are not is the
faulty op (`first_divergence`); in the other lanes the fault arrives through a collective, so their first
differing ops read differing inputs and are passed over. That op alone is recomputed on the host CPU in
float64 (`decide`) and the GPU whose output is not the CPU's is named. One lane naming the faulty group's
GPU, and no other lane naming anything, names that GPU; anything else names none (the finding stays
`one_of`).

Sees what the trace sees: the ops each GPU runs, on plain tensors (FSDP2's unsharded parameters, context
parallelism's compute outside attention) and on a DTensor's local shards (a tp-split layer's matmuls:
`OpTrace` hands a DTensor's op back to DTensor's dispatch with the trace on). Every rank calls it at once
(the replays are collectives of the whole mesh); every rank returns the same answer (the lanes' verdicts are
gathered over the mesh).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from checksums.op_witness import witness_between
from checksums.replay import witness_names
from checksums.tp_lanes import Lanes


def lane_witness(replay: Callable[[], Any], lanes: Lanes, suspect: int, good: int,
                 device: torch.device) -> tuple[int | None, str]:
    """The lane of tp (cp) group `suspect` whose GPU computed wrong, judged against group `good`, and the
    evidence; (None, why) when no single lane's op says so. `replay()`: this rank's part of a collective
    replay of the suspect group's batch (each lane its own chunk), as the step computes."""
    verdict = witness_between(replay, lanes.dp_group, good, suspect, device)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, verdict)
    return judged([every[r] for r in lanes.members(good)])


def judged(verdicts: list[tuple[float, str]]) -> tuple[int | None, str]:
    """The lane named from each lane's (t, evidence) as the good group's GPU decided it (`witness_names`: t
    near 0, the good GPU's output is the CPU's, so the suspect group's GPU in that lane computed wrong; near
    1, the good one did, which contradicts the replays: no name): exactly one lane naming, and no lane
    pointing the other way. Pure."""
    named = [lane for lane, (t, _) in enumerate(verdicts) if witness_names(t) == 1]
    against = [lane for lane, (t, _) in enumerate(verdicts) if witness_names(t) == 0]
    if len(named) == 1 and not against:
        return named[0], f"lane {named[0]}: {verdicts[named[0]][1]}"
    if not named and not against:
        return None, "no lane's op names a GPU (" + "; ".join(
            f"lane {lane}: {why}" for lane, (_, why) in enumerate(verdicts))[:600] + ")"
    return None, f"lanes {named} name the suspect group's GPU and lanes {against} the other's: no GPU named"
