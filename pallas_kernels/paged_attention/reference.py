"""Plain jnp paged attention: the oracle of the kernels (``api.IMPLS``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _widen(cache, dtype):
    """A cache of 16-bit floats stored as uint16 bits as those floats (other caches unchanged)."""
    return jax.lax.bitcast_convert_type(cache, dtype) if cache.dtype == jnp.uint16 else cache


def paged_attention_reference(
    q, k_cache, v_cache, layer, block_tables, positions, *, block_size: int, scale: float, dtype
):
    """Every key of each row's block table gathered, masked to key positions <= the query's, a
    float32 softmax whose probabilities are cast to ``dtype`` before they weight the values (as the
    model's chunked XLA form does). q [B, T, H, hd]; caches [L, S, KVH, hd] (16-bit floats possibly
    as uint16 bits). Returns [B, T, H, hd] float32."""
    B, T, H, hd = q.shape
    NB = block_tables.shape[1]
    keys = _widen(k_cache[layer], dtype)
    values = _widen(v_cache[layer], dtype)
    KVH = keys.shape[1]
    idx = (block_tables[:, :, None] * block_size + jnp.arange(block_size)).reshape(B, NB * block_size)
    k, v = keys[idx], values[idx]  # [B, W, KVH, hd]
    qg = q.astype(dtype).reshape(B, T, KVH, H // KVH, hd)
    scores = jnp.einsum("btkgd,bwkd->bkgtw", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(NB * block_size)[None, None, :] <= positions[:, :, None]  # [B, T, W]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    p = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    out = jnp.einsum("bkgtw,bwkd->bkgtd", p.astype(dtype), v, preferred_element_type=jnp.float32)
    out = out / p.sum(axis=-1)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
