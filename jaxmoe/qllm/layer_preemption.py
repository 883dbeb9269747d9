"""QLLM's preemption below the iteration level (arXiv:2503.09304, Sec. 3.3), as the engine's layer hook.

A step runs layer by layer (``pausable``) where a request can arrive while it runs: the engine polls
for arrivals (``engine.poll``: the serving loop, ``AsyncEngine``); a step holding latency-sensitive
work only where new latency-sensitive work can merge into it (it is stopped for a nested step only
where the cost model declines the merge).
Without a poll (``LLM.generate`` adds every request before the first step) nothing can arrive
mid-step and the step stays one fused program. At each pause point
(``between_layers``: after every ``pause_every`` layers, and with per-expert queues inside each MoE
layer: after its attention side, after its routing and between its expert rounds) the hook admits
what arrived meanwhile (``engine.poll``) and asks the scheduling policy whether to pause there
(``Scheduler.pause_at_layer``, with a ``PausePoint``: the stage and the queue depths); if so, it
schedules the waiting latency-sensitive work and

* merges it into the step (``merge``, the default; the paper's Fig. 1b): its rows run the layers done
  so far alone (the catch-up; inside a MoE layer also that layer's attention side and routing), then
  they and the step's rows share the rest in one batch (``LLMEngine.merge_batch``); inside a MoE
  layer their assignments enter the per-expert queues ahead of the waiting best-effort ones. Their
  tokens go out as the program call they joined ends (``engine.deliver``), before the step's later
  calls (its prefill chunks run after its decodes). Several arrivals may merge into one step, each at its own pause point;
  counted in ``ls_merges`` (those inside a MoE layer also in ``queue_merges``).
* else (``merge=False``, on an executor that cannot merge, where the merged batch's shape is not
  one warm-up compiled, or where the merge would cost the LS work more than running alone: the cost
  model below) runs it as a batch of its own while the step waits (its tokens go out at
  once, ``engine.deliver``), then the paused step goes on from where it stopped with its state (kept
  on the device) and the KV it wrote.

The cost model (``merge_tokens``): our batches are padded [rows, tokens] (no flat token lists), so a
prompt merged into a call pads every row of it to the prompt's token bucket, and the LS rows' first
token waits for the remaining layers of that padded call: on a compute-bound device a layer's time
grows with its token slots (rows x tokens) once they pass what a layer costs anyway (its weights,
its dispatch). A merge is taken only where the merged call has at most ``max(merge_tokens, the LS
work's own call's)`` token slots: LS decodes joining a decode call, or a prompt joining a call no
bigger than its own; else the LS work runs nested (alone), counted in ``merges_declined``.
``merge_tokens=None``: every merge the executor can take. The default (16) is where a call stopped
costing about one token's time on the loaded 2-core CPU (``bench/results/2026-11-28-qllm3.md``: an
8-layer step of 16 decode rows 1.5x one row, a [2, 64] prefill 1.6x a [1, 64] one, [4, 256] 36x).

A step whose paused state (hidden states) would exceed ``max_paused_state_bytes`` is not paused: its
latency-sensitive work waits for the step boundary.

The granularity (``pause_every``: layers per program; None: measured, ``qllm.granularity``): before
warm-up compiles (``choose_granularity``), or at the first step that could pause, the fused and the
pausable steps are timed on the decode shapes, and the finest granularity whose cost is within
``budget`` (2 %) is taken; where none is, no step pauses (``pauses_steps`` False: step-level
preemption, every step fused), ``pause_every`` 0 in the stats (``jaxmoe_pause_every``).
"""

from __future__ import annotations

import logging

from jaxmoe.engine.model_runner import Merge
from jaxmoe.engine.policies import PausePoint
from jaxmoe.engine.sequence import Priority
from jaxmoe.qllm import granularity

log = logging.getLogger(__name__)


