"""AEBS (Activated-Expert-Balanced Scheduling, janus §3.3 Algorithm 1) as a Pallas op."""

from .api import AUTO_IMPL, IMPLS, POLICIES, resolve_impl, schedule
from .reference import aebs_jnp, aebs_numpy, aebs_plus_numpy, random_jnp

__all__ = [
    "schedule",
    "resolve_impl",
    "AUTO_IMPL",
    "POLICIES",
    "IMPLS",
    "aebs_numpy",
    "aebs_plus_numpy",
    "aebs_jnp",
    "random_jnp",
]
