"""Grouped-matmul Pallas kernels (``pallas_call`` + scalar prefetch).

Rows of ``lhs [M, K]`` are sorted by group; ``rhs [G, K, N]`` holds one matrix
per group.  The M axis is cut into ``tm``-row tiles; a *work item* is a
(group, m-tile) pair where the group has rows in the tile.  The metadata
(``make_group_metadata``) is computed outside the kernel with plain jnp and
passed by scalar prefetch, so the index maps can pick ``rhs[group_ids[w]]``
and ``lhs/out[m_tile_ids[w]]``.  There are at most ``tiles_m + min(G, M) - 1``
work items (static grid); the items past ``num_active`` do no compute and map
to the same blocks as the last active item, so the TPU pipeline issues no DMA
for them.  Empty groups get no work item, so their weights are never read.

A tile shared by two groups is visited by consecutive work items; each stores
only its own rows (``where(row in group, new, old)``) into the output block,
which stays resident between consecutive grid steps with the same block index
(TPU; the work-item axis is "arbitrary") and is carried by the interpreter.
Rows past ``sum(group_sizes)`` are left unspecified here (the api zeroes them).

Two kernels make the SwiGLU FFN: ``gmm(x, [w_gate, w_up], epilogue=silu*up)``
(gate and up share the x tile, two fp32 accumulators, fused activation) and
``gmm(h, [w_down])``.  Backends: CPU/any with ``interpret=True`` (verified by
the tests) and Mosaic TPU (written to its block rules, not run on a TPU yet).
The Mosaic GPU version lives in ``kernel_gpu.py``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


class GroupMetadata(NamedTuple):
    group_ids: jax.Array  # [W] int32 group of work item w
    m_tile_ids: jax.Array  # [W] int32 m tile of work item w
    offsets: jax.Array  # [G+1] int32 row offsets of the groups
    num_active: jax.Array  # [1] int32 number of real work items


def num_work_items(m: int, num_groups: int, tm: int) -> int:
    """Static upper bound on (group, m-tile) pairs with rows in common."""
    return pl.cdiv(m, tm) + min(num_groups, m) - 1


def make_group_metadata(group_sizes, m: int, tm: int) -> GroupMetadata:
    """Work-item tables for ``m`` sorted rows in ``tm``-row tiles (jit-safe)."""
    num_groups = group_sizes.shape[0]
    tiles_m = pl.cdiv(m, tm)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    first_tile = starts // tm
    tiles = jnp.where(sizes > 0, (ends - 1) // tm - first_tile + 1, 0)
    items_end = jnp.cumsum(tiles)
    num_active = items_end[-1]
    w = jnp.arange(num_work_items(m, num_groups, tm), dtype=jnp.int32)
    # Padding items repeat the last active item (or item 0 if none is active).
    w = jnp.minimum(w, jnp.maximum(num_active - 1, 0))
    gid = jnp.minimum(jnp.searchsorted(items_end, w, side="right"), num_groups - 1).astype(jnp.int32)
    mt = first_tile[gid] + (w - (items_end[gid] - tiles[gid]))
    mt = jnp.clip(mt, 0, tiles_m - 1).astype(jnp.int32)
    return GroupMetadata(gid, mt, offsets, num_active.reshape(1))


def _silu_mul(a, b):
    return a * jax.nn.sigmoid(a) * b


def swiglu_epilogue(acc_gate, acc_up):
    return _silu_mul(acc_gate, acc_up)


def _pick(dim: int, cap: int, align: int) -> int:
    """Largest multiple of ``align`` <= cap dividing ``dim``; else ``dim``."""
    for t in range(min(cap, dim) // align * align, 0, -align):
        if dim % t == 0:
            return t
    return dim


def default_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) that satisfy the Mosaic TPU (8, 128) block rules."""
    tm = min(128, max(16, pl.cdiv(m, 16) * 16))
    return tm, _pick(k, 512, 128), _pick(n, 512, 128)


