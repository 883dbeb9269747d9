"""XLA implementations of the expert FFN (``api.py`` names them): ``dense``, ``bucketed_loop``,
``grouped``, and the sorted-by-expert forms that run a grouped matmul (``ragged_dot``,
``padded_einsum``, ``pallas``) from ``jaxmoe.pallas_kernels.grouped_matmul``.

The loop bodies / switch branches are compiled once, so compile time stays close to the dense form's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..grouped_matmul import combine, dispatch, grouped_swiglu

MAX_CAPACITY_BUCKETS = 7  # bucketed_loop: capacities T, T/2, ..., at most this many (compile time)
GROUPED_CAPACITY_GROWTH = 1.4  # grouped: finer capacities (T, T/1.4, ...): less padding, one branch each
GROUPED_MAX_BUCKETS = 10


def combine_weights(ids, weights, num_experts: int):
    """[T, E] combine weights from top-k ids / weights (ids of -1 are ignored)."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=weights.dtype)  # -1 -> all zeros
    return jnp.einsum("tk,tke->te", weights, one_hot)


def capacity_buckets(num_tokens: int, growth: float = 2.0, max_buckets: int = MAX_CAPACITY_BUCKETS) -> list[int]:
    """Ascending static capacities num_tokens, num_tokens / growth, ... (at most ``max_buckets``)."""
    caps = [num_tokens]
    while len(caps) < max_buckets and caps[-1] > 1:
        caps.append(max(1, min(caps[-1] - 1, round(caps[-1] / growth))))
    return caps[::-1]


def _swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def dense(x, ids, weights, experts):
    """Every expert on every token (one einsum per projection), mixed by the combine weights. On
    XLA:CPU this transpose-copies the stacked weights every step (BENCHMARKS.md, decode throughput)."""
    w_gate, w_up, w_down = experts.stacked(x.dtype)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
    y = jnp.einsum("tef,efd->ted", h, w_down)
    mix = combine_weights(ids, weights, experts.num_experts)
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), mix).astype(x.dtype)


def bucketed_loop(x, ids, weights, experts):
    """A ``fori_loop`` over experts. An expert no token is routed to is skipped; a routed one gathers
    its tokens into the smallest power-of-two capacity bucket that holds them (``lax.switch`` over a
    few static sizes), runs its FFN as 2-D matmuls and scatter-adds the weighted rows: reads only the
    routed experts' weights and computes about the routed rows."""
    T = x.shape[0]
    caps = capacity_buckets(T)
    mix = combine_weights(ids, weights, experts.num_experts)

    def body(e, acc):
        w = jax.lax.dynamic_index_in_dim(mix, e, axis=1, keepdims=False)  # [T]
        routed = w != 0

        def run(acc, cap):
            if cap == T:  # every row: no gather / scatter
                return acc + _swiglu(x, *experts.expert(e, x.dtype)).astype(jnp.float32) * w[:, None]
            (rows,) = jnp.nonzero(routed, size=cap, fill_value=T)  # T (out of range) pads
            xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)
            ws = jnp.take(w, rows, mode="fill", fill_value=0)
            y = _swiglu(xs, *experts.expert(e, x.dtype)).astype(jnp.float32) * ws[:, None]
            return acc.at[rows].add(y, mode="drop")

        branches = [lambda acc: acc] + [lambda acc, cap=cap: run(acc, cap) for cap in caps]
        n = routed.sum()
        branch = jnp.where(n == 0, 0, 1 + jnp.searchsorted(jnp.asarray(caps), n))
        return jax.lax.switch(branch, branches, acc)

    acc = jax.lax.fori_loop(0, experts.num_experts, body, jnp.zeros(x.shape, jnp.float32))
    return acc.astype(x.dtype)


