"""Embeddings, one whole layer and the LM head.

A layer's parameters are split the way the runtime splits the work:
``{"attn": ..., "mlp": ...}`` for a dense layer and ``{"attn": ..., "moe": ..., "shared": ...}``
for an MoE layer ("shared" only when the family has shared experts).  ``attn``, ``mlp`` and
``shared`` run on the attention side, ``moe`` (router + routed experts) on the expert side.
The monolithic executor (``jaxmoe.runtime.monolithic``) runs ``layer_step`` as one program per layer.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.models.attention import AttentionBatch, attention_layer
from jaxmoe.models.common import rms_norm, swiglu_mlp
from jaxmoe.models.experts import Brownout, moe_layer, shared_experts


def embed(params: dict, tokens: jnp.ndarray) -> jnp.ndarray:
    return params["embed"][tokens]


def attention_side_ffn(layer: dict, xn: jnp.ndarray) -> jnp.ndarray | None:
    """The part of the FFN that stays with attention: a dense MLP or the shared experts."""
    if "mlp" in layer:
        return swiglu_mlp(layer["mlp"], xn)
    if "shared" in layer:
        return shared_experts(layer["shared"], xn)
    return None


def lm_head(params: dict, cfg: ModelConfig, x: jnp.ndarray) -> jnp.ndarray:
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (x @ w).astype(jnp.float32)


def attention_side(layer: dict, cfg: ModelConfig, x, batch: AttentionBatch, cache: dict, block_size: int):
    """The attention side of a layer: (residual stream with attention and the attention-side FFN
    added, the normed input of the routed experts, the new cache)."""
    h, xn, cache = attention_layer(layer["attn"], cfg, x, batch, cache, block_size)
    out = attention_side_ffn(layer, xn)
    return (h if out is None else h + out), xn, cache


def layer_step(
    layer: dict,
    cfg: ModelConfig,
    x,
    batch: AttentionBatch,
    cache: dict,
    block_size: int,
    brownout: Brownout | None = None,
    expert_impl: str = "auto",
):
    """One whole layer (attention side, then the routed experts); ``expert_impl``: the expert-FFN
    implementation (``moe_layer``)."""
    x, xn, cache = attention_side(layer, cfg, x, batch, cache, block_size)
    if "moe" in layer:
        x = x + moe_layer(layer["moe"], cfg, xn, brownout, expert_impl)
    return x, cache
