"""The routed-expert SwiGLU FFN of an MoE layer as one op: one API, a plain jnp reference, named
implementations (XLA forms and the Pallas grouped-matmul kernels)."""

from . import cpu_kernel
from .api import IMPLS, ExpertWeights, Stacked, expert_ffn, fallback_above, resolve
from .reference import expert_ffn_reference

__all__ = [
    "cpu_kernel",
    "IMPLS",
    "ExpertWeights",
    "Stacked",
    "expert_ffn",
    "expert_ffn_reference",
    "fallback_above",
    "resolve",
]
