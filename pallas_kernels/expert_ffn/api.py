"""Public API of the expert-FFN op.

``expert_ffn(x, ids, weights, experts, impl=NAME)`` computes, for x [T, D] and the router's top-k
choices ids / weights [T, K] (id -1: no expert),

    y[t] = sum_k weights[t, k] * down(silu(x[t] @ gate[e]) * (x[t] @ up[e])),  e = ids[t, k]

in x.dtype with fp32 accumulation.  ``experts`` gives the stacked weights (``ExpertWeights``: a plain
``Stacked`` triple, or the model's per-layer view of packed weights).  Implementations (``IMPLS``):

* ``"reference"``: the obvious loop over experts (``reference.py``); the oracle of the tests.
* ``"dense"``: every expert on every token in one einsum, mixed by the combine weights; no
  data-dependent control flow (what GPU/TPU prefer).
* ``"bucketed_loop"``: a loop over experts, each on only its routed tokens in a power-of-two
  capacity bucket; reads only the routed experts' weights (fast on XLA:CPU at batch 1 and prefill).
* ``"expert_loop"``: the same per expert, unrolled over the experts (static indices): with
  ``PerExpert`` weights every matmul reads its expert's own buffer, with no slice copied first
  (XLA:CPU copies a dynamically sliced matmul operand: BENCHMARKS.md, issue 17).
* ``"grouped"``: tokens dispatched into an [E, C, D] buffer, one batched matmul per projection.
* ``"ragged_dot"``: sort by expert, ``jax.lax.ragged_dot`` (XLA's grouped matmul), un-sort.
* ``"padded_einsum"``: sort by expert, padded [E, T, D] einsum, un-sort.
* ``"pallas"``: sort by expert, the Pallas grouped-matmul kernels (``jaxmoe.pallas_kernels
  .grouped_matmul``: Mosaic TPU / Mosaic GPU on Hopper; the interpreter on CPU), un-sort.

Which one runs is explicit configuration (``EngineConfig.expert_impl``); ``"auto"`` is resolved by
the caller with ``resolve`` from its per-backend defaults.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import jax

from . import reference, xla


class ExpertWeights(Protocol):
    """The routed experts' weights: gate / up [E, D, F], down [E, F, D]."""

    num_experts: int

    def stacked(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """All experts (gate, up, down), as ``dtype``. Called where they are used (inside a loop body
        or switch branch), so a view over a bigger array is sliced there."""
        ...

    def expert(self, e, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One expert's (gate [D, F], up [D, F], down [F, D]); ``e`` may be traced."""
        ...


class Stacked(NamedTuple):
    """``ExpertWeights`` over three plain stacked arrays."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array

    @property
    def num_experts(self) -> int:
        return self.w_gate.shape[0]

    def stacked(self, dtype):
        return self.w_gate, self.w_up, self.w_down

    def expert(self, e, dtype):
        return tuple(jax.lax.dynamic_index_in_dim(w, e, keepdims=False) for w in self)


class PerExpert(NamedTuple):
    """``ExpertWeights`` as one buffer per expert and projection: tuples of E gate / up [D, F] and
    down [F, D] arrays. ``expert(e)`` with a Python int is that expert's own buffers (no slice);
    ``stacked`` builds the [E, ...] arrays (a copy) for the forms that need them. A buffer may hold
    16-bit floats as their uint16 bits (``packed``): XLA:CPU converts a bf16 matmul operand to fp32,
    and hoists that conversion out of the ``lax.switch`` that skips an unrouted expert, converting
    every expert on every step; bits are converted only where the expert runs."""

    w_gate: tuple
    w_up: tuple
    w_down: tuple

    @classmethod
    def split(cls, w_gate, w_up, w_down, packed: bool = False) -> "PerExpert":
        """Per-expert buffers from stacked [E, ...] arrays (``packed``: 16-bit floats as bits)."""
        pack = _pack16 if packed else (lambda a: a)
        return cls(*(tuple(pack(w[e]) for e in range(w.shape[0])) for w in (w_gate, w_up, w_down)))

    @property
    def num_experts(self) -> int:
        return len(self.w_gate)

    def stacked(self, dtype):
        return tuple(_unpack16(jax.numpy.stack(w), dtype) for w in self)

    def expert(self, e, dtype):
        if isinstance(e, int):
            return tuple(_unpack16(w[e], dtype) for w in self)
        return tuple(jax.lax.dynamic_index_in_dim(w, e, keepdims=False) for w in self.stacked(dtype))


def _pack16(a: jax.Array) -> jax.Array:
    """A bf16 / fp16 array as its uint16 bits (other dtypes unchanged)."""
    floating16 = a.dtype.itemsize == 2 and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
    return jax.lax.bitcast_convert_type(a, jax.numpy.uint16) if floating16 else a


def _unpack16(a: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype == jax.numpy.uint16 else a


def _sorted(grouped_impl: str) -> Callable:
    def run(x, ids, weights, experts, interpret=None):
        return xla.sorted_by_expert(x, ids, weights, experts, grouped_impl, interpret)

    return run


IMPLS: dict[str, Callable] = {
    "reference": reference.expert_ffn_reference,
    "dense": xla.dense,
    "bucketed_loop": xla.bucketed_loop,
    "expert_loop": xla.expert_loop,
    "grouped": xla.grouped,
    "ragged_dot": _sorted("ragged_dot"),
    "padded_einsum": _sorted("einsum"),
    "pallas": _sorted("pallas"),
}


def resolve(impl: str, defaults: dict[str, str]) -> str:
    """``impl`` checked against ``IMPLS``; ``"auto"`` becomes ``defaults[backend]`` (or
    ``defaults["other"]``) for the current JAX backend."""
    if impl == "auto":
        impl = defaults.get(jax.default_backend(), defaults["other"])
    if impl not in IMPLS:
        raise ValueError(f"expert_impl must be 'auto' or one of {sorted(IMPLS)}, got {impl!r}")
    return impl


def expert_ffn(x, ids, weights, experts: ExpertWeights, *, impl: str, interpret: bool | None = None):
    """The routed-experts output [T, D] in x.dtype (see the module docstring). ``interpret``: for
    ``"pallas"`` only (None: the interpreter on CPU, compiled kernels elsewhere)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    if impl == "pallas" or interpret is not None:
        return IMPLS[impl](x, ids, weights, experts, interpret=interpret)
    return IMPLS[impl](x, ids, weights, experts)
