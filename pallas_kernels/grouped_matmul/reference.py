"""Pure-JAX references for the grouped (per-expert) SwiGLU FFN.

All functions take rows already sorted by group (see ``dispatch.py``):
``x_sorted [M, D]``, ``group_sizes [G]`` (rows ``offsets[g]:offsets[g+1]``
belong to group ``g``; rows past ``sum(group_sizes)`` belong to no group and
come back as zeros), ``w_gate/w_up [G, D, F]``, ``w_down [G, F, D]``.
Matmuls accumulate in fp32; the intermediate ``h = silu(x@wg) * (x@wu)`` is
cast to ``x.dtype`` (as the kernels do) and the result is in ``x.dtype``.

* ``swiglu_loop``: a Python loop over groups with row masks (slow, obvious).
* ``swiglu_ragged_dot``: ``jax.lax.ragged_dot`` for the three projections.
* ``swiglu_padded_einsum``: scatter rows into ``[G, C, D]`` capacity buckets
  and run dense einsums over all groups (reads every expert's weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _silu_mul(g, u):
    return g * jax.nn.sigmoid(g) * u


def _row_group(group_sizes, m):
    """Group id of every row (``G`` for rows past ``sum(group_sizes)``)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")


def swiglu_loop(x_sorted, group_sizes, w_gate, w_up, w_down):
    m = x_sorted.shape[0]
    row_group = _row_group(group_sizes, m)
    out = jnp.zeros((m, w_down.shape[-1]), _F32)
    for g in range(w_gate.shape[0]):
        mask = (row_group == g)[:, None]
        xg = jnp.where(mask, x_sorted, 0)
        a = jnp.dot(xg, w_gate[g], preferred_element_type=_F32)
        b = jnp.dot(xg, w_up[g], preferred_element_type=_F32)
        h = _silu_mul(a, b).astype(x_sorted.dtype)
        y = jnp.dot(h, w_down[g], preferred_element_type=_F32)
        out = out + jnp.where(mask, y, 0)
    return out.astype(x_sorted.dtype)


def swiglu_ragged_dot(x_sorted, group_sizes, w_gate, w_up, w_down):
    gs = group_sizes.astype(jnp.int32)
    a = jax.lax.ragged_dot(x_sorted, w_gate, gs, preferred_element_type=_F32)
    b = jax.lax.ragged_dot(x_sorted, w_up, gs, preferred_element_type=_F32)
    h = _silu_mul(a, b).astype(x_sorted.dtype)
    y = jax.lax.ragged_dot(h, w_down, gs, preferred_element_type=_F32)
    return y.astype(x_sorted.dtype)


def swiglu_padded_einsum(x_sorted, group_sizes, w_gate, w_up, w_down, capacity: int | None = None):
    """Dense per-group einsum over ``[G, capacity, D]`` buckets.

    ``capacity`` (static) defaults to ``M`` which is always exact; a smaller
    capacity drops (zeroes) the rows of a group past ``capacity``.
    """
    m, d = x_sorted.shape
    num_groups = w_gate.shape[0]
    cap = m if capacity is None else int(capacity)
    gs = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs
    row_group = _row_group(gs, m)
    safe_group = jnp.minimum(row_group, num_groups - 1)
    slot = jnp.arange(m, dtype=jnp.int32) - starts[safe_group]
    keep = (row_group < num_groups) & (slot < cap)
    # Dropped rows are sent out of bounds and discarded by mode="drop".
    g_idx = jnp.where(keep, safe_group, num_groups)
    buckets = jnp.zeros((num_groups, cap, d), x_sorted.dtype)
    buckets = buckets.at[g_idx, slot].set(x_sorted, mode="drop")
    a = jnp.einsum("gcd,gdf->gcf", buckets, w_gate, preferred_element_type=_F32)
    b = jnp.einsum("gcd,gdf->gcf", buckets, w_up, preferred_element_type=_F32)
    h = _silu_mul(a, b).astype(x_sorted.dtype)
    y = jnp.einsum("gcf,gfd->gcd", h, w_down, preferred_element_type=_F32)
    y = y.astype(x_sorted.dtype)
    out = y.at[g_idx, slot].get(mode="fill", fill_value=0)
    return jnp.where(keep[:, None], out, 0)
