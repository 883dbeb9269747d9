"""The MoE part of a layer: routed experts (expert side) and shared experts (attention side).

Routed expert weights are stacked per expert: ``w_gate``/``w_up`` [E, D, F], ``w_down`` [E, F, D].
``routed_experts`` is the monolithic computation.  ``ROUTED_EXPERTS_IMPL`` picks its form; "auto"
(the default) uses ``"dense"`` off CPU and, on CPU, picks per shape between the two sparse forms
(assignments A = tokens x top_k, E experts): ``"bucketed_loop"`` when A < E or A > 8 E (batch-1
decode; prefill), ``"grouped"`` otherwise (decode batches).  All forms compute the same sum.

* ``"bucketed_loop"``: a ``lax.fori_loop`` over experts.  An expert no token is routed to is
  skipped; a routed one gathers its tokens into the smallest power-of-two capacity bucket that
  holds them (``lax.switch`` over a few static sizes), runs its SwiGLU FFN as 2-D matmuls and
  scatter-adds the weighted rows.  Reads only the routed experts' weights (2 of 8 for Mixtral at
  batch 1) and computes about the routed rows (~top_k/E of the dense FLOPs at prefill).  Slicing
  an expert out of the stacked weights costs a copy on XLA:CPU, which is cheap next to the FLOPs
  at prefill and next to reading all experts at batch 1.
* ``"grouped"``: tokens are dispatched into an [E, C, D] buffer, C the smallest of a few static
  capacities (steps of 1.4x) that holds the busiest expert's tokens (``lax.switch``), and each
  projection is one batched matmul over the stacked weights -- every expert read once, in place,
  no per-expert copies or loop.
* ``"dense"``: every expert on every token with one einsum, mixed by the (mostly zero) combine
  weights; no data-dependent control flow, which GPU/TPU prefer.  On XLA:CPU it transpose-copies
  the stacked weights every step: whole greedy decodes of a 114M-parameter Mixtral-style model
  are 4.7x (batch 1) and 2.6x (batch 16) slower with it than with "auto"
  (``bench/decode_throughput.py``; BENCHMARKS.md, decode throughput).

The loop bodies / switch branches are compiled once per layer, so compile time stays close to the
dense form's.  The disaggregated runtime uses grouped matmuls over physical replicas instead
(``jaxmoe.pallas_kernels.grouped_matmul``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import NamedTuple

from jaxmoe.brownout.routing import split
from jaxmoe.config import ModelConfig
from jaxmoe.models.common import swiglu_mlp, unpack16
from jaxmoe.models.router import route


def dense_combine_weights(ids: jnp.ndarray, weights: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """[T, E] combine weights from top-k ids/weights (ids of -1 are ignored)."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=weights.dtype)  # -1 -> all zeros
    return jnp.einsum("tk,tke->te", weights, one_hot)


ROUTED_EXPERTS_IMPL = "auto"  # "auto" | "bucketed_loop" | "grouped" | "dense" (see the module docstring)
MAX_CAPACITY_BUCKETS = 7  # bucketed_loop: capacities T, T/2, ..., at most this many (compile time)
GROUPED_CAPACITY_GROWTH = 1.4  # grouped: finer capacities (T, T/1.4, ...): less padding, one branch each
GROUPED_MAX_BUCKETS = 10


def _routed_impl(num_assignments: int, num_experts: int) -> str:
    if ROUTED_EXPERTS_IMPL != "auto":
        return ROUTED_EXPERTS_IMPL
    return "dense" if jax.default_backend() != "cpu" else "bucketed_loop"


def _layer_weights(p: dict, layer, dtype) -> dict:
    """The routed expert weights [E, ...] of one layer. With ``layer`` (the monolithic scan) they are
    stacked [L, E, ...] (16-bit floats packed, ``common.pack16``) and sliced here, at their use: a
    slice taken before an inner loop or switch would be copied whole (every expert of the layer) on
    every step."""
    if layer is None:
        return {k: p[k] for k in ("w_gate", "w_up", "w_down")}
    return {k: unpack16(jax.lax.dynamic_index_in_dim(p[k], layer, keepdims=False), dtype)
            for k in ("w_gate", "w_up", "w_down")}