def grouped(x, ids, weights, experts):
    """Tokens dispatched into an [E, C, D] buffer, C the smallest of a few static capacities (steps
    of 1.4x) that holds the busiest expert's tokens (``lax.switch``); each projection is one batched
    matmul over the stacked weights: every expert read once, in place."""
    T, D = x.shape
    E, K = experts.num_experts, ids.shape[1]
    expert = ids.reshape(-1)  # [A]: assignment a = (token a // K, choice a % K)
    valid = (expert >= 0) & (expert < E)  # id -1: no expert
    one_hot = jax.nn.one_hot(expert, E, dtype=jnp.int32)  # -1 -> all zeros
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), jnp.clip(expert, 0, E - 1)[:, None], axis=1)[:, 0] - 1
    token = jnp.repeat(jnp.arange(T, dtype=jnp.int32), K)
    caps = capacity_buckets(T, GROUPED_CAPACITY_GROWTH, GROUPED_MAX_BUCKETS)

    def run(cap):
        def apply(_):
            slot = jnp.where(valid, expert * cap + rank, E * cap)  # E * cap (out of range): dropped
            source = jnp.full((E * cap,), T, jnp.int32).at[slot].set(token, mode="drop")
            xg = jnp.take(x, source, axis=0, mode="fill", fill_value=0).reshape(E, cap, D)
            w_gate, w_up, w_down = experts.stacked(x.dtype)
            h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xg, w_gate)) * jnp.einsum("ecd,edf->ecf", xg, w_up)
            y = jnp.einsum("ecf,efd->ecd", h, w_down).reshape(E * cap, D)
            yk = jnp.take(y, slot, axis=0, mode="fill", fill_value=0).reshape(T, K, D)
            return jnp.einsum("tkd,tk->td", yk.astype(jnp.float32), weights.astype(jnp.float32)).astype(x.dtype)

        return apply

    busiest = one_hot.sum(axis=0).max()
    return jax.lax.switch(jnp.searchsorted(jnp.asarray(caps), busiest), [run(cap) for cap in caps], None)


def sorted_by_expert(x, ids, weights, experts, grouped_impl: str, interpret=None):
    """Rows sorted by expert (``dispatch``), one grouped SwiGLU (``grouped_impl``: ragged_dot | einsum
    | pallas), un-sorted and mixed (``combine``). The padded einsum's capacity is T: exact."""
    x_sorted, group_sizes, info = dispatch(x, ids, experts.num_experts)
    options = {"capacity": x.shape[0]} if grouped_impl == "einsum" else None
    stacks = layer_stack(experts, group_sizes, x.dtype) if grouped_impl == "pallas" else None
    if stacks is None:
        stacks = experts.stacked(x.dtype), group_sizes
    (gate, up, down), group_sizes = stacks
    y_sorted = grouped_swiglu(
        x_sorted, group_sizes, gate, up, down, impl=grouped_impl, interpret=interpret, kernel_options=options
    )
    return combine(y_sorted, weights, info)


def layer_stack(experts, group_sizes, dtype):
    """For the Pallas kernels, which read a group's weights by its index: every layer's experts as
    one [L * E, ...] stack (a reshape, no copy) and ``group_sizes`` placed at this layer's groups (the
    other layers' groups empty), so the kernel reads this layer's experts in place. Sliced per layer
    instead, the slice feeds a custom call, which XLA cannot fuse it into: it copies the layer's whole
    expert stack first (on an H200, 13.6 of a decode step's 20.2 ms of device time). None where the
    weights are not plain arrays of ``dtype`` (column panels, int8 / fp8): those are sliced as before."""
    (gate, up, down), index = experts.layered()
    arrays = (gate, up, down)
    if not all(isinstance(w, jax.Array) and w.ndim == 4 for w in arrays):  # tracers are jax.Arrays too
        return None
    arrays = tuple(jax.lax.bitcast_convert_type(w, dtype) if w.dtype == jnp.uint16 else w for w in arrays)
    if any(w.dtype != dtype for w in arrays):
        return None
    L, E = gate.shape[:2]
    flat = tuple(w.reshape((L * E,) + w.shape[2:]) for w in arrays)
    sizes = jax.lax.dynamic_update_slice(jnp.zeros((L * E,), group_sizes.dtype), group_sizes, (index * E,))
    return flat, sizes
