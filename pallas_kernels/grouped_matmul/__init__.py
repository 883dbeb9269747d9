"""Grouped (per-expert) SwiGLU FFN for MoE: dispatch, Pallas kernels, combine."""

from .api import IMPLS, grouped_swiglu
from .dispatch import DispatchInfo, combine, dispatch
from .kernel import GroupMetadata, gmm, make_group_metadata
from .reference import swiglu_loop, swiglu_padded_einsum, swiglu_ragged_dot

__all__ = [
    "IMPLS",
    "grouped_swiglu",
    "DispatchInfo",
    "combine",
    "dispatch",
    "GroupMetadata",
    "gmm",
    "make_group_metadata",
    "swiglu_loop",
    "swiglu_padded_einsum",
    "swiglu_ragged_dot",
]
