"""Planning (control plane, never imported by the per-step hot path): FinDEP's performance models,
the time model of a pipelined disaggregated step, and its configuration solver."""

from jaxmoe.lazy import lazy_exports

# imported on first use (PEP 562): the command line registers its subcommands without importing these
_EXPORTS = {
    "LinearModel": "jaxmoe.findep.linear",
    "BaseModels": "jaxmoe.findep.profile",
    "Dims": "jaxmoe.findep.profile",
    "Profile": "jaxmoe.findep.profile",
    "ProfileError": "jaxmoe.findep.profile",
    "StageModels": "jaxmoe.findep.profile",
    "derive_stages": "jaxmoe.findep.profile",
    "ORDERS": "jaxmoe.findep.schedule",
    "Event": "jaxmoe.findep.schedule",
    "StageTimes": "jaxmoe.findep.schedule",
    "estimate": "jaxmoe.findep.schedule",
    "simulate": "jaxmoe.findep.schedule",
    "BatchShape": "jaxmoe.findep.solver",
    "Limits": "jaxmoe.findep.solver",
    "Plan": "jaxmoe.findep.solver",
    "PlanError": "jaxmoe.findep.solver",
    "brute_force": "jaxmoe.findep.solver",
    "pppipe": "jaxmoe.findep.solver",
    "solve": "jaxmoe.findep.solver",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "ORDERS",
    "BaseModels",
    "BatchShape",
    "Dims",
    "Event",
    "Limits",
    "LinearModel",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "StageModels",
    "StageTimes",
    "brute_force",
    "derive_stages",
    "estimate",
    "pppipe",
    "simulate",
    "solve",
]
