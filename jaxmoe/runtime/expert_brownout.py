"""Brownout on the expert sub-mesh (BrownoutServe, arXiv:2507.17133, Algorithm 1) for the
disaggregated executor's expert program (``runtime.expert_program``).

After gating, every expert instance computes the same split of the step's choices
(``jaxmoe.brownout.routing.split``: the inputs are replicated, the split is deterministic, so no
instance needs to talk to another): choices kept by their original experts go through AEBS to a
replica slot as before; choices browned out go to their group's united expert. United experts live
in their own slot array on the expert mesh, ``[N x Cu, ...]`` sharded like the replica slots
(Cu = ceil(U / N) per instance), united expert u in slot ``(u % N) * Cu + u // N`` (round robin
over instances; slots past U hold zeros and get no token). The threshold is a traced value: moving
it does not recompile.

Two choices of one token may name two experts of one group, hence one united expert: they are
merged into one choice with the summed combine weight (g1 + g2) x FFN_u(x), what the monolithic
executor's combine computes, and what keeps every united slot at most one row per token (the padded
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


def united_slots(num_united: int, num_instances: int) -> tuple[int, np.ndarray]:
    """(Cu, slot of each united expert [U]): round robin over instances, Cu slots per instance."""
    per_instance = -(-num_united // num_instances)
    u = np.arange(num_united)
    return per_instance, ((u % num_instances) * per_instance + u // num_instances).astype(np.int32)


def place_united(moe: dict, num_instances: int, layer: int) -> dict:
    """The host arrays of one layer's united experts laid out in slots: ``united`` {name: [N x Cu,
    ...]} (zeros in unused slots), ``united_slot`` [U] and ``united_groups`` [E] (expert -> united)."""
    if "united" not in moe or "united_groups" not in moe:
        raise BrownoutError(
            f"MoE layer {layer} has no united experts: brownout needs a model directory made by "
            "`jaxmoe unite --model DIR --ways K --out DIR2`"
        )
    host = {k: np.asarray(moe["united"][k]) for k in NAMES}
    U = host["w_gate"].shape[0]
    per_instance, slot = united_slots(U, num_instances)
    united = {}
    for k, w in host.items():
        out = np.zeros((num_instances * per_instance,) + w.shape[1:], w.dtype)
        out[slot] = w
        united[k] = out
    return {"united": united, "united_slot": slot, "united_groups": np.asarray(moe["united_groups"], np.int32)}


def merge_same(ids, weights):
    """Choices of one token naming the same id become one (the first), weights summed: (ids, weights)
    [T, K] with the later duplicates -1 / 0."""
    K = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)  # [T, j, l]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [l, j]: j < l
    dup = (same & earlier[None]).any(-1)  # choice l repeats an earlier one
    merged = jnp.einsum("tjl,tl->tj", same.astype(weights.dtype), weights)
    return jnp.where(dup, -1, ids), jnp.where(dup, 0, merged)


def split_choices(p: dict, ids, weights, valid, threshold, full: bool):
    """Algorithm 1 on the gate's output: (original ids [T, K] for AEBS, united ids and weights [T, K]
    with duplicates merged, distinct experts used [2] = (original, united)). ``ids`` the router's
    (not masked); ``valid`` [T] real tokens (padding neither counts nor activates anything)."""
    original, united = split(ids, valid, p["united_groups"], threshold, full)
    keep = valid[:, None]
    original = jnp.where(keep, original, -1)
    united, u_weights = merge_same(jnp.where(keep, united, -1), weights)
    E, U = p["united_groups"].shape[0], p["united_slot"].shape[0]

    def distinct(a, n):
        return jnp.zeros((n,), bool).at[jnp.where(a >= 0, a, n)].set(True, mode="drop").sum()

    used = jnp.stack([distinct(original, E), distinct(united, U)]).astype(jnp.int32)
    return original, united, u_weights, used


def local_united(p: dict, united, instance, num_instances: int):
    """United ids [T, K] -> this instance's united slot indices (-1: elsewhere or none), and the
    distinct united slots every instance runs [N] (the same on every instance)."""
    per_instance = p["united"]["w_gate"].shape[0]  # inside shard_map: this instance's Cu slots
    slot = jnp.where(united >= 0, p["united_slot"][jnp.maximum(united, 0)], -1)
    first = instance * per_instance
    local = jnp.where((slot >= first) & (slot < first + per_instance), slot - first, -1)
    total = num_instances * per_instance
    runs = jnp.zeros((total,), bool).at[jnp.where(slot >= 0, slot, total)].set(True, mode="drop")
    return local, runs.reshape(num_instances, per_instance).sum(1).astype(jnp.int32)
