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
* ``"grouped"``: tokens dispatched into an [E, C, D] buffer, one batched matmul per projection.
* ``"ragged_dot"``: sort by expert, ``jax.lax.ragged_dot`` (XLA's grouped matmul), un-sort.
* ``"padded_einsum"``: sort by expert, padded [E, T, D] einsum, un-sort.
* ``"pallas"``: sort by expert, the Pallas grouped-matmul kernels (``jaxmoe.pallas_kernels
  .grouped_matmul``: Mosaic TPU / Mosaic GPU on Hopper; the interpreter on CPU), un-sort.
* ``"cpu_kernel"``: a C++ XLA:CPU custom call (``cpu_kernel.py``, built on first use) that reads each
  routed expert's weights once, in place, on every thread of XLA's pool, fastest on weights stored as
  column panels (``panels.py``); ``bucketed_loop`` for shapes or dtypes it does not take (and for
  prefill-sized batches of plain weights).
* ``"cpu_kernel_invariant"``: ``cpu_kernel`` with a work split that does not depend on the batch and
  no fallback: each token's output is bit-identical whatever it is batched with (deterministic mode).

Which one runs is explicit configuration (``EngineConfig.expert_impl``); ``"auto"`` is resolved by
the caller with ``resolve`` from its per-backend defaults (a default of ``"cpu_kernel"`` where the
kernel cannot be built becomes ``"bucketed_loop"``).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Protocol

import jax

from ..platform import target_platform
from . import cpu_kernel, reference, xla


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

    def layered(self) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array | int]:
        """The arrays as stored, stacked over layers ((gate, up, down) [L, E, ...], bfloat16 possibly as
        its uint16 bits, each plain or all three as column ``panels.Panels``), and the index of this
        layer: for a kernel that reads them in place."""
        ...


class Stacked(NamedTuple):
    """``ExpertWeights`` over three plain stacked arrays (or int8 / fp8 weights with ``at`` /
    ``dequantize``, ``jaxmoe.quantization.Quantized``: dequantized where used)."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array

    @property
    def num_experts(self) -> int:
        return self.w_gate.shape[0]

    def stacked(self, dtype):
        return tuple(w.dequantize(dtype) if hasattr(w, "dequantize") else w for w in self)

    def expert(self, e, dtype):
        return tuple(
            w.at(e).dequantize(dtype)
            if hasattr(w, "dequantize")
            else jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
            for w in self
        )

    def layered(self):
        return tuple(w.expand() if hasattr(w, "expand") else w[None] for w in self), 0


def _sorted(grouped_impl: str) -> Callable:
    def run(x, ids, weights, experts, interpret=None):
        return xla.sorted_by_expert(x, ids, weights, experts, grouped_impl, interpret)

    return run


IMPLS: dict[str, Callable] = {
    "reference": reference.expert_ffn_reference,
    "dense": xla.dense,
    "bucketed_loop": xla.bucketed_loop,
    "grouped": xla.grouped,
    "ragged_dot": _sorted("ragged_dot"),
    "padded_einsum": _sorted("einsum"),
    "pallas": _sorted("pallas"),
    "cpu_kernel": functools.partial(cpu_kernel.cpu_kernel, fallback=xla.bucketed_loop),
    "cpu_kernel_invariant": functools.partial(cpu_kernel.cpu_kernel, fallback=None, invariant=True),
}
CPU_KERNEL_FALLBACK = "bucketed_loop"  # what a default of "cpu_kernel" becomes where it cannot be built


def resolve(impl: str, defaults: dict[str, str]) -> str:
    """``impl`` checked against ``IMPLS``; ``"auto"`` becomes ``defaults[platform]`` (or
    ``defaults["other"]``) for the target platform (``pallas_kernels.platform``: this process's
    backend, or the platform programs are lowered for)."""
    if impl == "auto":
        impl = defaults.get(target_platform(), defaults["other"])
        if impl == "cpu_kernel" and not cpu_kernel.available():
            impl = CPU_KERNEL_FALLBACK
    if impl not in IMPLS:
        raise ValueError(f"expert_impl must be 'auto' or one of {sorted(IMPLS)}, got {impl!r}")
    return impl


def fallback_above(impl: str, num_experts: int, top_k: int) -> int | None:
    """The most tokens ``impl`` runs in its own form on plain weights of ``num_experts`` experts
    (top-k routing); larger batches run its fallback (None: it has none)."""
    return cpu_kernel.plain_rows(num_experts, top_k) if impl == "cpu_kernel" else None


def expert_ffn(x, ids, weights, experts: ExpertWeights, *, impl: str, interpret: bool | None = None):
    """The routed-experts output [T, D] in x.dtype (see the module docstring). ``interpret``: for
    ``"pallas"`` only (None: the interpreter on CPU, compiled kernels elsewhere)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    if impl == "pallas" or interpret is not None:
        return IMPLS[impl](x, ids, weights, experts, interpret=interpret)
    return IMPLS[impl](x, ids, weights, experts)
