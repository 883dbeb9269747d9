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
Loader), keeping the KV cache. With ``expert_rounds`` a layer-by-layer step runs each MoE layer as
QLLM's per-expert queues (``jaxmoe.qllm.expert_queues`` makes the ranges): attention side, routing
(every assignment joins its expert's FIFO queue), then rounds that serve the queues range by range,
with a pause point after the attention side, after the routing and between rounds; rows merged at
one of them have their assignments served ahead of the waiting ones.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.pallas_kernels.expert_ffn.cpu_kernel import program_jit
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.experts import AUTO_EXPERT_IMPL, TOP_K, routed_experts
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
    stack_layer_by_layer,
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


def _moe(group: dict) -> dict:
    """A layer group's MoE part, as a group (what the per-expert queues' routing and rounds read)."""
    return {"moe": group["moe"]}


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


def queue_depth(queued: np.ndarray, num_experts: int) -> np.ndarray:
    """Assignments waiting at each logical expert [E'] (``queued`` [T, K']: the logical expert each
    waiting (token, choice) assignment queues at; -1: served, or no expert)."""
    queued = np.asarray(queued).reshape(-1)
    return np.bincount(queued[queued >= 0], minlength=num_experts)[:num_experts]


def _place(old, new, keep: int, rows: int, old_bt, new_bt, B: int, T: int, fill):
    """The merged batch's [B, T, ...] (or flat [B*T, ...]) array: the running step's first ``keep``
    rows of ``old`` (its rows x tokens ``old_bt``), then the first ``rows`` rows of ``new``
    (``new_bt``), then padding (``fill``)."""
    flat = old.ndim == 2  # [B*T, ...]: per token (the experts' input, the queues, the partial outputs)
    old = old.reshape(*old_bt, *old.shape[1 if flat else 2 :])
    new = new.reshape(*new_bt, *new.shape[1 if flat else 2 :])
    out = np.full((B, T, *old.shape[2:]), fill, old.dtype)
    out[:keep, : old.shape[1]] = old[:keep]
    out[keep : keep + rows, : new.shape[1]] = new[:rows]
    return out.reshape(B * T, *out.shape[2:]) if flat else out


def step_program(cfg: ModelConfig, block_size: int, impl: str, routing):
    """The fused step, jitted: (stacked params, tokens, batch, stacked cache, logits_index, routing
    state) -> (logits, cache), every layer in one program (the cache donated). ``impl``: a resolved
    expert-FFN implementation; ``routing``: the expert routing. What ``MonolithicExecutor.forward``
    runs and ``jaxmoe lower`` lowers."""

    def step(params, tokens, batch, cache, logits_index, state):
        return forward(params, cfg, tokens, batch, cache, block_size, logits_index, routing, state, impl)

    return program_jit(impl == "cpu_kernel_invariant")(step, donate_argnums=(3,))  # deterministic mode


def layer_programs(cfg: ModelConfig, block_size: int, impl: str, routing, dtype, in_place: bool | str):
    """The layer-by-layer mode's programs, jitted (what a pausable step runs, what a step runs where
    the executor shares them, ``split_step``; what warm-up compiles and ``jaxmoe lower`` lowers):
    ``embed(params, tokens)``; ``layers(group, x, batch, group_cache, start, state, n)``: ``n`` layers
    of a layer group from ``start`` (both traced int32 scalars: one program per group, whatever the
    pause points), the cache donated; ``head(params, x, logits_index)``. ``dtype``: the parameters';
    ``in_place``: the expert weights are read in place (``cpu_kernel``)."""

    def some_layers(group, x, batch, group_cache, start, state, n):
        def body(i, carry):
            x, group_cache = carry
            index = start + i
            layer = layer_view(group, index, dtype, in_place=in_place)
            return layer_step(layer, cfg, x, batch, group_cache, block_size, index, routing, state, impl, in_place)

        return jax.lax.fori_loop(0, n, body, (x, group_cache))

    def head(params, x, logits_index):
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        return lm_head(params, cfg, x, invariant=in_place == INVARIANT, in_place=in_place is True)

    jit = program_jit(in_place == INVARIANT)
    return jit(embed), jit(some_layers, donate_argnums=(3,)), jit(head)


class MonolithicExecutor:
    """Owns the parameters and the paged KV cache; ``forward`` runs one step over all layers.

    Parameters and caches are stacked per layer group (``models.transformer.stack_layers``): the
    jitted step scans over layers."""

    # ``forward`` dispatches and returns (its tokens may be a device array): the engine may dispatch the
    # next step before reading this one's tokens (async scheduling, ``engine.engine``)
    overlaps_steps = True

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
        release_params: bool = False,
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
        layers: fewer dispatches and host checks, a longer wait for latency-sensitive work).
        ``release_params``: ``params["layers"]`` is the caller's to give up: its entries are set to None
        as they are stacked (``stack_layer_by_layer``), so start-up never holds the model twice."""
        self.cfg, self.block_size = cfg, block_size
        self.kv_layout = KVLayout.for_slots(num_slots, block_size)
        self.num_attention, self.num_cache_slots = 1, self.kv_layout.num_slots
        self.expert_impl = impl = resolve(expert_impl, AUTO_EXPERT_IMPL)
        self.routing, self.routing_state = routing, routing_state
        self.params_version = 0  # bumped by ``set_params`` (the prefix cache keys KV by it)
        in_place = in_place_mode(impl)  # weights read in place by the CPU kernel (``cpu_kernel*``)
        self.num_logical_experts, self.stacked = self._stack(params, in_place, release_params)
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
        self._scalars: dict[int, jax.Array] = {}  # ``_scalar``
        self.pause_stage = None  # "layer" or "experts" while a layer-by-layer step waits at a pause point
        # a step that does not pause runs the layer-by-layer programs too (embed, each layer group's
        # ``layers`` over the whole group, head) instead of the fused program, so a pausable step
        # compiles nothing more (set where steps may pause, a layer hook and a serving loop's poll:
        # ``LLMEngine.poll``; elsewhere the fused program)
        self.split_step = False
        dtype = self.stacked["embed"].dtype

        def attend(group, x, batch, group_cache, index):  # per-expert queues: a MoE layer's attention side
            layer = layer_view(group, index, dtype, in_place=in_place)
            h, xn, group_cache = attention_side(layer, cfg, x, batch, group_cache, block_size, index, in_place)
            return h, xn.reshape(-1, xn.shape[-1]), group_cache

        # ``route`` and ``expert_round`` take the group's MoE part only (``_moe``): the rest would be
        # flattened at every call for nothing (R + 1 calls per MoE layer)
        def route(group, xn, slots, index, state):  # ... its routing: every assignment joins its expert's queue
            layer = layer_view(group, index, dtype, in_place=in_place)
            valid = (slots >= 0).reshape(-1)  # padding queues nowhere
            queued, weights = routing.route(layer["moe"], cfg.moe, xn, valid, state)
            return queued, weights, jnp.zeros(xn.shape, jnp.float32)

        def expert_round(group, h, xn, queued, weights, partial, index, lo, hi, first):
            # serve the queued assignments at experts [lo, hi) of the tokens from ``first`` on; a served
            # assignment leaves its queue (-1); a token's output joins the residual stream (h + partial)
            # only after the layer's last round
            moe = layer_view(group, index, dtype)["moe"]
            mine = (queued >= lo) & (queued < hi) & (jnp.arange(queued.shape[0])[:, None] >= first)
            served = routed_experts(moe, xn, jnp.where(mine, queued, -1), weights, index, impl)
            partial = partial + served.astype(jnp.float32)
            return jnp.where(mine, -1, queued), partial, h + partial.reshape(h.shape).astype(h.dtype)

        self._step = step_program(cfg, block_size, impl, routing)
        self._embed, self._layers, self._head = layer_programs(cfg, block_size, impl, routing, dtype, in_place)
        jit = program_jit(in_place == INVARIANT)
        self._attend = jit(attend, donate_argnums=(3,))
        self._route = jit(route)
        self._expert_round = jit(expert_round)

    def _stack(self, params: dict, in_place: bool, release: bool = False):
        """(E + U logical experts, the stacked parameters: E + U logical experts per MoE layer, the expert
        weights as panels where the CPU kernel reads them in place), placed layer by layer
        (``release``: ``params["layers"]``' entries are dropped as they are placed)."""
        n = self.cfg.moe.num_experts + extra_experts(self.routing, params)
        logical = logical_params(self.routing, params)
        owners = (logical["layers"], params["layers"]) if release else (logical["layers"],)
        return n, stack_layer_by_layer(logical, bool(in_place), owners)

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
        """Assignments waiting in each logical expert's queue [E + U] while a step is paused inside a
        MoE layer after its routing (None anywhere else)."""
        if self._queued is None:
            return None
        return queue_depth(jax.device_get(self._queued), self.num_logical_experts)

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
        if self.split_step:
            programs = self._lower_programs(tokens, batch, index, self._whole_groups())
            return programs, programs[-1].out_info
        state = for_call(self.routing_state, tokens.shape[1])
        lowered = self._step.lower(self.stacked, tokens, batch, self.cache, index, state)
        return [lowered], lowered.out_info[0]

    def lower_layers(self, tokens, batch: AttentionBatch, logits_index) -> list[jax.stages.Lowered]:
        """The programs ``forward(..., between_layers=...)`` runs for these shapes, lowered (not
        compiled, not run): ``embed``, one ``layers`` program per layer group (or, with
        ``expert_rounds``, a MoE layer's ``attend``, ``route`` and ``expert_round``) and ``head``;
        with ``split_step`` only those ``lower`` does not return (the per-expert queues' programs).
        Traced on the argument types of ``forward``'s (uncommitted device arrays, the layer index,
        layer count and round bounds as traced int32 scalars), so compiling them fills the caches a
        layer-by-layer step looks in; a merge runs the same programs on shapes of the plan."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        skip = self._whole_groups() if self.split_step else []
        return self._lower_programs(tokens, batch, index, self._layer_steps(), skip)

    def _lower_programs(self, tokens, batch, index, steps, skip=()) -> list[jax.stages.Lowered]:
        """``embed``, the programs of ``steps`` (``_layer_steps``' form; those of ``skip`` left out:
        already lowered) and ``head``, lowered on ``forward``'s argument types; the head last."""
        state = for_call(self.routing_state, tokens.shape[1])

        def like(info):  # an intermediate array's type (the program's output), as an argument
            return jax.ShapeDtypeStruct(info.shape, info.dtype)

        embed = self._embed.lower(self.stacked, tokens)
        x = like(embed.out_info)
        i = jax.ShapeDtypeStruct((), jnp.int32)
        seen = {(g, queued) for g, _, _, queued in skip}
        programs = [] if skip else [embed]
        for g, _, _, queued in steps:
            if (g, queued) in seen:  # the first layer and the count are traced: one program per group
                continue
            seen.add((g, queued))
            group = self.stacked["groups"][g]
            if not queued:
                programs.append(self._layers.lower(group, x, batch, self.cache[g], i, state, i))
                continue
            attend = self._attend.lower(group, x, batch, self.cache[g], i)
            h, xn = (like(a) for a in attend.out_info[:2])
            route = self._route.lower(_moe(group), xn, batch.slots, i, state)
            queued_ids, weights, partial = (like(a) for a in route.out_info)
            rounds = self._expert_round.lower(_moe(group), h, xn, queued_ids, weights, partial, i, i, i, i)
            programs += [attend, route, rounds]
        return programs if skip else programs + [self._head.lower(self.stacked, x, index)]

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None); updates the KV cache.

        ``between_layers(n)``: run layer by layer (one program per ``pause_every`` layers of a layer
        group, the first layer's index a traced value) and call it after each program, the last
        layer's too, before the head (``n``: the layers done); what it runs on this
        executor meanwhile (another batch, on other KV slots) does not change this step's result.
        With ``expert_rounds``, ``between_layers(n)`` is also called inside each MoE layer (``n``: the
        layers done so far; ``pause_stage``): after its attention side ("attention"), after its
        routing ("routing") and between its expert rounds ("experts"). At every pause point it may
        return a ``RowMerge`` (QLLM's merge): the logits are then those of the merged rows
        (``executor.MergesRows``). Without it: the whole model as one fused program (the fast path)."""
        tokens, batch, index = self._args(tokens, batch, logits_index)
        state = for_call(self.routing_state, tokens.shape[1])  # per phase: a decode or a prefill call
        if between_layers is None and not self.split_step:
            logits, self.cache = self._step(self.stacked, tokens, batch, self.cache, index, state)
            return logits
        # the batch goes to the device once, not with each of the step's programs (host arrays would be
        # copied again at every call: one per layer, R + 2 per MoE layer with per-expert queues)
        tokens, batch = jax.device_put((tokens, batch))
        x = self._embed(self.stacked, tokens)
        if between_layers is None:  # ``split_step``: each layer group in one call
            for g, j, n, _ in self._whole_groups():
                x = self._run_layers(g, j, n, False, x, batch, state)
            return self._head(self.stacked, x, index)
        pause = PausePoints(between_layers)
        done, total = 0, self.cfg.num_layers

        def at(stage, outputs, queued=None):  # a pause point inside a MoE layer
            return self._pause_at(pause, done, stage, outputs, queued)

        for g, j, n, queued in self._layer_steps():
            if queued:
                x, batch, index = self._queued_layer(g, j, done, x, batch, index, state, at)
            else:
                x = self._run_layers(g, j, n, False, x, batch, state)
            done += n
            # a pause point at every boundary, also after the last layer (then the merged rows run every
            # layer alone and join the batch for the head)
            merge = self._pause_at(pause, done, "layer", (x,), last=done == total)
            if merge is not None:  # QLLM's merge: new rows catch up to this layer, then join the batch
                x, batch, index = self._merge(merge, x, batch, done, state)
        return self._head(self.stacked, x, index)

    def merge_ready(self) -> bool:
        """Whether the step now paused can take rows (``executor.MergesRows``): at every pause point
        (a layer boundary, or a stage of a MoE layer with per-expert queues)."""
        return self.pause_stage is not None

    def _scalar(self, n: int) -> jax.Array:
        """``n`` as an int32 on the device, made once (a layer index, a round's experts, a first token):
        a host scalar would be copied to the device at every program call that takes it."""
        scalar = self._scalars.get(n)
        if scalar is None:
            scalar = self._scalars[n] = jax.device_put(np.int32(n))  # a transfer, no program (jnp.asarray compiles one)
        return scalar

    def _pause_at(self, pause, done: int, stage: str, outputs, queued=None, last: bool = False):
        """A pause point (``stage``) after the programs that produce ``outputs``; ``queued``: the
        queues then (after a MoE layer's routing); ``last``: the one after the last layer (it waits for
        ``outputs``); what the hook returns (rows to merge, or None)."""
        self.pause_stage, self._queued = stage, queued
        try:
            return pause.last(done, *outputs) if last else pause(done, *outputs)
        finally:
            self.pause_stage, self._queued = None, None

    def layer_group_sizes(self) -> list[int]:
        """Layers in each layer group (``pause_every`` counts within a group: a program never spans two)."""
        return [n for _, _, n, _ in self._whole_groups()]

    def _whole_groups(self) -> list[tuple[int, int, int, bool]]:
        """``_layer_steps``' form of a step that does not pause (``split_step``): each group at once."""
        return [(g, 0, jax.tree.leaves(group)[0].shape[0], False) for g, group in enumerate(self.stacked["groups"])]

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

    def _run_layers(self, g: int, j: int, n: int, queued: bool, x, batch, state):
        if queued:
            return self._queued_layer(g, j, 0, x, batch, None, state)[0]
        group = self.stacked["groups"][g]
        x, self.cache[g] = self._layers(group, x, batch, self.cache[g], self._scalar(j), state, self._scalar(n))
        return x

    def _catch_up(self, merge: RowMerge, layers: int, state):
        """The merged rows alone through the first ``layers`` layers (the same per-layer programs as
        the step's, writing their KV): (their hidden states, their batch)."""
        tokens, batch, _ = self._args(merge.tokens, merge.batch, None)
        new, done = self._embed(self.stacked, tokens), 0
        for g, j, n, queued in self._layer_steps():
            if done >= layers:
                break
            new = self._run_layers(g, j, n, queued, new, batch, state)
            done += n
        return new, batch

    def _join(self, merge: RowMerge, old: tuple, new: tuple, old_batch: AttentionBatch, new_batch):
        """The running rows' arrays ``old`` and the new rows' ``new`` as the merged batch's (assembled
        on the host: no program per pair of shapes): (arrays, merged batch, merged logits index)."""
        merged_batch = AttentionBatch(*(_int32(a) for a in merge.merged_batch))
        B, T = merged_batch.slots.shape
        old, new = jax.device_get((old, new))
        shapes = (tuple(old_batch.slots.shape), tuple(new_batch.slots.shape), B, T)
        arrays = tuple(
            jax.device_put(_place(o, n, merge.keep, merge.rows, *shapes, -1 if o.dtype.kind == "i" else 0))
            for o, n in zip(old, new)
        )
        return arrays, merged_batch, _int32(merge.merged_index)

    def _merge(self, merge: RowMerge, x, batch, layers: int, state):
        """QLLM's merge (Fig. 1b) at a layer boundary: the new rows run layers 0 .. ``layers``-1 alone
        (the catch-up), then the running rows and the new ones form one batch for the remaining
        layers."""
        new, new_batch = self._catch_up(merge, layers, state)
        (x,), batch, index = self._join(merge, (x,), (new,), batch, new_batch)
        return x, batch, index

    def _queued_layer(self, g: int, j: int, done: int, x, batch: AttentionBatch, index, state, at=None):
        """Layer ``j`` of group ``g`` (``done``: the layers before it) with per-expert queues: its
        attention side, its routing (every (token, choice) assignment joins the FIFO queue of its
        expert, token order = row order), then the expert rounds, each serving the queues of its
        experts; the tokens' outputs join the residual stream after the last round. ``at(stage,
        outputs, queued)``: the pause points after the attention side, after the routing and between
        rounds (None: no pauses). Rows merged at one of them (``RowMerge``) run the layers before
        alone, then this layer's attention side (and routing) alone, and join the batch; their
        assignments enter the queues ahead of the waiting ones: the next round serves them at every
        expert (also at the experts whose round is done), then the remaining rounds go on.
        Returns (x, batch, logits index): the batch is the merged one after a merge."""
        group, i = self.stacked["groups"][g], self._scalar(j)
        h, xn, self.cache[g] = self._attend(group, x, batch, self.cache[g], i)
        merge = None if at is None else at("attention", (h, xn))
        if merge is not None:
            (h, xn), batch, index, _ = self._merge_in_layer(merge, g, j, done, (h, xn), batch, state)
        moe = _moe(group)
        queued, weights, partial = self._route(moe, xn, batch.slots, i, state)
        todo, stage = [(lo, hi, 0) for lo, hi in self.expert_rounds], "routing"
        while True:
            merge = None if at is None else at(stage, (queued, partial), queued)
            if merge is not None:
                arrays, batch, index, first = self._merge_in_layer(
                    merge, g, j, done, (h, xn, queued, weights, partial), batch, state
                )
                h, xn, queued, weights, partial = arrays
                todo.insert(0, (0, self.num_logical_experts, first))  # the new tokens jump every queue
            lo, hi, first = todo.pop(0)
            queued, partial, x = self._expert_round(
                moe, h, xn, queued, weights, partial, i, self._scalar(lo), self._scalar(hi), self._scalar(first)
            )
            if not todo:
                return x, batch, index
            stage = "experts"

    def _merge_in_layer(self, merge: RowMerge, g: int, j: int, done: int, arrays: tuple, batch, state):
        """QLLM's merge inside a MoE layer: the new rows catch up through the ``done`` layers before
        it, then run its attention side (and, if ``arrays`` hold the queues, its routing) alone; then
        both form one batch. Returns (merged ``arrays``, batch, logits index, the merged batch's first
        token of the new rows)."""
        new, new_batch = self._catch_up(merge, done, state)
        group, i = self.stacked["groups"][g], self._scalar(j)
        h, xn, self.cache[g] = self._attend(group, new, new_batch, self.cache[g], i)
        fresh = (h, xn) if len(arrays) == 2 else (h, xn, *self._route(_moe(group), xn, new_batch.slots, i, state))
        arrays, merged_batch, index = self._join(merge, arrays, fresh, batch, new_batch)
        return arrays, merged_batch, index, merge.keep * merged_batch.slots.shape[1]
