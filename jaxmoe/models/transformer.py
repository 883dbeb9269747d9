"""Embeddings, the monolithic layer loop and the LM head.

A layer's parameters are split the way the runtime splits the work:
``{"attn": ..., "mlp": ...}`` for a dense layer and ``{"attn": ..., "moe": ..., "shared": ...}``
for an MoE layer ("shared" only when the family has shared experts).  ``attn``, ``mlp`` and
``shared`` run on the attention side, ``moe`` (router + routed experts) on the expert side.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.models.attention import AttentionBatch, attention_layer, init_layer_cache
from jaxmoe.models.common import rms_norm, swiglu_mlp
from jaxmoe.models.experts import moe_layer, shared_experts


def init_cache(cfg: ModelConfig, num_slots: int, dtype) -> list[dict]:
    return [init_layer_cache(cfg, num_slots, dtype) for _ in range(cfg.num_layers)]


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


def forward(params: dict, cfg: ModelConfig, tokens, batch: AttentionBatch, cache: list, block_size: int,
            logits_index=None):
    """Monolithic forward over tokens [B, T].

    Returns (logits, cache): logits [B, V] at ``logits_index`` [B] (the last real token of each
    row), or [B, T, V] when ``logits_index`` is None.
    """
    x = embed(params, tokens)
    new_cache = []
    for layer, layer_cache in zip(params["layers"], cache):
        h, xn, layer_cache = attention_layer(layer["attn"], cfg, x, batch, layer_cache, block_size)
        new_cache.append(layer_cache)
        out = attention_side_ffn(layer, xn)
        x = h if out is None else h + out
        if "moe" in layer:
            x = x + moe_layer(layer["moe"], cfg, xn)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
    return lm_head(params, cfg, x), new_cache
