"""Planning (control plane, never imported by the per-step hot path): FinDEP's performance models,
the time model of a pipelined disaggregated step, and its configuration solver."""

import importlib

# imported on first use (PEP 562): the command line registers its subcommands without importing these
_EXPORTS = {
    "LinearModel": "jaxmoe.planning.linear",
    "BaseModels": "jaxmoe.planning.profile",
    "Dims": "jaxmoe.planning.profile",
    "Profile": "jaxmoe.planning.profile",
    "ProfileError": "jaxmoe.planning.profile",
    "StageModels": "jaxmoe.planning.profile",
    "derive_stages": "jaxmoe.planning.profile",
    "ORDERS": "jaxmoe.planning.schedule",
    "Event": "jaxmoe.planning.schedule",
    "StageTimes": "jaxmoe.planning.schedule",
    "estimate": "jaxmoe.planning.schedule",
    "simulate": "jaxmoe.planning.schedule",
    "BatchShape": "jaxmoe.planning.solver",
    "Limits": "jaxmoe.planning.solver",
    "Plan": "jaxmoe.planning.solver",
    "PlanError": "jaxmoe.planning.solver",
    "brute_force": "jaxmoe.planning.solver",
    "pppipe": "jaxmoe.planning.solver",
    "solve": "jaxmoe.planning.solver",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
