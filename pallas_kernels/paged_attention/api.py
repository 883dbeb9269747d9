"""Public API of the paged-attention op.

``paged_attention(q, k_cache, v_cache, layer, block_tables, positions, block_size=, scale=, dtype=,
impl=NAME)``: GQA softmax attention of queries q [B, T, H, hd] (at ``positions`` [B, T]) over the
keys and values of a KV cache stacked over layers ([L, S, KVH, hd], slots in blocks of
``block_size``, each row's blocks in ``block_tables`` [B, NB]), keys 0 .. position visible; returns
[B, T, H, hd] float32. Implementations (``IMPLS``):

* ``"reference"``: every key gathered and masked (``reference.py``); the oracle of the tests.
* ``"cpu_kernel"``: a C++ XLA:CPU custom call reading the cache in place (``cpu_kernel.py``).

The model's own XLA form (``jaxmoe.models.attention.gqa_xla``: chunks of keys, an online softmax)
is what runs where the kernel does not take the shapes.
"""

from __future__ import annotations

from . import cpu_kernel
from .reference import paged_attention_reference

IMPLS = {"reference": paged_attention_reference, "cpu_kernel": cpu_kernel.paged_attention}


def paged_attention(q, k_cache, v_cache, layer, block_tables, positions, *, block_size, scale, dtype, impl):
    if impl not in IMPLS:
        raise ValueError(f"paged attention impl must be one of {sorted(IMPLS)}, got {impl!r}")
    return IMPLS[impl](
        q, k_cache, v_cache, layer, block_tables, positions, block_size=block_size, scale=scale, dtype=dtype
    )
