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
from jaxmoe.models.common import INVARIANT, pack16, rms_norm, unpack16
from jaxmoe.models.rope import apply_rope, rope_cos_sin
from jaxmoe.pallas_kernels.paged_attention import cpu_kernel as attention_kernel


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


KV_CHUNK_TOKENS = 128  # keys per step of the attention loop (rounded to whole blocks)


def _write(cache: jnp.ndarray, slots: jnp.ndarray, values: jnp.ndarray, layer=None) -> jnp.ndarray:
    """Scatter values [B, T, ...] into cache slots; slot -1 (padding) is dropped. ``layer``: the
    cache is stacked [L, slots, ...] (the monolithic scan) and this layer's slice is written in place.
    A uint16 cache holds 16-bit floats as bits (``common.pack16``, as the scan's stacked weights)."""
    num_slots = cache.shape[0 if layer is None else 1]
    flat = slots.reshape(-1)
    flat = jnp.where(flat < 0, num_slots, flat)
    values = values.reshape((-1,) + values.shape[2:])
    values = pack16(values) if cache.dtype == jnp.uint16 else values.astype(cache.dtype)
    if layer is None:
        return cache.at[flat].set(values, mode="drop")
    return cache.at[layer, flat].set(values, mode="drop")


def _read(cache: jnp.ndarray, idx: jnp.ndarray, layer, dtype) -> jnp.ndarray:
    """Cache rows ``idx`` (of layer ``layer`` of a stacked cache) as ``dtype`` if packed."""
    return unpack16(cache[idx] if layer is None else cache[layer, idx], dtype)


def paged_attention(block_tables, positions, block_size: int, chunk_scores, mix) -> jnp.ndarray:
    """Softmax attention over each sequence's paged keys, a chunk of blocks at a time (online softmax).

    The loop runs ceil((max position + 1) / chunk) times, a number known only on device, so one
    compiled program serves every context length (no program per block-table width) and a step reads
    only the chunks some query can see. ``chunk_scores(idx, key_pos)`` -> (scores [..., T, W] fp32
    before masking, values of the chunk); ``mix(p, values)`` -> [..., T, out]; positions [B, T].
    Returns [..., T, out] (fp32) where ``...`` is what chunk_scores puts before T (batch first).
    """
    B, NB = block_tables.shape
    per_chunk = max(1, min(NB, KV_CHUNK_TOKENS // block_size))
    pad = -NB % per_chunk
    if pad:  # whole chunks; padded entries are masked (their keys lie past every position)
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    width = per_chunk * block_size
    num_chunks = jnp.minimum((jnp.max(positions) + width) // width, (NB + pad) // per_chunk)

    def chunk(c):
        """Masked scores and values of chunk c: [..., T, W] fp32 (-inf where not visible)."""
        blocks = jax.lax.dynamic_slice_in_dim(block_tables, c * per_chunk, per_chunk, axis=1)
        idx = (blocks[:, :, None] * block_size + jnp.arange(block_size)).reshape(B, width)
        key_pos = c * width + jnp.arange(width)
        scores, values = chunk_scores(idx, key_pos)
        visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, W]
        extra = scores.ndim - 3  # axes between batch and T (heads)
        return jnp.where(visible.reshape((B,) + (1,) * extra + visible.shape[1:]), scores, -jnp.inf), values

    def body(c, state):
        m, l, acc = state
        scores, values = chunk(c)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        scale = jnp.exp(m - m_new)
        return m_new, l * scale + p.sum(axis=-1), acc * scale[..., None] + mix(p, values)

    # Chunk 0 (key 0 is visible to every query, so every row's max is finite) starts the state; the
    # state then has the types of real outputs (inside shard_map: varying over the mesh axes).
    scores, values = chunk(0)
    m = scores.max(axis=-1)
    p = jnp.exp(scores - m[..., None])
    _, l, acc = jax.lax.fori_loop(1, num_chunks, body, (m, p.sum(axis=-1), mix(p, values)))
    return acc / l[..., None]


def _out_proj(p: dict, out: jnp.ndarray, tp_axis: str | None) -> jnp.ndarray:
    """The output projection. ``tp_axis``: inside a ``shard_map`` where this device holds some heads
    (the rows of ``o`` of its heads): the partial products are summed over that mesh axis before the
    bias is added (once)."""
    y = out @ p["o"]
    if tp_axis is not None:
        y = jax.lax.psum(y, tp_axis)
    bias = p.get("o_bias")
    return y if bias is None else y + bias


def gqa_attention(
    p: dict,
    cfg: ModelConfig,
    x,
    batch: AttentionBatch,
    cache: dict,
    block_size: int,
    layer=None,
    tp_axis=None,
    in_place: bool = False,
):
    a = cfg.attn
    B, T, _ = x.shape
    q = _linear(p, "q", x).reshape(B, T, a.num_heads, a.head_dim)
    k = _linear(p, "k", x).reshape(B, T, a.num_kv_heads, a.head_dim)
    v = _linear(p, "v", x).reshape(B, T, a.num_kv_heads, a.head_dim)
    if a.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, in_place == INVARIANT)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, in_place == INVARIANT)
    cos, sin = rope_cos_sin(cfg.rope, cfg.max_position, batch.positions)
    q = apply_rope(q, cos, sin, cfg.rope.interleaved)
    k = apply_rope(k, cos, sin, cfg.rope.interleaved)
    cache = {"k": _write(cache["k"], batch.slots, k, layer), "v": _write(cache["v"], batch.slots, v, layer)}
    attend = gqa_kernel if _kernel_attends(in_place, layer, q, cache["k"], k.dtype) else gqa_xla
    out = attend(q, cache, layer, batch, block_size, a.softmax_scale, k.dtype)  # [B, T, H, hd] fp32
    return _out_proj(p, out.reshape(B, T, a.num_heads * a.head_dim).astype(x.dtype), tp_axis), cache


