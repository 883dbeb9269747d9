"""Activation-aware expert replication and placement (JANUS 3.4, Algorithm 2), pure numpy.

Input: activation statistics of one MoE layer over a window: ``counts[e]`` (tokens routed to
logical expert e) and ``coact[e, f]`` (tokens routed to both e and f). Output: a placement
``slot_to_expert`` [N x C] for ``DisaggregatedExecutor.set_placement``.

1. ``replica_counts`` (expert replication): every expert gets one replica; each of the S - E
   spare slots goes, one at a time, to the expert with the largest per-replica load
   l_e = c_e / r_e. An expert has at most one replica per instance (r_e <= N).
2. ``place_replicas`` (Algorithm 2): replicas in decreasing order of load; each goes to the
   instance with a free slot, not hosting its expert yet, that adds the least co-activation
   a(i, j) with what it already hosts (lines 5-10); when no such instance exists it swaps a
   replica j of a full instance g (without e_i) to an instance h with a free slot, choosing the
   (g, j, h) with the smallest increase of co-activation load (lines 11-18).
3. ``to_slots`` turns per-instance expert sets into ``slot_to_expert``, keeping an expert in the
   slot it already had on that instance so that a re-layout copies as little as possible.

The objective (eq. 1-2): the co-activation load of instance g, I(g) = sum over pairs i < j of
experts on g of a(i, j); ``coactivation_load`` computes it, Algorithm 2 keeps max_g I(g) small.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def coactivation(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """a [E, E]: tokens that selected both e and f (diagonal: tokens that selected e) from
    routing ids [T, k] (-1 = no expert, e.g. padding)."""
    ids = np.asarray(ids).reshape(-1, np.asarray(ids).shape[-1])
    hit = np.zeros((ids.shape[0], num_experts + 1), np.int64)
    np.put_along_axis(hit, np.where(ids >= 0, ids, num_experts), 1, axis=1)
    hit = hit[:, :num_experts]
    return hit.T @ hit


def replica_counts(counts: Sequence[float], num_instances: int, slots_per_instance: int) -> list[int]:
    """r_e: 1 each, then every spare slot to the expert with the largest c_e / r_e (ties: fewer
    replicas, then lower id), never more than one replica per instance."""
    c = np.asarray(counts, np.float64)
    E, N, S = len(c), num_instances, num_instances * slots_per_instance
    if S < E:
        raise ValueError(f"{N} instances x {slots_per_instance} slots = {S} < {E} experts")
    r = [1] * E
    for _ in range(min(S - E, E * (N - 1))):
        e = min((e for e in range(E) if r[e] < N), key=lambda e: (-c[e] / r[e], r[e], e))
        r[e] += 1
    return r


def place_replicas(
    replicas: Sequence[int], counts: Sequence[float], coact: np.ndarray, num_instances: int, slots_per_instance: int
) -> list[list[int]]:
    """Algorithm 2: P(g), the logical experts hosted by each instance g."""
    r, c, a = list(replicas), np.asarray(counts, np.float64), np.asarray(coact, np.float64)
    N, C = num_instances, slots_per_instance
    if sum(r) > N * C or max(r) > N:
        raise ValueError(f"replicas {r} do not fit {N} instances x {C} slots (at most one per instance)")
    # line 3: replicas in decreasing order of load l_i = c_e / r_e (ties: lower expert id)
    order = sorted(((e, k) for e in range(len(r)) for k in range(r[e])), key=lambda ek: (-c[ek[0]] / r[ek[0]], ek))
    P: list[list[int]] = [[] for _ in range(N)]  # line 1
    load = np.zeros(N)  # sum of replica loads per instance: tie-break between equal penalties

    def penalty(e: int, hosted: list[int], skip: int = -1) -> float:
        return float(sum(a[e, f] for f in hosted if f != skip))

    for e, _ in order:  # line 4
        feasible = [g for g in range(N) if len(P[g]) < C and e not in P[g]]  # line 5
        if feasible:  # lines 6-10
            g = min(feasible, key=lambda g: (penalty(e, P[g]), load[g], g))
            P[g].append(e)
            load[g] += c[e] / r[e]
            continue
        # lines 11-18: every instance without e is full; free slots are only where e already is
        best = None
        for g in (g for g in range(N) if e not in P[g]):  # G-
            for j in P[g]:
                for h in (h for h in range(N) if len(P[h]) < C and j not in P[h]):  # H_i, x_{e_j,h} = 0
                    delta = penalty(e, P[g], skip=j) - penalty(j, P[g], skip=j) + penalty(j, P[h])
                    if best is None or (delta, g, j, h) < best:
                        best = (delta, g, j, h)
        if best is None:
            raise RuntimeError(f"Algorithm 2: no swap places a replica of expert {e} ({P})")
        _, g, j, h = best
        P[g][P[g].index(j)] = e
        P[h].append(j)
        load[g] += c[e] / r[e] - c[j] / r[j]
        load[h] += c[j] / r[j]
    return P


def to_slots(
    hosted: Sequence[Sequence[int]], slots_per_instance: int, previous: Sequence[int] | None = None
) -> list[int]:
    """slot_to_expert [N x C] from per-instance expert sets; an expert the instance already hosted
    (in ``previous``) keeps its slot; unused slots are -1."""
    C = slots_per_instance
    out = [-1] * (len(hosted) * C)
    for g, experts in enumerate(hosted):
        base = g * C
        old = list(previous[base : base + C]) if previous is not None else [-1] * C
        new = [e for e in experts if e not in old]
        for s in range(C):
            if old[s] in experts:
                out[base + s] = old[s]
            elif new:
                out[base + s] = new.pop(0)
    return out


def plan_placement(
    counts: Sequence[float],
    coact: np.ndarray,
    num_instances: int,
    slots_per_instance: int,
    previous: Sequence[int] | None = None,
) -> list[int]:
    """Replication, then Algorithm 2, then slots: the new ``slot_to_expert`` of one layer."""
    r = replica_counts(counts, num_instances, slots_per_instance)
    hosted = place_replicas(r, counts, coact, num_instances, slots_per_instance)
    return to_slots(hosted, slots_per_instance, previous)


def coactivation_load(slot_to_expert: Sequence[int], coact: np.ndarray, slots_per_instance: int) -> list[float]:
    """I(g) (eq. 1) for every instance of a placement."""
    a, C = np.asarray(coact, np.float64), slots_per_instance
    out = []
    for g in range(len(slot_to_expert) // C):
        hosted = sorted({e for e in slot_to_expert[g * C : (g + 1) * C] if e >= 0})
        out.append(float(sum(a[i, j] for x, i in enumerate(hosted) for j in hosted[x + 1 :])))
    return out
