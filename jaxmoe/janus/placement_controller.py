"""The host-side expert controller (JANUS 3.4): re-places expert replicas from recent activations.

Every ``every_steps`` engine steps (or on ``rebalance()``), it reads the expert side's
co-activation counters (``DisaggregatedExecutor.expert_coactivation``), takes the counts of the
window since the last rebalance, plans a new placement per MoE layer with activation-aware
replication + Algorithm 2 (``jaxmoe.janus.placement``) and re-shards the replicas between steps
(``executor.set_placement``; AEBS reads the new replica tables from the next step). Results are
unchanged by construction — any replica of an expert computes the same thing — only which
instance does the work moves.

    controller = PlacementController.attach(llm.engine, every_steps=500)  # or LLM(..., rebalance_every=500)

It is a step hook (``jaxmoe.engine.hooks``): it places the replicas of whichever executor the engine
serves with (live re-scaling may swap it; the statistics window then starts again).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxmoe.runtime.executor import ReplicaPlacement
from jaxmoe.janus.placement import coactivation_load, plan_placement


@dataclasses.dataclass
class Rebalance:
    """What one rebalance did: per MoE layer the window's tokens and max_g I(g) before / after."""

    tokens: list[int]
    max_load_before: list[float]
    max_load_after: list[float]
    slots_moved: int


class PlacementController:
    def __init__(self, executor: ReplicaPlacement, every_steps: int = 0, min_tokens: int = 1):
        if not isinstance(executor, ReplicaPlacement):
            raise TypeError(f"{type(executor).__name__} has no expert replicas to place (use a mesh file)")
        self.every_steps, self.min_tokens = every_steps, min_tokens
        self.engine = None  # attached: place the replicas of whichever executor the engine serves with
        self._executor = self._window_of = executor
        self._seen = executor.expert_coactivation()  # the window starts now
        self._steps = 0
        self.history: collections.deque[Rebalance] = collections.deque(maxlen=100)

    @classmethod
    def attach(cls, engine, every_steps: int) -> "PlacementController":
        """A controller for the engine's executor, run after every engine step that ran the model."""
        controller = cls(engine.executor, every_steps=every_steps)
        controller.engine = engine
        return engine.add_hook(controller)

    @property
    def executor(self) -> ReplicaPlacement:
        return self._executor if self.engine is None else self.engine.executor

    def _window(self) -> ReplicaPlacement:
        """The executor serving now; when live re-scaling swapped it in, its statistics window starts."""
        ex = self.executor
        if ex is not self._window_of:
            self._window_of, self._seen = ex, ex.expert_coactivation()
        return ex

    def before_step(self, engine) -> None:
        self._window()

    def after_step(self, engine, outputs) -> None:
        """Rebalance every ``every_steps`` steps that ran the model (0: never)."""
        if not engine.last_step_ran:
            return
        self._steps += 1
        if self.every_steps and self._steps % self.every_steps == 0:
            self.rebalance()

    def rebalance(self) -> Rebalance | None:
        """Plan and apply a new placement from the window's statistics; None (nothing changed)
        when a layer saw fewer than ``min_tokens`` tokens."""
        ex = self._window()
        now = ex.expert_coactivation()
        window = [a - b for a, b in zip(now, self._seen)]
        tokens = [int(np.diagonal(w).sum()) for w in window]
        if min(tokens) < self.min_tokens:
            return None
        self._seen = now
        N, C = ex.num_expert_instances, ex.slots_per_instance
        old = [ex.placement(i) for i in ex.moe_layers]
        new = [plan_placement(np.diagonal(w), w, N, C, previous=p) for w, p in zip(window, old)]
        result = Rebalance(
            tokens=tokens,
            max_load_before=[max(coactivation_load(p, w, C)) for p, w in zip(old, window)],
            max_load_after=[max(coactivation_load(p, w, C)) for p, w in zip(new, window)],
            slots_moved=ex.set_placement(new),
        )
        self.history.append(result)
        return result
