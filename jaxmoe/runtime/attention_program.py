"""The attention side of the disaggregated runtime: jitted programs on the attention sub-mesh.

Three programs, all with the batch split over attention instances (P("attn") on the row axis)
and the parameters replicated on every attention device (but for tensor-parallel instances,
``attention.devices_per_instance`` > 1: the attention heads' weights and KV cache split over the
instance's devices, mesh axis "attn_tp", ``attention_tp``):

  embed   tokens [B, T] -> (x [B, T, D], zeros [B, T, D])
  layer   (layer params, x, y_prev, batch, layer cache, local) -> (h, xn, layer cache)
          x <- x + y_prev (the previous layer's routed-expert output, back from E2A; the zeros
          from ``embed`` for the first layer and after a dense layer, so that one compiled program
          serves both cases: x + 0 == x exactly), then ``attention_layer`` (norm, attention
          over the paged KV cache, residual add), then a dense layer's MLP added into h. xn
          (post-attention norm) is what A2E sends.
  shared  (shared-expert params, h, xn) -> h + shared experts(xn): its own program (FinDEP), so
          the executor dispatches it after A2E and the expert program, and it overlaps with them.
  head    (head params, x, y_prev, logits_index) -> logits, after the last layer's residual add.

One jitted ``layer`` function serves every layer: jax caches the compiled program per input
shapes and pytree structure, so all layers of one kind (MoE, MoE + shared, dense) reuse one
compiled program per batch shape.

KV cache: each layer's cache arrays [num_slots, ...] are sharded P("attn") on the slot axis, so
attention instance i holds the contiguous slot range i*num_slots/m .. (i+1)*num_slots/m. ``layer``
has two forms (the static ``local`` argument):

  local=False  the cache write (scatter) and read (gather by block table) are ordinary jnp
               indexing; XLA's SPMD partitioner keeps them correct wherever a row's blocks live,
               at the price of collectives in every layer (all-gathers of the new K/V and the
               indices, an all-reduce of the gathered keys/values), whatever the block values.
  local=True   attention runs per instance (``jax.shard_map`` over "attn"): each instance reads
               and writes only its own cache shard, slot and block ids made local by subtracting
               its first slot; no cross-instance traffic. Correct only when every row's slots and
               blocks lie in its own instance's range (block-to-instance affinity: the engine's
               partitioned ``BlockManager`` + ``ModelRunner`` row placement); the executor checks
               that on the host (``DisaggregatedExecutor.is_local``) and falls back to local=False.

With tensor-parallel instances both forms are a ``shard_map`` that is manual over "attn_tp" (each
device its heads, the output projection summed over the instance: one all-reduce per layer);
local=True is manual over "attn" too, local=False leaves the instances' rows and slots to XLA.
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
from jaxmoe.models.common import INVARIANT
from jaxmoe.models.layer_matrix import invariant_matrices
from jaxmoe.pallas_kernels.expert_ffn.cpu_kernel import program_jit
from jaxmoe.models.experts import shared_experts
from jaxmoe.models.transformer import attention_side_ffn, embed, lm_head
from jaxmoe.quantization import dequantize_params
from jaxmoe.runtime import attention_tp
from jaxmoe.runtime.attention_tp import AttentionTP, expand_kv
from jaxmoe.runtime.process_local import ProcessLocal


@dataclasses.dataclass(frozen=True)
class AttentionPrograms:
    embed: Callable
    layer: Callable
    shared: Callable  # (shared params, h, xn) -> h + shared experts(xn)
    head: Callable
    rows: NamedSharding  # P("attn"): batch rows split over attention instances
    replicated: NamedSharding  # P(): on every attention device
    cache: dict  # one layer's cache key -> NamedSharding: P("attn") on the slot axis (+ heads: attention_tp)
    tp: AttentionTP  # heads over each instance's devices (size 1: none)

    def place_layer(self, layer: dict):
        """A layer's attention-side parameters (``attention_side_params``) on the attention mesh:
        replicated, but for tensor parallelism the attention heads split over ``attn_tp``
        (``attention_tp``; GQA KV heads repeated first when fewer than the devices)."""
        if self.tp.size == 1:
            return jax.device_put(layer, self.replicated)
        mesh = self.replicated.mesh
        attn = expand_kv(layer["attn"], self.tp.cfg, self.tp.kv_repeat)
        shardings = {k: NamedSharding(mesh, s) for k, s in attention_tp.param_specs(attn).items()}
        out = {k: jax.device_put(v, self.replicated) for k, v in layer.items() if k != "attn"}
        return {**out, "attn": {k: jax.device_put(v, shardings[k]) for k, v in attn.items()}}


@functools.lru_cache(maxsize=32)
def make_attention_programs(
    cfg: ModelConfig, block_size: int, sub: SubMeshes, invariant: bool = False
) -> AttentionPrograms:
    """The jitted programs (cached: executors with the same model, block size and sub-meshes
    share them, and so share their compiled executables). Raises ``MeshConfigError`` when the
    attention heads do not split over ``attention.devices_per_instance`` (``attention_tp.plan``).
    ``invariant`` (deterministic mode): every matrix product and norm sums each token's terms in an
    order of its own (``layer_matrix.invariant_matrices``, ``common.INVARIANT``) and attention runs
    the CPU paged-attention kernel, so a token's results do not depend on the other rows or on how
    its prompt was chunked (one-device instances only: ``DisaggregatedExecutor`` checks)."""
    attn, tp_axis = ATTN_AXES
    tp = attention_tp.plan(cfg, sub.spec)
    cfg, local_cfg = tp.cfg, tp.local_cfg  # all heads (KV heads repeated) / one device's heads
    rows = NamedSharding(sub.attention, P(attn))
    replicated = NamedSharding(sub.attention, P())
    cache_specs = attention_tp.cache_specs(cfg, tp.size)
    cache = {k: NamedSharding(sub.attention, s) for k, s in cache_specs.items()}
    split = tp.size > 1

    def embed_step(table, tokens):
        x = embed({"embed": table}, tokens)
        return x, jnp.zeros_like(x)

    def attend(p, x, batch: AttentionBatch, layer_cache):
        if invariant:  # the kernel reads a cache stacked over layers: this one as a stack of one
            stacked = jax.tree.map(lambda a: a[None], layer_cache)
            p = invariant_matrices(p)
            h, xn, stacked = attention_layer(p, cfg, x, batch, stacked, block_size, 0, in_place=INVARIANT)
            return h, xn, jax.tree.map(lambda a: a[0], stacked)
        if split:  # this device's heads (manual over attn_tp; the rows as the caller has them)
            return attention_layer(p, local_cfg, x, batch, layer_cache, block_size, tp_axis=tp_axis)
        return attention_layer(p, cfg, x, batch, layer_cache, block_size)

    def attend_on_instance(p, x, batch: AttentionBatch, layer_cache):
        """``attend`` on one instance's rows and cache shard, with local slot and block ids."""
        n = jax.tree.leaves(layer_cache)[0].shape[0]  # this instance's slots
        first = jax.lax.axis_index(attn) * n
        slots = jnp.where(batch.slots >= 0, batch.slots - first, -1)
        tables = jnp.clip(batch.block_tables - first // block_size, 0, n // block_size - 1)
        return attend(p, x, AttentionBatch(batch.positions, slots, tables), layer_cache)

    def attend_split(p, x, batch, layer_cache, local: bool):
        """Attention with the heads split over attn_tp: manual over both axes (local) or over
        attn_tp only, the instances' rows and cache slots left to XLA (not local)."""
        specs = attention_tp.param_specs(p)
        if local:
            return jax.shard_map(
                attend_on_instance,
                mesh=sub.attention,
                in_specs=(specs, P(attn), P(attn), cache_specs),
                out_specs=(P(attn), P(attn), cache_specs),
            )(p, x, batch, layer_cache)
        heads = {k: P(None, *s[1:]) for k, s in cache_specs.items()}  # the same, slots left to XLA
        return jax.shard_map(
            attend,
            mesh=sub.attention,
            in_specs=(specs, P(), P(), heads),
            out_specs=(P(), P(), heads),
            axis_names={tp_axis},
        )(p, x, batch, layer_cache)

    attend_local = jax.shard_map(
        attend_on_instance, mesh=sub.attention, in_specs=(P(), P(attn), P(attn), P(attn)), out_specs=P(attn)
    )

    def layer_step(layer, x, y_prev, batch: AttentionBatch, layer_cache, local: bool = False):
        x = x + y_prev
        layer = dequantize_params(layer, x.dtype)  # int8 / fp8 projections (quantize_attention): this layer's
        if split:
            h, xn, layer_cache = attend_split(layer["attn"], x, batch, layer_cache, local)
        else:
            h, xn, layer_cache = (attend_local if local else attend)(layer["attn"], x, batch, layer_cache)
        out = attention_side_ffn(invariant_matrices(layer) if invariant else layer, xn)
        return (h if out is None else h + out), xn, layer_cache

    def shared_step(p, h, xn):
        return h + shared_experts(
            invariant_matrices(p) if invariant else p, xn
        )  # the monolithic forward's order: (h + shared) + routed

    def head_step(head, x, y_prev, logits_index):
        x = x + y_prev
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        return lm_head(head, cfg, x, invariant=invariant)

    jit = program_jit(invariant)
    return AttentionPrograms(
        # each runs only on the processes that hold attention devices (``process_local``)
        embed=ProcessLocal(jit(embed_step, out_shardings=(rows, rows)), sub.attention),
        layer=ProcessLocal(
            jit(layer_step, out_shardings=(rows, rows, cache), donate_argnums=(4,), static_argnums=(5,)),
            sub.attention,
        ),
        shared=ProcessLocal(jit(shared_step, out_shardings=rows), sub.attention),
        head=ProcessLocal(jit(head_step, out_shardings=rows), sub.attention),
        rows=rows,
        replicated=replicated,
        cache=cache,
        tp=tp,
    )


def attention_side_params(layer: dict) -> dict:
    """The part of a layer's parameters the attention ``layer`` program reads (the shared experts,
    when they run on the attention side, are the ``shared`` program's)."""
    return {k: v for k, v in layer.items() if k in ("attn", "mlp")}


def head_params(params: dict, cfg: ModelConfig) -> dict:
    """What ``lm_head`` reads: the final norm and the output matrix (the embedding when tied)."""
    return {
        "final_norm": params["final_norm"],
        ("embed" if cfg.tie_embeddings else "lm_head"): params["embed" if cfg.tie_embeddings else "lm_head"],
    }
