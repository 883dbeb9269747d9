"""The disaggregated executor (JANUS 3.1-3.3): attention and experts on separate sub-meshes.

One step, as code (``DisaggregatedExecutor.forward``)::

    x, y = embed(tokens), 0                              # attention mesh, rows split P("attn")
    for each layer:
        x, xn, cache = attention.layer(x, y, ...)        # residual add of y, attention, dense MLP,
                                                         # on the attention mesh
        if MoE layer:
            xe = a2e(xn)                                 # full activations -> every expert device
            partials = expert.run(xe, ...)               # gate + AEBS + grouped matmul, per expert
                                                         # instance (shard_map over "expert")
            x = attention.shared(x, xn)                  # shared experts (FinDEP: attention side,
                                                         # dispatched after the experts: overlaps)
            y = e2a(partials)                            # sum of partials -> rows on attention mesh
        else:
            y = 0
    logits = attention.head(x, y)                        # last residual add, final norm, LM head
    return to_local(logits)                              # readable by this process

No jit spans both meshes: the transfers between them are explicit and counted per layer
(``transfer_stats``): in one process ``jaxmoe.runtime.transfer`` (one ``jax.device_put`` per hop
of the layer's plan); when the sub-meshes span processes (``jax.distributed``)
``jaxmoe.runtime.cross_process`` (the same plan as ppermute rounds; every process runs this same
code and gets the logits, docs/multi_host.md).
The batch is padded to a multiple of the attention instances; padding tokens (slot -1) activate
no expert. The KV cache is sharded over attention instances on the slot axis (see
``attention_program``). Routed experts live in S = N x C physical slots with a logical->physical
replica table (``replicas``), kept with the device counters by ``expert_side.ExpertSide``;
``set_placement`` moves replicas between steps. Transfer counts and phase timings: ``step_stats``.

With ``pipeline=`` a ``Pipeline(r1, order, r2)``, a dict of those, or a ``PipelineChooser`` (asked
per step) the rows run as r1 micro-batches interleaved per layer, each micro-batch's expert work in
r2 chunks (``runtime.pipeline``, ``runtime.chunks``: FinDEP's ASAS / AASS orders, PPPipe's PP);
the default is the sequential schedule. The programs are dispatched in the pipeline's dispatch
sequence (``Pipeline.dispatch``: FinDEP's event model, so chunk j's E2A right after its expert
program and the next layer's attention of a micro-batch as soon as the model starts it; without
one ``pipeline.program_order``); ``record_dispatch`` records what was dispatched, in order.

The MoE layers route with an ``ExpertRouting`` (``models.routing``; top-k by default) inside the
expert program; its extra logical experts (e.g. BrownoutServe's united experts) are placed in replica
slots beside the originals, and ``routing_state`` (e.g. the brownout threshold) may change between
steps without recompiling.

With ``expert_rounds`` (QLLM's per-expert queues) a layer-by-layer step with the sequential schedule
runs each MoE layer's expert work as the gate alone, then rounds over ranges of logical experts, with
pause points after the attention side, after the gate and between rounds.

Same interface as ``MonolithicExecutor``: ``.params``, ``.cache``, ``forward``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.mesh import ClusterSpec, MeshConfigError, SubMeshes, build_meshes, load_mesh
from jaxmoe.models.attention import AttentionBatch, init_layer_cache
from jaxmoe.models.experts import TOP_K
from jaxmoe.models.routing import ExpertRouting, extra_experts, for_call, slots_with_extra
from jaxmoe.runtime.attention_program import attention_side_params, head_params, make_attention_programs
from jaxmoe.runtime.cross_process import CrossProcessTransfer, spans_processes
from jaxmoe.pallas_kernels.expert_ffn import resolve
from jaxmoe.runtime.expert_program import AUTO_EXPERT_IMPL, make_expert_program
from jaxmoe.runtime.expert_side import ExpertSide
from jaxmoe.runtime import chunks, op_impls
from jaxmoe.runtime.pipeline import Pipeline, PipelineChooser, expected_tasks, program_order, split_rows
from jaxmoe.runtime.monolithic import check_rounds, queue_depth
from jaxmoe.runtime.pause_points import PausePoints
from jaxmoe.runtime.step_stats import LayerTransferStats, Phases
from jaxmoe.runtime.process_local import ProcessLocal, runs_here
from jaxmoe.runtime.transfer import LocalTransfer, TransferBackend, plan_transfers
from jaxmoe.quantization import is_quantized_tree


class _MicroBatch(NamedTuple):
    tokens: jax.Array
    batch: AttentionBatch
    index: jax.Array | None
    valid: tuple[jax.Array, ...]  # real tokens of each expert-side chunk, on the expert mesh


class DisaggregatedExecutor:
    """Attention program -> A2E -> expert program -> E2A, layer by layer, on two sub-meshes.

    Args:
      cfg, params, num_slots, block_size: as for ``MonolithicExecutor`` (params with logical
        expert weights [E, ...]; they are re-laid out into slots and not kept).
      mesh: a mesh file path, a parsed dict, a ``ClusterSpec`` or ``SubMeshes``.
      replica_policy: AEBS policy, "aebs" | "aebs_plus" | "random".
      expert_impl: the expert-FFN op's implementation (``jaxmoe.pallas_kernels.expert_ffn``:
        "auto" = cpu_kernel on CPU (where it builds), ragged_dot elsewhere; or "pallas", "ragged_dot", ...).
      aebs_impl: "auto" (per target platform and policy, ``pallas_kernels.aebs.AUTO_IMPL``: the Pallas
        kernel on GPU / TPU, the faster measured form on CPU) | "reference" (jnp / numpy) | "kernel" (Pallas).
      interpret: Pallas interpret mode for both kernels (None: on CPU only).
      placement: slot -> logical expert list [S] (-1 = unused), the same for every MoE layer,
        or one list per MoE layer; default ``replicas.default_placement``.
      transfer: what executes A2E / E2A and host reads (kept as ``.transfer``): a
        ``transfer.TransferBackend``, or a factory called with the SubMeshes. None: ``cross_process.CrossProcessTransfer`` when the
        sub-meshes span processes, else ``transfer.LocalTransfer`` (device_put hops).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        num_slots: int,
        block_size: int,
        mesh,
        *,
        replica_policy: str = "aebs",
        expert_impl: str = "auto",
        aebs_impl: str = "auto",
        interpret: bool | None = None,
        placement: Sequence[int] | Sequence[Sequence[int]] | None = None,
        transfer=None,
        cache_dtype=None,
        pipeline: Pipeline | PipelineChooser | dict | str | None = None,
        pause_every: int = 1,
        routing: ExpertRouting = TOP_K,
        routing_state=None,
        placed_experts: dict | None = None,
        expert_rounds=None,
    ):
        """``pause_every``: with layer-level preemption, the pause points are every that many layers.
        ``expert_rounds``: with layer-level preemption, QLLM's per-expert queues: each MoE layer's gate
        runs alone, then its logical experts are served in these contiguous ranges [lo, hi), with
        pause points after the attention side, after the gate and between ranges (sequential schedule
        only: a step whose pipeline has r1 or r2 > 1 runs its MoE layers whole).
        ``routing`` / ``routing_state``: the MoE layers' expert routing, run in the expert program,
        and its start state (e.g. ``jaxmoe.brownout.routing.BrownoutRouting`` and the threshold; the
        params hold what it needs, e.g. united experts).
        ``placed_experts``: per MoE layer, its expert-side parameters already laid out on this
        expert mesh by ``placement`` (``runtime.rescale``); ``params`` then has them in that form."""
        self.cfg, self.block_size = cfg, block_size
        if not isinstance(pause_every, int) or isinstance(pause_every, bool) or pause_every < 1:
            raise ValueError(
                f"pause_every must be a positive integer (layers between pause points), got {pause_every!r}"
            )
        self.pause_every = pause_every
        self.sub = mesh if isinstance(mesh, SubMeshes) else _sub_meshes(_spec(mesh))
        spec = self.sub.spec
        spec.validate_for(cfg.moe.num_experts)
        self.num_attention = spec.attention.count
        self.num_expert_instances = spec.experts.count
        self.slots_per_instance = spec.experts.slots_per_instance
        self.shared_on_experts = spec.shared_experts == "experts"
        _check_quantized_instances(spec, params)

        if transfer is None:
            transfer = CrossProcessTransfer(self.sub) if spans_processes(self.sub) else LocalTransfer()
        elif isinstance(transfer, type) or not isinstance(transfer, TransferBackend):  # a factory (or class)
            transfer = transfer(self.sub)
        self.transfer = transfer

        self.expert_impl = resolve(expert_impl, AUTO_EXPERT_IMPL)
        invariant = self.expert_impl == "cpu_kernel_invariant"  # deterministic mode: every program batch-invariant
        if invariant and (spec.attention.devices_per_instance > 1 or spec.experts.devices_per_instance > 1):
            raise ValueError(
                f"{spec.source}: deterministic mode (expert_impl 'cpu_kernel_invariant') runs on instances of one "
                "device: attention.devices_per_instance and experts.devices_per_instance must be 1"
            )
        self.attention = make_attention_programs(cfg, block_size, self.sub, invariant)
        # the routing's extra logical experts take ceil(U / N) more slots per instance
        self.slots_per_instance = slots_with_extra(
            self.slots_per_instance, extra_experts(routing, params), self.num_expert_instances
        )
        self.experts = make_expert_program(
            cfg,
            self.sub,
            self.slots_per_instance,
            policy=replica_policy,
            aebs_impl=aebs_impl,
            expert_impl=self.expert_impl,
            interpret=interpret,
            routing=routing,
        )

        self._op_impls = op_impls.build(
            requested_expert_impl=expert_impl,
            expert_impl=self.expert_impl,
            defaults=AUTO_EXPERT_IMPL,
            reads_in_place=False,
            mla=cfg.attn.kind == "mla",
            aebs=op_impls.aebs(replica_policy, self.experts.aebs_impl),
        )
        op_impls.log("disaggregated", self._op_impls)

        # Attention side: everything but the routed experts, replicated on the attention mesh.
        rep = self.attention.replicated
        self._embed = jax.device_put(params["embed"], rep)
        self._head = jax.device_put(head_params(params, cfg), rep)
        self._attn_layers = [self.attention.place_layer(attention_side_params(layer)) for layer in params["layers"]]
        self._shared_layers = (
            {}
            if self.shared_on_experts
            else {
                i: jax.device_put(layer["shared"], rep) for i, layer in enumerate(params["layers"]) if "shared" in layer
            }
        )
        self.pipeline = Pipeline.parse(pipeline)  # a PipelineChooser (a fixed Pipeline is one)
        self.last_pipeline: Pipeline | None = None  # what the last step ran
        # Expert side: router + slot arrays (+ shared experts) per MoE layer, on the expert mesh.
        self.expert_side = ExpertSide(
            cfg, params, self.sub, self.experts, self.transfer, placement, routing, routing_state, placed_experts
        )
        self.moe_layers = self.expert_side.moe_layers
        self.expert_rounds = check_rounds(expert_rounds, self.expert_side.num_logical)
        self.pause_stage = None  # where a layer-by-layer step waits: "layer", or inside a MoE layer (queues)
        self._queued = None  # the queues (logical ids of the waiting assignments) while paused after a gate
        self._to_f32 = jax.jit(lambda p: p.astype(jnp.float32))  # a token's partial outputs add up in float32
        self._accumulate = jax.jit(lambda acc, p: acc + p.astype(jnp.float32))
        self._to_dtype = jax.jit(lambda acc, like: acc.astype(like.dtype))

        # KV cache: slots padded to whole blocks per attention instance, sharded P("attn").
        self.kv_layout = KVLayout.for_slots(num_slots, block_size, self.num_attention)
        self.num_cache_slots = self.kv_layout.num_slots
        dtype = cache_dtype or params["embed"].dtype
        self._new_layer_cache = ProcessLocal(
            jax.jit(
                lambda: init_layer_cache(self.attention.tp.cfg, self.num_cache_slots, dtype),
                out_shardings=self.attention.cache,
            ),
            self.sub.attention,
        )  # each instance: only its slots (and heads: tensor parallel)
        self.reset_cache()

        self._transfers = {i: LayerTransferStats() for i in self.moe_layers}
        self._step = 0
        self.timing = False  # True: block after every phase and record per-layer times in .timings
        self.timings: collections.deque[dict] = collections.deque(maxlen=1000)
        self.observer = None  # observer(phase, layer, outputs) after every phase (tests, debugging)
        # True: the last step's dispatches, in order, in .last_dispatch (step_stats.Phases.dispatched)
        self.record_dispatch = False
        self.last_dispatch: list[tuple] = []
        self._checked_sequences: set = set()

    def reset_cache(self) -> None:
        """A fresh (zero) KV cache, e.g. after a failed step deleted the donated one."""
        self.cache = [self._new_layer_cache() for _ in range(self.cfg.num_layers)]

    # ------------------------------------------------------------------ the data path

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """Logits [B, V] at ``logits_index`` (or [B, T, V] when it is None), readable by this
        process (``transfer.to_local``: every process calls forward); updates the KV cache.
        With ``pipeline.r1 > 1`` the rows run as micro-batches interleaved layer by layer (FinDEP).
        ``between_layers(n)``: called after every ``pause_every`` layers but the last, once the device
        has got there (``runtime.pause_points``; layer-level preemption: it may run another batch on
        this executor meanwhile)."""
        tokens, batch, logits_index, B = self._pad(tokens, batch, logits_index)
        local = self.is_local(batch)  # attention per instance, no cross-instance traffic
        rows, T = tokens.shape[0] // self.num_attention, tokens.shape[1]
        pipe = self.pipeline.for_batch(rows, T, int(batch.positions.max()) + 1)
        self.last_pipeline = pipe
        r1 = pipe.r1
        parts, where = split_rows(tokens, batch, logits_index, self.num_attention, r1)
        mbs = [self._upload(*part, pipe.r2) for part in parts]
        step = jax.device_put(np.int32(self._step), self.experts.replicated)
        self._step += 1
        state = for_call(self.routing_state, T)  # per phase: a decode or a prefill call
        run = Phases(self.timing, self.observer, self.record_dispatch)
        pause = None if between_layers is None else PausePoints(between_layers, self.pause_every)

        xs, ys = map(list, zip(*(run("embed", None, self.attention.embed, self._embed, mb.tokens) for mb in mbs)))
        zeros = ys[0]  # no routed output to add before the first layer (nor after a dense layer)
        seq = self._dispatch_sequence(pipe, layered=pause is not None)
        xns, chunk_state = [None] * r1, [None] * r1  # per micro-batch: its layer's xn, (plan, shape, chunks)
        done = 0  # layers whose every task is dispatched (pause points: the sequence is then layer by layer)
        queues = pause is not None and bool(self.expert_rounds) and r1 == 1 and pipe.r2 == 1
        for task, i, k, c in seq:
            if pause is not None and i > done:
                done = i
                self._pause_at(pause, i, "layer", (xs, ys))
            if task == "attention":
                xs[k], xns[k], self.cache[i] = run(
                    "attention", i, self.attention.layer, self._attn_layers[i], xs[k], ys[k], mbs[k].batch,
                    self.cache[i], local, at=(k, c),
                )  # fmt: skip
                if i not in self.expert_side.layers:
                    ys[k] = zeros
            elif task == "shared":
                if i in self._shared_layers:
                    xs[k] = run("shared", i, self.attention.shared, self._shared_layers[i], xs[k], xns[k], at=(k, c))
            elif task == "expert" and queues:
                chunk_state[k] = self._queued_experts(run, i, mbs[k], (step, state), chunk_state[k], pause)
            else:
                chunk_state[k] = self._chunk_task(
                    run, task, i, k, c, xns[k], mbs[k], (step, state), chunk_state[k], pipe
                )
                if task == "e2a" and all(y is not None for y in chunk_state[k][3]):  # every chunk back
                    ys[k] = self._join(run, i, chunk_state[k])
        logits = [
            self.transfer.to_local(run("head", None, self.attention.head, self._head, xs[k], ys[k], mb.index))
            for k, mb in enumerate(mbs)
        ]
        if self.timing:
            self.timings.append(run.record)
        if self.record_dispatch:
            self.last_dispatch = run.dispatched
        out = logits[0] if r1 == 1 else jnp.concatenate(logits)[where]
        return out if B == out.shape[0] else out[:B]

    def lower_step(self, tokens, batch: AttentionBatch, logits_index) -> tuple[list, jax.ShapeDtypeStruct] | None:
        """The programs ``forward(tokens, batch, logits_index)`` runs, traced and lowered on these
        shapes but neither compiled nor run (no data moves, no collective: a thread may compile them
        while another executor serves, and compiling one fills the cache ``forward`` looks in); and
        the shape of the logits ``forward`` returns. Layers of the same kind share one program (each
        is lowered once). In one process A2E / E2A are ``device_put`` hops, not programs; across
        processes the ``CrossProcessTransfer`` programs are included. None: the step's pipeline
        splits the rows (r1 > 1) or the expert work (r2 > 1), not lowered ahead (it compiles on first
        use). Unlike ``runtime.executor.LowersAhead`` (the monolithic executor) warm-up does not use
        it: it runs each shape instead, which also compiles what runs outside these programs."""
        tokens, batch, logits_index, B = self._pad(tokens, batch, logits_index)
        rows, T = tokens.shape[0] // self.num_attention, tokens.shape[1]
        pipe = self.pipeline.for_batch(rows, T, int(batch.positions.max()) + 1)
        if pipe.r1 != 1 or pipe.r2 != 1:
            return None
        local = self.is_local(batch)
        A, cross = self.attention, isinstance(self.transfer, CrossProcessTransfer)

        def struct(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

        programs: list = []
        seen: set = set()

        def lower(name, fn, *args):
            """fn lowered on args (once per distinct argument shapes); its output's shapes."""
            leaves = jax.tree.leaves(args)
            key = (name, str(jax.tree.structure(args)))
            key += tuple((a.shape, str(a.dtype), str(a.sharding)) if hasattr(a, "shape") else a for a in leaves)
            if not runs_here(fn):  # its devices all belong to other processes: neither compiled nor run here
                return fn.out_info(*args)
            low = fn.lower(*args)
            if key not in seen:
                seen.add(key)
                programs.append(low)
            return low.out_info

        tok = struct(tokens.shape, jnp.int32, A.rows)
        bat = AttentionBatch(*(struct(a.shape, jnp.int32, A.rows) for a in batch))
        index = None if logits_index is None else struct(logits_index.shape, jnp.int32, A.rows)
        valid = struct(batch.slots.shape, jnp.bool_, self.experts.replicated)
        step = struct((), jnp.int32, self.experts.replicated)
        x, y = (struct(o.shape, o.dtype, A.rows) for o in lower("embed", A.embed, self._embed, tok))
        zeros = y
        side = self.expert_side
        state = for_call(self.routing_state, tokens.shape[1])  # this call's phase, as ``forward``'s
        for i, layer in enumerate(self._attn_layers):
            h, xn, _ = lower("attention", A.layer, layer, x, y, bat, self.cache[i], local)
            h, xn = struct(h.shape, h.dtype, A.rows), struct(xn.shape, xn.dtype, A.rows)
            if i in side.layers:
                plan = plan_transfers(self.sub.spec, int(np.prod(xn.shape)) * xn.dtype.itemsize // self.num_attention)
                xe = struct(xn.shape, xn.dtype, self.sub.replicated_sharding)
                if cross:
                    more, xe = self.transfer.lower_a2e(xn, plan)
                    programs.extend(more)
                args = (side.layers[i], side._tables[i], xe, valid, step, side._coact[i], side._state_on_mesh(state))
                part = lower("experts", self.experts.run, *args)[0]
                part = struct(part.shape, part.dtype, self.sub.partials_sharding)
                y = struct(part.shape[1:], part.dtype, self.sub.batch_sharding)
                if cross:
                    more, y = self.transfer.lower_e2a(part, plan)
                    programs.extend(more)
            else:
                y = zeros
            if i in self._shared_layers:
                h = lower("shared", A.shared, self._shared_layers[i], h, xn)
                h = struct(h.shape, h.dtype, A.rows)
            x = h
        logits = lower("head", A.head, self._head, x, y, index)
        logits = struct(logits.shape, logits.dtype, A.rows)
        if cross:
            more, logits = self.transfer.lower_to_local(logits)
            programs.extend(more)
        return programs, logits

    def _dispatch_sequence(self, pipe: Pipeline, layered: bool) -> tuple:
        """The step's (task, layer, micro-batch, chunk) sequence: ``pipe.dispatch`` (FinDEP's event
        model), else ``program_order``; checked to hold every task once. ``layered`` (pause points):
        stably regrouped layer by layer, so a pause point sees whole layers."""
        moe = tuple(i in self.expert_side.layers for i in range(len(self._attn_layers)))
        seq = pipe.dispatch if pipe.dispatch is not None else program_order(pipe, moe)
        key = (seq, moe, pipe.r1, pipe.r2)
        if key not in self._checked_sequences:
            if collections.Counter(seq) != expected_tasks(pipe.r1, pipe.r2, moe):
                raise ValueError(
                    f"pipeline dispatch sequence does not hold every task of r1={pipe.r1}, r2={pipe.r2} over "
                    f"{len(moe)} layers exactly once"
                )
            _check_dependencies(seq, moe, pipe.r2)
            if len(self._checked_sequences) > 64:
                self._checked_sequences.clear()
            self._checked_sequences.add(key)
        return tuple(sorted(seq, key=lambda task: task[1])) if layered else seq

    def _chunk_task(self, run, task: str, i: int, k: int, c: int, xn, mb: _MicroBatch, step, state, pipe):
        """Dispatch one expert-side task of micro-batch k's chunk c in layer i (async): A2E (the first
        one cuts the micro-batch into its r2 chunks, ``runtime.chunks``), the expert program, or E2A.
        ``step``: (the step counter on the expert mesh, the routing state of this call).
        ``state``: (plan, xn's shape, per chunk its latest output); returns it updated."""
        if task == "a2e" and c == 0:
            parts = (xn,) if pipe.r2 == 1 else run("split", i, chunks.split, xn, self.sub, pipe.r2)
            plan = plan_transfers(self.sub.spec, parts[0].nbytes // self.num_attention)
            state = (plan, xn.shape, list(parts), [None] * pipe.r2)
        if state is None:
            raise ValueError(f"pipeline dispatch sequence: {task} of layer {i} micro-batch {k} before its a2e")
        plan, shape, data, back = state
        if task == "a2e":
            data[c] = run("a2e", i, self.transfer.a2e, data[c], plan, self.sub, at=(k, c))
        elif task == "expert":
            data[c] = run("expert", i, self.expert_side.run, i, data[c], mb.valid[c], *step, at=(k, c))[0]
            self._transfers[i].count(plan)
        else:
            back[c] = run("e2a", i, self.transfer.e2a, data[c], plan, self.sub, at=(k, c))
        return state

    def _pause_at(self, pause: PausePoints, layers: int, stage: str, outputs, queued=None) -> None:
        """A pause point (``stage``) after the programs that produce ``outputs``; ``queued``: the
        queues then (after a MoE layer's gate). The layer-by-layer step cannot take rows here (no
        merge on this executor): latency-sensitive work runs as a step of its own meanwhile."""
        self.pause_stage, self._queued = stage, queued
        try:
            if stage == "layer":
                pause(layers, *outputs)
            else:
                pause.inside(layers, *outputs)
        finally:
            self.pause_stage, self._queued = None, None

    def _queued_experts(self, run, i: int, mb: _MicroBatch, step, state, pause: PausePoints):
        """Layer i's expert work as QLLM's per-expert queues (sequential schedule; ``step`` and
        ``state`` as ``_chunk_task``'s, after A2E): a pause point (the attention side is done), the gate alone
        (every assignment joins its expert's FIFO queue), a pause point, then the rounds, each serving
        the queues of its range of logical experts, with a pause point between rounds. The partial
        outputs add up (float32) on the expert mesh; E2A carries their sum, so a token's output joins
        its hidden state only after the last round."""
        plan, shape, data, back = state
        step, routing_state = step
        xe, valid = data[0], mb.valid[0]
        self._pause_at(pause, i, "attention", (xe,))
        queued, weights = run("expert", i, self.expert_side.route, i, xe, valid, routing_state)
        acc = None
        for r, (lo, hi) in enumerate(self.expert_rounds):
            self._pause_at(pause, i, "routing" if r == 0 else "experts", (queued,), queued)
            partials, queued = run("expert", i, self.expert_side.serve, i, xe, queued, weights, step, lo, hi)
            acc = self._to_f32(partials) if acc is None else self._accumulate(acc, partials)
        data[0] = self._to_dtype(acc, partials)
        self._transfers[i].count(plan)
        return plan, shape, data, back

    def expert_queue_depth(self):
        """Assignments waiting in each logical expert's queue [E + U] while a step is paused inside a
        MoE layer after its gate (None anywhere else)."""
        if self._queued is None:
            return None
        return queue_depth(self.transfer.fetch(self._queued), self.expert_side.num_logical)

    def _join(self, run, i: int, state):
        """Micro-batch's routed output: its chunks' E2A outputs joined back into its rows."""
        _, shape, _, back = state
        return back[0] if len(back) == 1 else run("join", i, chunks.join, back, shape, self.sub)

    def _upload(self, tokens, batch: AttentionBatch, index, r2: int = 1) -> _MicroBatch:
        rows = self.attention.rows
        valid = batch.slots >= 0  # host metadata for the gate
        parts = [valid] if r2 == 1 else chunks.split_valid(valid, self.num_attention, r2)
        return _MicroBatch(
            tokens=jax.device_put(tokens, rows),
            batch=AttentionBatch(*(jax.device_put(a, rows) for a in batch)),
            index=None if index is None else jax.device_put(index, rows),
            valid=tuple(jax.device_put(v, self.experts.replicated) for v in parts),
        )

    def _pad(self, tokens, batch: AttentionBatch, logits_index):
        """Rows padded to a multiple of the attention instances (padding: slot -1, table 0)."""
        tokens = np.asarray(tokens, np.int32)
        batch = AttentionBatch(*(np.asarray(a, np.int32) for a in batch))
        index = None if logits_index is None else np.asarray(logits_index, np.int32)
        B = tokens.shape[0]
        pad = -B % self.num_attention
        if pad:
            rows = lambda a, v: np.concatenate([a, np.full((pad,) + a.shape[1:], v, a.dtype)])  # noqa: E731
            tokens = rows(tokens, 0)
            batch = AttentionBatch(rows(batch.positions, 0), rows(batch.slots, -1), rows(batch.block_tables, 0))
            index = None if index is None else rows(index, 0)
        return tokens, batch, index, B

    def is_local(self, batch: AttentionBatch) -> bool:
        """Whether every row's slots and block table entries (host arrays, rows padded to a multiple
        of the attention instances) lie in the KV slot range of the instance that gets the row."""
        kv, B = self.kv_layout, batch.slots.shape[0]
        inst = (np.arange(B) * self.num_attention // B)[:, None]
        slots_ok = (batch.slots < 0) | (kv.instance_of_slot(batch.slots) == inst)
        return bool(slots_ok.all() and (kv.instance_of_block(batch.block_tables) == inst).all())

    # ------------------------------------------------------------------ observability

    def op_impls(self) -> dict[str, str]:
        """Op -> the implementation this executor's programs run (``runtime.op_impls``)."""
        return dict(self._op_impls)

    @property
    def shared_layers(self) -> list[int]:
        """Layers whose shared experts run as the attention side's ``shared`` program."""
        return sorted(self._shared_layers)

    def transfer_stats(self) -> dict[int, dict]:
        """Per MoE layer (by layer index): steps run, A2E/E2A hops and bytes so far (cumulative,
        split intra/cross-node), hops per step, and the strategy of the last step."""
        return {i: stats.summary() for i, stats in self._transfers.items()}

    def expert_activation_counts(self) -> list[list[int]]:
        """Per MoE layer: cumulative tokens routed to each logical expert (padding excluded): the
        diagonal of ``expert_coactivation``."""
        return [[int(c) for c in np.diagonal(a)] for a in self.expert_coactivation()]

    def expert_coactivation(self) -> list[np.ndarray]:
        """Per MoE layer: cumulative co-activation counts [E, E] (``ExpertSide.coactivation``)."""
        return self.expert_side.coactivation()

    @property
    def routing(self) -> ExpertRouting:
        """The MoE layers' expert routing (``executor.Routed``)."""
        return self.expert_side.routing

    @property
    def routing_state(self):
        """The routing's state for the next steps (may change between steps; no recompile)."""
        return self.expert_side.routing_state

    @routing_state.setter
    def routing_state(self, value) -> None:
        self.expert_side.routing_state = value

    def activated_experts(self) -> dict[int, tuple[int, int]]:
        """Per MoE layer: distinct (original, extra) logical experts the last step used (``ExpertSide``)."""
        return self.expert_side.activated_experts()

    def activated_per_instance(self) -> dict[int, list[int]]:
        """Per MoE layer: distinct replicas each expert instance ran in the last step (AEBS's load).
        A collective across processes, like ``expert_activation_counts``."""
        return self.expert_side.activated_per_instance()

    @property
    def params(self) -> dict:
        """The parameters as laid out: attention-side ones (KV heads repeated for tensor-parallel instances
        with more devices than them), per MoE layer the router and slot arrays [S, ...] under "moe"."""
        layers = []
        for i, layer in enumerate(self._attn_layers):
            layer = dict(layer)
            if i in self._shared_layers:
                layer["shared"] = self._shared_layers[i]
            if i in self.expert_side.layers:
                moe = dict(self.expert_side.layers[i])
                if "shared" in moe:
                    layer["shared"] = moe.pop("shared")
                layer["moe"] = moe
            layers.append(layer)
        return {"embed": self._embed, **self._head, "layers": layers}

    # ------------------------------------------------------------------ replicas (``ExpertSide``)

    @property
    def layouts(self) -> dict:
        """Per MoE layer: its ``ReplicaLayout``."""
        return self.expert_side.layouts

    def placement(self, layer: int | None = None) -> list[int]:
        """slot -> logical expert of a MoE layer (default: the first one)."""
        return self.expert_side.placement(layer)

    def set_placement(self, slot_to_expert: Sequence[int] | Sequence[Sequence[int]]) -> int:
        """Re-lay out the expert replicas between steps (``ExpertSide.set_placement``); returns the
        slots copied across instances."""
        return self.expert_side.set_placement(slot_to_expert)


def _check_dependencies(seq, moe: tuple[bool, ...], r2: int) -> None:
    """ValueError naming the first task of ``seq`` dispatched before a task whose output it reads."""
    seen: set = set()
    for task, i, k, c in seq:
        if task == "attention":
            need = [("attention", i - 1, k, -1)] if i else []
            if i and moe[i - 1]:
                need += [("shared", i - 1, k, -1)] + [("e2a", i - 1, k, j) for j in range(r2)]
        elif task in ("shared", "a2e"):
            need = [("attention", i, k, -1)] + ([("a2e", i, k, 0)] if c > 0 else [])
        else:
            need = [("a2e" if task == "expert" else "expert", i, k, c)]
        missing = [n for n in need if n not in seen]
        if missing:
            raise ValueError(f"pipeline dispatch sequence: {(task, i, k, c)} comes before {missing[0]}, which it reads")
        seen.add((task, i, k, c))


def _check_quantized_instances(spec: ClusterSpec, params: dict) -> None:
    """Where int8 / fp8 weights (``jaxmoe.quantization``) meet instances of several devices: an expert
    instance splits each slot's FFN columns, and an int8 weight's per-column scales split with them,
    but an fp8 weight's 128 x 128 blocks only where each device gets whole blocks; attention instances
    split heads, which quantized projections do not take."""
    k = spec.attention.devices_per_instance
    if k > 1 and is_quantized_tree([layer.get("attn", {}) for layer in params["layers"]]):
        raise MeshConfigError(
            f"{spec.source}: attention.devices_per_instance: {k}: quantized attention projections "
            "(quantize_attention) run on attention instances of one device (their scales are not split by heads)"
        )
    k = spec.experts.devices_per_instance
    for layer in params["layers"]:
        w = layer.get("moe", {}).get("w_gate")
        if k > 1 and getattr(w, "block", None) is not None and w.shape[-1] % (k * max(w.block)):
            raise MeshConfigError(
                f"{spec.source}: experts.devices_per_instance: {k}: quantized fp8 expert weights split over "
                f"{k} devices need an intermediate size divisible by {k} x {max(w.block)} (whole scale blocks per "
                f"device), got {w.shape[-1]}; use quantization='int8' or instances of one device"
            )


@functools.lru_cache(maxsize=16)
def _sub_meshes(spec: ClusterSpec) -> SubMeshes:
    """One SubMeshes per spec, so executors on the same layout share compiled programs."""
    return build_meshes(spec)


def _spec(mesh) -> ClusterSpec:
    if isinstance(mesh, ClusterSpec):
        return mesh
    if isinstance(mesh, (str, Path, Mapping)):
        return load_mesh(mesh)
    raise TypeError(f"mesh: expected a mesh file path, a dict, a ClusterSpec or SubMeshes, got {type(mesh).__name__}")