def routed_experts(p: dict, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray, layer=None) -> jnp.ndarray:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) for x [T, D]; ``layer``: see ``_layer_weights``."""
    num_experts = p["w_gate"].shape[0 if layer is None else 1]
    impl = _routed_impl(ids.size, num_experts)
    if impl == "grouped":
        return _grouped_experts(p, x, ids, weights, layer)
    combine = dense_combine_weights(ids, weights, num_experts)
    if impl == "bucketed_loop":
        return _bucketed_loop_experts(p, x, combine, layer)
    w = _layer_weights(p, layer, x.dtype)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, w["w_gate"])) * jnp.einsum("td,edf->tef", x, w["w_up"])
    y = jnp.einsum("tef,efd->ted", h, w["w_down"])
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)


def capacity_buckets(num_tokens: int, growth: float = 2.0, max_buckets: int = MAX_CAPACITY_BUCKETS) -> list[int]:
    """Ascending static capacities num_tokens, num_tokens / growth, ... (at most ``max_buckets``)."""
    caps = [num_tokens]
    while len(caps) < max_buckets and caps[-1] > 1:
        caps.append(max(1, min(caps[-1] - 1, round(caps[-1] / growth))))
    return caps[::-1]


def _bucketed_loop_experts(p: dict, x: jnp.ndarray, combine: jnp.ndarray, layer=None) -> jnp.ndarray:
    """The same sum, one expert at a time over only its routed tokens (see the module docstring)."""
    T = x.shape[0]
    caps = capacity_buckets(T)

    def expert_weights(e):
        if layer is None:
            return {k: jax.lax.dynamic_index_in_dim(p[k], e, keepdims=False) for k in ("w_gate", "w_up", "w_down")}
        return {k: unpack16(jax.lax.dynamic_slice(p[k], (layer, e, 0, 0), (1, 1) + p[k].shape[2:])[0, 0], x.dtype)
                for k in ("w_gate", "w_up", "w_down")}

    def body(e, acc):
        w = jax.lax.dynamic_index_in_dim(combine, e, axis=1, keepdims=False)  # [T]
        routed = w != 0

        def run(acc, cap):
            if cap == T:  # every row: no gather / scatter
                return acc + swiglu_mlp(expert_weights(e), x).astype(jnp.float32) * w[:, None]
            (rows,) = jnp.nonzero(routed, size=cap, fill_value=T)  # T (out of range) pads
            xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)
            ws = jnp.take(w, rows, mode="fill", fill_value=0)
            y = swiglu_mlp(expert_weights(e), xs).astype(jnp.float32) * ws[:, None]
            return acc.at[rows].add(y, mode="drop")

        branches = [lambda acc: acc] + [lambda acc, cap=cap: run(acc, cap) for cap in caps]
        n = routed.sum()
        branch = jnp.where(n == 0, 0, 1 + jnp.searchsorted(jnp.asarray(caps), n))
        return jax.lax.switch(branch, branches, acc)

    acc = jax.lax.fori_loop(0, combine.shape[1], body, jnp.zeros(x.shape, jnp.float32))
    return acc.astype(x.dtype)


def _grouped_experts(p: dict, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray, layer=None) -> jnp.ndarray:
    """The same sum via an [E, C, D] dispatch buffer and batched matmuls (see the module docstring)."""
    T, D = x.shape
    E, K = p["w_gate"].shape[0 if layer is None else 1], ids.shape[1]
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
            w = _layer_weights(p, layer, x.dtype)
            h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xg, w["w_gate"])) * jnp.einsum("ecd,edf->ecf", xg, w["w_up"])
            y = jnp.einsum("ecf,efd->ecd", h, w["w_down"]).reshape(E * cap, D)
            yk = jnp.take(y, slot, axis=0, mode="fill", fill_value=0).reshape(T, K, D)
            return jnp.einsum("tkd,tk->td", yk.astype(jnp.float32), weights.astype(jnp.float32)).astype(x.dtype)
        return apply

    busiest = one_hot.sum(axis=0).max()
    return jax.lax.switch(jnp.searchsorted(jnp.asarray(caps), busiest), [run(cap) for cap in caps], None)


class Brownout(NamedTuple):
    """Brownout inputs of one step (BrownoutServe, ``jaxmoe.brownout``): ``threshold`` a traced
    scalar (no recompile when it changes), ``valid`` [tokens] real tokens, ``full`` static."""

    threshold: jnp.ndarray
    valid: jnp.ndarray
    full: bool = False


def moe_layer(p: dict, cfg: ModelConfig, x: jnp.ndarray, layer=None, brownout: Brownout | None = None) -> jnp.ndarray:
    """Routed-experts output for normed activations x [..., D] (gate + top-k + experts + combine).
    ``layer``: the expert weights in ``p`` are stacked over layers (see ``_layer_weights``).
    ``brownout`` (with united experts ``p["united"]`` and their groups ``p["united_groups"]``): each
    choice goes to its original expert or its group's united expert (Algorithm 1, eq. 5)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights = route(p, cfg.moe, x)
    if brownout is None or "united" not in p:
        return routed_experts(p, x, ids, weights, layer).reshape(shape)
    original, united = split(ids, brownout.valid, p["united_groups"], brownout.threshold, brownout.full)
    y = routed_experts(p, x, original, weights, layer) + routed_experts(p["united"], x, united, weights, layer)
    return y.reshape(shape)


def shared_experts(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """Shared expert(s); Qwen2-MoE scales the output by sigmoid(x @ shared_gate)."""
    y = swiglu_mlp(p, x)
    if "shared_gate" in p:
        y = y * jax.nn.sigmoid((x @ p["shared_gate"]).astype(jnp.float32)).astype(y.dtype)
    return y
