"""The expert-routing contract: how a MoE layer's tokens choose their experts, run alike by both executors.

A routing maps a layer's MoE parameters and activations to choices over *logical* experts: the E
experts of the checkpoint (ids 0 .. E - 1), then U extra experts the routing brings (ids E .. E + U - 1,
e.g. BrownoutServe's united experts, ``jaxmoe.brownout.routing``). An executor keeps the layer's MoE
parameters in the routing's logical form (``logical_params``: the expert weights stacked over the
E + U logical experts) and runs one expert-FFN call over the logical ids ``route`` returns: the
monolithic executor stacks the weights per layer, the disaggregated one places the logical experts
in replica slots (C + ceil(U / N) per instance, ``slots_with_extra``).

``route`` runs inside the executors' jitted programs. The routing object is static (hashable: part of
the compiled programs); ``state`` is a traced per-step value (a pytree of numbers, or None), so changing
it between steps recompiles nothing. ``TopKRouting`` (the router's top-k, U = 0, no state) is the
core's default.

A state may differ per phase (``PhaseStates``: one for prefill, one for decode, e.g. BrownoutServe's
two thresholds). The executors resolve it per program call (``for_call``): the engine runs decodes and
prefill chunks as separate calls (``ModelRunner.run``), a call of one-token rows is a decode call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.models.router import route as top_k

WEIGHTS = ("w_gate", "w_up", "w_down")  # the routed experts' weight stacks [E + U, ...]


@runtime_checkable
class ExpertRouting(Protocol):
    """A MoE layer's expert choices over E original + U extra logical experts."""

    name: str  # for logs and errors

    def extra_experts(self, moe: dict) -> int:
        """U: the logical experts this routing adds beyond the E originals (0 for top-k); ``moe`` one
        layer's MoE parameters (as loaded, or in logical form). A ``ValueError`` when they lack
        what the routing needs."""
        ...

    def logical_params(self, moe: dict) -> dict:
        """One layer's MoE parameters in logical form: ``w_gate`` / ``w_up`` / ``w_down`` stacked over
        the E + U logical experts (the originals, then the extras), the router's arrays, and the small
        per-layer arrays ``route`` reads. Logical form in, the same out."""
        ...

    def route(self, moe: dict, cfg: MoEConfig, x: jax.Array, valid: jax.Array | None, state: Any):
        """(ids [T, K'] int32 over logical experts, -1: no expert; combine weights [T, K'] float32) for
        tokens x [T, D] (jit-able). ``moe`` in logical form; ``valid`` [T] the real tokens (None: all;
        padding activates no expert); ``state`` the traced per-step value."""
        ...

    def exact(self, state: Any) -> bool:
        """Whether the layers route as the checkpoint's own top-k under ``state`` (e.g. brownout at
        threshold 1 in every phase): KV computed so is the exact model's, which the prefix cache lets
        a step under any state read (``is_exact``)."""
        ...


@dataclasses.dataclass(frozen=True)
class TopKRouting:
    """The router's top-k over the E original experts (``models.router.route``); no extra experts,
    no state."""

    name: ClassVar[str] = "top-k"

    def extra_experts(self, moe: dict) -> int:
        return 0

    def logical_params(self, moe: dict) -> dict:
        return dict(moe)

    def route(self, moe: dict, cfg: MoEConfig, x, valid=None, state=None):
        ids, weights = top_k(moe, cfg, x)
        return mask_padding(ids, valid), weights

    def exact(self, state) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class PhaseStates:
    """A routing state per phase: ``prefill`` for program calls of prefill chunks, ``decode`` for calls
    of one-token rows (``for_call``)."""

    prefill: Any
    decode: Any


def for_call(state, tokens_per_row: int):
    """The state a program call of rows of ``tokens_per_row`` tokens runs with: of ``PhaseStates``, the
    decode state for one-token rows (decodes; a prompt's one-token last chunk rides with them) and the
    prefill state otherwise (a call holding any longer row); any other state as it is."""
    if isinstance(state, PhaseStates):
        return state.decode if tokens_per_row == 1 else state.prefill
    return state


def state_key(state):
    """A hashable, printable key of a routing state (its numbers as floats): what the prefix cache's
    KV depends on."""
    if isinstance(state, PhaseStates):
        return (state_key(state.prefill), state_key(state.decode))
    return None if state is None else tuple(float(v) for v in jax.tree.leaves(state))


def is_exact(routing, state) -> bool:
    """``routing.exact(state)``; False for a routing that does not say (its KV is only its own state's)."""
    exact = getattr(routing, "exact", None)
    return bool(exact(state)) if exact is not None else False


def mask_padding(ids, valid):
    """``ids`` [T, K] with -1 (no expert) on the tokens that are not ``valid`` [T] (None: all are)."""
    return ids if valid is None else jnp.where(valid.reshape(-1, 1), ids, -1)


def extra_experts(routing: ExpertRouting, params: dict) -> int:
    """U of ``routing`` over the MoE layers of ``params`` (the same in every layer); a ``ValueError``
    (of the routing's type) naming the first layer that does not fit."""
    counts = {}
    for i, layer in enumerate(params["layers"]):
        if "moe" in layer:
            try:
                counts[i] = routing.extra_experts(layer["moe"])
            except ValueError as e:
                raise type(e)(f"MoE layer {i}: {e}") from None
    if len(set(counts.values())) > 1:
        raise ValueError(f"{routing.name} routing: every MoE layer needs the same extra experts, got {counts}")
    return next(iter(counts.values()), 0)


def logical_params(routing: ExpertRouting, params: dict) -> dict:
    """``params`` with every MoE layer's parameters in ``routing``'s logical form."""
    layers = [
        dict(layer, moe=routing.logical_params(layer["moe"])) if "moe" in layer else layer for layer in params["layers"]
    ]
    return dict(params, layers=layers)


def slots_with_extra(slots: int, extra: int, instances: int) -> int:
    """Replica slots per expert instance with ``extra`` logical experts placed beside the originals:
    the mesh file's ``slots`` plus ceil(extra / instances)."""
    return slots + -(-extra // instances)
