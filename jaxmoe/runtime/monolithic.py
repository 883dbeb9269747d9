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

from jaxmoe.brownout.config import check_threshold
from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.experts import AUTO_EXPERT_IMPL, Brownout
from jaxmoe.models.router import route
from jaxmoe.models.transformer import (
    attention_side,
    embed,
    forward,
    init_stacked_cache,
    layer_step,
    layer_view,
    lm_head,
    stack_layers,
    store_as_panels,
    unstack_layers,
)
from jaxmoe.pallas_kernels.expert_ffn import resolve
from jaxmoe.runtime import op_impls
from jaxmoe.runtime.expert_queues import expert_bounds, queue_depth, serve_round
from jaxmoe.runtime.pause_points import PausePoints


def _int32(a):
    """``a`` as int32: jax arrays stay on device, anything else becomes a host array (a no-op for what
    ``ModelRunner.prepare`` builds) that the jitted call transfers without a separate dispatch."""
    if isinstance(a, jax.Array):
        return a if a.dtype == jnp.int32 else a.astype(jnp.int32)
    return np.asarray(a, np.int32)


def step_program(cfg: ModelConfig, block_size: int, impl: str, full_brownout: bool = False):
    """The fused step, jitted: (stacked params, tokens, batch, stacked cache, logits_index, brownout
    threshold) -> (logits, cache), every layer in one program (the cache donated). ``impl``: a
    resolved expert-FFN implementation. What ``MonolithicExecutor.forward`` runs and ``jaxmoe lower``
    lowers."""

    def step(params, tokens, batch, cache, logits_index, threshold):
        return forward(params, cfg, tokens, batch, cache, block_size, logits_index, threshold, full_brownout, impl)

    return jax.jit(step, donate_argnums=(3,))


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
        expert_queues: int = 0,
        pause_every: int = 1,
    ):
        """``expert_impl``: the expert-FFN implementation (``jaxmoe.pallas_kernels.expert_ffn``; "auto":
        ``models.experts.AUTO_EXPERT_IMPL``). ``brownout``: a ``BrownoutConfig`` (the params must hold united experts,
        ``jaxmoe.brownout.united.attach``); its threshold is ``brownout_threshold``, which may
        change between steps (SALC) without recompiling. ``expert_queues``: in the layer-by-layer
        mode, serve each MoE layer's expert queues in this many rounds with a pause point between
        them (QLLM per-expert queues, ``runtime.expert_queues``; 0: one expert program per layer).
        ``pause_every``: in the layer-by-layer mode, layers per program (pause points every that many
        layers: fewer dispatches and host checks, a longer wait for latency-sensitive work)."""
        self.cfg, self.block_size = cfg, block_size
        self.kv_layout = KVLayout.for_slots(num_slots, block_size)
        self.num_attention, self.num_cache_slots = 1, self.kv_layout.num_slots
        self.expert_impl = impl = resolve(expert_impl, AUTO_EXPERT_IMPL)
        self.stacked = stack_layers(params)
        in_place = impl == "cpu_kernel"  # weights read in place by the CPU kernel
        self._op_impls = op_impls.build(
            requested_expert_impl=expert_impl,
            expert_impl=impl,
            defaults=AUTO_EXPERT_IMPL,
            reads_in_place=in_place,
            mla=cfg.attn.kind == "mla",
        )
        op_impls.log("monolithic", self._op_impls)
        if in_place:  # the expert weights in the layout it reads fastest
            self.stacked = store_as_panels(self.stacked)
        dtype = cache_dtype or params["embed"].dtype
        self._new_cache = lambda: init_stacked_cache(cfg, self.stacked, self.num_cache_slots, dtype)
        self.cache = self._new_cache()
        self.brownout = brownout
        self._brownout_threshold = None if brownout is None else brownout.threshold
        full = brownout is not None and brownout.use_full_brownout
        self.expert_queues = expert_queues
        if not isinstance(pause_every, int) or isinstance(pause_every, bool) or pause_every < 1:
            raise ValueError(
                f"pause_every must be a positive integer (layers between pause points), got {pause_every!r}"
            )
        self.pause_every = pause_every
        self._rounds = expert_bounds(cfg.moe.num_experts, expert_queues) if expert_queues else []
        if self._rounds and brownout is not None:
            raise ValueError("expert_queues and brownout cannot be combined (per-expert queues serve original experts)")
        self._queued = None  # (ids, first expert not yet served) while a step waits between expert rounds
        dtype = self.stacked["embed"].dtype

        def some_layers(group, x, batch, group_cache, start, threshold, n):  # the layer-by-layer mode
            brownout = None if threshold is None else Brownout(threshold, (batch.slots >= 0).reshape(-1), full)

            def body(carry, index):
                x, group_cache = carry
                layer = layer_view(group, index, dtype, in_place=in_place)
                step = layer_step(layer, cfg, x, batch, group_cache, block_size, index, brownout, impl, in_place)
                return step, None

            (x, group_cache), _ = jax.lax.scan(body, (x, group_cache), start + jnp.arange(n))
            return x, group_cache

        def gate(group, x, batch, group_cache, index):  # expert queues: attention side + gating
            layer = layer_view(group, index, dtype, in_place=in_place)
            h, xn, group_cache = attention_side(layer, cfg, x, batch, group_cache, block_size, index, in_place)
            xn = xn.reshape(-1, xn.shape[-1])
            ids, weights = route(layer["moe"], cfg.moe, xn)
            ids = jnp.where((batch.slots >= 0).reshape(-1, 1), ids, -1)  # padding queues nowhere
            return h, xn, ids, weights, jnp.zeros(xn.shape, jnp.float32), group_cache

        def expert_round(group, h, xn, ids, weights, partial, index, lo, hi):
            partial = serve_round(
                layer_view(group, index, dtype)["moe"], xn, ids, weights, partial, lo, hi, index, impl
            )
            return partial, h + partial.reshape(h.shape).astype(h.dtype)

        def head(params, x, logits_index):
            if logits_index is not None:
                x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
            return lm_head(params, cfg, x)

        self._step = step_program(cfg, block_size, impl, full)
        self._embed = jax.jit(embed)
        self._layers = jax.jit(some_layers, donate_argnums=(3,), static_argnums=(6,))
        self._head = jax.jit(head)
        self._gate = jax.jit(gate, donate_argnums=(3,))
        self._expert_round = jax.jit(expert_round)

    @property
    def brownout_threshold(self) -> float | None:
        """The brownout threshold of the next steps (None: built without brownout); it may change
        between steps without recompiling."""
        return self._brownout_threshold

    @brownout_threshold.setter
    def brownout_threshold(self, value) -> None:
        if self.brownout is None:
            raise ValueError("brownout_threshold: this executor was built without brownout")
        self._brownout_threshold = check_threshold(value)

    @property
    def params(self) -> dict:
        """Per-layer parameters (views of the stacked arrays)."""
        return unstack_layers(self.stacked)

    def op_impls(self) -> dict[str, str]:
        """Op -> the implementation this executor's programs run (``runtime.op_impls``)."""
        return dict(self._op_impls)

    def expert_activation_counts(self) -> None:
        """The fused program does not count expert activations."""
        return None

    def expert_queue_depth(self):
        """Assignments waiting in each expert's queue [E] while a step is paused between expert
        rounds (None anywhere else)."""
        if self._queued is None:
            return None
        ids, served_below = self._queued
        return queue_depth(jax.device_get(ids), served_below, self.cfg.moe.num_experts)

    def reset_cache(self) -> None:
        """A fresh (zero) KV cache, e.g. after a failed step deleted the donated one."""
        self.cache = self._new_cache()

    def _args(self, tokens, batch: AttentionBatch, logits_index):
        batch = AttentionBatch(*(_int32(a) for a in batch))
        index = None if logits_index is None else _int32(logits_index)
        return _int32(tokens), batch, index

    def lower(
        self, tokens, batch: AttentionBatch, logits_index
    ) -> tuple[list[jax.stages.Lowered], jax.ShapeDtypeStruct]:
        """The fused step program for these shapes, lowered (not compiled, not run), and the logits'
        shape (``executor.LowersAhead``): the same arguments as ``forward``'s, so compiling it fills
        the cache ``forward`` looks in."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        threshold = None if self.brownout_threshold is None else np.float32(self.brownout_threshold)
        lowered = self._step.lower(self.stacked, tokens, batch, self.cache, index, threshold)
        return [lowered], lowered.out_info[0]

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache.

        ``between_layers(n)``: run layer by layer (one program per ``pause_every`` layers of a layer
        group, the first layer's index a traced value) and call it after each program but the
        last (``n``: the layers done); what it runs on this
        executor meanwhile (another batch, on other KV slots) does not change this step's result.
        With ``expert_queues``, ``between_layers(n)`` is also called between the expert rounds of a
        MoE layer (``n``: the layers done so far).
        Without it: the whole model as one fused program (the fast path)."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        threshold = None if self.brownout_threshold is None else np.float32(self.brownout_threshold)
        if between_layers is None:
            logits, self.cache = self._step(self.stacked, tokens, batch, self.cache, index, threshold)
            return logits
        x = self._embed(self.stacked, tokens)
        pause = PausePoints(between_layers)
        done, total = 0, self.cfg.num_layers
        for g, group in enumerate(self.stacked["groups"]):
            size, j = jax.tree.leaves(group)[0].shape[0], 0
            while j < size:
                if self._rounds and "moe" in group:
                    x, n = self._queued_layer(g, j, x, batch, lambda partial: pause(done, partial)), 1
                else:
                    n = min(self.pause_every, size - j)
                    x, self.cache[g] = self._layers(group, x, batch, self.cache[g], np.int32(j), threshold, n)
                j, done = j + n, done + n
                if done < total:
                    pause(done, x)
        return self._head(self.stacked, x, index)

    def _queued_layer(self, g: int, j: int, x, batch: AttentionBatch, pause_point):
        """Layer ``j`` of group ``g`` with per-expert queues: attention and gating, then the expert
        rounds with ``pause_point(partial)`` between them; the tokens' outputs join the residual stream
        after the last round."""
        group = self.stacked["groups"][g]
        h, xn, ids, weights, partial, self.cache[g] = self._gate(group, x, batch, self.cache[g], np.int32(j))
        for r, (lo, hi) in enumerate(self._rounds):
            partial, x = self._expert_round(
                group, h, xn, ids, weights, partial, np.int32(j), np.int32(lo), np.int32(hi)
            )
            if r + 1 < len(self._rounds):
                self._queued = (ids, hi)
                try:
                    pause_point(partial)
                finally:
                    self._queued = None
        return x
