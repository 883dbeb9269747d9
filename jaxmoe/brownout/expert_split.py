"""Brownout on the expert sub-mesh (BrownoutServe, arXiv:2507.17133, Algorithm 1) for the
disaggregated executor's expert program (``runtime.expert_program``).

United experts are logical experts of the expert side like the originals: with E original and U
united experts per layer, united expert u is logical expert ``E + u``, and the replica layout
(``runtime.replicas``) places E + U logical experts over N instances x C' slots, C' = C + ceil(U / N)
(the mesh file's C slots per instance for the originals, plus room for the united experts). So a
united expert gets redundant replicas like a hot original expert (``default_placement``, or the
placement controller from measured load), and AEBS chooses among its replicas.

After gating, every expert instance computes the same split of the step's choices
(``jaxmoe.brownout.routing.split``: the inputs are replicated, the split is deterministic, so no
instance needs to talk to another): choices kept by their original experts stay, choices browned out
go to their group's united expert (id E + u). Both go through AEBS together ([T, 2K] choices) to a
replica slot. The threshold is a traced value: moving it does not recompile.

Two choices of one token may name two experts of one group, hence one united expert: they are
merged into one choice with the summed combine weight (g1 + g2) x FFN_u(x), what the monolithic
executor's combine computes, and what keeps every slot at most one row per token (the padded
einsum's capacity).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmoe.brownout.config import BrownoutError
from jaxmoe.brownout.routing import split

NAMES = ("w_gate", "w_up", "w_down")
MODES = ("partial", "full")


def check_mode(mode) -> None:
    if mode is not None and mode not in MODES:
        raise BrownoutError(f"expert-side brownout must be None or one of {MODES}, got {mode!r}")


def num_united(params: dict) -> int:
    """U, the united experts per MoE layer of ``params`` (``jaxmoe.brownout.united.attach``, or the
    expert side's placed parameters: both hold the expert -> united map ``united_groups``, whose
    largest entry is U - 1); a ``BrownoutError`` naming the first MoE layer without them."""
    counts = set()
    for i, layer in enumerate(params["layers"]):
        if "moe" not in layer:
            continue
        if "united_groups" not in layer["moe"]:
            raise BrownoutError(
                f"MoE layer {i} has no united experts: brownout needs a model directory made by "
                "`jaxmoe unite --model DIR --ways K --out DIR2`"
            )
        counts.add(int(np.max(np.asarray(layer["moe"]["united_groups"]))) + 1)
    if len(counts) != 1:
        raise BrownoutError(f"every MoE layer needs the same number of united experts, got {sorted(counts)}")
    return counts.pop()


def slots_per_instance(slots: int, num_united: int, num_instances: int) -> int:
    """C': the mesh file's ``slots`` per instance plus ceil(U / N) for the united experts."""
    return slots + -(-num_united // num_instances)


def logical_weights(moe: dict) -> dict:
    """One layer's expert weights as E + U logical experts {name: [E + U, ...]} (host arrays):
    the originals, then the united experts."""
    return {k: np.concatenate([np.asarray(moe[k]), np.asarray(moe["united"][k])]) for k in NAMES}


def merge_same(ids, weights):
    """Choices of one token naming the same id become one (the first), weights summed: (ids, weights)
    [T, K] with the later duplicates -1 / 0."""
    K = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)  # [T, j, l]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [l, j]: j < l
    dup = (same & earlier[None]).any(-1)  # choice l repeats an earlier one
    merged = jnp.einsum("tjl,tl->tj", same.astype(weights.dtype), weights)
    return jnp.where(dup, -1, ids), jnp.where(dup, 0, merged)


def split_choices(p: dict, ids, weights, valid, threshold, full: bool, num_united: int):
    """Algorithm 1 on the gate's output: (logical ids [T, 2K] for AEBS: the kept originals, then the
    united experts as E + u with duplicates merged; their combine weights [T, 2K]; distinct experts
    used [2] = (original, united)). ``ids`` the router's (not masked); ``valid`` [T] real tokens
    (padding neither counts nor activates anything)."""
    original, united = split(ids, valid, p["united_groups"], threshold, full)
    keep = valid[:, None]
    original = jnp.where(keep, original, -1)
    united, u_weights = merge_same(jnp.where(keep, united, -1), weights)
    E = p["united_groups"].shape[0]

    def distinct(a, n):
        return jnp.zeros((n,), bool).at[jnp.where(a >= 0, a, n)].set(True, mode="drop").sum()

    used = jnp.stack([distinct(original, E), distinct(united, num_united)]).astype(jnp.int32)
    ids_all = jnp.concatenate([original, jnp.where(united >= 0, united + E, -1)], axis=1)
    weights_all = jnp.concatenate([jnp.where(original >= 0, weights, 0), u_weights.astype(weights.dtype)], axis=1)
    return ids_all, weights_all, used
