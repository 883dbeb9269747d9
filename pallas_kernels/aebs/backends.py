"""The AEBS kernel body (``kernel.aebs_kernel_body``) as a callable per backend: the Pallas
interpreter (any host) or Mosaic GPU (compiled, or through its interpreter)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .kernel import NROWS, aebs_kernel_body


def _gpu_body(ids_ref, rt_ref, it_ref, iota_ref, phys_ref, loads_ref, ws_ref, rt_s, it_s, *, num_replicas, **kw):
    """Mosaic GPU wrapper: the replica tables (scalar-read in the sequential
    loops) are staged into SMEM once; the workspace ``ws_ref`` is SMEM scratch."""
    for r in range(num_replicas):
        rt_s[r, :] = rt_ref[r, :]
        it_s[r, :] = it_ref[r, :]
    aebs_kernel_body(ids_ref, rt_s, it_s, iota_ref, phys_ref, loads_ref, ws_ref, num_replicas=num_replicas, **kw)


def build(num_experts, num_instances, num_replicas, tkp, width, *, policy, max_moves, backend, compare_with_alg1=True):
    """Returns f(ids [tkp], rt [R, width], it [R, width], iota [width]) -> (phys, loads).

    backend: "interpret" (``pl.pallas_call(interpret=True)``, any host),
    "mosaic_gpu" (``plgpu.kernel``, compiled for an NVIDIA GPU) or
    "mosaic_gpu_interpret" (the same ``plgpu.kernel`` through the Mosaic GPU
    interpreter; used by the tests to exercise the GPU wrapper on CPU).
    """
    kw = dict(
        num_experts=num_experts,
        num_instances=num_instances,
        num_replicas=num_replicas,
        policy=policy,
        max_moves=max_moves,
        compare_with_alg1=compare_with_alg1,
    )
    i32 = jnp.int32
    outs = (jax.ShapeDtypeStruct((tkp,), i32), jax.ShapeDtypeStruct((width,), i32))
    if backend == "interpret":
        ws = jax.ShapeDtypeStruct((NROWS, width), i32)  # workspace as an extra output
        fn = pl.pallas_call(
            functools.partial(aebs_kernel_body, **kw), out_shape=outs + (ws,), interpret=True, name="aebs"
        )
        return lambda *args: fn(*args)[:2]
    if backend in ("mosaic_gpu", "mosaic_gpu_interpret"):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        scratch = (
            plgpu.SMEM((NROWS, width), i32),
            plgpu.SMEM((num_replicas, width), i32),
            plgpu.SMEM((num_replicas, width), i32),
        )
        body = functools.partial(_gpu_body, **kw)
        # Lane semantics named, not left to the default: the body is written for it (scalar
        # operands broadcast implicitly, boolean vectors), and newer jax defaults to Warpgroup.
        lane = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
        extra = dict(interpret=True) if backend == "mosaic_gpu_interpret" else dict(compiler_params=lane)
        try:
            return plgpu.kernel(body, out_type=outs, scratch_types=scratch, **extra)
        except TypeError:  # jax versions that only know the *_shape spellings
            return plgpu.kernel(body, out_shape=outs, scratch_shapes=scratch, **extra)
    raise ValueError(f"unknown backend {backend!r}")
