"""The plain jnp reference of the expert FFN: a Python loop over experts, each on every token,
weighted by that token's combine weight for it (zero when it did not choose it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_ffn_reference(x, ids, weights, experts):
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) for x [T, D]; ids of -1 (or out of range) add nothing."""
    w_gate, w_up, w_down = experts.stacked(x.dtype)
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(experts.num_experts):
        combine = jnp.sum(jnp.where(ids == e, weights.astype(jnp.float32), 0.0), axis=1)  # [T]
        g = jnp.dot(x, w_gate[e], preferred_element_type=jnp.float32)
        u = jnp.dot(x, w_up[e], preferred_element_type=jnp.float32)
        h = (jax.nn.silu(g) * u).astype(x.dtype)
        out = out + combine[:, None] * jnp.dot(h, w_down[e], preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
