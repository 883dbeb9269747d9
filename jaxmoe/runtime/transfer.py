"""A2E / E2A transfers between the attention and expert sub-meshes (JANUS 3.2).

Data contract (one call each per layer):
  a2e: x [B, ...] sharded P("attn") on the attention mesh (attention instance i holds
       rows block i)  ->  x [B, ...] replicated on the expert mesh. JANUS gates on the
       expert side, so every expert device gets all tokens' full activations.
  e2a: y [n, B, ...] sharded P("expert") on the expert mesh (y[j] = the partial output
       of expert instance j, zeros for experts it does not host)  ->  sum_j y[j],
       [B, ...] sharded P("attn") on the attention mesh.

A *plan* (``transfer_plan``: pure Python, from the ClusterSpec and the bytes per attention
instance) lists every hop of a transfer and its strategy (direct or two-phase).

Execution walks the plan hop by hop with one `jax.device_put` per Transfer (a jit cannot
take inputs on one mesh and return outputs on another); concatenation and summation
happen on the receiving device (``transfer_walk``). So the plan's counters are exactly the hops
executed, and ``transfer_walk.host_ops`` (the same walk, dry) counts the host calls besides them.
This is single-controller: every device must be addressable from this process
(``LocalTransfer``); across processes ``cross_process.CrossProcessTransfer`` runs the same plan.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import numpy as np

from jaxmoe.mesh import SubMeshes
from jaxmoe.runtime.transfer_plan import (  # noqa: F401  (the plan's names, re-exported: part of this API)
    DIRECT,
    MULTICAST,
    STRATEGIES,
    UNICAST,
    Transfer,
    TransferCounts,
    TransferPlan,
    choose_strategy,
    plan_transfers,
)
from jaxmoe.runtime.transfer_walk import JaxOps, walk_a2e, walk_e2a


def a2e(x_attn: jax.Array, plan: TransferPlan, sub_meshes: SubMeshes) -> jax.Array:
    """[B, ...] P('attn') on the attention mesh -> [B, ...] replicated on the expert mesh."""
    spec, devices = sub_meshes.spec, sub_meshes.devices
    check_input(x_attn, sub_meshes.batch_sharding, spec.attention.count * plan.bytes_per_instance, plan, "a2e input")
    shards = {s.device: s.data for s in x_attn.addressable_shards}
    blocks = [shards[devices[inst[0]]] for inst in spec.attention.devices]
    outs = walk_a2e(spec, plan, blocks, JaxOps(devices))
    return jax.make_array_from_single_device_arrays(x_attn.shape, sub_meshes.replicated_sharding, outs)


def e2a(y_expert: jax.Array, plan: TransferPlan, sub_meshes: SubMeshes) -> jax.Array:
    """[n, B, ...] P('expert') partials on the expert mesh -> their sum, [B, ...] P('attn') on the attention mesh."""
    spec, devices = sub_meshes.spec, sub_meshes.devices
    n, m = spec.experts.count, spec.attention.count
    if y_expert.ndim < 2 or y_expert.shape[0] != n:
        raise ValueError(f"e2a input: expected [{n} expert instances, B, ...], got shape {y_expert.shape}")
    check_input(y_expert, sub_meshes.partials_sharding, n * m * plan.bytes_per_instance, plan, "e2a input")
    shards = {s.device: s.data for s in y_expert.addressable_shards}
    partials = [shards[devices[inst[0]]] for inst in spec.experts.devices]
    outs = walk_e2a(spec, plan, partials, JaxOps(devices))
    return jax.make_array_from_single_device_arrays(y_expert.shape[1:], sub_meshes.batch_sharding, outs)


@runtime_checkable
class TransferBackend(Protocol):
    """What moves activations between the sub-meshes for ``DisaggregatedExecutor`` (its
    ``.transfer``): ``LocalTransfer`` in one process, ``cross_process.CrossProcessTransfer`` across."""

    def a2e(self, x: jax.Array, plan: TransferPlan | None = None, sub: SubMeshes | None = None) -> jax.Array:
        """Normed activations (rows on the attention mesh) -> a full copy on every expert device."""
        ...

    def e2a(self, y: jax.Array, plan: TransferPlan | None = None, sub: SubMeshes | None = None) -> jax.Array:
        """Per-expert-instance partial outputs -> their sum, rows on the attention mesh."""
        ...

    def to_local(self, x: jax.Array) -> jax.Array:
        """An array of either side, readable by this process."""
        ...

    def fetch(self, x: jax.Array) -> np.ndarray:
        """A host copy of an array of either side."""
        ...


class LocalTransfer:
    """``a2e`` / ``e2a`` as a transfer object (``DisaggregatedExecutor.transfer``) for one process,
    with the interface of ``cross_process.CrossProcessTransfer``: every array is readable here,
    so ``to_local`` is the identity and ``fetch`` is ``np.asarray``."""

    a2e = staticmethod(a2e)
    e2a = staticmethod(e2a)
    fetch = staticmethod(np.asarray)

    @staticmethod
    def to_local(x: jax.Array) -> jax.Array:
        return x


def check_input(x: jax.Array, sharding, nbytes: int, plan: TransferPlan, what: str) -> None:
    """Raise ValueError unless x has the sharding and size the transfer plan was made for."""
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
        raise ValueError(f"{what}: expected sharding {sharding}, got {x.sharding}")
    if x.nbytes != nbytes:
        raise ValueError(
            f"{what}: the plan was made for {plan.bytes_per_instance} bytes per attention instance "
            f"({nbytes} bytes here) but the array has {x.nbytes}; make one plan per batch shape"
        )
