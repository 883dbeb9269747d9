"""The contract between the engine and an executor (what runs one step of the model).

The engine (``ModelRunner``, ``LLMEngine``, ``AsyncEngine``) calls only what ``Executor`` declares;
``MonolithicExecutor`` and ``DisaggregatedExecutor`` implement it (``tests/runtime/test_executor_protocol.py``).
Capabilities some executors have are their own protocols, checked with ``isinstance`` by the hooks
that need them: ``ReplicaPlacement`` (expert replicas re-placed between steps: the disaggregated
executor; ``jaxmoe.janus.placement_controller``) and ``Routed`` (the expert routing it runs and its
run-time state: both executors; e.g. ``jaxmoe.brownout`` moves the threshold) and ``ExpertQueueing``
(per-expert queues: pause points inside a MoE layer, after its attention side, after its routing and
between its expert rounds; both executors, with rounds from ``jaxmoe.qllm``) and
``MergesRows`` (rows that join a layer-by-layer step at a pause point: QLLM's merge; the monolithic
executor) and ``LowersAhead`` (the
step's programs, fused and layer by layer, traced and lowered without running them, so warm-up can
compile them in parallel: the monolithic executor). Layer-level preemption (QLLM) is every executor's:
``forward(..., between_layers=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.kv_layout import KVLayout
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.routing import ExpertRouting


@runtime_checkable
class Executor(Protocol):
    cfg: ModelConfig
    kv_layout: KVLayout  # blocks, block size, and the attention instance that holds each block
    cache: Any  # the KV cache (device arrays) of ``kv_layout.num_slots`` slots; a failed step may delete it
    expert_impl: str  # the expert-FFN implementation its programs run (``jaxmoe.pallas_kernels.expert_ffn``)

    def forward(self, tokens, batch: AttentionBatch, logits_index, between_layers=None) -> jax.Array:
        """One step: logits [B, V] at ``logits_index`` (or [B, T, V] when None); writes the KV of the
        batch's slots. ``between_layers(n)``: run layer by layer and call it at each pause point
        inside the step (``n``: layers done; every ``pause_every`` layers, and between expert
        rounds with per-expert queues), once the device has got there (``runtime.pause_points``)
        (QLLM layer-level preemption; it may run another batch meanwhile)."""
        ...

    def reset_cache(self) -> None:
        """A fresh KV cache (after a failed step deleted the donated one)."""
        ...

    def expert_activation_counts(self) -> list[list[int]] | None:
        """Per MoE layer, tokens routed to each expert so far (None: this executor does not count)."""
        ...

    @property
    def params(self) -> dict:
        """The parameters as a per-layer tree."""
        ...


@runtime_checkable
class ReplicaPlacement(Protocol):
    """Expert replicas that the host-side controller re-places between steps (JANUS 3.4)."""

    def expert_coactivation(self) -> list[np.ndarray]:
        """Per MoE layer: cumulative co-activation counts [E, E] (diagonal: tokens per expert)."""
        ...

    def placement(self, layer: int | None = None) -> list[int]:
        """slot -> logical expert of a MoE layer (default: the first one)."""
        ...

    def set_placement(self, slot_to_expert: Sequence[int] | Sequence[Sequence[int]]) -> int:
        """Install a new placement (one for all MoE layers, or one per layer); returns slots moved."""
        ...


@runtime_checkable
class Routed(Protocol):
    """The MoE layers route with ``routing`` (``models.routing.ExpertRouting``, fixed at build);
    ``routing_state`` is its traced per-step value (None for top-k), which may change between steps
    without recompiling (e.g. BrownoutServe's threshold, ``jaxmoe.brownout.routing``)."""

    routing: ExpertRouting
    routing_state: Any


@runtime_checkable
class ExpertUseCounting(Protocol):
    """Distinct experts each step reads (the disaggregated executor's expert program counts them;
    brownout lowers them: united experts replace groups of originals)."""

    def activated_experts(self) -> dict[int, tuple[int, int]]:
        """Per MoE layer: distinct (original, extra) logical experts the real tokens of the last step
        used (extra: the routing's experts beyond the E originals, e.g. united experts)."""
        ...


@runtime_checkable
class ExpertQueueing(Protocol):
    """Per-expert queues (QLLM, ``jaxmoe.qllm.expert_queues``): in a layer-by-layer step, each MoE
    layer routes every (token, choice) assignment into its logical expert's FIFO queue, and the
    queues are served in rounds over the ranges [lo, hi) of ``expert_rounds`` (empty: off), with pause
    points after the attention side, after the routing and between rounds (``pause_stage``)."""

    expert_rounds: list[tuple[int, int]]

    def expert_queue_depth(self) -> np.ndarray | None:
        """Assignments waiting at each logical expert [E + U] while a step is paused inside a MoE
        layer after its routing (None anywhere else)."""
        ...


class RowMerge(NamedTuple):
    """Rows that join a step paused at a pause point (QLLM's merge, ``MergesRows``): ``between_layers``
    returns one. ``tokens`` / ``batch`` [B', T']: the new rows alone, padded (their first ``rows`` rows
    are real); they run the layers done so far alone (the catch-up, writing their KV there; inside a
    MoE layer with per-expert queues also its attention side and routing). Then the
    step goes on over ``merged_batch`` / ``merged_index`` [Bm, Tm]: the running step's first ``keep``
    rows, then the new rows, then padding."""

    tokens: Any
    batch: AttentionBatch
    rows: int
    keep: int
    merged_batch: AttentionBatch
    merged_index: Any


@runtime_checkable
class MergesRows(Protocol):
    """QLLM's merge (Fig. 1b): at a pause point of a layer-by-layer step, ``between_layers`` may
    return a ``RowMerge``; the new rows catch up to that point alone, then every row shares the
    rest of the step in one batch, and ``forward`` returns the logits of the merged rows."""

    def merge_ready(self) -> bool:
        """Whether the step now paused can take rows here."""
        ...


@runtime_checkable
class LowersAhead(Protocol):
    """The step's programs (fused, and layer by layer) for given shapes, traced and lowered but
    neither compiled nor run (``engine.warmup`` compiles them on a thread pool). Compiling a returned ``Lowered`` fills the
    same caches ``forward`` looks in, so a later ``forward`` on arrays of these shapes compiles
    nothing."""

    def lower(
        self, tokens, batch: AttentionBatch, logits_index
    ) -> tuple[list[jax.stages.Lowered], jax.ShapeDtypeStruct]:
        """(the programs ``forward(tokens, batch, logits_index)`` runs, lowered; the logits' shape)."""
        ...

    def lower_layers(self, tokens, batch: AttentionBatch, logits_index) -> list[jax.stages.Lowered]:
        """The programs ``forward(tokens, batch, logits_index, between_layers=...)`` runs (a step run
        layer by layer, layer-level preemption), lowered."""
        ...
