"""``LayerMatrix``: one layer's [K, N] matrix of a weight stacked over layers [L, K, N], used as
``x @ m``.

Inside the monolithic scan a layer's weights are a dynamic slice of the stack, and XLA:CPU copies
every such slice before its matmul (BENCHMARKS.md, the profile of the 107 M model). Where the CPU kernel takes
the shapes (``pallas_kernels.expert_ffn.cpu_kernel.matmul_supports``: a few rows), ``x @ m``
reads the matrix in place instead; elsewhere it is the slice and ``@`` it replaces. An ``invariant``
view (deterministic mode) runs the kernel at every row count: a row's result then does not depend
on the other rows (``cpu_kernel.invariant_matmul``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.models.common import unpack16
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel


class LayerMatrix:
    def __init__(self, stack: jax.Array, index, dtype, invariant: bool = False):
        self.stack, self.index, self.dtype = stack, index, dtype  # stack: 16-bit floats maybe as bits
        self.invariant = invariant

    def array(self) -> jax.Array:
        """The matrix itself (a copy on XLA:CPU)."""
        return unpack16(jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False), self.dtype)

    def __rmatmul__(self, x):
        if self.invariant:
            if not cpu_kernel.matmul_supports(x, self.stack, any_rows=True):
                raise ValueError(f"deterministic mode: the CPU kernel does not take x {x.shape} @ {self.stack.shape}")
            return cpu_kernel.invariant_matmul(x, self.stack, self.index)
        if cpu_kernel.matmul_supports(x, self.stack):
            return cpu_kernel.layer_matmul(x, self.stack, self.index)
        return x @ self.array()


def invariant_matrices(tree):
    """``tree`` with every plain 2-D float matrix (a projection [K, N]) as an invariant ``LayerMatrix``,
    so ``x @ m`` sums each row in an order that does not depend on the other rows (deterministic mode
    on the disaggregated executor, whose programs get one layer's matrices unstacked); other leaves
    (norms, biases) as they are."""

    def view(a):
        if getattr(a, "ndim", 0) == 2 and jnp.issubdtype(a.dtype, jnp.floating):
            return LayerMatrix(a[None], 0, a.dtype, invariant=True)
        return a

    return jax.tree.map(view, tree)
