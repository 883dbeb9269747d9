"""Gating on the expert side: router scores, top-k selection and combine weights for every family.

* softmax + greedy top-k (Mixtral, Qwen2/3-MoE, DeepSeek-V2 ``greedy``), optional renormalisation;
* DeepSeek-V2 ``group_limited_greedy``: groups ranked by their best expert score;
* DeepSeek-V3 ``noaux_tc``: sigmoid scores, ``e_score_correction_bias`` used for selection only,
  groups ranked by the sum of their top-2 biased scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.pallas_kernels.expert_ffn.cpu_kernel import invariant_sum


def _group_mask(choice: jnp.ndarray, moe: MoEConfig, group_score) -> jnp.ndarray:
    """[T, E] mask keeping the experts of the ``topk_group`` best groups."""
    T, E = choice.shape
    grouped = choice.reshape(T, moe.n_group, E // moe.n_group)
    scores = group_score(grouped)  # [T, n_group]
    _, best = jax.lax.top_k(scores, moe.topk_group)
    keep = jnp.zeros((T, moe.n_group), bool).at[jnp.arange(T)[:, None], best].set(True)
    return jnp.repeat(keep, E // moe.n_group, axis=1)


def route(p: dict, moe: MoEConfig, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Top-k logical expert ids [T, k] (int32) and combine weights [T, k] (fp32) for tokens x [T, D]."""
    # deterministic mode (an invariant ``LayerMatrix`` router): sums in an order fixed per token
    invariant = getattr(p["router"], "invariant", False)
    router = p["router"]  # fp32 logits also for 16-bit weights (a LayerMatrix sums in fp32 itself)
    logits = (x @ router if invariant else jnp.matmul(x, router, preferred_element_type=jnp.float32)).astype(
        jnp.float32
    )
    if moe.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    elif invariant:
        e = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = e / invariant_sum(e)[..., None]
    else:
        scores = jax.nn.softmax(logits, axis=-1)

    choice = scores + p["score_bias"].astype(jnp.float32) if moe.score_bias else scores
    if moe.topk_method == "group_limited_greedy":  # DeepSeek-V2: group score = best expert
        mask = _group_mask(choice, moe, lambda g: g.max(axis=-1))
        choice = jnp.where(mask, choice, 0.0)
    elif moe.topk_method == "noaux_tc":  # DeepSeek-V3: group score = sum of its top-2
        mask = _group_mask(choice, moe, lambda g: jax.lax.top_k(g, 2)[0].sum(axis=-1))
        choice = jnp.where(mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, moe.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # unbiased scores

    if moe.norm_topk_prob:
        total = invariant_sum(weights)[..., None] if invariant else weights.sum(axis=-1, keepdims=True)
        weights = weights / (total + 1e-20)
    weights = weights * moe.routed_scaling_factor
    return ids.astype(jnp.int32), weights
