"""The MoE part of a layer: routed experts (expert side) and shared experts (attention side).

Routed expert weights are stacked per logical expert: ``w_gate``/``w_up`` [E', D, F], ``w_down``
[E', F, D] (E' = E + U: the originals and the extra experts of the layer's routing, ``models.routing``).
``moe_layer`` routes (``ExpertRouting.route``) and makes one ``routed_experts`` call, which runs the expert-FFN op (``jaxmoe.pallas_kernels.expert_ffn``) with the
implementation the caller names (``EngineConfig.expert_impl``; "auto" resolves with
``AUTO_EXPERT_IMPL``: on XLA:CPU ``cpu_kernel``, a C++ custom call that reads each routed expert's
weights once, in place, on the threads of XLA's pool -- on every batch where the weights are stored as
column panels (the monolithic executor does so for it), decode-sized batches only on plain weights,
``bucketed_loop`` otherwise and where no compiler can build it (``bench/expert_ffn_cpu.py``,
BENCHMARKS.md) -- and ``dense`` elsewhere, which has no data-dependent control flow).  The disaggregated runtime runs the same op
over physical replica slots (``jaxmoe.runtime.expert_program``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.models.common import swiglu_mlp, unpack16
from jaxmoe.models.routing import ExpertRouting, TopKRouting
from jaxmoe.pallas_kernels.expert_ffn import Stacked, expert_ffn, resolve
from jaxmoe.pallas_kernels.expert_ffn.panels import at
from jaxmoe.quantization import is_quantized

AUTO_EXPERT_IMPL = {"cpu": "cpu_kernel", "other": "dense"}
_NAMES = ("w_gate", "w_up", "w_down")
TOP_K = TopKRouting()


class LayerWeights(NamedTuple):
    """``ExpertWeights`` of one layer inside the monolithic scan: the weights are stacked [L, E, ...]
    (16-bit floats packed, ``common.pack16``; possibly as column ``Panels``, ``store_as_panels``, or
    int8 / fp8 ``Quantized``, ``jaxmoe.quantization``) and
    sliced at their use: a slice taken before an inner loop or switch would be copied whole (every
    expert of the layer) on every step."""

    p: dict
    layer: jax.Array

    @property
    def num_experts(self) -> int:
        return self.p["w_gate"].shape[1]

    def stacked(self, dtype):
        return tuple(_take(self.p[k], dtype, self.layer) for k in _NAMES)

    def expert(self, e, dtype):
        return tuple(_take(self.p[k], dtype, self.layer, e) for k in _NAMES)

    def layered(self):
        return tuple(self.p[k] for k in _NAMES), self.layer


def _take(a, dtype, *index):
    """The plain matrix ``a[index]`` in ``dtype``: unpacked (``unpack16``), or dequantized if ``a`` is
    an int8 / fp8 ``Quantized`` weight (only this slice: ``jaxmoe.quantization``)."""
    return a.at(*index).dequantize(dtype) if is_quantized(a) else unpack16(at(a, *index), dtype)


def routed_experts(
    p: dict, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray, layer=None, impl: str = "auto"
) -> jnp.ndarray:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) for x [T, D]; ``layer``: the weights are stacked
    over layers (``LayerWeights``); ``impl``: an expert-FFN implementation or "auto"."""
    experts = Stacked(*(p[k] for k in _NAMES)) if layer is None else LayerWeights(p, layer)
    return expert_ffn(x, ids, weights, experts, impl=resolve(impl, AUTO_EXPERT_IMPL))


def moe_layer(
    p: dict,
    cfg: ModelConfig,
    x: jnp.ndarray,
    layer=None,
    routing: ExpertRouting = TOP_K,
    valid=None,
    state=None,
    impl: str = "auto",
) -> jnp.ndarray:
    """Routed-experts output for normed activations x [..., D]: the routing's choices over logical
    experts (``models.routing``; ``p`` in its logical form, ``valid`` the real tokens, ``state`` its
    traced per-step value), then one expert-FFN call and the combine. ``layer``: the expert weights in
    ``p`` are stacked over layers (``LayerWeights``); ``impl``: the expert-FFN implementation
    (``routed_experts``)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights = routing.route(p, cfg.moe, x, None if valid is None else valid.reshape(-1), state)
    return routed_experts(p, x, ids, weights, layer, impl).reshape(shape)


def shared_experts(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """Shared expert(s); Qwen2-MoE scales the output by sigmoid(x @ shared_gate)."""
    y = swiglu_mlp(p, x)
    if "shared_gate" in p:
        y = y * jax.nn.sigmoid((x @ p["shared_gate"]).astype(jnp.float32)).astype(y.dtype)
    return y
