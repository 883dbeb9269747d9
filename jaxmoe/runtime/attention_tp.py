"""Tensor parallelism inside an attention instance (``attention.devices_per_instance: k`` > 1).

An attention instance of k devices (mesh axis ``attn_tp``) splits the attention heads over them,
Megatron-style: device t of an instance holds

  GQA  the columns of q / k / v (and their biases) of heads t*H/k .. (t+1)*H/k - 1 and of their KV
       heads, the matching rows of o, and the KV cache of its KV heads ([slots, KVH/k, head_dim]);
  MLA  the columns of q (or q_b) and kv_b of its heads and the matching rows of o; the compressed
       KV cache (ckv, kpe) is one per token for all heads, so every device of the instance keeps
       all of it (replicated over ``attn_tp``), as do q_a / kv_a and the norms.

Each device computes attention for its heads and its partial output projection; the partials are
summed over ``attn_tp`` (``models.attention``'s ``tp_axis``) before o's bias and the residual add.
Embedding, LM head, dense MLPs and shared experts stay replicated on every attention device.

Head counts: H (query heads) must be a multiple of k, else ``MeshConfigError``. GQA KV heads: a
multiple of k is split; fewer KV heads than k, with k a multiple of them, are *replicated*: each
KV head is repeated k / KVH times (weights and cache), so device t holds exactly the KV head its
query heads read (what vLLM does); any other count is a ``MeshConfigError``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmoe.config import ModelConfig
from jaxmoe.mesh import ATTN_AXES, ClusterSpec, MeshConfigError

TP = ATTN_AXES[1]
_COLUMNS = ("q", "k", "v", "q_b", "kv_b")  # [in, heads * dim]: split by heads (columns)
_HEAD_BIASES = ("q_bias", "k_bias", "v_bias")


@dataclasses.dataclass(frozen=True)
class AttentionTP:
    """How the attention side of ``cfg`` is laid out over ``size`` devices per instance."""

    size: int  # devices per attention instance (k)
    kv_repeat: int  # each GQA KV head is repeated this many times (1: no replication)
    cfg: ModelConfig  # the attention side's config: num_kv_heads after the repeat (all heads)

    @property
    def local_cfg(self) -> ModelConfig:
        """The config one device of an instance sees: H / k query heads, KVH' / k KV heads."""
        a = self.cfg.attn
        attn = dataclasses.replace(a, num_heads=a.num_heads // self.size, num_kv_heads=a.num_kv_heads // self.size)
        return dataclasses.replace(self.cfg, attn=attn)


def plan(cfg: ModelConfig, spec: ClusterSpec) -> AttentionTP:
    """The tensor-parallel layout of ``cfg`` on ``spec``'s attention instances; raises
    ``MeshConfigError`` naming ``attention.devices_per_instance`` and the head count that does not fit."""
    k, a = spec.attention.devices_per_instance, cfg.attn
    if k == 1:
        return AttentionTP(1, 1, cfg)
    field = f"{spec.source}: attention.devices_per_instance"
    if a.num_heads % k:
        raise MeshConfigError(
            f"{field}: {k} devices per instance must divide the model's {a.num_heads} attention heads "
            "(tensor parallelism splits the heads over an instance's devices)"
        )
    repeat = 1
    if a.kind == "gqa" and a.num_kv_heads % k:
        if k % a.num_kv_heads:
            raise MeshConfigError(
                f"{field}: {k} devices per instance and the model's {a.num_kv_heads} KV heads: one must "
                "divide the other (KV heads are split over the devices, or replicated when fewer)"
            )
        repeat = k // a.num_kv_heads
        cfg = dataclasses.replace(cfg, attn=dataclasses.replace(a, num_kv_heads=k))
    return AttentionTP(k, repeat, cfg)


def expand_kv(attn: dict, cfg: ModelConfig, repeat: int) -> dict:
    """A GQA layer's attention parameters with every KV head's k / v columns (and biases) repeated
    ``repeat`` times, next to each other: KV head j becomes heads j*repeat .. j*repeat + repeat - 1,
    which the query heads of j read (grouped-query attention gives the same result)."""
    if repeat == 1:
        return attn
    hd, out = cfg.attn.head_dim, dict(attn)
    for name in ("k", "v", "k_bias", "v_bias"):
        if name in attn:
            w = attn[name]
            heads = w.reshape(w.shape[:-1] + (-1, hd))
            out[name] = jnp.repeat(heads, repeat, axis=-2).reshape(w.shape[:-1] + (-1,))
    return out


def param_specs(attn: dict) -> dict:
    """PartitionSpecs over the attention mesh of one layer's attention parameters (``attn``)."""

    def spec(name):
        if name in _COLUMNS:
            return P(None, TP)
        if name in _HEAD_BIASES:
            return P(TP)
        if name == "o":
            return P(TP, None)
        return P()

    return {name: spec(name) for name in attn}


def cache_specs(cfg: ModelConfig, tp: int) -> dict:
    """PartitionSpecs of one layer's KV cache: slots over attention instances ("attn"); GQA heads
    over the instance's devices ("attn_tp") when tp > 1; MLA's compressed cache replicated on them."""
    attn = ATTN_AXES[0]
    if cfg.attn.kind == "mla":
        return {"ckv": P(attn), "kpe": P(attn)}
    heads = P(attn, TP) if tp > 1 else P(attn)
    return {"k": heads, "v": heads}
