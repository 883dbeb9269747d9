"""How often a step may pause (QLLM layer-level preemption): the pause granularity, chosen from a
measurement of what the pause points cost when nothing preempts.

A pausable step runs one ``layers`` program per ``pause_every`` layers, plus ``embed`` and ``head``,
and waits at each pause point for the program before it; the fused step is one program. Each program
call has a fixed price (dispatch, and on XLA:CPU the runtime threads' hand-over: ~0.1 ms of CPU on the
2-core test machine, about one layer of the demo model; bench/results/2026-12-07-qllm-cost.md), so the
relative cost of pausing depends on the model, the batch and the device. ``measure_costs`` times, on
padding rows, the fused step and the pausable step at each candidate granularity (alternating, the
least of ``rounds`` runs of each) for the decode shapes served (the cheapest calls: the largest
relative cost); ``choose`` takes the finest granularity whose cost is within the budget, or 0 (none:
step-level preemption, every step fused).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from jaxmoe.engine.policies import PausePoint

log = logging.getLogger(__name__)

BUDGET = 0.02  # the most a pausable step may cost over the fused one when nothing preempts (default on)
ROUNDS = 15  # alternating runs of every variant per shape; the least time of each counts

# ``time_step(engine, rows, tokens, every)``: seconds of one step of that shape on padding rows, the
# fused step for ``every`` 0, else a pausable one with a pause point every ``every`` layers
StepTimer = Callable[[object, int, int, int], float]


def candidates(group_sizes: list[int]) -> list[int]:
    """The granularities worth measuring for layer groups of these sizes: per number of program calls
    the finest (the others make as many calls and pause later)."""
    finest: dict[int, int] = {}
    for every in range(1, max(group_sizes) + 1):
        finest.setdefault(sum(math.ceil(n / every) for n in group_sizes), every)
    return sorted(finest.values())


def choose(costs: dict[int, float], budget: float = BUDGET) -> int:
    """The finest granularity (layers per program) whose cost is within ``budget``; 0 where none is:
    step-level preemption."""
    within = [every for every, cost in costs.items() if cost <= budget]
    return min(within) if within else 0


def decode_shapes(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The shapes to measure: the decode shapes (one token per row) with the fewest and the most rows,
    else the shape of the fewest tokens."""
    decodes = sorted(s for s in shapes if s[1] == 1)
    if decodes:
        return sorted({decodes[0], decodes[-1]})
    return [min(shapes, key=lambda s: (s[0] * s[1], s))] if shapes else []


def time_padding_step(engine, rows: int, tokens: int, every: int) -> float:
    """``StepTimer`` on the engine's runner: one step of padding rows (forward, sampler, tokens read
    back), its pause points asking the scheduler's policy as a served step's do (nothing waits)."""
    executor, scheduler = engine.runner.executor, engine.scheduler

    def point(layer):
        scheduler.pause_at_layer(frozenset(), PausePoint(layer, "layer", None))

    executor.pause_every = max(every, 1)
    executor.split_step = every > 0
    t0 = time.perf_counter()
    engine.runner.run_padding(rows, tokens, point if every else None)
    return time.perf_counter() - t0


def measure_costs(
    engine,
    shapes: list[tuple[int, int]],
    granularities: list[int],
    rounds: int = ROUNDS,
    time_step: StepTimer = time_padding_step,
) -> dict[int, float]:
    """Per granularity, the pausable step's extra time over the fused step's (0.05: 5 % more), the
    largest over ``shapes``: per shape every variant runs once (compiling), then ``rounds`` times in
    turn (order rotated), and the least time of each counts. The executor's ``pause_every`` and
    ``split_step`` are restored."""
    executor = engine.runner.executor
    saved = executor.pause_every, executor.split_step
    variants = [0, *granularities]
    costs = dict.fromkeys(granularities, -math.inf)
    try:
        for rows, tokens in shapes:
            for every in variants:
                time_step(engine, rows, tokens, every)
            best = dict.fromkeys(variants, math.inf)
            for r in range(rounds):
                k = r % len(variants)
                for every in variants[k:] + variants[:k]:
                    best[every] = min(best[every], time_step(engine, rows, tokens, every))
            for every in granularities:
                costs[every] = max(costs[every], best[every] / best[0] - 1)
    finally:
        executor.pause_every, executor.split_step = saved
    return costs
