"""The expert sub-mesh's state in the disaggregated executor: per MoE layer the placed parameters
(router + routed-expert replica slots [S, ...], + shared experts when they live there), the replica
layout and the AEBS tables, and the device-side counters the placement controller reads
(co-activations, activated replicas per instance, distinct experts used per step). ``set_placement``
re-lays the replicas out between steps (JANUS 3.4). The layout's logical experts are those of the
expert routing (``models.routing``): the E originals and the routing's U extra experts (E + u, e.g.
BrownoutServe's united experts) over C + ceil(U / N) slots per instance, so extra experts are
replicated, balanced by AEBS and re-placed like the originals; it also holds the routing's run-time
state (``routing_state``: a traced input of the expert program, so changing it does not recompile)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.mesh import SubMeshes
from jaxmoe.models.experts import TOP_K
from jaxmoe.models.routing import ExpertRouting, extra_experts, slots_with_extra
from jaxmoe.runtime.expert_program import ExpertProgram, place_layer, place_tables, relayout_layer
from jaxmoe.runtime.replicas import ReplicaLayout, default_placement


class ExpertSide:
    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        sub: SubMeshes,
        program: ExpertProgram,
        transfer,
        placement: Sequence[int] | Sequence[Sequence[int]] | None = None,
        routing: ExpertRouting = TOP_K,
        routing_state=None,
        placed: dict | None = None,
    ):
        """``params``: the model parameters (expert weights [E, ...], and what ``routing`` needs, e.g.
        united experts); ``placement``: see ``set_placement`` (default ``replicas.default_placement``);
        ``transfer.fetch`` reads the device counters (a collective across processes). ``routing`` /
        ``routing_state``: the expert routing (the program was made with it) and its start state.
        ``placed``: per MoE layer, the parameters already laid out by ``placement`` on this mesh (live
        re-scaling), used as they are."""
        self.cfg, self.sub, self.program, self.transfer = cfg, sub, program, transfer
        spec = sub.spec
        self.num_instances, self.slots_per_instance = spec.experts.count, spec.experts.slots_per_instance
        self.num_extra = extra_experts(routing, params)  # U: the routing's logical experts beyond E
        self.num_logical = cfg.moe.num_experts + self.num_extra
        self.slots_per_instance = slots_with_extra(self.slots_per_instance, self.num_extra, self.num_instances)
        self.shared_here = spec.shared_experts == "experts"
        self.moe_layers = [i for i, layer in enumerate(params["layers"]) if "moe" in layer]
        self.layouts = self._layouts(placement)
        self.routing, self.routing_state = routing, routing_state
        self._state = (None, None)  # (the state's leaves and structure, its device copy)
        self.layers = {
            i: placed[i]
            if placed is not None
            else place_layer(params["layers"][i], self.layouts[i], sub, self.shared_here, routing, i)
            for i in self.moe_layers
        }
        self._tables = {i: place_tables(self.layouts[i], sub) for i in self.moe_layers}
        L = self.num_logical
        self._coact = {i: jax.device_put(np.zeros((L, L), np.int32), program.replicated) for i in self.moe_layers}
        self._coact_host = {i: np.zeros((L, L), np.int64) for i in self.moe_layers}
        self._activated = {}
        self._used = {}

    def run(self, i: int, xe, valid, step, state=None):
        """Layer i's expert program on the A2E'd activations (async; gate, AEBS and grouped matmul
        all run on the expert mesh): (per-instance partial outputs, co-activation counters,
        activated replicas per instance, distinct experts used); the counters are kept here.
        ``state``: the routing state of this call (``models.routing.for_call`` of ``routing_state``)."""
        on_mesh = self._state_on_mesh(state)
        out = self.program.run(self.layers[i], self._tables[i], xe, valid, step, self._coact[i], on_mesh)
        _, self._coact[i], self._activated[i], self._used[i] = out
        return out

    def route(self, i: int, xe, valid, state=None):
        """Per-expert queues (QLLM): layer i's gate alone on the A2E'd activations (async): (queued
        logical expert ids [B*T, K'], combine weights), replicated on the expert mesh; the counters
        count the step as ``run`` does. ``state``: as ``run``'s."""
        program = self.program
        queued, weights, self._coact[i], self._used[i] = program.route(
            self.layers[i], xe, valid, self._coact[i], self._state_on_mesh(state)
        )
        self._activated.pop(i, None)
        return queued, weights

    def serve(self, i: int, xe, queued, weights, step, lo: int, hi: int):
        """One round of layer i's per-expert queues: the queued assignments at logical experts
        [lo, hi) run (AEBS places them on replicas). Returns (per-instance partial outputs, the
        queues left); the replicas activated add up over the layer's rounds."""
        rep = self.program.replicated
        lo, hi = (jax.device_put(np.int32(v), rep) for v in (lo, hi))
        partials, activated, queued = self.program.serve(
            self.layers[i], self._tables[i], xe, queued, weights, step, lo, hi
        )
        self._activated[i] = activated if i not in self._activated else self._activated[i] + activated
        return partials, queued

    def _state_on_mesh(self, state):
        """A routing state on the expert mesh (copied once per new value; None stays None)."""
        key = jax.tree.flatten(state)
        if self._state[0] != key:
            on_mesh = jax.tree.map(lambda v: jax.device_put(np.asarray(v), self.program.replicated), state)
            self._state = (key, on_mesh)
        return self._state[1]

    # ------------------------------------------------------------------ statistics

    def coactivation(self) -> list[np.ndarray]:
        """Per MoE layer: cumulative co-activation counts [E, E] int64 (tokens that chose both e
        and f; the diagonal: tokens that chose e), the placement controller's statistics, over the
        E + U logical experts as routed (the routing's extra expert u is E + u).

        Counted on device (int32, per step inside the expert program); a read folds the device
        counters into host int64 totals and resets them, so they never overflow. Across
        processes it is a collective (``transfer.fetch``): every process must call it.
        """
        for i in self.moe_layers:
            self._coact_host[i] += self.transfer.fetch(self._coact[i]).astype(np.int64)
            self._coact[i] = jax.device_put(np.zeros_like(self._coact_host[i], np.int32), self.program.replicated)
        return [self._coact_host[i].copy() for i in self.moe_layers]

    def activated_experts(self) -> dict[int, tuple[int, int]]:
        """Per MoE layer: distinct (original, extra) logical experts the real tokens of the last step
        used (before replicas; extra: ids E + u, e.g. united experts; 0 for top-k). Brownout lowers it."""
        return {i: tuple(int(v) for v in self.transfer.fetch(u)) for i, u in self._used.items()}

    def activated_per_instance(self) -> dict[int, list[int]]:
        """Per MoE layer: distinct replicas (of original and extra logical experts) each expert
        instance ran in the last step (AEBS's load)."""
        return {i: [int(v) for v in self.transfer.fetch(a)] for i, a in self._activated.items()}

    # ------------------------------------------------------------------ replicas

    def placement(self, layer: int | None = None) -> list[int]:
        """slot -> logical expert of a MoE layer (default: the first one)."""
        return list(self.layouts[self.moe_layers[0] if layer is None else layer].slot_to_expert)

    def set_placement(self, slot_to_expert: Sequence[int] | Sequence[Sequence[int]]) -> int:
        """Re-lay out the expert replicas between steps (the host-side controller's hook).

        ``slot_to_expert``: one list [S] for every MoE layer, or one per MoE layer. Moves weights
        (``expert_program.relayout_layer``: ``jax.device_put``, or ``slot_moves`` collectives when
        the expert sub-mesh spans processes) and installs the new replica tables; AEBS uses them
        from the next step. Returns the slots copied across instances. Under ``jax.distributed``
        every process calls it, at the same point.
        """
        new = self._layouts(slot_to_expert)
        moved = 0
        for i in self.moe_layers:
            if new[i].slot_to_expert == self.layouts[i].slot_to_expert:
                continue
            self.layers[i], n = relayout_layer(self.layers[i], self.layouts[i], new[i], self.sub)
            self._tables[i] = place_tables(new[i], self.sub)
            moved += n
        self.layouts = new
        return moved

    def _layouts(self, placement) -> dict[int, ReplicaLayout]:
        E, N, C = self.num_logical, self.num_instances, self.slots_per_instance
        if placement is None:
            placement = default_placement(E, N, C)
        placement = list(placement)
        nested = bool(placement) and isinstance(placement[0], Sequence)
        per_layer = placement if nested else [placement] * len(self.moe_layers)
        if len(per_layer) != len(self.moe_layers):
            raise ValueError(f"{len(per_layer)} placements for {len(self.moe_layers)} MoE layers")
        return {i: ReplicaLayout(tuple(int(e) for e in p), E, N, C) for i, p in zip(self.moe_layers, per_layer)}
