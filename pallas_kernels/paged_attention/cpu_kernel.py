"""The ``cpu_kernel`` implementation of paged attention: ``cpu/paged_attention.cc`` as an XLA:CPU
custom call (``jax.ffi``), prebuilt at install time or built on first use, and registered by
``pallas_kernels.cpu_build``.

It reads the KV cache stacked over layers in place at the layer (the monolithic scan's cache), each
key and value once for the query heads that share it; XLA's form gathers every row's keys into a
fresh array chunk by chunk and was a quarter of a batch-1 decode step (BENCHMARKS.md).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from ..cpu_build import CppKernels, KernelUnavailable

SOURCE = pathlib.Path(__file__).with_name("cpu") / "paged_attention.cc"
TARGET = "jaxmoe_paged_attention"
VECTOR = 16  # head_dim must be a multiple of this (the kernel's vector width in floats)
MAX_HEAD_DIM = 128  # and at most this (a head's query and accumulator stay in registers)
LIBRARY = CppKernels(SOURCE, {TARGET: "JaxmoePagedAttention"}, fallback="the XLA paged attention")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can; built and registered on the first call)."""
    return LIBRARY.unavailable_reason()


def available() -> bool:
    """Whether the kernel can run in this process."""
    return unavailable_reason() is None


def supports(q, k_cache, dtype) -> bool:
    """Whether the kernel takes queries q [B, T, H, hd] over a cache [L, S, KVH, hd] whose values
    are ``dtype`` (float32, or bfloat16 stored as itself or as its uint16 bits)."""
    cache_dtypes = (jnp.float32,) if dtype == jnp.float32 else (jnp.bfloat16, jnp.uint16)
    return (
        q.ndim == 4
        and k_cache.ndim == 4
        and q.shape[-1] == k_cache.shape[-1]
        and q.shape[-1] % VECTOR == 0
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.shape[2] % k_cache.shape[2] == 0
        and dtype in (jnp.float32, jnp.bfloat16)
        and k_cache.dtype in cache_dtypes
        and available()
    )


def paged_attention(q, k_cache, v_cache, layer, block_tables, positions, *, block_size: int, scale: float, dtype):
    """Attention of q [B, T, H, hd] over the paged caches [L, S, KVH, hd] at ``layer``: [B, T, H, hd]
    float32 (``supports``; raises ``KernelUnavailable`` where the kernel cannot run)."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(f"paged attention 'cpu_kernel' is unavailable: {reason}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        block_size=np.int64(block_size),
        scale=np.float32(scale),
        round_p=np.int64(jnp.dtype(dtype) == jnp.bfloat16),
    )
