"""The attention side of a layer: RMSNorm, RoPE, GQA or MLA attention over a paged KV cache.

``attention_layer`` is what the runtime's attention program runs: it reads and writes the KV cache,
adds the attention output to the residual stream and returns the post-attention-normed activations
that the expert side consumes.  The KV cache is paged: each layer's cache holds ``num_slots =
num_blocks * block_size`` token slots, a sequence's tokens live in the blocks its block table lists.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.models.common import rms_norm
from jaxmoe.models.rope import apply_rope, rope_cos_sin


MLA_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a layernorms use the default eps, not rms_norm_eps


class AttentionBatch(NamedTuple):
    """Where the tokens of one step sit: all [B, T] except block_tables [B, NB]."""

    positions: jnp.ndarray  # position of each token in its sequence
    slots: jnp.ndarray  # KV-cache slot each token writes to; -1 for padding
    block_tables: jnp.ndarray  # physical blocks of each sequence, in logical order


def init_layer_cache(cfg: ModelConfig, num_slots: int, dtype) -> dict:
    a = cfg.attn
    if a.kind == "mla":
        return {
            "ckv": jnp.zeros((num_slots, a.kv_lora_rank), dtype),
            "kpe": jnp.zeros((num_slots, a.qk_rope_head_dim), dtype),
        }
    return {
        "k": jnp.zeros((num_slots, a.num_kv_heads, a.head_dim), dtype),
        "v": jnp.zeros((num_slots, a.num_kv_heads, a.head_dim), dtype),
    }


def _linear(p: dict, name: str, x: jnp.ndarray) -> jnp.ndarray:
    y = x @ p[name]
    bias = p.get(name + "_bias")
    return y if bias is None else y + bias


def _write(cache: jnp.ndarray, slots: jnp.ndarray, values: jnp.ndarray) -> jnp.ndarray:
    """Scatter values [B, T, ...] into cache slots; slot -1 (padding) is dropped."""
    num_slots = cache.shape[0]
    flat = slots.reshape(-1)
    flat = jnp.where(flat < 0, num_slots, flat)
    return cache.at[flat].set(values.reshape((-1,) + values.shape[2:]).astype(cache.dtype), mode="drop")


def _gather(cache: jnp.ndarray, block_tables: jnp.ndarray, block_size: int) -> jnp.ndarray:
    """Each sequence's cached tokens in logical order: [B, NB * block_size, ...]."""
    idx = block_tables[:, :, None] * block_size + jnp.arange(block_size)
    return cache[idx.reshape(block_tables.shape[0], -1)]


def _causal_mask(positions: jnp.ndarray, num_keys: int) -> jnp.ndarray:
    """[B, T, L]: key l is visible to a query at position p when l <= p."""
    return jnp.arange(num_keys)[None, None, :] <= positions[:, :, None]


def _softmax(scores: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def gqa_attention(p: dict, cfg: ModelConfig, x, batch: AttentionBatch, cache: dict, block_size: int):
    a = cfg.attn
    B, T, _ = x.shape
    q = _linear(p, "q", x).reshape(B, T, a.num_heads, a.head_dim)
    k = _linear(p, "k", x).reshape(B, T, a.num_kv_heads, a.head_dim)
    v = _linear(p, "v", x).reshape(B, T, a.num_kv_heads, a.head_dim)
    if a.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg.rope, cfg.max_position, batch.positions)
    q = apply_rope(q, cos, sin, cfg.rope.interleaved)
    k = apply_rope(k, cos, sin, cfg.rope.interleaved)
    cache = {"k": _write(cache["k"], batch.slots, k), "v": _write(cache["v"], batch.slots, v)}
    keys = _gather(cache["k"], batch.block_tables, block_size)  # [B, L, KVH, hd]
    values = _gather(cache["v"], batch.block_tables, block_size)
    group = a.num_heads // a.num_kv_heads
    q = q.reshape(B, T, a.num_kv_heads, group, a.head_dim)
    scores = jnp.einsum("btkgd,blkd->bkgtl", q, keys) * a.softmax_scale
    mask = _causal_mask(batch.positions, keys.shape[1])[:, None, None]
    probs = _softmax(scores, mask).astype(values.dtype)
    out = jnp.einsum("bkgtl,blkd->btkgd", probs, values).reshape(B, T, a.num_heads * a.head_dim)
    return _linear(p, "o", out), cache


def mla_attention(p: dict, cfg: ModelConfig, x, batch: AttentionBatch, cache: dict, block_size: int):
    """DeepSeek multi-head latent attention, caching the compressed KV (absorbed form)."""
    a = cfg.attn
    B, T, _ = x.shape
    H, nope, rope_dim = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
    if a.q_lora_rank:
        q = _linear(p, "q_b", rms_norm(_linear(p, "q_a", x), p["q_a_norm"], MLA_NORM_EPS))
    else:
        q = _linear(p, "q", x)
    q = q.reshape(B, T, H, nope + rope_dim)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv = _linear(p, "kv_a", x)
    ckv = rms_norm(kv[..., : a.kv_lora_rank], p["kv_a_norm"], MLA_NORM_EPS)
    k_pe = kv[..., a.kv_lora_rank :][:, :, None, :]  # one rope key shared by all heads
    cos, sin = rope_cos_sin(cfg.rope, cfg.max_position, batch.positions)
    q_pe = apply_rope(q_pe, cos, sin, cfg.rope.interleaved)
    k_pe = apply_rope(k_pe, cos, sin, cfg.rope.interleaved)[:, :, 0]
    cache = {"ckv": _write(cache["ckv"], batch.slots, ckv), "kpe": _write(cache["kpe"], batch.slots, k_pe)}
    all_ckv = _gather(cache["ckv"], batch.block_tables, block_size)  # [B, L, C]
    all_kpe = _gather(cache["kpe"], batch.block_tables, block_size)  # [B, L, R]
    w_kv_b = p["kv_b"].reshape(a.kv_lora_rank, H, nope + a.v_head_dim)
    w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
    q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
    scores = jnp.einsum("bthc,blc->bhtl", q_latent, all_ckv) + jnp.einsum("bthr,blr->bhtl", q_pe, all_kpe)
    mask = _causal_mask(batch.positions, all_ckv.shape[1])[:, None]
    probs = _softmax(scores * a.softmax_scale, mask).astype(all_ckv.dtype)
    out_latent = jnp.einsum("bhtl,blc->bthc", probs, all_ckv)
    out = jnp.einsum("bthc,chv->bthv", out_latent, w_uv).reshape(B, T, H * a.v_head_dim)
    return _linear(p, "o", out), cache


def attention_layer(p: dict, cfg: ModelConfig, x, batch: AttentionBatch, cache: dict, block_size: int):
    """Residual attention block.  Returns (h, xn, cache): h = x + attn(norm(x)), xn = post_norm(h)."""
    attend = mla_attention if cfg.attn.kind == "mla" else gqa_attention
    out, cache = attend(p, cfg, rms_norm(x, p["input_norm"], cfg.rms_norm_eps), batch, cache, block_size)
    h = x + out.astype(x.dtype)
    return h, rms_norm(h, p["post_norm"], cfg.rms_norm_eps), cache
