"""The attention side of the disaggregated runtime: jitted programs on the attention sub-mesh.

Three programs, all with the batch split over attention instances (P("attn") on the row axis)
and the parameters replicated on every attention device:

  embed   tokens [B, T] -> (x [B, T, D], zeros [B, T, D])
  layer   (layer params, x, y_prev, batch, layer cache) -> (h, xn, layer cache)
          x <- x + y_prev (the previous layer's routed-expert output, back from E2A; the zeros
          from ``embed`` for the first layer and after a dense layer, so that one compiled program
          serves both cases: x + 0 == x exactly), then ``attention_layer`` (norm, attention
          over the paged KV cache, residual add), then the attention-side FFN (a dense MLP or
          the shared experts, FinDEP) added into h. xn (post-attention norm) is what A2E sends.
  head    (head params, x, y_prev, logits_index) -> logits, after the last layer's residual add.

One jitted ``layer`` function serves every layer: jax caches the compiled program per input
shapes and pytree structure, so all layers of one kind (MoE, MoE + shared, dense) reuse one
compiled program per batch shape.

KV cache: each layer's cache arrays [num_slots, ...] are sharded P("attn") on the slot axis, so
attention instance i holds the contiguous slot range i*num_slots/m .. (i+1)*num_slots/m. The
cache write (scatter) and read (gather by block table) are ordinary jnp indexing: XLA's SPMD
partitioner keeps them correct wherever a sequence's blocks live (a gather from a remote
instance becomes a masked local gather plus a cross-instance reduction). They are *local*,
i.e. need no cross-instance traffic, only when the block manager allocates a sequence's blocks
from the slot range of the attention instance that owns the sequence's batch row
(block-to-instance affinity); the runtime is correct without it, and fast with it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.config import ModelConfig
from jaxmoe.mesh import ATTN_AXES, SubMeshes
from jaxmoe.models.attention import AttentionBatch, attention_layer
from jaxmoe.models.transformer import attention_side_ffn, embed, lm_head


@dataclasses.dataclass(frozen=True)
class AttentionPrograms:
    embed: Callable
    layer: Callable
    head: Callable
    rows: NamedSharding  # P("attn"): batch rows split over attention instances
    replicated: NamedSharding  # P(): on every attention device
    cache: NamedSharding  # P("attn") on the slot axis


@functools.lru_cache(maxsize=32)
def make_attention_programs(cfg: ModelConfig, block_size: int, sub: SubMeshes) -> AttentionPrograms:
    """The jitted programs (cached: executors with the same model, block size and sub-meshes
    share them, and so share their compiled executables)."""
    rows = NamedSharding(sub.attention, P(ATTN_AXES[0]))
    replicated = NamedSharding(sub.attention, P())
    cache = NamedSharding(sub.attention, P(ATTN_AXES[0]))

    def embed_step(table, tokens):
        x = embed({"embed": table}, tokens)
        return x, jnp.zeros_like(x)

    def layer_step(layer, x, y_prev, batch: AttentionBatch, layer_cache):
        x = x + y_prev
        h, xn, layer_cache = attention_layer(layer["attn"], cfg, x, batch, layer_cache, block_size)
        out = attention_side_ffn(layer, xn)
        return (h if out is None else h + out), xn, layer_cache

    def head_step(head, x, y_prev, logits_index):
        x = x + y_prev
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        return lm_head(head, cfg, x)

    return AttentionPrograms(
        embed=jax.jit(embed_step, out_shardings=(rows, rows)),
        layer=jax.jit(layer_step, out_shardings=(rows, rows, cache), donate_argnums=(4,)),
        head=jax.jit(head_step, out_shardings=rows),
        rows=rows,
        replicated=replicated,
        cache=cache,
    )


def attention_side_params(layer: dict, shared_on_attention: bool) -> dict:
    """The part of a layer's parameters the attention program reads."""
    keep = ("attn", "mlp", "shared") if shared_on_attention else ("attn", "mlp")
    return {k: v for k, v in layer.items() if k in keep}


def head_params(params: dict, cfg: ModelConfig) -> dict:
    """What ``lm_head`` reads: the final norm and the output matrix (the embedding when tied)."""
    return {"final_norm": params["final_norm"], ("embed" if cfg.tie_embeddings else "lm_head"):
            params["embed" if cfg.tie_embeddings else "lm_head"]}
