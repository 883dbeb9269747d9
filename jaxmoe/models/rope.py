"""Rotary position embeddings: default, linear and YaRN frequencies; halves or interleaved pairs.

Frequencies follow Hugging Face's ``modeling_rope_utils`` so logits match transformers.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxmoe.config import RopeConfig, yarn_mscale


def inv_freq_and_scale(rope: RopeConfig, max_position: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the factor applied to cos/sin."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if rope.kind == "default":
        return inv_freq.astype(np.float32), 1.0
    if rope.kind == "linear":
        return (inv_freq / rope.factor).astype(np.float32), 1.0
    # YaRN
    factor = rope.factor
    orig = rope.original_max_position or max_position
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(rope: RopeConfig, max_position: int, positions: jnp.ndarray):
    """cos, sin of shape positions.shape + [dim/2], in fp32."""
    inv_freq, scale = inv_freq_and_scale(rope, max_position)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleaved: bool) -> jnp.ndarray:
    """Rotate x [..., T, H, dim] by per-position cos/sin [..., T, dim/2].

    ``interleaved`` rotates consecutive pairs (x[2i], x[2i+1]) as DeepSeek does; the result is
    returned de-interleaved ([evens, odds]), which leaves every query-key dot product unchanged as
    long as queries and keys go through the same function.
    """
    dtype = x.dtype
    x = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[..., None, :], sin[..., None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)
