"""The MoE part of a layer: routed experts (expert side) and shared experts (attention side).

Routed expert weights are stacked per expert: ``w_gate``/``w_up`` [E, D, F], ``w_down`` [E, F, D].
``routed_experts`` is the monolithic computation: every expert is applied to every token and the
outputs are mixed by the (mostly zero) combine weights.  At decode batch sizes this reads each
expert's weights once, which is what bounds an MoE layer; the disaggregated runtime uses grouped
matmuls over physical replicas instead (``pallas_kernels.grouped_matmul``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.models.common import swiglu_mlp
from jaxmoe.models.router import route


def dense_combine_weights(ids: jnp.ndarray, weights: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """[T, E] combine weights from top-k ids/weights (ids of -1 are ignored)."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=weights.dtype)  # -1 -> all zeros
    return jnp.einsum("tk,tke->te", weights, one_hot)


def routed_experts(p: dict, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) for x [T, D]."""
    combine = dense_combine_weights(ids, weights, p["w_gate"].shape[0])
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, p["w_gate"])) * jnp.einsum("td,edf->tef", x, p["w_up"])
    y = jnp.einsum("tef,efd->ted", h, p["w_down"])
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)


def moe_layer(p: dict, cfg: ModelConfig, x: jnp.ndarray) -> jnp.ndarray:
    """Routed-experts output for normed activations x [..., D] (gate + top-k + experts + combine)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights = route(p, cfg.moe, x)
    return routed_experts(p, x, ids, weights).reshape(shape)


def shared_experts(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """Shared expert(s); Qwen2-MoE scales the output by sigmoid(x @ shared_gate)."""
    y = swiglu_mlp(p, x)
    if "shared_gate" in p:
        y = y * jax.nn.sigmoid((x @ p["shared_gate"]).astype(jnp.float32)).astype(y.dtype)
    return y
