"""SALC driving a running engine: a step hook (``jaxmoe.engine.hooks``) that feeds the SLO analyzer
and moves the threshold.

After every step: each request that got its first token in it adds a TTFT sample; each request
that got a later token adds one TPOT sample, the time since its previous token (so the TPOT P90 is
over tokens, as the paper's SLO violations are, not over steps). Then (after every step, or at
most every ``period_s`` seconds) Algorithm 2 runs per phase that has an SLO, one SALC instance per
phase as in the paper: the TTFT SALC moves the prefill threshold, the TPOT SALC the decode threshold
(a phase without an SLO keeps its threshold). ``state()`` is what metrics export
(``jaxmoe_brownout_threshold{phase}``, the P90s).
"""

from __future__ import annotations

import time

from jaxmoe.brownout.config import BrownoutError, SALCConfig
from jaxmoe.brownout.routing import is_brownout, set_threshold, thresholds
from jaxmoe.brownout.salc import SALC, SLOAnalyzer

PHASE_OF = {"ttft": "prefill", "tpot": "decode"}  # the latency each phase's SALC watches


class BrownoutController:
    stats_key = "brownout"

    def __init__(self, executor, config: SALCConfig, clock=time.monotonic):
        if not is_brownout(executor):
            raise BrownoutError("SALC needs an executor built with brownout (LLM(dir, brownout=...))")
        self.executor, self.config, self.clock = executor, config, clock
        self.analyzer = SLOAnalyzer(config.window_s, clock)
        start = thresholds(executor)
        self.salc = {  # latency -> the SALC of its phase
            latency: SALC(slo, config.warning_factor, config.increment, config.shrink_ratio, start[PHASE_OF[latency]])
            for latency, slo in (("ttft", config.slo_ttft_s), ("tpot", config.slo_tpot_s))
            if slo is not None
        }
        self._updated = None
        self._last_token: dict[str, float] = {}  # request -> when its latest token was seen

    @classmethod
    def attach(cls, engine, config: SALCConfig, clock=time.monotonic) -> BrownoutController:
        return engine.add_hook(cls(engine.executor, config, clock))

    def before_step(self, engine) -> None:
        if engine.executor is not self.executor:  # live re-scaling swapped it in (with the threshold)
            self.executor = engine.executor

    def after_step(self, engine, outputs) -> None:
        if engine.last_step_ran:
            self.update(engine, outputs)

    def update(self, engine, outputs=()) -> None:
        """Feed the analyzer with the samples of the step's ``outputs`` (``RequestOutput``) and move
        the threshold (Algorithm 2)."""
        now = self.clock()
        for out in outputs:
            n = len(out.delta_token_ids)
            if n == 0:
                continue
            last = self._last_token.pop(out.request_id, None)
            if last is None:
                if out.ttft is not None:
                    self.analyzer.record("ttft", out.ttft, now)
            else:
                for _ in range(n):  # one sample per decoded token
                    self.analyzer.record("tpot", (now - last) / n, now)
            if not out.finished:
                self._last_token[out.request_id] = now
        self._last_token = {r: t for r, t in self._last_token.items() if engine.scheduler.get(r) is not None}
        if self._updated is not None and now - self._updated < self.config.period_s:
            return
        self._updated = now
        for latency, salc in self.salc.items():
            set_threshold(self.executor, salc.update(self.analyzer.p90(latency, now)), PHASE_OF[latency])

    def stats(self) -> dict:
        return self.state()

    def state(self) -> dict:
        return {
            "threshold": thresholds(self.executor),  # {"prefill": t, "decode": t}
            "p90": {phase: self.analyzer.p90(phase) for phase in ("ttft", "tpot")},
        }
