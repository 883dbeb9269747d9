"""The closed scaling loop (JANUS, arXiv:2512.13525, section 3.4 "Resource scaling"): measured
decode latency, SLO violations, queueing and per-instance utilization drive the decisions; the
performance model only ranks candidate actions, and is checked against what was measured.

* ``WindowMeter`` collects one decision window of measurements (``observe`` per decode step) and
  closes it into a ``Window``: per-token TPOT (a step's wall time counts once per request that
  decoded in it, split over the tokens it gave that request), its mean and token-weighted P90, the
  share of tokens over the SLO, the decode batch and context, requests waiting and their growth,
  time to first token, arrivals, and the utilization of every attention instance (KV blocks used
  of its partition) and expert instance (activated replicas of its slots).
* ``CorrectedPerf``: the performance model times a correction factor learned online. When the
  predicted TPOT of the serving layout at the measured batch and context differs from the measured
  mean by more than ``gap_limit`` (20 %) of the measured value, the factor is re-fitted to
  ``measured / raw predicted`` of that window (a re-fit).
* ``SideController``: one per sub-cluster (attention, experts), each with its own trigger, its own
  candidate counts and its own down-vote hysteresis. ``ClosedLoopController`` runs both and
  combines their counts into one layout among those that fit the devices.
* Fallback: when the gap stays beyond ``gap_limit`` for ``fallback_after`` windows in a row although
  the model was re-fitted after each, the model is not trusted and a measured-only rule decides (one
  instance more on the busier side when the SLO is violated, one fewer on the idler side after
  ``down_after`` windows with headroom) until a window's gap is back within the limit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from jaxmoe.janus.scaling.controller import JANUS, Layout, Load, steady_state
from jaxmoe.janus.scaling.perf_model import DisaggregatedPerf, PerfModel

SIDES = ("attention", "experts")


@dataclasses.dataclass
class Window:
    """What one decision window measured."""

    start: float
    end: float
    tokens: float = 0.0  # decode tokens (the first token of a request is not a decode token)
    tpot_mean_s: float | None = None  # token-weighted mean per-token decode time
    tpot_p90_s: float | None = None  # token-weighted P90
    violations: float = 0.0  # share of decode tokens whose per-token time exceeded the SLO
    decode_steps: float = 0.0
    batch: float = 0.0  # mean requests decoding per decode step
    token_batch: float = 0.0  # the same, token-weighted: the batch the mean decode token was in
    context: float = 1.0  # mean tokens attended by a decoding request
    waiting: int = 0  # requests waiting at the end of the window
    waiting_growth: int = 0  # waiting at the end less waiting at the start
    ttft_p90_s: float | None = None  # of the requests whose first token came in the window
    arrivals: int = 0
    output_tokens: float = 1.0  # mean requested output tokens of the live requests
    attention_util: list[float] = dataclasses.field(default_factory=list)  # per instance, highest seen
    expert_util: list[float] | None = None  # per instance, mean of the samples; None: not measured

    @property
    def duration(self) -> float:
        return max(self.end - self.start, 1e-9)

    @property
    def load(self) -> Load:
        return Load(self.arrivals / self.duration, self.output_tokens, self.context)

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()}


class WindowMeter:
    """Accumulates the measurements of the current window (``observe``), closes it (``close``)."""

    def __init__(self, slo_tpot_s: float, start: float, waiting: int = 0):
        self.slo = slo_tpot_s
        self._reset(start, waiting)

    def _reset(self, start: float, waiting: int) -> None:
        self.start, self.waiting_start, self.waiting = start, waiting, waiting
        self._tpot: list[tuple[float, float]] = []  # (seconds per token, tokens)
        self._ttft: list[float] = []
        self.decode_steps = 0.0
        self._batch_sum = self._context_sum = self._batch_sq = 0.0
        self.arrivals = 0
        self.output_tokens = 1.0
        self._attn: list[float] = []
        self._expert_sum: np.ndarray | None = None
        self._expert_n = 0

    def observe(
        self,
        step_s: float,
        decoded: Sequence[int] = (),
        contexts: Sequence[float] = (),
        steps: float = 1.0,
        waiting: int | None = None,
        ttft: Iterable[float] = (),
    ) -> None:
        """One step (or ``steps`` alike) of ``step_s`` seconds each; ``decoded[i]``: decode tokens the
        step gave request i (each request's per-token time is ``step_s / decoded[i]``);
        ``contexts[i]``: its tokens attended."""
        decoded = np.asarray(decoded, dtype=np.int64)
        decoded = decoded[decoded > 0]
        if decoded.size:
            per, count = np.unique(decoded, return_counts=True)
            for d, n in zip(per.tolist(), count.tolist()):
                self._tpot.append((step_s / d, d * n * steps))
            self.decode_steps += steps
            self._batch_sum += decoded.size * steps
            self._batch_sq += decoded.size * int(decoded.sum()) * steps
            if contexts:
                self._context_sum += float(np.mean(contexts)) * len(decoded) * steps
        self._ttft.extend(ttft)
        if waiting is not None:
            self.waiting = waiting

    def utilization(self, attention: Sequence[float] | None = None, experts: Sequence[float] | None = None) -> None:
        """Per-instance utilization samples: attention (the highest of the window is kept), experts
        (averaged over the samples)."""
        if attention is not None:
            att = list(attention)
            if len(att) != len(self._attn):
                self._attn = att
            else:
                self._attn = [max(a, b) for a, b in zip(self._attn, att)]
        if experts is not None:
            ex = np.asarray(experts, float)
            if self._expert_sum is None or self._expert_sum.shape != ex.shape:
                self._expert_sum, self._expert_n = np.zeros_like(ex), 0
            self._expert_sum += ex
            self._expert_n += 1

    def partial_p90(self) -> tuple[float | None, float]:
        """(token-weighted P90, tokens) of the window so far."""
        if not self._tpot:
            return None, 0.0
        v, w = np.asarray(self._tpot).T
        return weighted_quantile(v, w, 0.9), float(w.sum())

    def close(self, end: float, arrivals: int, output_tokens: float) -> Window:
        """The window ending at ``end`` (``arrivals``: requests admitted in it); a new one starts."""
        w = Window(self.start, end, arrivals=arrivals, output_tokens=output_tokens)
        if self._tpot:
            v, wt = np.asarray(self._tpot).T
            w.tokens = float(wt.sum())
            w.tpot_mean_s = float(np.average(v, weights=wt))
            w.tpot_p90_s = weighted_quantile(v, wt, 0.9)
            w.violations = float(wt[v > self.slo].sum() / wt.sum())
        if self.decode_steps:
            w.decode_steps = self.decode_steps
            w.batch = self._batch_sum / self.decode_steps
            w.token_batch = self._batch_sq / w.tokens
            w.context = max(self._context_sum / self._batch_sum, 1.0) if self._context_sum else 1.0
        w.waiting, w.waiting_growth = self.waiting, self.waiting - self.waiting_start
        if self._ttft:
            w.ttft_p90_s = float(np.quantile(self._ttft, 0.9))
        w.attention_util = list(self._attn)
        if self._expert_sum is not None and self._expert_n:
            w.expert_util = [float(x) for x in self._expert_sum / self._expert_n]
        self._reset(end, self.waiting)
        return w


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` of the total."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, q * cum[-1] - 1e-12))
    return float(values[order][min(i, len(values) - 1)])


class CorrectedPerf:
    """A ``DisaggregatedPerf`` times a correction factor learned online (``refit``)."""

    def __init__(self, pm: DisaggregatedPerf):
        self.pm, self.factor = pm, 1.0

    def raw_tpot(self, batch: float, context: float, attention: int, experts: int) -> float:
        return self.pm.tpot_disaggregated(max(batch, 1.0), context, attention, experts)

    def tpot_disaggregated(self, batch, context, attention, experts, balanced=True, two_phase=True) -> float:
        return self.factor * self.pm.tpot_disaggregated(
            max(batch, 1.0), context, attention, experts, balanced, two_phase
        )

    def kv_capacity(self, attention: int, context: float) -> float:
        return self.pm.kv_capacity(attention, context)

    def refit(self, measured: float, batch: float, context: float, attention: int, experts: int) -> None:
        """The factor that makes this window's prediction equal what was measured."""
        raw = self.raw_tpot(batch, context, attention, experts)
        if raw > 0 and measured > 0:
            self.factor = measured / raw

    def shares(self, batch: float, context: float, attention: int, experts: int) -> dict[str, float]:
        """The attention and expert sides' shares of the predicted step time (the rest: embedding,
        LM head, sampling, overhead, left out)."""
        pm, b = self.pm, max(batch, 1.0)
        if hasattr(pm, "parts"):  # FittedPerfModel
            p = pm.parts(b, context, attention, experts)
            d = pm.dims
            att, exp = d.layers * p["attention"], d.moe_layers * (p["a2e"] + p["expert"] + p["e2a"])
        elif isinstance(pm, PerfModel):
            m = pm.model
            att = m.layers * pm.attention_s(b / attention, context)
            exp = m.moe_layers * (pm.moe_s(b, experts) + pm.transfer_s(b, attention, experts))
        else:  # any model: what doubling each side would save
            t = pm.tpot_disaggregated(b, context, attention, experts)
            att = max(t - pm.tpot_disaggregated(b, context, 2 * attention, experts), 0.0)
            exp = max(t - pm.tpot_disaggregated(b, context, attention, 2 * experts), 0.0)
        total = max(att + exp, 1e-12)
        return {"attention": att / total, "experts": exp / total}


@dataclasses.dataclass
class SideDecision:
    count: int  # what this sub-cluster's controller asks for
    reason: str  # hold | up:slo | up:kv | up:measured | down | down:measured


class SideController:
    """The controller of one sub-cluster: its trigger, its candidate counts, its down votes."""

    def __init__(self, side: str, down_after: int, util_low: float, util_high: float):
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self.side, self.down_after, self.util_low, self.util_high = side, down_after, util_low, util_high
        self.down_votes = 0
        self.last: SideDecision | None = None

    def utilization(self, w: Window) -> float | None:
        """The busiest instance's utilization (None: not measured)."""
        u = w.attention_util if self.side == "attention" else w.expert_util
        return max(u) if u else None

    def pressure(self, w: Window) -> bool:
        """This side's own reason to grow: attention KV memory nearly full while requests queue."""
        u = self.utilization(w)
        return self.side == "attention" and u is not None and u >= self.util_high and w.waiting > 0

    def vote_down(self, headroom: bool, w: Window) -> bool:
        """Count a window with headroom (and this side's utilization below ``util_low`` where
        measured); True after ``down_after`` in a row."""
        u = self.utilization(w)
        if headroom and (u is None or u < self.util_low):
            self.down_votes += 1
        else:
            self.down_votes = 0
        return self.down_votes >= self.down_after


class ClosedLoopController:
    """Two sub-cluster controllers and the model check (module docstring). ``decide(window)``
    returns the layout to serve; ``current`` is the layout serving."""

    def __init__(
        self,
        pm: DisaggregatedPerf,
        layouts: Iterable[Layout],
        slo_tpot: float,
        margin: float = 0.85,
        down_after: int = 2,
        headroom: float = 0.3,
        max_violations: float = 0.1,
        gap_limit: float = 0.2,
        fallback_after: int = 2,
        util_low: float = 0.5,
        util_high: float = 0.9,
    ):
        if not isinstance(pm, DisaggregatedPerf):
            raise TypeError(f"pm: {type(pm).__name__} is not a DisaggregatedPerf (tpot_disaggregated, kv_capacity)")
        if slo_tpot <= 0:
            raise ValueError(f"slo_tpot must be > 0, got {slo_tpot}")
        self.pm, self.model, self.slo = pm, CorrectedPerf(pm), slo_tpot
        self.margin, self.headroom, self.max_violations = margin, headroom, max_violations
        self.gap_limit, self.fallback_after = gap_limit, fallback_after
        self.layouts = sorted(layouts)
        if not self.layouts:
            raise ValueError("no candidate layout")
        self.sides = {s: SideController(s, down_after, util_low, util_high) for s in SIDES}
        self.current: Layout | None = None
        self.fallback = False
        self.refits = self.fallbacks = 0
        self._gap_windows = 0
        self.predicted_s: float | None = None  # the corrected model's TPOT of the serving layout, last window
        self.measured_s: float | None = None
        self.gap: float | None = None
        self._predicted: dict[tuple, float] = {}

    # -- the model check -------------------------------------------------------------------------
    def check_model(self, w: Window, layout: Layout) -> None:
        """Compare the predicted TPOT of ``layout`` at the window's batch and context with the
        measured mean; beyond ``gap_limit``: re-fit, and fall back after ``fallback_after`` such
        windows in a row."""
        if w.tpot_mean_s is None or w.token_batch <= 0:
            return
        a, e = layout.attention, layout.experts
        self.measured_s = w.tpot_mean_s
        self.predicted_s = self.model.tpot_disaggregated(w.token_batch, w.context, a, e)
        self.gap = abs(self.predicted_s - self.measured_s) / self.measured_s
        if self.gap > self.gap_limit:
            self._gap_windows += 1
            self.model.refit(self.measured_s, w.token_batch, w.context, a, e)
            self.refits += 1
            if self._gap_windows >= self.fallback_after and not self.fallback:
                self.fallback = True
                self.fallbacks += 1
        else:
            self._gap_windows = 0
            self.fallback = False

    # -- one decision ----------------------------------------------------------------------------
    def violated(self, w: Window) -> bool:
        over = w.tpot_p90_s is not None and w.tpot_p90_s > self.slo
        queue = w.waiting > 0 and w.waiting_growth > 0
        return over or w.violations > self.max_violations or queue

    def has_headroom(self, w: Window) -> bool:
        return (
            w.tpot_p90_s is not None
            and w.tpot_p90_s < (1 - self.headroom) * self.slo
            and w.violations == 0
            and w.waiting == 0
        )

    def demand(self, w: Window) -> Load:
        """The decode work to serve, as a token rate: the window's decode tokens per second plus the
        waiting requests' output tokens over one more window (``Load`` of one-token requests, so
        ``steady_state`` gives the batch that rate keeps in flight on a layout: Little's law)."""
        rate = (w.tokens + w.waiting * w.output_tokens) / w.duration
        return Load(rate, 1.0, w.context)

    def predict(self, a: int, e: int, demand: Load) -> float:
        """The corrected model's TPOT of aXeY at its steady state under ``demand`` (inf: it cannot
        keep up or hold the batch)."""
        key = (a, e, demand, self.model.factor)
        if key not in self._predicted:  # one decision asks for the same layouts several times
            state = steady_state(self.model, JANUS, Layout(a + e, a, e), demand)
            self._predicted[key] = math.inf if state is None else state[1]
        return self._predicted[key]

    def meets(self, a: int, e: int, demand: Load) -> bool:
        return self.predict(a, e, demand) <= self.margin * self.slo

    def decide(self, w: Window, serving: Layout | None = None) -> Layout:
        self._predicted.clear()
        cur = serving or self.current or self.layouts[0]
        self.current = cur
        self.check_model(w, cur)
        violated, headroom = self.violated(w), self.has_headroom(w)
        down = {s: c.vote_down(headroom, w) for s, c in self.sides.items()}
        if violated:
            for c in self.sides.values():
                c.down_votes = 0
        demand = self.demand(w)
        if self.fallback:
            a, e = self._measured_rule(w, cur, violated, down)
        else:
            rising = violated or (w.tpot_p90_s is not None and w.tpot_p90_s > self.margin * self.slo)
            a, e = self._model_rule(w, cur, violated, rising, down, demand)
        want = self._fit(a, e, cur, demand)
        if want != cur:
            for c in self.sides.values():
                c.down_votes = 0
        self.current = want
        return want

    def _model_rule(
        self, w: Window, cur: Layout, violated: bool, rising: bool, down: dict, demand: Load
    ) -> tuple[int, int]:
        """Each side's controller proposes its count with the other side held at its latest proposal;
        the bottleneck side (the larger share of the predicted step) proposes first; two rounds, so
        the first side can give back what the second side's growth made unneeded."""
        shares = self.model.shares(max(w.token_batch + w.waiting, 1.0), w.context, cur.attention, cur.experts)
        order = sorted(SIDES, key=lambda s: -shares[s])
        counts = {"attention": cur.attention, "experts": cur.experts}
        for _ in range(2):
            for s in order:
                other, now = counts[_other(s)], cur_count(cur, s)
                n, reason = now, "hold"
                if rising:  # the measurement triggers; the model picks the least count predicted to recover
                    n = self._least(s, other, demand, now, None)
                    n = now if n is None else n
                    reason = "up:slo" if n > now else "hold"
                elif down[s]:  # headroom measured for down_after windows: the least count predicted to suffice
                    n = self._least(s, other, demand, 1, now)
                    n = now if n is None else n
                    reason = "down" if n < now else "hold"
                if self.sides[s].pressure(w) and n <= now:  # KV memory nearly full while requests queue
                    n, reason = now + 1, "up:kv"
                counts[s] = n
                self.sides[s].last = SideDecision(n, reason)
        if violated and (counts["attention"], counts["experts"]) == (cur.attention, cur.experts):
            # measured over the SLO although the model says nothing better is needed or possible: the
            # measurement wins, one instance more on the side with the larger share that the devices allow
            for s in order:
                grown = dict(counts, **{s: counts[s] + 1})
                if self._layout(grown["attention"], grown["experts"]) is not None:
                    counts = grown
                    self.sides[s].last = SideDecision(counts[s], "up:measured")
                    break
        return counts["attention"], counts["experts"]

    def _layout(self, a: int, e: int) -> Layout | None:
        return next((lay for lay in self.layouts if (lay.attention, lay.experts) == (a, e)), None)

    def _least(self, side: str, other: int, demand: Load, lower: int, upper: int | None) -> int | None:
        """The least count of ``side`` in [lower, upper] (None: no upper bound) that a layout with the
        other side at ``other`` allows and that is predicted to meet ``margin x SLO`` under
        ``demand``. Growing (``upper`` None) when none does: the count with the lowest predicted TPOT
        (None: no layout allows a count); shrinking: None."""
        grow = upper is None
        counts = {cur_count(lay, side) for lay in self.layouts if cur_count(lay, _other(side)) == other}
        counts = sorted(counts or {cur_count(lay, side) for lay in self.layouts})  # those the devices allow
        counts = [n for n in counts if lower <= n and (grow or n <= upper)]
        if not counts:
            return None
        best, best_t = None, math.inf
        for n in counts:
            a, e = (n, other) if side == "attention" else (other, n)
            t = self.predict(a, e, demand)
            if t <= self.margin * self.slo:
                return n
            if t < best_t * (1 - 1e-9):
                best, best_t = n, t
        return (counts[-1] if best is None else best) if grow else None

    def _measured_rule(self, w: Window, cur: Layout, violated: bool, down: dict) -> tuple[int, int]:
        """The model is not trusted: one instance more on the busier side when the SLO is violated
        (the other side if the devices hold no more of it); one fewer on the idler side when both
        sides agreed to shrink. Only layouts that fit: the model is not asked."""
        util = {s: self.sides[s].utilization(w) for s in SIDES}
        u = {s: 0.5 if v is None else v for s, v in util.items()}
        a, e = cur.attention, cur.experts
        if violated:
            first = "attention" if self.sides["attention"].pressure(w) or u["attention"] > u["experts"] else "experts"
            for s in (first, _other(first)):  # the busier side, unless the devices hold no more of it
                grown = (a + 1, e) if s == "attention" else (a, e + 1)
                if self._layout(*grown) is not None:
                    a, e = grown
                    self.sides[s].last = SideDecision(a if s == "attention" else e, "up:measured")
                    break
        elif down["attention"] and down["experts"]:
            s = "attention" if u["attention"] <= u["experts"] else "experts"
            n = cur_count(cur, s)
            shrunk = (a - 1, e) if s == "attention" else (a, e - 1)
            if n > 1 and u[s] * n / (n - 1) < self.sides[s].util_high and self._layout(*shrunk) is not None:
                a, e = shrunk
                self.sides[s].last = SideDecision(n - 1, "down:measured")
        return a, e

    def _fit(self, a: int, e: int, cur: Layout, demand: Load) -> Layout:
        """The combined request as a layout that fits the devices: (a, e) itself, else among the
        layouts with at most a and e instances the one with the lowest predicted TPOT (ties: the
        cheapest; when none keeps up: the largest)."""
        exact = self._layout(a, e)
        if exact is not None:
            return exact
        within = [lay for lay in self.layouts if lay.attention <= a and lay.experts <= e]
        if not within:
            return cur
        predicted = {lay: self.predict(lay.attention, lay.experts, demand) for lay in within}
        if all(math.isinf(t) for t in predicted.values()):  # none keeps up: the most instances
            return max(within, key=lambda lay: (lay.gpus, lay))
        return min(within, key=lambda lay: (predicted[lay], lay))

    def stats(self) -> dict:
        return {
            "tpot_predicted_s": self.predicted_s,
            "tpot_measured_s": self.measured_s,
            "model_gap": self.gap,
            "model_correction": self.model.factor,
            "model_refits": self.refits,
            "model_fallbacks": self.fallbacks,
            "fallback": self.fallback,
            "sides": {
                s: {
                    "down_votes": c.down_votes,
                    "want": None if c.last is None else c.last.count,
                    "reason": None if c.last is None else c.last.reason,
                }
                for s, c in self.sides.items()
            },
        }


def cur_count(layout: Layout, side: str) -> int:
    return layout.attention if side == "attention" else layout.experts


def _other(side: str) -> str:
    return "experts" if side == "attention" else "attention"
