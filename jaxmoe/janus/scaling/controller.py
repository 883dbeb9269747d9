"""Which layout serves a load at the least cost: the scaling controller (JANUS section 3.4).

A ``Layout`` is a number of attention and expert instances (disaggregated) or of GPUs (monolithic);
its cost is its GPUs. Given a load (request rate, output length, context), ``steady_state`` finds
the batch that load keeps in flight (Little's law: batch = rate x output tokens x TPOT(batch)) and
its TPOT; a layout meets the SLO when that TPOT is under it and the KV cache holds the batch.
``ScalingController.decide`` applies the least-cost layout predicted to meet the SLO (with a
safety margin); it scales up at once and down only after ``down_after`` decisions in a row agree
(no flapping).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxmoe.janus.scaling.perf_model import DisaggregatedPerf, PerfModel


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    gpus: int
    attention: int = 0  # 0: monolithic
    experts: int = 0

    @property
    def name(self) -> str:
        return f"{self.attention}A{self.experts}E" if self.attention else f"{self.gpus} GPUs"


@dataclasses.dataclass(frozen=True)
class System:
    """How a policy runs a layout: disaggregated (AEBS-balanced or random expert scheduling,
    two-phase or direct transfers) or monolithic."""

    disaggregated: bool = True
    balanced: bool = True
    two_phase: bool = True

    def tpot(self, pm: DisaggregatedPerf, layout: Layout, batch: float, context: float) -> float:
        if not self.disaggregated:
            return _roofline(pm).tpot_monolithic(batch, context, layout.gpus)
        return pm.tpot_disaggregated(batch, context, layout.attention, layout.experts, self.balanced, self.two_phase)

    def capacity(self, pm: DisaggregatedPerf, layout: Layout, context: float) -> float:
        if not self.disaggregated:
            return _roofline(pm).monolithic_capacity(layout.gpus, context)
        return pm.kv_capacity(layout.attention, context)


def _roofline(pm) -> PerfModel:
    if not isinstance(pm, PerfModel):
        raise TypeError(f"monolithic layouts need the roofline PerfModel, not {type(pm).__name__}")
    return pm


JANUS = System()
DISAGG = System(balanced=False, two_phase=False)
MONOLITHIC = System(disaggregated=False)


def candidates(pm: PerfModel, kind: str, max_gpus: int = 128) -> list[Layout]:
    """The layouts a policy may choose: ``janus`` (any instance counts), ``disagg`` (whole nodes per
    side), ``monolithic`` (16, 32, 64 GPUs, as the paper's SGLang baseline)."""
    node = pm.hw.gpus_per_node
    e_min = pm.min_expert_instances()
    if kind == "janus":
        return [Layout(a + e, a, e) for a in range(1, 33) for e in range(e_min, 65) if a + e <= max_gpus]
    if kind == "disagg":
        return [
            Layout(a + e, a, e)
            for a in range(node, 33, node)
            for e in range(node, 65, node)
            if e >= e_min and a + e <= max_gpus
        ]
    if kind == "monolithic":
        return [Layout(g) for g in (16, 32, 64) if g <= max_gpus]
    raise ValueError(f"unknown layout kind {kind!r} (janus, disagg, monolithic)")


@dataclasses.dataclass(frozen=True)
class Load:
    rate: float  # requests per second
    output_tokens: float  # mean generated tokens per request
    context: float  # mean tokens attended by a decode step


def steady_state(pm: DisaggregatedPerf, system: System, layout: Layout, load: Load) -> tuple[float, float] | None:
    """(batch in flight, TPOT) of the load on the layout, or None when it cannot keep up."""
    if load.rate <= 0:
        return 0.0, system.tpot(pm, layout, 1.0, load.context)
    cap = system.capacity(pm, layout, load.context)
    demand = lambda b: load.rate * load.output_tokens * system.tpot(pm, layout, max(b, 1.0), load.context)  # noqa: E731
    if cap < 1 or demand(cap) > cap:
        return None
    lo, hi = 0.0, cap  # demand(b) - b is > 0 at 0 and <= 0 at cap: the smallest crossing
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if demand(mid) > mid else (lo, mid)
    return hi, system.tpot(pm, layout, max(hi, 1.0), load.context)


class ScalingController:
    def __init__(
        self,
        pm: DisaggregatedPerf,
        system: System,
        layouts: Iterable[Layout],
        slo_tpot: float,
        margin: float = 0.85,
        down_after: int = 2,
    ):
        self.pm, self.system, self.slo, self.margin, self.down_after = pm, system, slo_tpot, margin, down_after
        if not isinstance(pm, DisaggregatedPerf):
            raise TypeError(f"pm: {type(pm).__name__} is not a DisaggregatedPerf (tpot_disaggregated, kv_capacity)")
        self.layouts = sorted(layouts)
        if not self.layouts:
            raise ValueError("no candidate layout")
        self.current: Layout | None = None
        self._down_votes = 0

    def best(self, load: Load) -> Layout:
        """The least-cost layout predicted to meet ``margin x SLO``; if none does, the one with the
        lowest predicted TPOT (the largest if none keeps up at all)."""
        fallback = None
        for layout in self.layouts:  # sorted by GPUs
            state = steady_state(self.pm, self.system, layout, load)
            if state is None:
                continue
            if state[1] <= self.margin * self.slo:
                return layout
            if fallback is None or state[1] < fallback[1]:
                fallback = (layout, state[1])
        return fallback[0] if fallback is not None else self.layouts[-1]

    def decide(self, load: Load) -> Layout:
        want = self.best(load)
        if self.current is None or want.gpus >= self.current.gpus:
            self.current, self._down_votes = want, 0
        else:
            self._down_votes += 1
            if self._down_votes >= self.down_after:
                self.current, self._down_votes = want, 0
        return self.current
