"""The statistics the serving loop publishes after every step (scheduler, KV blocks, queues,
preemptions, the state of the hooks that report it, expert activation counts) for metrics readers
on other threads."""

from __future__ import annotations

import logging
import time
from typing import Any

from jaxmoe.engine.hooks import ReportsStats
from jaxmoe.runtime.executor import ExpertUseCounting

log = logging.getLogger(__name__)


class EngineStats:
    def __init__(self, counts_every_s: float = 1.0):
        """``counts_every_s``: read the executor's expert counts at most this often (across processes
        a read is a collective)."""
        self.counts_every_s = counts_every_s
        self._counts_time = 0.0
        self._expert_counts = None
        self._activated = None

    def snapshot(self, engine, in_flight: int, step_errors: int) -> dict[str, Any]:
        snap: dict[str, Any] = dict(engine.scheduler.stats())
        snap["queues"] = engine.scheduler.queue_lengths()
        snap["preemptions"] = {k: dict(v) for k, v in engine.scheduler.preemptions.items()}
        snap["num_blocks"] = engine.block_manager.num_blocks
        snap["in_flight"] = in_flight
        snap["step_errors"] = step_errors
        for hook in [*engine.hooks, engine.layer_hook]:
            if isinstance(hook, ReportsStats):
                snap[hook.stats_key] = hook.stats()
        now = time.monotonic()
        if now - self._counts_time >= self.counts_every_s:
            try:
                counts = engine.executor.expert_activation_counts()
                if counts is not None:
                    self._counts_time = now
                    rows = [[int(c) for c in layer] for layer in counts]
                    moe = [i for i, is_moe in enumerate(engine.cfg.moe_layers) if is_moe]
                    layers = moe if len(moe) == len(rows) else list(range(len(rows)))
                    self._expert_counts = list(zip(layers, rows))  # (model layer index, counts)
                executor = engine.executor
                used = executor.activated_experts() if isinstance(executor, ExpertUseCounting) else None
                if used:
                    self._activated = {
                        "original": sum(o for o, _ in used.values()),
                        "united": sum(u for _, u in used.values()),
                        "per_layer": {i: list(v) for i, v in used.items()},
                    }
            except Exception:
                log.exception("expert_activation_counts() / activated_experts() failed")
        snap["expert_counts"] = self._expert_counts
        snap["activated_experts"] = self._activated  # of the last step read (all MoE layers)
        return snap
