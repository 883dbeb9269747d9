"""Small building blocks shared by both sides of a layer: RMSNorm and the SwiGLU MLP."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x).astype(dtype)


def swiglu_mlp(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """Dense SwiGLU MLP: down(silu(x @ gate) * (x @ up)); weights stored [D, F] and [F, D]."""
    h = jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])
    return h @ p["w_down"]
