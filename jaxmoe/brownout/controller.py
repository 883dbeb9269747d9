"""SALC driving a running engine: a step hook (``jaxmoe.engine.hooks``) that feeds the SLO analyzer
and moves the threshold.

After every step: each request that got its first token in it adds a TTFT sample; a step that
decoded adds its wall time as a TPOT sample (the time every decoding request waited for its next
token). Then (after every step, or at most every ``period_s`` seconds) Algorithm 2 runs per phase that has an SLO and the executor's brownout threshold
becomes the lower of the phases' thresholds (the stricter phase wins). ``state()`` is what metrics
export (``jaxmoe_brownout_threshold``, the P90s).
"""

from __future__ import annotations

import time

from jaxmoe.brownout.config import BrownoutError, SALCConfig
from jaxmoe.brownout.routing import is_brownout, set_threshold, threshold
from jaxmoe.brownout.salc import SALC, SLOAnalyzer


class BrownoutController:
    stats_key = "brownout"

    def __init__(self, executor, config: SALCConfig, clock=time.monotonic):
        if not is_brownout(executor):
            raise BrownoutError("SALC needs an executor built with brownout (LLM(dir, brownout=...))")
        self.executor, self.config, self.clock = executor, config, clock
        self.analyzer = SLOAnalyzer(config.window_s, clock)
        start = threshold(executor)
        self.salc = {
            phase: SALC(slo, config.warning_factor, config.increment, config.shrink_ratio, start)
            for phase, slo in (("ttft", config.slo_ttft_s), ("tpot", config.slo_tpot_s))
            if slo is not None
        }
        self._last = self._updated = None
        self._seen_first: set[str] = set()

    @classmethod
    def attach(cls, engine, config: SALCConfig) -> BrownoutController:
        return engine.add_hook(cls(engine.executor, config))

    def before_step(self, engine) -> None:
        if engine.executor is not self.executor:  # live re-scaling swapped it in (with the threshold)
            self.executor = engine.executor

    def after_step(self, engine, outputs) -> None:
        if engine.last_step_ran:
            self.update(engine)

    def update(self, engine) -> None:
        """Feed the analyzer with the step's samples and move the threshold (Algorithm 2)."""
        now = self.clock()
        decoded = False
        for rid in engine.step_request_ids:
            seq = engine.scheduler.get(rid)
            if seq is None or seq.first_token_time is None:
                continue
            if rid not in self._seen_first:
                self._seen_first.add(rid)
                self.analyzer.record("ttft", seq.first_token_time - seq.arrival_time, now)
            elif seq.num_output_tokens > 1:
                decoded = True
        self._seen_first &= {s.request_id for s in engine.scheduler.running}
        if decoded and self._last is not None:
            self.analyzer.record("tpot", now - self._last, now)
        self._last = now
        if self._updated is not None and now - self._updated < self.config.period_s:
            return
        self._updated = now
        thresholds = [salc.update(self.analyzer.p90(phase, now)) for phase, salc in self.salc.items()]
        set_threshold(self.executor, min(thresholds))

    def stats(self) -> dict:
        return self.state()

    def state(self) -> dict:
        return {
            "threshold": threshold(self.executor),
            "p90": {phase: self.analyzer.p90(phase) for phase in ("ttft", "tpot")},
        }
