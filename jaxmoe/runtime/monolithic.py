"""The monolithic executor: every layer's attention and experts in one jitted program on one device
set.  It is the baseline the disaggregated runtime is checked against, and the single-GPU default.

``forward`` returns logits that stay on device; ``ModelRunner`` samples them with the sampler's own
program (one per batch size, shared by every token bucket: the sampler is not compiled again into
each step program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.experts import AUTO_EXPERT_IMPL, Brownout
from jaxmoe.models.transformer import (
    embed,
    forward,
    init_stacked_cache,
    layer_step,
    layer_view,
    lm_head,
    stack_layers,
    unstack_layers,
)
from jaxmoe.pallas_kernels.expert_ffn import resolve


def _int32(a):
    """``a`` as int32: jax arrays stay on device, anything else becomes a host array (a no-op for what
    ``ModelRunner.prepare`` builds) that the jitted call transfers without a separate dispatch."""
    if isinstance(a, jax.Array):
        return a if a.dtype == jnp.int32 else a.astype(jnp.int32)
    return np.asarray(a, np.int32)


class MonolithicExecutor:
    """Owns the parameters and the paged KV cache; ``forward`` runs one step over all layers.

    Parameters and caches are stacked per layer group (``models.transformer.stack_layers``): the
    jitted step scans over layers."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        num_slots: int,
        block_size: int,
        cache_dtype=None,
        brownout=None,
        expert_impl: str = "auto",
    ):
        """``expert_impl``: the expert-FFN implementation (``jaxmoe.pallas_kernels.expert_ffn``; "auto":
        ``models.experts.AUTO_EXPERT_IMPL``). ``brownout``: a ``BrownoutConfig`` (the params must hold united experts,
        ``jaxmoe.brownout.united.attach``); its threshold is ``brownout_threshold``, which may
        change between steps (SALC) without recompiling."""
        self.cfg, self.block_size = cfg, block_size
        self.kv_layout = KVLayout.for_slots(num_slots, block_size)
        self.num_attention, self.num_cache_slots = 1, self.kv_layout.num_slots
        self.stacked = stack_layers(params)
        dtype = cache_dtype or params["embed"].dtype
        self._new_cache = lambda: init_stacked_cache(cfg, self.stacked, self.num_cache_slots, dtype)
        self.cache = self._new_cache()
        self.brownout = brownout
        self.brownout_threshold = None if brownout is None else brownout.threshold
        full = brownout is not None and brownout.use_full_brownout
        self.expert_impl = impl = resolve(expert_impl, AUTO_EXPERT_IMPL)

        def step(params, tokens, batch, cache, logits_index, threshold):
            return forward(params, cfg, tokens, batch, cache, block_size, logits_index, threshold, full, impl)

        def one_layer(group, x, batch, group_cache, index, threshold):  # the layer-by-layer mode
            brownout = None if threshold is None else Brownout(threshold, (batch.slots >= 0).reshape(-1), full)
            layer = layer_view(group, index, self.stacked["embed"].dtype)
            return layer_step(layer, cfg, x, batch, group_cache, block_size, index, brownout, impl)

        def head(params, x, logits_index):
            if logits_index is not None:
                x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
            return lm_head(params, cfg, x)

        self._step = jax.jit(step, donate_argnums=(3,))
        self._embed = jax.jit(embed)
        self._layer = jax.jit(one_layer, donate_argnums=(3,))
        self._head = jax.jit(head)

    @property
    def params(self) -> dict:
        """Per-layer parameters (views of the stacked arrays)."""
        return unstack_layers(self.stacked)

    def expert_activation_counts(self) -> None:
        """The fused program does not count expert activations."""
        return None

    def reset_cache(self) -> None:
        """A fresh (zero) KV cache, e.g. after a failed step deleted the donated one."""
        self.cache = self._new_cache()

    def _args(self, tokens, batch: AttentionBatch, logits_index):
        batch = AttentionBatch(*(_int32(a) for a in batch))
        index = None if logits_index is None else _int32(logits_index)
        return _int32(tokens), batch, index

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache.

        ``between_layers(n)``: run layer by layer (one program per layer group, the layer index a
        traced value) and call it after each of the first L - 1 layers; what it runs on this
        executor meanwhile (another batch, on other KV slots) does not change this step's result.
        Without it: the whole model as one fused program (the fast path)."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        threshold = None if self.brownout_threshold is None else np.float32(self.brownout_threshold)
        if between_layers is None:
            logits, self.cache = self._step(self.stacked, tokens, batch, self.cache, index, threshold)
            return logits
        x = self._embed(self.stacked, tokens)
        done, total = 0, self.cfg.num_layers
        for g, group in enumerate(self.stacked["groups"]):
            for j in range(jax.tree.leaves(group)[0].shape[0]):
                x, self.cache[g] = self._layer(group, x, batch, self.cache[g], np.int32(j), threshold)
                done += 1
                if done < total:
                    between_layers(done)
        return self._head(self.stacked, x, index)
