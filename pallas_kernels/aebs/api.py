"""Public entry point of the AEBS op: ``schedule`` (policy x implementation dispatch).

``impl="kernel"`` runs the Pallas kernel: ``kernel.py`` interpreted on CPU, Mosaic GPU on NVIDIA
GPUs (lowering checked, execution unverified here); ``kernel_tpu.py`` (Mosaic TPU, policy "aebs")
on TPUs (lowered and compiled ahead against libtpu in tests, not run on a TPU).
``resolve_impl("auto")`` picks the form per target platform (``AUTO_IMPL``).
``impl="reference"`` runs the jnp Algorithm 1 (``aebs``) or the numpy
``aebs_plus`` through ``jax.pure_callback`` (so both stay usable under jit).
``policy="random"`` is reference-only: it ignores ``impl``.
"""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp

from ..platform import target_platform
from . import backends as _backends
from . import kernel_tpu as _tpu
from . import reference as _ref

POLICIES = ("aebs", "aebs_plus", "random")
IMPLS = ("kernel", "reference")


def _round_up(x, m):
    return max(m, -(-x // m) * m)


def _prepare(topk_ids, replica_table, replica_instance, num_instances):
    """Kernel layout: flat, -1-padded ids; transposed replica/instance tables."""
    T, k = topk_ids.shape
    E, R = replica_table.shape
    tkp = _round_up(T * k, 128)
    width = _round_up(max(E, num_instances), 128)
    ids = jnp.asarray(topk_ids, jnp.int32).reshape(-1)
    ids = jnp.where((ids >= 0) & (ids < E), ids, -1)
    ids = jnp.pad(ids, (0, tkp - T * k), constant_values=-1)
    rt = jnp.asarray(replica_table, jnp.int32)
    it = jnp.where(rt >= 0, jnp.asarray(replica_instance, jnp.int32)[jnp.maximum(rt, 0)], -1)
    rt = jnp.pad(rt.T, ((0, 0), (0, width - E)), constant_values=-1)
    it = jnp.pad(it.T, ((0, 0), (0, width - E)), constant_values=-1)
    return ids, rt, it, tkp, width


def _backend(interpret):
    """The kernel's backend on the target platform (``pallas_kernels.platform``): the Pallas
    interpreter on CPU (or when asked), Mosaic GPU on GPUs, Mosaic TPU on TPUs."""
    platform = target_platform()
    if interpret is None:
        interpret = platform == "cpu"
    if interpret:
        return "interpret"
    if platform in ("gpu", "tpu"):
        return {"gpu": "mosaic_gpu", "tpu": "mosaic_tpu"}[platform]
    raise NotImplementedError(
        f"AEBS kernel has no compiled lowering for platform {platform!r}; use interpret=True or impl='reference'."
    )


# "auto" per target platform and policy: the compiled kernels on GPU and TPU (TPU: Algorithm 1 only,
# kernel_tpu); on CPU the fastest measured form (BENCHMARKS.md, "Scheduling overhead",
# bench/aebs_overhead.py): the jnp reference for aebs (44-107 us vs 79-284 us interpreted), the
# interpreted kernel for aebs_plus (232-444 us vs 1-11 ms through the numpy callback).
AUTO_IMPL = {
    ("gpu", "aebs"): "kernel",
    ("gpu", "aebs_plus"): "kernel",
    ("tpu", "aebs"): "kernel",
    ("tpu", "aebs_plus"): "reference",
    ("cpu", "aebs"): "reference",
    ("cpu", "aebs_plus"): "kernel",
}


def resolve_impl(impl: str, policy: str = "aebs") -> str:
    """``impl`` checked against ``IMPLS``; ``"auto"`` becomes ``AUTO_IMPL[target platform, policy]``
    (``pallas_kernels.platform``; the "random" policy ignores it)."""
    if impl == "auto":
        impl = AUTO_IMPL.get((target_platform(), policy), "reference")
    if impl not in IMPLS:
        raise ValueError(f"aebs_impl must be 'auto' or one of {IMPLS}, got {impl!r}")
    return impl


@functools.partial(jax.jit, static_argnames=("num_instances", "policy", "backend", "max_moves"))
def _kernel_schedule(topk_ids, replica_table, replica_instance, *, num_instances, policy, backend, max_moves):
    T, k = topk_ids.shape
    E, R = replica_table.shape
    if backend in ("mosaic_tpu", "mosaic_tpu_interpret"):
        if policy != "aebs":
            raise NotImplementedError(f"AEBS on TPU: the Mosaic TPU kernel runs policy 'aebs' only, not {policy!r}")
        ids, rt, it = _tpu.prepare(topk_ids, replica_table, replica_instance)
        fn = _tpu.build(E, num_instances, R, T * k, interpret=backend == "mosaic_tpu_interpret")
        phys, loads = fn(ids, rt, it)
        return phys.reshape(T, k), loads
    ids, rt, it, tkp, width = _prepare(topk_ids, replica_table, replica_instance, num_instances)
    fn = _backends.build(E, num_instances, R, tkp, width, policy=policy, max_moves=max_moves, backend=backend)
    phys, loads = fn(ids, rt, it, jnp.arange(width, dtype=jnp.int32))
    return phys[: T * k].reshape(T, k), loads[:num_instances]


def _plus_callback(topk_ids, replica_table, replica_instance, num_instances, max_moves):
    T, k = topk_ids.shape
    out = (jax.ShapeDtypeStruct((T, k), jnp.int32), jax.ShapeDtypeStruct((num_instances,), jnp.int32))

    def host(ids, rt, ri):
        O, load = _ref.aebs_plus_numpy(np.asarray(ids), np.asarray(rt), np.asarray(ri), num_instances, max_moves)
        return O.astype(np.int32), load.astype(np.int32)

    return jax.pure_callback(host, out, topk_ids, replica_table, replica_instance)


def schedule(
    topk_ids,
    replica_table,
    replica_instance,
    num_instances,
    *,
    policy="aebs",
    impl="kernel",
    interpret=None,
    seed=0,
    max_moves=None,
):
    """Assign every activated logical expert to exactly one of its replicas.

    Args:
      topk_ids: [T, k] int32 logical expert ids; -1 (or any id outside [0, E))
        marks an empty slot.
      replica_table: [E, R_max] int32, row e = physical slot ids hosting expert
        e, -1 padded.
      replica_instance: [S] int32, instance (in [0, num_instances)) of each slot.
      num_instances: N (static).
      policy: "aebs" (janus Algorithm 1), "aebs_plus" (improved, never a larger
        max than "aebs") or "random" (uniform replica per expert; ignores impl).
      impl: "kernel" (Pallas) or "reference".
      interpret: kernel only; None = interpret iff the default backend is CPU.
      seed: int or PRNG key for policy="random" (may be traced).
      max_moves: aebs_plus bound on local-improvement moves (default 4N).

    Returns:
      (physical_ids [T, k] int32, -1 where the input slot is empty;
       activated_per_instance [N] int32, distinct activated replicas per instance).

    Deterministic for aebs/aebs_plus, so every instance computes the same answer.
    Usable inside ``jax.jit`` (policy/impl/num_instances/interpret/max_moves must
    be static Python values).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    num_instances = int(num_instances)
    topk_ids = jnp.asarray(topk_ids, jnp.int32)
    replica_table = jnp.asarray(replica_table, jnp.int32)
    replica_instance = jnp.asarray(replica_instance, jnp.int32)
    if max_moves is None:
        max_moves = 4 * num_instances
    if policy == "random":
        return _ref.random_jnp(topk_ids, replica_table, replica_instance, num_instances, seed)
    if impl == "reference":
        if policy == "aebs":
            return _ref.aebs_jnp(topk_ids, replica_table, replica_instance, num_instances)
        return _plus_callback(topk_ids, replica_table, replica_instance, num_instances, int(max_moves))
    return _kernel_schedule(
        topk_ids,
        replica_table,
        replica_instance,
        num_instances=num_instances,
        policy=policy,
        backend=_backend(interpret),
        max_moves=int(max_moves),
    )
