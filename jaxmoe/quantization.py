"""Weight quantization for serving: routed-expert (and optionally attention) weights stored as int8 or
fp8 on load, dequantized where they are used.

``quantize_params(params, "int8" | "fp8", attention=False)`` replaces each routed expert matrix
(``layers[i]["moe"]["w_gate" | "w_up" | "w_down"]``, [E, K, N] used as ``x @ W``) -- and with
``attention`` the attention projections -- by a ``Quantized`` weight:

* ``int8``: symmetric, one float32 scale per output channel (column N): ``W ~ q * scale[..., None, :]``.
* ``fp8``: float8_e4m3fn, one float32 scale per 128 x 128 block of [K, N] (the block-wise FP8 format of
  the DeepSeek-V3 releases, ``jaxmoe.checkpoint.fp8``).

Either halves the bytes of a bf16 weight (plus 4 bytes per channel or block). ``Quantized`` is a pytree
(its ``q`` and ``scale`` are the leaves), so it is stacked over layers like the array it replaces; the
expert code and the layer view take one layer's (or one expert's) slice with ``at`` and ``dequantize``
it there, in the activations' dtype, so no full dequantized copy of the weights is ever made.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmoe.pallas_kernels.expert_ffn.panels import Panels, at

METHODS = ("int8", "fp8")
FP8_BLOCK = (128, 128)
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
ROUTED = ("w_gate", "w_up", "w_down")
ATTENTION = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b")  # GQA and MLA projections [in, out]


@jax.tree_util.register_pytree_with_keys_class
class Quantized:
    """A matrix [..., K, N] stored as ``q`` (int8 or float8_e4m3fn; int8 routed experts may be column
    ``Panels`` for the CPU kernel, ``models.transformer.store_as_panels`` and the disaggregated executor's
    replica slots, ``runtime.expert_program``) and float32 ``scale``: [..., 1, N]
    (int8, per output channel) or [..., ceil(K / bk), ceil(N / bn)] (fp8, ``block`` = (bk, bn))."""

    def __init__(self, q, scale, block: tuple[int, int] | None = None):
        self.q, self.scale, self.block = q, scale, block

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        return ((keys("q"), self.q), (keys("scale"), self.scale)), self.block

    def tree_flatten(self):
        return (self.q, self.scale), self.block

    @classmethod
    def tree_unflatten(cls, block, children):
        return cls(*children, block)

    @property
    def method(self) -> str:
        return "int8" if self.block is None else "fp8"

    @property
    def shape(self) -> tuple:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return getattr(self.q, "data", self.q).nbytes + self.scale.nbytes

    def at(self, *index) -> "Quantized":
        """``self[index]`` on the leading (stacking) axes, ``q`` plain; ``index`` may be traced."""
        return Quantized(at(self.q, *index), at(self.scale, *index), self.block)

    def expand(self) -> "Quantized":
        """With a new leading axis of size 1 (as ``w[None]``)."""
        q = Panels(self.q.data[None], self.q.width, self.q.pairs) if isinstance(self.q, Panels) else self.q[None]
        return Quantized(q, self.scale[None], self.block)

    def dequantize(self, dtype) -> jax.Array:
        """The matrix in ``dtype`` (computed in float32)."""
        scale = self.scale
        if self.block is not None:
            (k, n), (bk, bn) = self.q.shape[-2:], self.block
            scale = jnp.repeat(jnp.repeat(scale, bk, axis=-2)[..., :k, :], bn, axis=-1)[..., :n]
        return (self.q.astype(jnp.float32) * scale).astype(dtype)

    def __repr__(self) -> str:
        return f"Quantized({self.method}, shape={self.shape}, block={self.block})"


def is_quantized(a) -> bool:
    """For tree walks that must see ``Quantized`` whole (``is_leaf=is_quantized``)."""
    return isinstance(a, Quantized)


@jax.jit
def quantize_int8(w: jax.Array) -> Quantized:
    """Symmetric int8, one scale per output channel (the last axis; the max over axis -2 maps to 127)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Quantized(q, scale)


@jax.jit
def quantize_fp8(w: jax.Array) -> Quantized:
    """float8_e4m3fn with one scale per ``FP8_BLOCK`` block of the last two axes (edge blocks partial)."""
    w = w.astype(jnp.float32)
    *lead, k, n = w.shape
    bk, bn = FP8_BLOCK
    nk, nn = math.ceil(k / bk), math.ceil(n / bn)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, nk * bk - k), (0, nn * bn - n)])
    blocks = padded.reshape(*lead, nk, bk, nn, bn)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, nk * bk, nn * bn)[..., :k, :n]
    return Quantized(jnp.clip(q, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale, FP8_BLOCK)


def check_method(quantization: str | None) -> str | None:
    if quantization not in (None, *METHODS):
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or None), got {quantization!r}")
    return quantization


def quantize_params(params: dict, quantization: str | None, attention: bool = False) -> dict:
    """``params`` (per-layer, as loaded) with the routed expert weights -- and with ``attention`` the
    attention projections -- quantized (``quantization``: "int8", "fp8" or None: unchanged). Weight by
    weight: the float copy of each is released once its quantized form exists."""
    if check_method(quantization) is None:
        if attention:
            raise ValueError("quantize_attention needs quantization='int8' or 'fp8'")
        return params
    quantize = quantize_int8 if quantization == "int8" else quantize_fp8
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        if "moe" in layer:
            layer["moe"] = {k: quantize(v) if k in ROUTED else v for k, v in layer["moe"].items()}
        if attention:
            layer["attn"] = {
                k: quantize(v) if k in ATTENTION and getattr(v, "ndim", 0) == 2 else v for k, v in layer["attn"].items()
            }
        layers.append(layer)
    return {**params, "layers": layers}


def dequantize_params(params, dtype=None):
    """Every ``Quantized`` weight in ``params`` as a plain array (``dtype``: default float32)."""
    dtype = dtype or jnp.float32
    return jax.tree.map(lambda a: a.dequantize(dtype) if is_quantized(a) else a, params, is_leaf=is_quantized)


def is_quantized_tree(params) -> bool:
    return any(is_quantized(a) for a in jax.tree.leaves(params, is_leaf=is_quantized))


def routed_expert_bytes(params: dict) -> int:
    """Bytes of the routed expert weights (quantized ones with their scales)."""
    total = 0
    for layer in params["layers"]:
        for k in ROUTED:
            if k in layer.get("moe", {}):
                total += layer["moe"][k].nbytes
    return total
