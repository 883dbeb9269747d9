"""Grouped-matmul kernel for NVIDIA Hopper (sm_90) via Pallas Mosaic GPU.

The suite checks it by cross-lowering to the Mosaic GPU custom call on a
CPU-only machine (see the tests). One H200 run (jax 0.11.2,
bench/results/2026-11-28-h200.md) compiled it and found it equal to the
reference, at 87 % of the copy bandwidth at DeepSeek-V2-Lite expert shapes;
no other GPU has run it.  It follows the structure of
jax's own ``pallas/ops/gpu/ragged_dot_mgpu.py`` (Warpgroup lowering, wgmma,
``emit_pipeline`` over K, TMA row-ladder stores), but with the same
precomputed work-item metadata as ``kernel.py`` instead of an unrolled
per-group search.

One CTA per (n-tile, work item).  CTAs of inactive work items exit at once,
so empty groups read no weights.  A CTA stores only the rows of its group in
its m tile, so CTAs sharing a tile write disjoint rows (no ordering needed).
Needs bf16/f16 inputs, ``M % block_m == 0``, ``K % block_k == 0`` and
``N % block_n == 0``.  Not for Blackwell (wgmma is sm_90 only).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .kernel import GroupMetadata


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # lazy: GPU only

    return plgpu


def gmm_mgpu(
    lhs,
    rhs: Sequence[jax.Array],
    meta: GroupMetadata,
    *,
    block_m: int = 64,
    block_n: int | None = None,
    block_k: int = 64,
    max_concurrent_steps: int | None = None,
    epilogue: Callable | None = None,
    out_dtype=None,
    interpret=None,
):
    """Same contract as ``kernel.gmm`` (rows past the groups: unspecified).

    ``interpret``: ``None`` compiles for the GPU; a Mosaic GPU interpret-params
    object (see ``gpu_interpret_params``) simulates the kernel on CPU.
    """
    plgpu = _plgpu()
    m, k = lhs.shape
    n = rhs[0].shape[-1]
    nr = len(rhs)
    num_w = meta.group_ids.shape[0]
    if lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"Mosaic GPU gmm needs bf16/f16, got {lhs.dtype}")
    if any(r.dtype != lhs.dtype for r in rhs):
        raise NotImplementedError("lhs and rhs dtypes must match")
    if block_n is None:  # enough CTAs to keep HBM busy at decode sizes
        block_n = 128 if (n % 128 == 0 and (n // 128) * num_w >= 264) else 64
    if m % block_m or k % block_k or n % block_n:
        raise ValueError(f"{(m, k, n)=} not divisible by {(block_m, block_k, block_n)=}")
    if max_concurrent_steps is None:
        max_concurrent_steps = 4 if nr == 1 else 3
    max_concurrent_steps = max(2, min(max_concurrent_steps, k // block_k))
    epilogue = epilogue or (lambda a: a)
    out_dtype = out_dtype or lhs.dtype

    def body(gids, mts, offs, nact, x_gmem, *refs):
        w_gmems, o_gmem = refs[:nr], refs[nr]
        ni = lax.axis_index("n")
        wi = lax.axis_index("w")

        @pl.when(wi < nact[0])
        def _work():
            g = gids[wi]
            mt = mts[wi]
            block_start = mt * block_m
            start = jnp.maximum(offs[g], block_start)
            end = jnp.minimum(offs[g + 1], block_start + block_m)
            size = end - start

            def acc_scope(*accs):
                def step(_, x_smem, *w_smems):
                    for acc, w_smem in zip(accs, w_smems):
                        plgpu.wgmma(acc, x_smem, w_smem)
                    plgpu.wgmma_wait(nr)  # previous step's operands are free again

                plgpu.emit_pipeline(
                    step,
                    grid=(k // block_k,),
                    in_specs=[plgpu.BlockSpec((block_m, block_k), lambda kk: (mt, kk), delay_release=1)]
                    + [plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, ni), delay_release=1)] * nr,
                    max_concurrent_steps=max_concurrent_steps,
                )(x_gmem, *(w.at[g] for w in w_gmems))
                return tuple(acc[...] for acc in accs)

            accs = pl.run_scoped(acc_scope, *(plgpu.ACC((block_m, block_n)) for _ in rhs))
            res = epilogue(*accs).astype(out_dtype)

            def store_scope(o_smem):
                o_smem[...] = res
                plgpu.commit_smem()
                # TMA box sizes are static: store the ``size`` rows as a ladder of
                # power-of-two row blocks (as ragged_dot_mgpu does).
                row = start - block_start
                bit = block_m
                while bit >= 1:

                    @pl.when(size & bit != 0)
                    def _(row=row, bit=bit):
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[pl.ds(row, bit)],
                            o_gmem.at[pl.ds(block_start + row, bit), pl.ds(ni * block_n, block_n)],
                        )

                    row = row + (size & bit)
                    bit //= 2
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store_scope, plgpu.SMEM((block_m, block_n), out_dtype))

    kern = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // block_n, num_w),
        grid_names=("n", "w"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({} if interpret is None else {"interpret": interpret}),
    )
    return kern(*meta, lhs, *rhs)


def gpu_interpret_params():
    """Mosaic GPU interpret params (private jax API; None if unavailable)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params

        return params.InterpretGPUParams()
    except (ImportError, AttributeError):
        return None


def grouped_swiglu_mgpu(x, group_sizes, w_gate, w_up, w_down, *, block_m: int = 64, **kwargs):
    """Fused gate/up+SiLU kernel then down kernel on Hopper; rows padded."""
    from .kernel import make_group_metadata, swiglu_epilogue

    m = x.shape[0]
    m_pad = pl.cdiv(m, block_m) * block_m
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0))) if m_pad != m else x
    meta = make_group_metadata(group_sizes, m_pad, block_m)
    h = gmm_mgpu(xp, [w_gate, w_up], meta, block_m=block_m, epilogue=swiglu_epilogue, **kwargs)
    y = gmm_mgpu(h, [w_down], meta, block_m=block_m, **kwargs)
    return y[:m]
