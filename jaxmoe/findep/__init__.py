"""Planning (control plane, never imported by the per-step hot path): FinDEP's performance models,
the time model of a pipelined disaggregated step, and its configuration solver."""

from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.profile import BaseModels, Dims, Profile, ProfileError, StageModels, derive_stages
from jaxmoe.findep.schedule import ORDERS, Event, StageTimes, estimate, simulate
from jaxmoe.findep.solver import BatchShape, Limits, Plan, PlanError, brute_force, pppipe, solve

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
