"""The monolithic executor: every layer's attention and experts in one jitted program on one device
set.  It is the baseline the disaggregated runtime is checked against, and the single-GPU default.

Besides ``forward`` (the interface every executor has), it offers ``forward_sample``: the same step
with the sampler fused into the jitted program, so a decode step is one dispatch that returns only
the sampled tokens (and logprobs) instead of the [B, V] logits.  ``ModelRunner`` uses it when the
executor has it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.engine.sampler import sample
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.transformer import forward, init_cache


def _int32(a):
    """``a`` as int32: jax arrays stay on device, anything else becomes a host array (a no-op for what
    ``ModelRunner.prepare`` builds) that the jitted call transfers without a separate dispatch."""
    if isinstance(a, jax.Array):
        return a if a.dtype == jnp.int32 else a.astype(jnp.int32)
    return np.asarray(a, np.int32)


class MonolithicExecutor:
    """Owns the parameters and the paged KV cache; ``forward`` runs one step over all layers."""

    def __init__(self, cfg: ModelConfig, params: dict, num_slots: int, block_size: int, cache_dtype=None):
        self.cfg, self.params, self.block_size = cfg, params, block_size
        self._new_cache = lambda: init_cache(cfg, num_slots, cache_dtype or params["embed"].dtype)
        self.cache = self._new_cache()

        def step(params, tokens, batch, cache, logits_index):
            return forward(params, cfg, tokens, batch, cache, block_size, logits_index)

        def step_sample(params, tokens, batch, cache, logits_index, sampling, num_logprobs):
            logits, cache = forward(params, cfg, tokens, batch, cache, block_size, logits_index)
            return sample(logits, *sampling, num_logprobs=num_logprobs), cache

        self._step = jax.jit(step, donate_argnums=(3,))
        self._step_sample = jax.jit(step_sample, donate_argnums=(3,), static_argnames=("num_logprobs",))

    def reset_cache(self) -> None:
        """A fresh (zero) KV cache, e.g. after a failed step deleted the donated one."""
        self.cache = self._new_cache()

    def _args(self, tokens, batch: AttentionBatch, logits_index):
        batch = AttentionBatch(*(_int32(a) for a in batch))
        index = None if logits_index is None else _int32(logits_index)
        return _int32(tokens), batch, index

    def forward(self, tokens, batch: AttentionBatch, logits_index) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        logits, self.cache = self._step(self.params, tokens, batch, self.cache, index)
        return logits

    def forward_sample(self, tokens, batch: AttentionBatch, logits_index, temperature, top_k, top_p, seeds,
                       steps, num_logprobs: int = 0):
        """``sampler.sample(forward(...), temperature, ..., num_logprobs)`` as one jitted program:
        (tokens [B], logprob of token [B], top ids [B, n], top logprobs [B, n]); updates the KV cache."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        sampling = (temperature, top_k, top_p, seeds, steps)
        out, self.cache = self._step_sample(self.params, tokens, batch, self.cache, index, sampling,
                                            num_logprobs=num_logprobs)
        return out
