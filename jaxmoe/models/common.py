"""Small building blocks shared by both sides of a layer: RMSNorm, the SwiGLU MLP, and the bit-packing
of 16-bit float weights stacked over layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.pallas_kernels.expert_ffn.cpu_kernel import invariant_sum

# ``in_place`` / ``invariant`` value of deterministic mode's batch-invariant form (``transformer.in_place_mode``)
INVARIANT = "invariant"


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float, invariant: bool = False) -> jnp.ndarray:
    """RMSNorm in float32; ``invariant``: the mean of squares summed in an order fixed per row, whatever
    the other rows (``invariant_sum``: deterministic mode)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    if invariant:
        mean = (invariant_sum(x * x) / x.shape[-1])[..., None]
    else:
        mean = jnp.mean(x * x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(mean + eps)
    return (weight.astype(jnp.float32) * x).astype(dtype)


def swiglu_mlp(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """Dense SwiGLU MLP: down(silu(x @ gate) * (x @ up)); weights stored [D, F] and [F, D]."""
    h = jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])
    return h @ p["w_down"]


def pack16(a: jnp.ndarray) -> jnp.ndarray:
    """A bf16 / fp16 array as its uint16 bits (other dtypes unchanged). XLA:CPU has no 16-bit float
    dot: it converts a loop's loop-invariant bf16 operand to fp32 *whole*, outside the loop, so a
    scan over stacked bf16 weights would convert every layer's weights on every step. Bits are not
    floats: only the slice a layer uses is turned back into bf16 (``unpack16``) and converted."""
    return (
        jax.lax.bitcast_convert_type(a, jnp.uint16)
        if a.dtype.itemsize == 2 and jnp.issubdtype(a.dtype, jnp.floating)
        else a
    )


def unpack16(a: jnp.ndarray, dtype) -> jnp.ndarray:
    """The inverse of ``pack16`` for a model whose float dtype is ``dtype``."""
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype == jnp.uint16 else a