def gmm(
    lhs,
    rhs: Sequence[jax.Array],
    meta: GroupMetadata,
    *,
    tiling: tuple[int, int, int],
    epilogue: Callable | None = None,
    out_dtype=None,
    interpret: bool = False,
):
    """``out[r] = epilogue(*(lhs[r] @ rhs_i[group(r)]))`` for each row r.

    ``lhs [M, K]`` with ``M % tm == 0``; every ``rhs_i [G, K, N]``.  Returns
    ``[M, N]`` in ``out_dtype`` (default ``lhs.dtype``); fp32 accumulation.
    """
    tm, tk, tn = tiling
    m, k = lhs.shape
    n = rhs[0].shape[-1]
    nr = len(rhs)
    if m % tm or k % tk or n % tn:
        raise ValueError(f"shape {(m, k, n)} not divisible by tiling {tiling}")
    epilogue = epilogue or (lambda a: a)
    out_dtype = out_dtype or lhs.dtype
    tiles_k = k // tk
    num_w = meta.group_ids.shape[0]

    def kernel(gids, mts, offs, nact, x_ref, *refs):
        w_refs, (o_ref,), accs = refs[:nr], refs[nr : nr + 1], refs[nr + 1 :]
        wi, ki = pl.program_id(1), pl.program_id(2)
        active = wi < nact[0]

        @pl.when(ki == 0)
        def _zero():
            for acc in accs:
                acc[...] = jnp.zeros_like(acc)

        @pl.when(active)
        def _accumulate():
            x = x_ref[...]
            for acc, w_ref in zip(accs, w_refs):
                acc[...] += jnp.dot(x, w_ref[...], preferred_element_type=jnp.float32)

        @pl.when(active & (ki == tiles_k - 1))
        def _store():
            g = gids[wi]
            rows = mts[wi] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            mask = (rows >= offs[g]) & (rows < offs[g + 1])
            res = epilogue(*(acc[...] for acc in accs)).astype(o_ref.dtype)
            o_ref[...] = jnp.where(mask, res, o_ref[...])

    def k_eff(wi, ki, nact):
        # Inactive items keep the last block index: no new DMA on TPU.
        return jnp.where(wi < nact[0], ki, tiles_k - 1)

    def x_map(ni, wi, ki, gids, mts, offs, nact):
        return mts[wi], k_eff(wi, ki, nact)

    def w_map(ni, wi, ki, gids, mts, offs, nact):
        return gids[wi], k_eff(wi, ki, nact), ni

    def o_map(ni, wi, ki, gids, mts, offs, nact):
        return mts[wi], ni

    itemsize = jnp.dtype(lhs.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n * nr,
        transcendentals=m * n if nr > 1 else 0,
        bytes_accessed=(m * k * (n // tn) + num_w * k * n * nr) * itemsize + m * n * jnp.dtype(out_dtype).itemsize,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n // tn, num_w, tiles_k),
        in_specs=[pl.BlockSpec((tm, tk), x_map)] + [pl.BlockSpec((None, tk, tn), w_map) for _ in rhs],
        out_specs=pl.BlockSpec((tm, tn), o_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32) for _ in rhs],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="grouped_swiglu_gmm",
    )(*meta, lhs, *rhs)


def grouped_swiglu_pallas(
    x, group_sizes, w_gate, w_up, w_down, *, tiling_gate_up=None, tiling_down=None, interpret: bool = False
):
    """Fused gate/up+SiLU kernel then down kernel; rows padded to ``tm``.

    ``tiling_*`` = (tm, tk, tn); both kernels must use the same ``tm``.
    """
    m, d = x.shape
    f = w_gate.shape[-1]
    t1 = tiling_gate_up or default_tiling(m, d, f)
    t2 = tiling_down or (t1[0],) + default_tiling(m, f, d)[1:]
    if t1[0] != t2[0]:
        raise ValueError(f"gate/up and down tilings need the same tm: {t1}, {t2}")
    tm = t1[0]
    m_pad = pl.cdiv(m, tm) * tm
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0))) if m_pad != m else x
    meta = make_group_metadata(group_sizes, m_pad, tm)
    h = gmm(xp, [w_gate, w_up], meta, tiling=t1, epilogue=swiglu_epilogue, interpret=interpret)
    y = gmm(h, [w_down], meta, tiling=t2, interpret=interpret)
    return y[:m]
