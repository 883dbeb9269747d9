"""Expert weights stored as column panels: the layout the ``cpu_kernel`` expert FFN reads fastest.

A stacked matrix ``a [..., K, N]`` is stored as ``Panels`` of ``width`` P columns: ``data [..., N / P,
K, P]``, each panel's K rows of P columns one contiguous block. The CPU kernel walks a panel as one
stream with a register tile of rows x P columns (``cpu/expert_ffn.cc``); on the plain layout it must
stream many rows at once and reached about three quarters of the speed (BENCHMARKS.md, issue 17).

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
    """A stacked matrix [..., K, N] stored as ``data`` [..., N / width, K, width]."""

    def __init__(self, data, width: int):
        self.data, self.width = data, width

    def tree_flatten(self):
        return (self.data,), self.width

    @classmethod
    def tree_unflatten(cls, width, children):
        return cls(children[0], width)

    @property
    def shape(self) -> tuple:
        """The plain matrix's shape [..., K, N]."""
        *lead, n, k, p = self.data.shape
        return (*lead, k, n * p)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self) -> str:
        return f"Panels(shape={self.shape}, width={self.width}, dtype={self.dtype})"


def is_panels(a) -> bool:
    """For tree walks that must see ``Panels`` whole (``is_leaf=is_panels``)."""
    return isinstance(a, Panels)


def width_for(*dims: int) -> int | None:
    """The widest panel width dividing every dim (None: none does)."""
    return next((w for w in WIDTHS if all(d % w == 0 for d in dims)), None)


def to_panels(a: jax.Array, width: int) -> Panels:
    """``a [..., K, N]`` as panels of ``width`` columns (N % width == 0)."""
    *lead, k, n = a.shape
    if n % width:
        raise ValueError(f"to_panels: {n} columns are not a multiple of the panel width {width}")
    return Panels(jnp.moveaxis(a.reshape(*lead, k, n // width, width), -2, -3), width)


def plain(a):
    """The plain matrix [..., K, N] of ``Panels`` (an array is returned as is)."""
    if not isinstance(a, Panels):
        return a
    *lead, n, k, p = a.data.shape
    return jnp.moveaxis(a.data, -3, -2).reshape(*lead, k, n * p)


def at(a, *index):
    """The plain matrix ``a[index]`` (``index`` on the leading, stacking axes; may be traced) of an
    array or ``Panels``: one dynamic slice, un-panelled in the copy XLA makes of it."""
    data = a.data if isinstance(a, Panels) else a
    n = len(index)
    rest = data.shape[n:]
    out = jax.lax.dynamic_slice(data, (*index, *(0,) * len(rest)), (1,) * n + rest).reshape(rest)
    return plain(Panels(out, a.width)) if isinstance(a, Panels) else out
