"""FinDEP's expert-side chunks (r2, arXiv:2512.21487): one micro-batch's tokens cut into r2 runs per
attention instance, each sent to the experts, run and sent back on its own.

A micro-batch xn [B, T, D] is sharded P("attn") on its rows: attention instance i holds rows
i*R .. (i+1)*R (R = B / instances). ``split`` views each instance's rows as one run of R*T tokens and
cuts it into r2 equal pieces, giving r2 arrays [instances, R*T/r2, D], still P("attn") (every
instance keeps its own tokens: no data moves). Each is a valid input of the transfers' row contract
(one "row" per instance), so A2E, the expert program (which treats [B', T', D] as B'*T' independent
tokens) and E2A run on it unchanged. ``join`` puts the r2 E2A outputs back into [B, T, D] P("attn").
``split_valid`` cuts the host's [B, T] token mask the same way.

The routed output of a token does not depend on which chunk it is in: the gate is per token, and
AEBS only chooses which replica (identical weights) runs it; the co-activation counters add up to
the same totals. ``activated_per_instance`` then reports the last chunk's replicas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.mesh import ATTN_AXES, SubMeshes


@functools.lru_cache(maxsize=64)
def _programs(sub: SubMeshes, instances: int, r2: int):
    rows = NamedSharding(sub.attention, P(ATTN_AXES[0]))

    def split(x):
        B, T, D = x.shape
        flat = x.reshape(instances, (B // instances) * T, D)
        return tuple(jnp.split(flat, r2, axis=1))

    def join(parts, shape):
        return jnp.concatenate(parts, axis=1).reshape(shape)

    return (
        jax.jit(split, out_shardings=(rows,) * r2),
        jax.jit(join, out_shardings=rows, static_argnums=(1,)),
    )


def split(x: jax.Array, sub: SubMeshes, r2: int) -> tuple[jax.Array, ...]:
    """[B, T, D] P("attn") -> r2 x [instances, B/instances*T/r2, D] P("attn")."""
    return _programs(sub, sub.spec.attention.count, r2)[0](x)


def join(parts, shape: tuple[int, ...], sub: SubMeshes) -> jax.Array:
    """The inverse of ``split``: r2 x [instances, L, D] -> ``shape`` [B, T, D] P("attn")."""
    return _programs(sub, sub.spec.attention.count, len(parts))[1](tuple(parts), tuple(shape))


def split_valid(valid: np.ndarray, instances: int, r2: int) -> list[np.ndarray]:
    """The host token mask [B, T] cut like ``split``: r2 x [instances, B/instances*T/r2]."""
    return np.split(valid.reshape(instances, -1), r2, axis=1)
