"""GQA attention over a paged KV cache stacked over layers as one op: one API, a plain jnp
reference, and a C++ XLA:CPU kernel that reads the cache in place."""

from . import cpu_kernel
from .api import IMPLS, paged_attention
from .reference import paged_attention_reference

__all__ = ["cpu_kernel", "IMPLS", "paged_attention", "paged_attention_reference"]
