"""The monolithic executor: every layer's attention and experts in one jitted program on one device
set.  It is the baseline the disaggregated runtime is checked against, and the single-GPU default.

``forward`` returns logits that stay on device; ``ModelRunner`` samples them with the sampler's own
program (one per batch size, shared by every token bucket: the sampler is not compiled again into
each step program).

The MoE layers route with an ``ExpertRouting`` (``models.routing``; top-k by default): their expert
weights are stacked over the routing's E + U logical experts, and ``routing_state`` (e.g.
BrownoutServe's threshold; per phase: ``models.routing.PhaseStates``, resolved per call) is a traced
argument of the step programs, so it may change between steps without recompiling. ``set_params``
replaces the parameters between steps (e.g. united experts of another k: BrownoutServe's Experts
Loader), keeping the KV cache. With ``expert_rounds`` a layer-by-layer step serves each MoE layer's logical
experts range by range, with a pause point between ranges (QLLM's per-expert queues:
``jaxmoe.qllm.expert_queues`` makes the ranges).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.experts import AUTO_EXPERT_IMPL, TOP_K, routed_experts_in
from jaxmoe.models.routing import ExpertRouting, extra_experts, for_call, logical_params
from jaxmoe.models.transformer import (
    attention_side,
    embed,
    INVARIANT,
    forward,
    in_place_mode,
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
from jaxmoe.runtime.executor import RowMerge
from jaxmoe.runtime.pause_points import PausePoints


def _int32(a):
    """``a`` as int32: jax arrays stay on device, anything else becomes a host array (a no-op for what
    ``ModelRunner.prepare`` builds) that the jitted call transfers without a separate dispatch."""
    if isinstance(a, jax.Array):
        return a if a.dtype == jnp.int32 else a.astype(jnp.int32)
    return np.asarray(a, np.int32)


def check_rounds(rounds, num_experts: int) -> list[tuple[int, int]]:
    """``rounds`` as a list of (lo, hi): non-empty, contiguous ranges that cover the logical experts
    0 .. ``num_experts`` in order (None or empty: no rounds); a ``ValueError`` naming ``expert_rounds``
    otherwise."""
    if rounds is None or (isinstance(rounds, (list, tuple)) and not rounds):
        return []
    try:
        out = [(lo, hi) for lo, hi in rounds]
    except (TypeError, ValueError):
        out = []
    ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for r in out for v in r)
    edges = [lo for lo, _ in out] + [out[-1][1]] if out else []
    contiguous = all(a[1] == b[0] for a, b in zip(out, out[1:]))
    if not (ints and contiguous and edges and edges[0] == 0 and edges[-1] == num_experts) or any(
        lo >= hi for lo, hi in out
    ):
        raise ValueError(
            f"expert_rounds must be contiguous ranges (lo, hi) covering the {num_experts} logical experts "
            f"in order, got {rounds!r}"
        )
    return [(int(lo), int(hi)) for lo, hi in out]


def queue_depth(ids: np.ndarray, served_below: int, num_experts: int) -> np.ndarray:
    """Assignments still queued at each logical expert [E'] when the experts below ``served_below``
    are done (``ids`` [T, K'], -1: no expert)."""
    ids = np.asarray(ids).reshape(-1)
    waiting = ids[ids >= served_below]
    return np.bincount(waiting, minlength=num_experts)[:num_experts]


def step_program(cfg: ModelConfig, block_size: int, impl: str, routing):
    """The fused step, jitted: (stacked params, tokens, batch, stacked cache, logits_index, routing
    state) -> (logits, cache), every layer in one program (the cache donated). ``impl``: a resolved
    expert-FFN implementation; ``routing``: the expert routing. What ``MonolithicExecutor.forward``
    runs and ``jaxmoe lower`` lowers."""

    def step(params, tokens, batch, cache, logits_index, state):
        return forward(params, cfg, tokens, batch, cache, block_size, logits_index, routing, state, impl)

    return jax.jit(step, donate_argnums=(3,))


def layer_programs(cfg: ModelConfig, block_size: int, impl: str, routing, dtype, in_place: bool | str):
    """The layer-by-layer mode's programs, jitted (what a pausable step runs, warm-up compiles and
    ``jaxmoe lower`` lowers): ``embed(params, tokens)``; ``layers(group, x, batch, group_cache, start,
    state, n)``: ``n`` (static) layers of a layer group from ``start`` (traced), the cache donated;
    ``head(params, x, logits_index)``. ``dtype``: the parameters'; ``in_place``: the expert weights
    are read in place (``cpu_kernel``)."""

    def some_layers(group, x, batch, group_cache, start, state, n):
        def body(carry, index):
            x, group_cache = carry
            layer = layer_view(group, index, dtype, in_place=in_place)
            step = layer_step(layer, cfg, x, batch, group_cache, block_size, index, routing, state, impl, in_place)
            return step, None

        (x, group_cache), _ = jax.lax.scan(body, (x, group_cache), start + jnp.arange(n))
        return x, group_cache

    def head(params, x, logits_index):
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        return lm_head(params, cfg, x, invariant=in_place == INVARIANT)

    return jax.jit(embed), jax.jit(some_layers, donate_argnums=(3,), static_argnums=(6,)), jax.jit(head)


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
        routing: ExpertRouting = TOP_K,
        routing_state=None,
        expert_impl: str = "auto",
        expert_rounds=None,
        pause_every: int = 1,
    ):
        """``expert_impl``: the expert-FFN implementation (``jaxmoe.pallas_kernels.expert_ffn``; "auto":
        ``models.experts.AUTO_EXPERT_IMPL``). ``routing``: how the MoE layers choose their logical
        experts (``models.routing``; the params must have what it needs, e.g. united experts);
        ``routing_state``: its traced per-step value, which may change between steps without
        recompiling (e.g. the brownout threshold, which SALC moves). ``expert_rounds``: in the
        layer-by-layer mode, serve each MoE layer's logical experts in these contiguous ranges
        [lo, hi) with a pause point between them (QLLM per-expert queues; None: one expert program
        per layer).
        ``pause_every``: in the layer-by-layer mode, layers per program (pause points every that many
        layers: fewer dispatches and host checks, a longer wait for latency-sensitive work)."""
        self.cfg, self.block_size = cfg, block_size
        self.kv_layout = KVLayout.for_slots(num_slots, block_size)
        self.num_attention, self.num_cache_slots = 1, self.kv_layout.num_slots
        self.expert_impl = impl = resolve(expert_impl, AUTO_EXPERT_IMPL)
        self.routing, self.routing_state = routing, routing_state
        self.params_version = 0  # bumped by ``set_params`` (the prefix cache keys KV by it)
        in_place = in_place_mode(impl)  # weights read in place by the CPU kernel (``cpu_kernel*``)
        self.num_logical_experts, self.stacked = self._stack(params, in_place)
        self._op_impls = op_impls.build(
            requested_expert_impl=expert_impl,
            expert_impl=impl,
            defaults=AUTO_EXPERT_IMPL,
            reads_in_place=bool(in_place),
            mla=cfg.attn.kind == "mla",
        )
        op_impls.log("monolithic", self._op_impls)
        dtype = cache_dtype or params["embed"].dtype
        self._new_cache = lambda: init_stacked_cache(cfg, self.stacked, self.num_cache_slots, dtype)
        self.cache = self._new_cache()
        if not isinstance(pause_every, int) or isinstance(pause_every, bool) or pause_every < 1:
            raise ValueError(
                f"pause_every must be a positive integer (layers between pause points), got {pause_every!r}"
            )
        self.pause_every = pause_every
        self.expert_rounds = check_rounds(expert_rounds, self.num_logical_experts)
        self._queued = None  # (ids, first expert not yet served) while a step waits between expert rounds
        self.pause_stage = None  # "layer" or "experts" while a layer-by-layer step waits at a pause point
        dtype = self.stacked["embed"].dtype

        def gate(group, x, batch, group_cache, index, state):  # expert rounds: attention side + routing
            layer = layer_view(group, index, dtype, in_place=in_place)
            h, xn, group_cache = attention_side(layer, cfg, x, batch, group_cache, block_size, index, in_place)
            xn = xn.reshape(-1, xn.shape[-1])
            valid = (batch.slots >= 0).reshape(-1)  # padding queues nowhere
            ids, weights = routing.route(layer["moe"], cfg.moe, xn, valid, state)
            return h, xn, ids, weights, jnp.zeros(xn.shape, jnp.float32), group_cache

        def expert_round(group, h, xn, ids, weights, partial, index, lo, hi):
            # a token's output joins the residual stream (h + partial) only after the last round
            moe = layer_view(group, index, dtype)["moe"]
            partial = partial + routed_experts_in(moe, xn, ids, weights, lo, hi, index, impl).astype(jnp.float32)
            return partial, h + partial.reshape(h.shape).astype(h.dtype)

        self._step = step_program(cfg, block_size, impl, routing)
        self._embed, self._layers, self._head = layer_programs(cfg, block_size, impl, routing, dtype, in_place)
        self._gate = jax.jit(gate, donate_argnums=(3,))
        self._expert_round = jax.jit(expert_round)

    def _stack(self, params: dict, in_place: bool):
        """(E + U logical experts, the stacked parameters: E + U logical experts per MoE layer, the expert
        weights as panels where the CPU kernel reads them in place)."""
        n = self.cfg.moe.num_experts + extra_experts(self.routing, params)
        stacked = stack_layers(logical_params(self.routing, params))
        return n, store_as_panels(stacked) if in_place else stacked

    def set_params(self, params: dict) -> None:
        """Serve ``params`` (a per-layer tree of the same model, with what the routing needs) from the
        next step on; between steps only. The routing's extra experts may differ in number (united
        experts of another k): the programs are traced again for the new shapes. The KV cache is kept,
        so requests in flight go on. A ``ValueError`` when the model's shapes differ, or the per-expert
        queues' rounds do not cover the new logical experts."""
        n = self.cfg.moe.num_experts + extra_experts(self.routing, params)
        if self.expert_rounds and n != self.num_logical_experts:
            raise ValueError(
                f"expert_rounds cover {self.num_logical_experts} logical experts, the new parameters have {n}"
            )
        old = {k: v for k, v in self.stacked.items() if k != "groups"}
        new_n, stacked = self._stack(params, in_place_mode(self.expert_impl))
        for k, v in old.items():
            if jax.tree.map(jnp.shape, v) != jax.tree.map(jnp.shape, stacked[k]):
                raise ValueError(f"set_params: {k} has other shapes than the model this executor serves")
        self.num_logical_experts, self.stacked = new_n, stacked
        self.params_version += 1

    @property
    def params(self) -> dict:
        """Per-layer parameters (views of the stacked arrays; the MoE layers' in the routing's logical
        form, from which an executor with the same routing can be built)."""
        return unstack_layers(self.stacked)

    def op_impls(self) -> dict[str, str]:
        """Op -> the implementation this executor's programs run (``runtime.op_impls``)."""
        return dict(self._op_impls)

    def expert_activation_counts(self) -> None:
        """The fused program does not count expert activations."""
        return None

    def expert_queue_depth(self):
        """Assignments waiting in each logical expert's queue [E + U] while a step is paused between
        expert rounds (None anywhere else)."""
        if self._queued is None:
            return None
        ids, served_below = self._queued
        return queue_depth(jax.device_get(ids), served_below, self.num_logical_experts)

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
        state = for_call(self.routing_state, tokens.shape[1])
        lowered = self._step.lower(self.stacked, tokens, batch, self.cache, index, state)
        return [lowered], lowered.out_info[0]

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache.

        ``between_layers(n)``: run layer by layer (one program per ``pause_every`` layers of a layer
        group, the first layer's index a traced value) and call it after each program but the
        last (``n``: the layers done); what it runs on this
        executor meanwhile (another batch, on other KV slots) does not change this step's result.
        With ``expert_rounds``, ``between_layers(n)`` is also called between the expert rounds of a
        MoE layer (``n``: the layers done so far). At a layer boundary it may return a ``RowMerge``
        (QLLM's merge): the logits are then those of the merged rows (``executor.MergesRows``).
        Without it: the whole model as one fused program (the fast path)."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        state = for_call(self.routing_state, tokens.shape[1])  # per phase: a decode or a prefill call
        if between_layers is None:
            logits, self.cache = self._step(self.stacked, tokens, batch, self.cache, index, state)
            return logits
        x = self._embed(self.stacked, tokens)
        pause = PausePoints(between_layers)
        done, total = 0, self.cfg.num_layers
        for g, j, n, queued in self._layer_steps():
            x = self._run_layers(g, j, n, queued, x, batch, state, lambda partial: self._pause(pause, done, partial))
            done += n
            if done < total:
                self.pause_stage = "layer"
                try:
                    merge = pause(done, x)
                finally:
                    self.pause_stage = None
                if merge is not None:  # QLLM's merge: new rows catch up to this layer, then join the batch
                    x, batch, index = self._merge(merge, x, done, state)
        return self._head(self.stacked, x, index)

    def merge_ready(self) -> bool:
        """Whether the step now paused can take rows (``executor.MergesRows``): at a layer boundary."""
        return self.pause_stage == "layer"

    def _pause(self, pause, done: int, partial) -> None:
        """A pause point between the expert groups of a MoE layer (rows cannot join here)."""
        self.pause_stage = "experts"
        try:
            pause(done, partial)
        finally:
            self.pause_stage = None

    def _layer_steps(self):
        """(group, first layer in it, layers, per-expert queues) of each program of the layer-by-layer
        mode, in order."""
        for g, group in enumerate(self.stacked["groups"]):
            size, j = jax.tree.leaves(group)[0].shape[0], 0
            while j < size:
                queued = bool(self.expert_rounds) and "moe" in group
                n = 1 if queued else min(self.pause_every, size - j)
                yield g, j, n, queued
                j += n

    def _run_layers(self, g: int, j: int, n: int, queued: bool, x, batch, state, pause_point=None):
        if queued:
            return self._queued_layer(g, j, x, batch, state, pause_point)
        group = self.stacked["groups"][g]
        x, self.cache[g] = self._layers(group, x, batch, self.cache[g], np.int32(j), state, n)
        return x

    def _merge(self, merge: RowMerge, x, layers: int, state):
        """QLLM's merge (Fig. 1b): the new rows run layers 0 .. ``layers``-1 alone (the catch-up, the
        same per-layer programs as the step's), then the running rows and the new ones form one batch
        (assembled on the host: no program per pair of shapes) for the remaining layers."""
        tokens, batch, _ = self._args(merge.tokens, merge.batch, None)
        new, done = self._embed(self.stacked, tokens), 0
        for g, j, n, queued in self._layer_steps():
            if done >= layers:
                break
            new = self._run_layers(g, j, n, queued, new, batch, state)
            done += n
        merged_batch = AttentionBatch(*(_int32(a) for a in merge.merged_batch))
        index = _int32(merge.merged_index)
        old, new = jax.device_get((x, new))
        B, T = merged_batch.slots.shape
        merged = np.zeros((B, T, old.shape[-1]), old.dtype)
        merged[: merge.keep, : old.shape[1]] = old[: merge.keep]
        merged[merge.keep : merge.keep + merge.rows, : new.shape[1]] = new[: merge.rows]
        return jax.device_put(merged), merged_batch, index

    def _queued_layer(self, g: int, j: int, x, batch: AttentionBatch, state, pause_point=None):
        """Layer ``j`` of group ``g`` with per-expert queues: attention and routing, then the expert
        rounds with ``pause_point(partial)`` between them (None: no pauses); the tokens' outputs join the
        residual stream after the last round."""
        group = self.stacked["groups"][g]
        h, xn, ids, weights, partial, self.cache[g] = self._gate(group, x, batch, self.cache[g], np.int32(j), state)
        for r, (lo, hi) in enumerate(self.expert_rounds):
            partial, x = self._expert_round(
                group, h, xn, ids, weights, partial, np.int32(j), np.int32(lo), np.int32(hi)
            )
            if pause_point is not None and r + 1 < len(self.expert_rounds):
                self._queued = (ids, hi)
                try:
                    pause_point(partial)
                finally:
                    self._queued = None
        return x
