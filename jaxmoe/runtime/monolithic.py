"""The monolithic executor: every layer's attention and experts on one device set, the baseline the
disaggregated runtime is checked against and the single-device default.

A step is one program per layer (compiled once per layer structure and shape: DeepSeek's dense first
layers and its MoE layers are two programs, whatever the depth), called over each layer's own
parameter and KV-cache buffers, between an embedding and an LM-head program. No weight is sliced out
of a bigger array at run time: XLA:CPU copies a dynamically sliced matmul operand before the matmul,
and in the earlier form (one ``lax.scan`` over weights stacked by layer) those copies cost more than
the matmuls (BENCHMARKS.md, issue 17). On CPU the routed experts are also kept one buffer per expert
(``PerExpert``) for the ``expert_loop`` implementation.

``forward`` returns logits that stay on device; ``ModelRunner`` samples them with the sampler's own
program. Called with ``between_layers``, it calls it at the pause points (every ``pause_every``
layers, and between expert rounds with per-expert queues): QLLM's layer-level preemption.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.brownout.config import check_threshold
from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.models.attention import AttentionBatch, init_layer_cache
from jaxmoe.models.common import pack16
from jaxmoe.models.experts import Brownout
from jaxmoe.models.router import route
from jaxmoe.models.transformer import attention_side, embed, layer_step, lm_head
from jaxmoe.pallas_kernels.expert_ffn import PerExpert, resolve
from jaxmoe.runtime.expert_queues import expert_bounds, queue_depth, serve_round
from jaxmoe.runtime.pause_points import PausePoints

# The expert-FFN implementation "auto" resolves to (``models.experts.AUTO_EXPERT_IMPL`` is the
# disaggregated expert program's): on XLA:CPU a loop over experts with one buffer per expert.
AUTO_EXPERT_IMPL = {"cpu": "expert_loop", "other": "dense"}
ROUTED = ("w_gate", "w_up", "w_down")


def _int32(a):
    """``a`` as int32: jax arrays stay on device, anything else becomes a host array (a no-op for what
    ``ModelRunner.prepare`` builds) that the jitted call transfers without a separate dispatch."""
    if isinstance(a, jax.Array):
        return a if a.dtype == jnp.int32 else a.astype(jnp.int32)
    return np.asarray(a, np.int32)


def _per_expert(p: dict) -> dict:
    """A routed-experts dict with its stacked [E, ...] weights split into one buffer per expert
    (16-bit floats as bits: ``PerExpert``)."""
    split = PerExpert.split(*(p[k] for k in ROUTED), packed=True)
    return {**p, **dict(zip(ROUTED, split))}


def _stacked(p: dict, dtype) -> dict:
    """The inverse of ``_per_expert``."""
    if not isinstance(p["w_gate"], tuple):
        return p
    return {**p, **dict(zip(ROUTED, PerExpert(*(p[k] for k in ROUTED)).stacked(dtype)))}


def _expert_layout(layer: dict, convert) -> dict:
    """``layer`` with ``convert`` applied to its routed experts (and their united experts)."""
    if "moe" not in layer:
        return layer
    moe = convert(layer["moe"])
    if "united" in moe:
        moe = {**moe, "united": convert(moe["united"])}
    return {**layer, "moe": moe}


class MonolithicExecutor:
    """Owns the per-layer parameters and KV caches; ``forward`` runs one step over all layers."""

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
        ``AUTO_EXPERT_IMPL``). ``brownout``: a ``BrownoutConfig`` (the params must hold united experts,
        ``jaxmoe.brownout.united.attach``); its threshold is ``brownout_threshold``, which may
        change between steps (SALC) without recompiling. ``expert_queues``: with ``between_layers``,
        serve each MoE layer's expert queues in this many rounds with a pause point between
        them (QLLM per-expert queues, ``runtime.expert_queues``; 0: one expert program per layer).
        ``pause_every``: with ``between_layers``, layers between pause points."""
        self.cfg, self.block_size = cfg, block_size
        self.kv_layout = KVLayout.for_slots(num_slots, block_size)
        self.num_attention, self.num_cache_slots = 1, self.kv_layout.num_slots
        self.expert_impl = impl = resolve(expert_impl, AUTO_EXPERT_IMPL)
        layout = _per_expert if impl == "expert_loop" else (lambda p: p)
        self.globals = {k: v for k, v in params.items() if k != "layers"}
        self.layers = [_expert_layout(layer, layout) for layer in params["layers"]]
        dtype = cache_dtype or params["embed"].dtype
        self._new_cache = lambda: [  # 16-bit floats as bits: see common.pack16
            jax.tree.map(pack16, init_layer_cache(cfg, self.num_cache_slots, dtype)) for _ in self.layers
        ]
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

        def layer(layer, x, batch, cache, threshold):
            brownout = None if threshold is None else Brownout(threshold, (batch.slots >= 0).reshape(-1), full)
            return layer_step(layer, cfg, x, batch, cache, block_size, brownout, impl)

        def gate(layer, x, batch, cache):  # expert queues: attention side + gating
            h, xn, cache = attention_side(layer, cfg, x, batch, cache, block_size)
            xn = xn.reshape(-1, xn.shape[-1])
            ids, weights = route(layer["moe"], cfg.moe, xn)
            ids = jnp.where((batch.slots >= 0).reshape(-1, 1), ids, -1)  # padding queues nowhere
            return h, xn, ids, weights, jnp.zeros(xn.shape, jnp.float32), cache

        def expert_round(moe, h, xn, ids, weights, partial, lo, hi):
            partial = serve_round(moe, xn, ids, weights, partial, lo, hi, impl)
            return partial, h + partial.reshape(h.shape).astype(h.dtype)

        def head(params, x, logits_index):
            if logits_index is not None:
                x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
            return lm_head(params, cfg, x)

        self._embed = jax.jit(embed)
        self._layer = jax.jit(layer, donate_argnums=(3,))
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
        """Per-layer parameters, routed experts stacked [E, ...] (as loaded)."""
        dtype = self.globals["embed"].dtype
        return {
            **self.globals,
            "layers": [_expert_layout(layer, lambda p: _stacked(p, dtype)) for layer in self.layers],
        }

    def expert_activation_counts(self) -> None:
        """The monolithic programs do not count expert activations."""
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

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache.

        ``between_layers(n)``: called at each pause point (``n``: the layers done), every
        ``pause_every`` layers and, with ``expert_queues``, between the expert rounds of a MoE
        layer; what it runs on this executor meanwhile (another batch, on other KV slots) does not
        change this step's result."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        threshold = None if self.brownout_threshold is None else np.float32(self.brownout_threshold)
        pause = None if between_layers is None else PausePoints(between_layers)
        x = self._embed(self.globals, tokens)
        total = len(self.layers)
        for i, layer in enumerate(self.layers):
            if pause is not None and self._rounds and "moe" in layer:
                x = self._queued_layer(i, x, batch, lambda partial, done=i: pause(done, partial))
            else:
                x, self.cache[i] = self._layer(layer, x, batch, self.cache[i], threshold)
            done = i + 1
            if pause is not None and done < total and done % self.pause_every == 0:
                pause(done, x)
        return self._head(self.globals, x, index)

    def _queued_layer(self, i: int, x, batch: AttentionBatch, pause_point):
        """Layer ``i`` with per-expert queues: attention and gating, then the expert rounds with
        ``pause_point(partial)`` between them; the tokens' outputs join the residual stream after the
        last round."""
        layer = self.layers[i]
        h, xn, ids, weights, partial, self.cache[i] = self._gate(layer, x, batch, self.cache[i])
        for r, (lo, hi) in enumerate(self._rounds):
            partial, x = self._expert_round(layer["moe"], h, xn, ids, weights, partial, np.int32(lo), np.int32(hi))
            if r + 1 < len(self._rounds):
                self._queued = (ids, hi)
                try:
                    pause_point(partial)
                finally:
                    self._queued = None
        return x
