"""JANUS scaling (arXiv:2512.13525, sections 3.4 and 5): a performance model of disaggregated and
monolithic MoE serving, a scaling controller that picks the least-cost layout meeting a TPOT SLO,
and a cluster simulator that replays a synthetic diurnal, bursty trace (``jaxmoe simulate``).

Control plane only: nothing here is imported by the per-step hot path.
"""

from jaxmoe.janus.scaling.controller import Layout, ScalingController, candidates
from jaxmoe.janus.scaling.perf_model import DEEPSEEK_V2, H100, Hardware, ModelShape, PerfModel
from jaxmoe.janus.scaling.simulator import compare, simulate
from jaxmoe.janus.scaling.trace import TraceShape, synthesize

__all__ = [
    "DEEPSEEK_V2",
    "H100",
    "Hardware",
    "Layout",
    "ModelShape",
    "PerfModel",
    "ScalingController",
    "TraceShape",
    "candidates",
    "compare",
    "simulate",
    "synthesize",
]
