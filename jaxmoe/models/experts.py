"""The MoE part of a layer: routed experts (expert side) and shared experts (attention side).

Routed expert weights are stacked per expert: ``w_gate``/``w_up`` [E, D, F], ``w_down`` [E, F, D].
The monolithic executor may keep them one buffer per expert instead (tuples, ``PerExpert``).
``routed_experts`` runs the expert-FFN op (``jaxmoe.pallas_kernels.expert_ffn``) with the
implementation the caller names (``EngineConfig.expert_impl``). ``AUTO_EXPERT_IMPL`` is what "auto"
means in the disaggregated expert program, which runs the op over physical replica slots
(``jaxmoe.runtime.expert_program``): on XLA:CPU ``bucketed_loop``, which reads only the routed
experts' weights, and ``dense`` elsewhere, which has no data-dependent control flow. The monolithic
executor's "auto" is ``runtime.monolithic.AUTO_EXPERT_IMPL``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.brownout.routing import split
from jaxmoe.config import ModelConfig
from jaxmoe.models.common import swiglu_mlp
from jaxmoe.models.router import route
from jaxmoe.pallas_kernels.expert_ffn import PerExpert, Stacked, expert_ffn, resolve

AUTO_EXPERT_IMPL = {"cpu": "bucketed_loop", "other": "dense"}
_NAMES = ("w_gate", "w_up", "w_down")


def expert_weights(p: dict) -> Stacked | PerExpert:
    """The routed experts of ``p``: stacked [E, ...] arrays (as loaded), or tuples of one buffer per
    expert (the monolithic executor's CPU layout, ``PerExpert``)."""
    weights = tuple(p[k] for k in _NAMES)
    return PerExpert(*weights) if isinstance(weights[0], tuple) else Stacked(*weights)


def routed_experts(p: dict, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray, impl: str = "auto") -> jnp.ndarray:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) for x [T, D]; ``impl``: an expert-FFN
    implementation or "auto"."""
    experts = expert_weights(p)
    return expert_ffn(x, ids, weights, experts, impl=resolve(impl, AUTO_EXPERT_IMPL))


class Brownout(NamedTuple):
    """Brownout inputs of one step (BrownoutServe, ``jaxmoe.brownout``): ``threshold`` a traced
    scalar (no recompile when it changes), ``valid`` [tokens] real tokens, ``full`` static."""

    threshold: jnp.ndarray
    valid: jnp.ndarray
    full: bool = False


def moe_layer(
    p: dict, cfg: ModelConfig, x: jnp.ndarray, brownout: Brownout | None = None, impl: str = "auto"
) -> jnp.ndarray:
    """Routed-experts output for normed activations x [..., D] (gate + top-k + experts + combine).
    ``impl``: the expert-FFN implementation (``routed_experts``).
    ``brownout`` (with united experts ``p["united"]`` and their groups ``p["united_groups"]``): each
    choice goes to its original expert or its group's united expert (Algorithm 1, eq. 5)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights = route(p, cfg.moe, x)
    if brownout is None or "united" not in p:
        return routed_experts(p, x, ids, weights, impl).reshape(shape)
    original, united = split(ids, brownout.valid, p["united_groups"], brownout.threshold, brownout.full)
    y = routed_experts(p, x, original, weights, impl) + routed_experts(p["united"], x, united, weights, impl)
    return y.reshape(shape)


def shared_experts(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """Shared expert(s); Qwen2-MoE scales the output by sigmoid(x @ shared_gate)."""
    y = swiglu_mlp(p, x)
    if "shared_gate" in p:
        y = y * jax.nn.sigmoid((x @ p["shared_gate"]).astype(jnp.float32)).astype(y.dtype)
    return y
