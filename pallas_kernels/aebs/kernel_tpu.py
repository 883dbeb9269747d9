"""AEBS (janus Algorithm 1) as a Pallas Mosaic TPU kernel.

Mosaic TPU keeps scalars in SMEM and vectors in (8, 128)-tiled VMEM; Algorithm 1 is a sequence
of scalar decisions (each multi-replica expert goes to the least-loaded instance hosting it, in
ascending expert id, so every decision reads the loads the earlier ones left), so this form runs
all of it on the scalar core, every array in SMEM:

  ids    [TK]     flattened top-k logical ids, -1 = empty slot (cleaned by ``api``)
  rt     [E * R]  replica table, row-major: rt[e * R + r] = r-th physical slot of e, -1 padded
  it     [E * R]  instance of rt[e * R + r] (-1 where rt is -1)
outputs
  phys   [TK]     physical replica per (token, slot), -1 where ids is -1
  loads  [N]      activated replicas per instance
scratch
  act, rep [E]    activated flag, chosen replica per logical expert

Steps (Algorithm 1's lines): 1 marks the activated experts over the token slots; 5-8 give the
single-replica experts their replica; 10-13 the multi-replica ones, in ascending id, the
lexicographic minimum of (load, instance, physical id) over their replicas; 14-17 remap the
token slots. Only policy "aebs" (Algorithm 1): ``aebs_plus``'s path search is not built here.
Checked against the jnp reference through the TPU interpreter (``pltpu.InterpretParams``) and
lowered for TPU in the tests; not run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BIG = 1 << 30


def _body(ids_ref, rt_ref, it_ref, phys_ref, loads_ref, act_ref, rep_ref, *, E, N, R, TK):
    def zero_experts(e, c):
        act_ref[e] = 0
        rep_ref[e] = -1
        return c

    lax.fori_loop(0, E, zero_experts, 0)

    def zero_loads(g, c):
        loads_ref[g] = 0
        return c

    lax.fori_loop(0, N, zero_loads, 0)

    def collect(t, c):  # line 1
        e = ids_ref[t]

        @pl.when(e >= 0)
        def _():
            act_ref[e] = 1

        return c

    lax.fori_loop(0, TK, collect, 0)

    def replicas(e):
        nrep = jnp.int32(0)
        for r in range(R):
            nrep = nrep + jnp.where(rt_ref[e * R + r] >= 0, 1, 0)
        return nrep

    def single(e, c):  # lines 5-8: the unique replica (-1 padding is below every slot id)
        @pl.when((act_ref[e] == 1) & (replicas(e) == 1))
        def _():
            p, g = rt_ref[e * R], it_ref[e * R]
            for r in range(1, R):
                p = jnp.maximum(p, rt_ref[e * R + r])
                g = jnp.maximum(g, it_ref[e * R + r])
            rep_ref[e] = p
            loads_ref[g] = loads_ref[g] + 1

        return c

    lax.fori_loop(0, E, single, 0)

    def multi(e, c):  # lines 10-13, ascending logical id
        @pl.when((act_ref[e] == 1) & (replicas(e) > 1))
        def _():
            bl, bg, bp = jnp.int32(BIG), jnp.int32(BIG), jnp.int32(BIG)
            for r in range(R):
                p, g = rt_ref[e * R + r], it_ref[e * R + r]
                ok = p >= 0
                load = jnp.where(ok, loads_ref[jnp.maximum(g, 0)], BIG)
                better = ok & ((load < bl) | ((load == bl) & ((g < bg) | ((g == bg) & (p < bp)))))
                bl = jnp.where(better, load, bl)
                bg = jnp.where(better, g, bg)
                bp = jnp.where(better, p, bp)
            rep_ref[e] = bp
            loads_ref[bg] = loads_ref[bg] + 1

        return c

    lax.fori_loop(0, E, multi, 0)

    def remap(t, c):  # lines 14-17
        e = ids_ref[t]
        phys_ref[t] = jnp.where(e >= 0, rep_ref[jnp.maximum(e, 0)], -1)
        return c

    lax.fori_loop(0, TK, remap, 0)


def build(num_experts: int, num_instances: int, num_replicas: int, tk: int, *, interpret: bool = False):
    """f(ids [tk], rt [E * R], it [E * R]) -> (phys [tk], loads [N]), all int32: the Mosaic TPU
    kernel, or (``interpret``) the same kernel through the TPU interpreter on any host."""
    E, N, R = num_experts, num_instances, num_replicas
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    i32 = jnp.int32
    return pl.pallas_call(
        functools.partial(_body, E=E, N=N, R=R, TK=tk),
        out_shape=(jax.ShapeDtypeStruct((tk,), i32), jax.ShapeDtypeStruct((N,), i32)),
        in_specs=[smem, smem, smem],
        out_specs=(smem, smem),
        scratch_shapes=[pltpu.SMEM((E,), i32), pltpu.SMEM((E,), i32)],
        interpret=pltpu.InterpretParams() if interpret else False,
        name="aebs_tpu",
    )


def prepare(topk_ids, replica_table, replica_instance):
    """The kernel's inputs: flat ids (outside [0, E) -> -1) and the flat replica / instance tables."""
    E, R = replica_table.shape
    ids = jnp.asarray(topk_ids, jnp.int32).reshape(-1)
    ids = jnp.where((ids >= 0) & (ids < E), ids, -1)
    rt = jnp.asarray(replica_table, jnp.int32)
    it = jnp.where(rt >= 0, jnp.asarray(replica_instance, jnp.int32)[jnp.maximum(rt, 0)], -1)
    return ids, rt.reshape(-1), it.reshape(-1)
