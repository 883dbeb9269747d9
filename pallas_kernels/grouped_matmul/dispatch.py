"""Token dispatch/combine around the grouped expert FFN (static shapes).

``dispatch`` stable-sorts the ``T*k`` (token, slot) pairs by physical expert
replica id; slots whose id is negative (or >= ``num_groups``) are dropped: they
get the sentinel key ``num_groups`` so they sort last, belong to no group and
get zero weight in ``combine``.  ``x_sorted`` always has ``T*k`` rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DispatchInfo(NamedTuple):
    sort_idx: jax.Array  # [T*k] int32: sorted row r holds flat slot sort_idx[r]
    inv_idx: jax.Array  # [T*k] int32: flat slot s sits at sorted row inv_idx[s]
    valid: jax.Array  # [T, k] bool: slot routed to a real group


def dispatch(x, physical_ids, num_groups: int):
    """Returns ``(x_sorted [T*k, D], group_sizes [G] int32, DispatchInfo)``."""
    t, k = physical_ids.shape
    ids = physical_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_groups)
    key = jnp.where(valid, ids, num_groups)
    sort_idx = jnp.argsort(key, stable=True).astype(jnp.int32)
    inv_idx = jnp.zeros_like(sort_idx).at[sort_idx].set(jnp.arange(t * k, dtype=jnp.int32))
    x_sorted = jnp.take(x, sort_idx // k, axis=0)
    group_sizes = jnp.zeros((num_groups,), jnp.int32).at[key].add(1, mode="drop")
    return x_sorted, group_sizes, DispatchInfo(sort_idx, inv_idx, valid.reshape(t, k))


def combine(y_sorted, weights, info: DispatchInfo):
    """Un-permutes ``y_sorted [T*k, D]``, weights by ``weights [T, k]``, sums
    over k in fp32 and returns ``[T, D]`` in ``y_sorted.dtype``.

    Dropped slots are masked with ``where`` (not multiplied by 0), so garbage in
    their rows can never leak NaN/Inf into the result.
    """
    t, k = weights.shape
    y = jnp.take(y_sorted, info.inv_idx, axis=0).reshape(t, k, -1)
    y = jnp.where(info.valid[..., None], y.astype(jnp.float32), 0.0)
    w = jnp.where(info.valid, weights.astype(jnp.float32), 0.0)
    return jnp.sum(y * w[..., None], axis=1).astype(y_sorted.dtype)
