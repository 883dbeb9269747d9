"""The monolithic executor: every layer's attention and experts in one jitted program on one device
set.  It is the baseline the disaggregated runtime is checked against, and the single-GPU default."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.transformer import forward, init_cache


class MonolithicExecutor:
    """Owns the parameters and the paged KV cache; ``forward`` runs one step over all layers."""

    def __init__(self, cfg: ModelConfig, params: dict, num_slots: int, block_size: int, cache_dtype=None):
        self.cfg, self.params, self.block_size = cfg, params, block_size
        dtype = cache_dtype or params["embed"].dtype
        self.cache = init_cache(cfg, num_slots, dtype)

        def step(params, tokens, batch, cache, logits_index):
            return forward(params, cfg, tokens, batch, cache, block_size, logits_index)

        self._step = jax.jit(step, donate_argnums=(3,))

    def forward(self, tokens, batch: AttentionBatch, logits_index) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache."""
        batch = AttentionBatch(*(jnp.asarray(a, jnp.int32) for a in batch))
        index = None if logits_index is None else jnp.asarray(logits_index, jnp.int32)
        logits, self.cache = self._step(self.params, jnp.asarray(tokens, jnp.int32), batch, self.cache, index)
        return logits
