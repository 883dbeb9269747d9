"""BrownoutServe's SLO analyzer and SLO-aware latency control (SALC, Algorithm 2).

``SLOAnalyzer`` keeps (time, latency) samples per phase (``ttft``: prefill, ``tpot``: decode) and
answers the P90 over the last ``tw`` seconds (``np.percentile``'s linear P90, from a window kept
sorted: a step adds and expires a few samples, the P90 is read in O(1); sorting the window at every
call cost 1.7 ms per step with 3,200 TPOT samples, several per cent of a decode step).
``SALC.update`` is Algorithm 2 for one phase: below ``warning_factor x slo`` the threshold grows by
``increment`` (fewer tokens browned out), above ``slo`` it shrinks by ``shrink_ratio``; it stays in
[0, 1]. Paper defaults: warning 0.8, increment 0.1, shrink 0.8.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time

from jaxmoe.brownout.config import BrownoutError, check_salc, check_threshold

PHASES = ("ttft", "tpot")


class SLOAnalyzer:
    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        if not window_s > 0:
            raise BrownoutError(f"SLO analyzer window must be > 0 seconds, got {window_s!r}")
        self.window_s, self.clock = window_s, clock
        self._samples = {p: collections.deque() for p in PHASES}  # (time, latency), oldest first
        self._sorted = {p: [] for p in PHASES}  # the same latencies, ascending

    def record(self, phase: str, latency_s: float, at: float | None = None) -> None:
        if phase not in self._samples:
            raise BrownoutError(f"unknown phase {phase!r} (ttft, tpot)")
        latency_s = float(latency_s)
        self._samples[phase].append((self.clock() if at is None else at, latency_s))
        bisect.insort(self._sorted[phase], latency_s)

    def _expire(self, phase: str, now: float | None) -> list[float]:
        """Drop the samples of ``phase`` older than the window; its latencies now, ascending."""
        now = self.clock() if now is None else now
        q, ordered = self._samples[phase], self._sorted[phase]
        while q and q[0][0] < now - self.window_s:
            del ordered[bisect.bisect_left(ordered, q.popleft()[1])]
        return ordered

    def samples(self, phase: str, now: float | None = None) -> list[float]:
        """The latencies of ``phase`` in the last window (oldest first)."""
        self._expire(phase, now)
        return [v for _, v in self._samples[phase]]

    def p90(self, phase: str, now: float | None = None) -> float | None:
        """P90 latency of ``phase`` over the last window (None: no sample in it): ``np.percentile(.., 90)``
        (linear interpolation between the two nearest ranks) of the window's latencies."""
        ordered = self._expire(phase, now)
        if not ordered:
            return None
        h = 0.9 * (len(ordered) - 1)
        lo = int(h)
        a, b, t = ordered[lo], ordered[min(lo + 1, len(ordered) - 1)], h - lo
        return a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t)  # numpy's lerp, to the last bit


@dataclasses.dataclass
class SALC:
    slo: float  # seconds
    warning_factor: float = 0.8
    increment: float = 0.1
    shrink_ratio: float = 0.8
    threshold: float = 1.0

    def __post_init__(self):
        check_salc(
            slo=self.slo, warning_factor=self.warning_factor, increment=self.increment, shrink_ratio=self.shrink_ratio
        )
        self.threshold = check_threshold(self.threshold)

    def update(self, latency: float | None) -> float:
        """Algorithm 2 with the recent P90 ``latency`` (None: no data, nothing changes)."""
        if latency is None:
            return self.threshold
        warning_line = self.slo * self.warning_factor
        if latency < warning_line:
            self.threshold = min(1.0, self.threshold + self.increment)
        elif latency > self.slo:
            self.threshold = self.threshold * self.shrink_ratio
        return self.threshold
