"""Expert weights stored as column panels: the layout the ``cpu_kernel`` expert FFN reads fastest.

A stacked matrix ``a [..., K, N]`` is stored as ``Panels`` of ``width`` P columns: ``data [..., N / P,
K, P]``, each panel's K rows of P columns one contiguous block. The CPU kernel walks a panel as one
stream with a register tile of rows x P columns (``cpu/expert_ffn.cc``); on the plain layout it must
stream many rows at once and reached about three quarters of the speed (BENCHMARKS.md).

16-bit weights may be stored **in pairs** (``pairs=True``, where the CPU has AVX512-BF16,
``cpu_kernel.has_bf16_dot``): ``data [..., N / P, K / 2, 2 P]``, rows k and k + 1 of a panel
interleaved column by column (column j's two values at 2 j, 2 j + 1), the operand of the bf16 dot
instruction (``vdpbf16ps``), which the kernel then runs on bf16 pairs of the activations.

``Panels`` is a pytree (its array is the leaf), so it passes through ``jit`` and the layer scan
like the array it replaces; ``at`` and ``plain`` give every other reader the plain matrices. That
costs XLA's matmuls a transposing copy (``bucketed_loop`` on panels ran at 0.82-0.93x of plain at
prefill sizes), which is why the kernel takes every batch on panels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WIDTHS = (64, 32, 16)  # panel widths the kernel has tiles for, widest (fastest) first


@jax.tree_util.register_pytree_node_class
class Panels:
    """A stacked matrix [..., K, N] stored as ``data`` [..., N / width, K, width] (``pairs``:
    [..., N / width, K / 2, 2 width])."""

    def __init__(self, data, width: int, pairs: bool = False):
        self.data, self.width, self.pairs = data, width, pairs

    def tree_flatten(self):
        return (self.data,), (self.width, self.pairs)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple:
        """The plain matrix's shape [..., K, N]."""
        *lead, n, k, p = self.data.shape
        return (*lead, 2 * k, n * p // 2) if self.pairs else (*lead, k, n * p)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self) -> str:
        return f"Panels(shape={self.shape}, width={self.width}, pairs={self.pairs}, dtype={self.dtype})"


def is_panels(a) -> bool:
    """For tree walks that must see ``Panels`` whole (``is_leaf=is_panels``)."""
    return isinstance(a, Panels)


def width_for(*dims: int) -> int | None:
    """The widest panel width dividing every dim (None: none does)."""
    return next((w for w in WIDTHS if all(d % w == 0 for d in dims)), None)


def to_panels(a: jax.Array, width: int, pairs: bool = False) -> Panels:
    """``a [..., K, N]`` as panels of ``width`` columns (N % width == 0; ``pairs``: K even)."""
    *lead, k, n = a.shape
    if n % width:
        raise ValueError(f"to_panels: {n} columns are not a multiple of the panel width {width}")
    if pairs and k % 2:
        raise ValueError(f"to_panels: {k} rows cannot be stored in pairs")
    data = jnp.moveaxis(a.reshape(*lead, k, n // width, width), -2, -3)  # [..., N / P, K, P]
    if pairs:
        data = jnp.swapaxes(data.reshape(*lead, n // width, k // 2, 2, width), -1, -2)
        data = data.reshape(*lead, n // width, k // 2, 2 * width)
    return Panels(data, width, pairs)


def plain(a):
    """The plain matrix [..., K, N] of ``Panels`` (an array is returned as is)."""
    if not isinstance(a, Panels):
        return a
    data = a.data
    *lead, n, k, p = data.shape
    if a.pairs:  # [..., N / P, K / 2, 2 P] -> [..., N / P, K, P]
        data = jnp.swapaxes(data.reshape(*lead, n, k, p // 2, 2), -1, -2).reshape(*lead, n, 2 * k, p // 2)
        k, p = 2 * k, p // 2
    return jnp.moveaxis(data, -3, -2).reshape(*lead, k, n * p)


def at(a, *index):
    """The plain matrix ``a[index]`` (``index`` on the leading, stacking axes; may be traced) of an
    array or ``Panels``: one dynamic slice, un-panelled in the copy XLA makes of it."""
    data = a.data if isinstance(a, Panels) else a
    n = len(index)
    rest = data.shape[n:]
    out = jax.lax.dynamic_slice(data, (*index, *(0,) * len(rest)), (1,) * n + rest).reshape(rest)
    return plain(Panels(out, a.width, a.pairs)) if isinstance(a, Panels) else out
