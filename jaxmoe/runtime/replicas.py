"""Physical expert replicas: which logical expert each expert slot holds (JANUS 3.3/3.4).

The expert side holds S = N x C *slots* (N expert instances, C = slots_per_instance); slot s lives
on instance s // C (slot arrays are [S, ...] sharded P("expert"), so instance j holds the
contiguous slots j*C .. j*C+C-1). A placement is a list ``slot_to_expert`` [S] of logical expert
ids, -1 for an unused slot (its weights are zeros and AEBS never selects it). Every logical expert
needs at least one slot; the spare slots hold redundant replicas of (hot) experts.

From a placement come the two tables AEBS reads (``jaxmoe.pallas_kernels.aebs.api.schedule``):
  replica_table    [E, R_max] int32: row e = the slots hosting expert e, ascending, -1 padded.
                   R_max = S - E + 1 (the most replicas any valid placement can give one
                   expert), fixed per layout so a new placement never changes a shape.
  replica_instance [S] int32: the instance of each slot (s // C).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """A validated placement of E logical experts over N instances x C slots."""

    slot_to_expert: tuple[int, ...]  # [S]
    num_experts: int  # E
    num_instances: int  # N
    slots_per_instance: int  # C

    def __post_init__(self):
        S, E = self.num_slots, self.num_experts
        if len(self.slot_to_expert) != S:
            raise ValueError(
                f"placement has {len(self.slot_to_expert)} entries, expected {S} slots "
                f"({self.num_instances} instances x {self.slots_per_instance})"
            )
        bad = [e for e in self.slot_to_expert if not -1 <= e < E]
        if bad:
            raise ValueError(f"placement: expert ids must be in [-1, {E}), got {sorted(set(bad))}")
        missing = sorted(set(range(E)) - set(self.slot_to_expert))
        if missing:
            raise ValueError(f"placement: experts {missing} have no slot")

    @property
    def num_slots(self) -> int:
        return self.num_instances * self.slots_per_instance

    @property
    def max_replicas(self) -> int:
        """R_max: the replica table's width (S - E + 1, independent of the placement)."""
        return self.num_slots - self.num_experts + 1

    def replicas(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.slot_to_expert) if e == expert]

    def replica_table(self) -> np.ndarray:
        table = np.full((self.num_experts, self.max_replicas), -1, np.int32)
        for e in range(self.num_experts):
            slots = self.replicas(e)
            table[e, : len(slots)] = slots
        return table

    def replica_instance(self) -> np.ndarray:
        return (np.arange(self.num_slots) // self.slots_per_instance).astype(np.int32)

    def gather_index(self) -> np.ndarray:
        """[S] logical expert to copy into each slot (0 for unused slots, masked by `used`)."""
        return np.maximum(np.asarray(self.slot_to_expert, np.int32), 0)

    def used(self) -> np.ndarray:
        return np.asarray(self.slot_to_expert) >= 0

    def describe(self) -> str:
        C = self.slots_per_instance
        return "; ".join(
            f"expert[{j}]: {list(self.slot_to_expert[j * C : (j + 1) * C])}" for j in range(self.num_instances)
        )


def default_placement(
    num_experts: int,
    num_instances: int,
    slots_per_instance: int,
    counts: Sequence[float] | None = None,
    redundant: bool = True,
) -> list[int]:
    """Round-robin placement: expert e on instance e % N; spare slots get redundant replicas.

    Slots are filled in round-robin order (local slot 0 of every instance, then local slot 1, ...):
    first experts 0..E-1, then each spare slot takes the expert that is not yet on that instance
    and has the largest ``counts[e] / replicas[e]`` (the highest per-replica load; without counts,
    the fewest replicas, i.e. cycling from expert 0), ties to the lowest id. ``redundant=False``
    leaves the spare slots unused (-1).
    """
    E, N, C = num_experts, num_instances, slots_per_instance
    if N * C < E:
        raise ValueError(f"{N} instances x {C} slots = {N * C} < {E} experts")
    order = [j * C + c for c in range(C) for j in range(N)]
    placement = [-1] * (N * C)
    hosted = [set() for _ in range(N)]
    reps = [0] * E
    for e, s in enumerate(order[:E]):
        placement[s] = e
        hosted[s // C].add(e)
        reps[e] += 1
    if not redundant:
        return placement
    load = [float(c) for c in counts] if counts is not None else [1.0] * E
    for s in order[E:]:
        j = s // C
        free = [e for e in range(E) if e not in hosted[j]]
        if not free:
            continue
        e = min(free, key=lambda e: (-load[e] / reps[e], reps[e], e))
        placement[s] = e
        hosted[j].add(e)
        reps[e] += 1
    return placement