class LayerPreemption:
    stats_key = "layer_preemption"

    def __init__(
        self,
        max_paused_state_bytes: int | None = None,
        merge: bool = True,
        merge_tokens: int | None = 16,
        pause_every: int | None = 1,
        budget: float = granularity.BUDGET,
        time_step: granularity.StepTimer = granularity.time_padding_step,
    ):
        """``pause_every``: the executor's layers per program (stats only), or None: choose it
        (``choose_granularity``) within ``budget`` from ``time_step``'s timings."""
        self.pause_every = pause_every  # 0: no step pauses (step-level preemption); None: not chosen yet
        self.budget, self.time_step = budget, time_step
        self.pause_costs: dict[int, float] | None = None  # measured: granularity -> extra time of a step
        self.max_paused_state_bytes = max_paused_state_bytes
        self.merge = merge  # LS work joins the paused step (else it runs as a step of its own)
        self.merge_tokens = merge_tokens  # the cost model: token slots a merged call may have (None: any)
        self.merges_declined = 0  # merges the cost model declined (the LS work ran nested, alone)
        self.ls_merges = 0  # latency-sensitive requests merged into a running step
        self.queue_merges = 0  # ... of them, merged inside a MoE layer (their tokens jumped the expert queues)
        self.merges_refused = 0  # merges refused in a step holding latency-sensitive work (the work waited)
        self.layer_pauses = 0  # times a step was paused between layers for latency-sensitive work
        self.paused_state_bytes_max = 0  # the most device memory a paused step kept (hidden states)
        self.pauses_over_budget = 0  # pauses refused: the step's state exceeded max_paused_state_bytes
        self.expert_queue_depth: list[int] | None = (
            None  # per expert, assignments queued at the latest pause inside a MoE layer
        )

    @property
    def pauses_steps(self) -> bool:
        """False where the measured granularity found none within budget: every step runs fused."""
        return self.pause_every != 0

    def choose_granularity(self, engine, shapes: list[tuple[int, int]]) -> None:
        """Where the granularity is to be measured (``pause_every`` None) and steps may pause (a poll,
        an executor that runs layer groups: the monolithic one), time the steps of ``shapes``' decode
        shapes fused and at each candidate granularity, and take the finest within ``budget`` (none:
        step-level preemption); the executor's ``pause_every`` and ``split_step`` follow."""
        executor = engine.runner.executor
        if self.pause_every is not None or engine.poll is None or not hasattr(executor, "layer_group_sizes"):
            return
        measured = granularity.decode_shapes(shapes)
        if not measured:
            return
        options = granularity.candidates(executor.layer_group_sizes())
        self.pause_costs = granularity.measure_costs(engine, measured, options, time_step=self.time_step)
        self.pause_every = granularity.choose(self.pause_costs, self.budget)
        costs = ", ".join(f"{k}: {100 * c:+.1f} %" for k, c in self.pause_costs.items())
        if self.pause_every:
            executor.pause_every = self.pause_every
            log.info(
                "layer preemption: a pause point every %d layers (cost per layers per program, shapes %s: %s; "
                "budget %.0f %%)",
                self.pause_every,
                measured,
                costs,
                100 * self.budget,
            )
        else:
            log.warning(
                "layer preemption: no pause granularity costs within %.0f %% of the fused step (layers per "
                "program, shapes %s: %s): step-level preemption, every step fused",
                100 * self.budget,
                measured,
                costs,
            )
        engine.share_step_programs()

    def pausable(self, engine, batch) -> bool:
        """A step may pause where something can arrive during it (a poll) and the granularity chosen
        (measured here at the first such step if warm-up did not) pauses steps; one that holds
        latency-sensitive work only where that work can merge into it (``merge`` on an executor that
        merges rows): new latency-sensitive work then joins it (or, where the cost model declines the
        merge, runs nested) instead of waiting for its end."""
        if engine.poll is None:
            return False
        if self.pause_every is None:
            self.choose_granularity(engine, engine.runner.plan.shapes())
        if not self.pauses_steps:
            return False
        if self.merge and getattr(engine.executor, "merge_ready", None) is not None:
            return True
        return all(s.priority is Priority.BE for s in batch.seqs)

    def between_layers(self, engine, layer: int) -> None:
        if engine.poll is not None:
            engine.poll()
        paused = frozenset(engine.step_request_ids)
        scheduler = engine.scheduler
        executor = engine.executor
        # per-expert queues (``ExpertQueueing``); getattr, not isinstance: a runtime-checkable protocol's
        # isinstance inspects the class on every call, and this runs at every pause point of every step
        depth = getattr(executor, "expert_queue_depth", None)
        stage = getattr(executor, "pause_stage", None) or "layer"
        point = PausePoint(layer, stage, depth)
        if not scheduler.pause_at_layer(paused, point):  # the policy sees the stage and the queue depths
            return
        state = engine.runner.pausable_state_bytes
        budget = self.max_paused_state_bytes
        if budget is not None and state > budget:  # too big to keep: LS work waits for the step boundary
            self.pauses_over_budget += 1
            return
        inner = scheduler.schedule(exclude=paused, priority=Priority.LS)
        if inner.is_empty:
            return
        if point.queue_depth is not None:  # what waits at each expert as the step pauses there
            self.expert_queue_depth = point.queue_depth
        outcome = engine.merge_batch(inner, self._cheap) if self.merge else Merge.UNAVAILABLE
        if outcome is Merge.MERGED:
            merged = len(inner.prefills) + len(inner.decodes)
            self.ls_merges += merged
            if stage != "layer":
                self.queue_merges += merged
            return
        if outcome is Merge.DECLINED:  # the merge would cost the LS work more than running alone: nested
            self.merges_declined += 1
        elif any(s is not None and s.priority is Priority.LS for s in map(scheduler.get, paused)):
            # a step holding latency-sensitive work is not stopped for a nested step where the merge
            # was refused for its shape (not compiled): that work waits for its end
            self.merges_refused += 1
            return
        self.layer_pauses += 1
        self.paused_state_bytes_max = max(self.paused_state_bytes_max, state)
        for rid in paused:
            seq = scheduler.get(rid)
            if seq is not None:
                scheduler.preemptions["pause" if stage == "layer" else "expert_pause"][seq.priority.value] += 1
        try:
            outputs = engine.run_batch(inner)
        finally:
            engine.step_request_ids = sorted(paused)
        engine.deliver(outputs)  # the latency-sensitive tokens go out now, not after the paused step

    def _cheap(self, merged: tuple, alone: tuple) -> bool:
        """The cost model: whether a merged call of ``merged`` [rows, tokens] costs the LS rows (whose
        own call is ``alone``) about what running alone would (see the module docstring)."""
        limit = self.merge_tokens
        return limit is None or merged[0] * merged[1] <= max(limit, alone[0] * alone[1])

    def stats(self) -> dict:
        return {
            "pause_every": self.pause_every,
            "merges_declined": self.merges_declined,
            "layer_pauses": self.layer_pauses,
            "ls_merges": self.ls_merges,
            "queue_merges": self.queue_merges,
            "merges_refused": self.merges_refused,
            "pauses_over_budget": self.pauses_over_budget,
            "paused_state_bytes_max": self.paused_state_bytes_max,
            "expert_queue_depth": self.expert_queue_depth,
        }