def _kernel_attends(in_place, layer, q, k_cache, dtype) -> bool:
    """Whether the CPU paged-attention kernel runs (``attention_layer``'s ``in_place``): for decode
    steps (one query token per row), and in deterministic mode (``INVARIANT``) for every step. A
    prefill chunk runs the XLA form: the kernel computes each query token alone (a dot and a
    horizontal sum per key) where XLA multiplies the chunk's queries by 128 keys at a time, and a
    1,088-token prompt's prefill took 3.5-5x as long in the kernel (bench/results/2026-11-28-prefill.md)."""
    if not in_place or layer is None or not (in_place == INVARIANT or q.shape[1] == 1):
        return False
    return attention_kernel.supports(q, k_cache, dtype)


def gqa_xla(q, cache: dict, layer, batch: AttentionBatch, block_size: int, scale: float, dtype) -> jnp.ndarray:
    """GQA of queries q [B, T, H, hd] over the paged cache (stacked at ``layer``, or one layer's when
    None) in XLA: keys gathered a chunk at a time, online softmax (``paged_attention``). [B, T, H, hd] fp32."""
    B, T, H, hd = q.shape
    kv_heads = cache["k"].shape[-2]
    q = q.reshape(B, T, kv_heads, H // kv_heads, hd)

    def chunk_scores(idx, key_pos):
        keys, values = _read(cache["k"], idx, layer, dtype), _read(cache["v"], idx, layer, dtype)  # [B, W, KVH, hd]
        scores = jnp.einsum("btkgd,bwkd->bkgtw", q, keys, preferred_element_type=jnp.float32)
        return scores * scale, values

    def mix(probs, values):
        return jnp.einsum("bkgtw,bwkd->bkgtd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)

    out = paged_attention(batch.block_tables, batch.positions, block_size, chunk_scores, mix)  # [B, KVH, G, T, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def gqa_kernel(q, cache: dict, layer, batch: AttentionBatch, block_size: int, scale: float, dtype) -> jnp.ndarray:
    """``gqa_xla``'s result from the CPU paged-attention kernel, which reads the stacked cache in place
    (``jaxmoe.pallas_kernels.paged_attention``; where ``cpu_kernel.supports`` the shapes)."""
    return attention_kernel.paged_attention(
        q, cache["k"], cache["v"], layer, batch.block_tables, batch.positions,
        block_size=block_size, scale=scale, dtype=dtype,
    )  # fmt: skip


def mla_attention(
    p: dict, cfg: ModelConfig, x, batch: AttentionBatch, cache: dict, block_size: int, layer=None, tp_axis=None
):
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
    cache = {
        "ckv": _write(cache["ckv"], batch.slots, ckv, layer),
        "kpe": _write(cache["kpe"], batch.slots, k_pe, layer),
    }
    w_kv_b = p["kv_b"].reshape(a.kv_lora_rank, H, nope + a.v_head_dim)
    w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
    q_latent = jnp.einsum("bthn,chn->bhtc", q_nope, w_uk)
    q_pe = q_pe.transpose(0, 2, 1, 3)  # [B, H, T, R]

    def chunk_scores(idx, key_pos):
        ckv_c = _read(cache["ckv"], idx, layer, ckv.dtype)  # [B, W, C]
        kpe_c = _read(cache["kpe"], idx, layer, k_pe.dtype)  # [B, W, R]
        scores = jnp.einsum("bhtc,bwc->bhtw", q_latent, ckv_c, preferred_element_type=jnp.float32) + jnp.einsum(
            "bhtr,bwr->bhtw", q_pe, kpe_c, preferred_element_type=jnp.float32
        )
        return scores * a.softmax_scale, ckv_c

    def mix(probs, ckv_c):
        return jnp.einsum("bhtw,bwc->bhtc", probs.astype(ckv_c.dtype), ckv_c, preferred_element_type=jnp.float32)

    out_latent = paged_attention(batch.block_tables, batch.positions, block_size, chunk_scores, mix)
    out_latent = out_latent.astype(x.dtype)  # [B, H, T, C]
    out = jnp.einsum("bhtc,chv->bthv", out_latent, w_uv).reshape(B, T, H * a.v_head_dim)
    return _out_proj(p, out, tp_axis), cache


def attention_layer(
    p: dict,
    cfg: ModelConfig,
    x,
    batch: AttentionBatch,
    cache: dict,
    block_size: int,
    layer=None,
    tp_axis=None,
    in_place: bool = False,
):
    """Residual attention block.  Returns (h, xn, cache): h = x + attn(norm(x)), xn = post_norm(h).
    ``layer``: index into a cache stacked over layers (see ``_write``); None: a one-layer cache.
    ``in_place``: GQA decode steps read that stacked cache in place with the CPU paged-attention
    kernel where it takes the shapes (``jaxmoe.pallas_kernels.paged_attention``), instead of gathering
    the keys; ``INVARIANT`` (deterministic mode): every step does (``_kernel_attends``).
    ``tp_axis``: tensor parallelism inside a ``shard_map`` (``runtime.attention_tp``): ``cfg`` counts
    this device's heads, ``p`` holds their columns of q/k/v and rows of o, and the output projection
    is summed over that mesh axis."""
    invariant = in_place == INVARIANT  # deterministic mode: norms summed in a fixed order per token
    xn = rms_norm(x, p["input_norm"], cfg.rms_norm_eps, invariant)
    if cfg.attn.kind == "mla":
        out, cache = mla_attention(p, cfg, xn, batch, cache, block_size, layer, tp_axis)
    else:
        out, cache = gqa_attention(p, cfg, xn, batch, cache, block_size, layer, tp_axis, in_place)
    h = x + out.astype(x.dtype)
    return h, rms_norm(h, p["post_norm"], cfg.rms_norm_eps, invariant), cache
