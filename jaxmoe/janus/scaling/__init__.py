"""JANUS scaling (arXiv:2512.13525, sections 3.4 and 5): a performance model of disaggregated and
monolithic MoE serving, a scaling controller that picks the least-cost layout meeting a TPOT SLO,
and a cluster simulator that replays a synthetic diurnal, bursty trace (``jaxmoe simulate``).

Control plane only: nothing here is imported by the per-step hot path.
"""

from jaxmoe.lazy import lazy_exports

# imported on first use (PEP 562): the command line registers its subcommands without importing these
_EXPORTS = {
    "Layout": "jaxmoe.janus.scaling.controller",
    "ScalingController": "jaxmoe.janus.scaling.controller",
    "candidates": "jaxmoe.janus.scaling.controller",
    "DEEPSEEK_V2": "jaxmoe.janus.scaling.perf_model",
    "H100": "jaxmoe.janus.scaling.perf_model",
    "Hardware": "jaxmoe.janus.scaling.perf_model",
    "ModelShape": "jaxmoe.janus.scaling.perf_model",
    "PerfModel": "jaxmoe.janus.scaling.perf_model",
    "compare": "jaxmoe.janus.scaling.simulator",
    "simulate": "jaxmoe.janus.scaling.simulator",
    "TraceShape": "jaxmoe.janus.scaling.trace",
    "synthesize": "jaxmoe.janus.scaling.trace",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


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
