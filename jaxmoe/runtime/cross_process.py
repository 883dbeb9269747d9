"""A2E / E2A across processes (multi-controller ``jax.distributed``): collectives over one mesh.

``jaxmoe.runtime.transfer`` executes a layer's transfer plan with one ``jax.device_put`` per hop.
That needs every device addressable from this process. Under ``jax.distributed`` (one process
per node) the attention and expert sub-meshes live in different processes, and jax 0.10's public
``device_put`` cannot move data there (docs/multi_host.md lists the exact errors):

  * ``device_put(x, NamedSharding(expert_mesh, P()))`` with x on another process' devices:
    ``ValueError: device_put's second argument must be a Device or a Sharding which represents
    addressable devices`` (sending process) / ``NotImplementedError: Cannot reshard an input
    that is not fully addressable`` (receiving process);
  * same layout on both sides (P("attn") -> P("expert"), 4 -> 4 devices): ``ValueError: The
    backend (...) does not support cross-host device transfers. Please set
    jax_cross_host_transfer_socket_address ...`` (an experimental DCN path that, once
    configured, only copies between *identically laid out* shardings);
  * one jit over both sub-meshes: ``ValueError: Received incompatible devices for jitted
    computation``.

What does work is a collective: every process joins one jitted ``shard_map`` over a 1-D mesh
``"xfer"`` spanning all the cluster's devices (``sub.devices``, so mesh position == spec device
index). This module executes *the same* ``TransferPlan`` as ``transfer.py`` inside that program:

  * each device holds a buffer of the m attention row blocks, [m, R, ...] (R rows per block);
    A2E starts with attention instance i's block at slot i of its first device, E2A with expert
    instance j's whole partial on its first device (zeros everywhere else);
  * the plan's hops are packed, in plan order, into *rounds*: sets of hops with distinct
    sources, distinct destinations and the same number of blocks. One round is one
    ``jax.lax.ppermute``: each source sends its [k, R, ...] blocks; each destination stores
    them in its buffer (A2E) or adds them to the sum it received (E2A: a device's value is that
    sum plus its own partial unless the sum already includes it, as ``transfer_walk._sum`` picks
    disjoint chunks). The rounds are replayed on the host when the program is built: every
    expert device must get every block, every attention device every partial exactly once;
  * A2E returns each expert device's full buffer ([B, ...], replicated on the expert mesh),
    E2A each attention device's own block ([R, ...], P("attn") on the attention mesh).

So the bytes that cross between devices are exactly the plan's (``TransferPlan.counts``), the
executor's counters stay valid, and the same code runs in one process (a plain in-process
ppermute) or many (gloo on CPU, NCCL on GPU, ICI/DCN on TPU). The input and output arrays are
re-wrapped between the sub-mesh and the global mesh with ``make_array_from_single_device_arrays``
(no copy). Every process must make the same calls in the same order (multi-controller SPMD): the
runtime's host logic is deterministic and the sampled tokens reach every process via
``to_local``.

``to_local(x)`` (also ``fetch``) brings an array of either side to *every* process: replicated
on its side's mesh, then one ppermute hop from a device of that side to the first device of each
process that has none. The executor uses it for the logits (the engine samples on every process)
and for host reads of expert-side counters.

``DisaggregatedExecutor`` uses this class by default when its sub-meshes span processes
(``spans_processes``); in one process it uses ``transfer.LocalTransfer``. The rounds themselves:
``transfer_rounds``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.mesh import ClusterSpec, SubMeshes
from jaxmoe.runtime.process_local import ProcessLocal
from jaxmoe.runtime.transfer import Transfer, TransferCounts, TransferPlan, check_input, plan_transfers
from jaxmoe.runtime.transfer_rounds import (
    XFER,
    Round,
    replay_a2e,
    replay_e2a,
    run_a2e_rounds,
    run_e2a_rounds,
    schedule_rounds,
)


def spans_processes(sub: SubMeshes) -> bool:
    """True when the cluster's devices belong to more than one process (``jax.distributed``)."""
    return len({d.process_index for d in sub.devices}) > 1


class CrossProcessTransfer:
    """A2E / E2A (and host fetches) between sub-meshes that may live in different processes.

    Drop-in for ``transfer.a2e`` / ``transfer.e2a``: ``a2e(x, plan, sub)`` and
    ``e2a(y, plan, sub)`` take and return the same arrays with the same shardings (``plan`` may be
    None: the mesh file's policy picks one). ``counts`` accumulates hops and bytes per direction
    (TransferCounts, split intra/cross-node like ``TransferPlan.counts``), ``collectives`` the
    ppermute rounds launched.
    """

    def __init__(self, sub: SubMeshes):
        self.sub = sub
        self.spec = sub.spec
        self.mesh = Mesh(np.array(sub.devices, dtype=object), (XFER,))
        self._local = [dev for dev in sub.devices if dev.process_index == jax.process_index()]
        self._programs: dict = {}
        self._zeros: dict = {}
        self.counts = {"a2e": TransferCounts(), "e2a": TransferCounts(), "fetch": TransferCounts()}
        self.collectives = {"a2e": 0, "e2a": 0, "fetch": 0}

    @classmethod
    def for_lowering(cls, spec: ClusterSpec, mesh) -> CrossProcessTransfer:
        """An instance that only builds the A2E / E2A programs (``_build_a2e`` / ``_build_e2a``) over
        ``mesh``, e.g. a ``jax.sharding.AbstractMesh`` of ``spec.num_devices`` (``jaxmoe lower``)."""
        self = cls.__new__(cls)
        self.spec, self.mesh = spec, mesh
        return self

    # ------------------------------------------------------------------ A2E / E2A

    def plan(self, x: jax.Array) -> TransferPlan:
        """The plan the mesh file's policy picks for activations x [B, ...] (P("attn"))."""
        return plan_transfers(self.spec, x.nbytes // self.spec.attention.count)

    def a2e(self, x: jax.Array, plan: TransferPlan | None = None, sub: SubMeshes | None = None) -> jax.Array:
        """[B, ...] P('attn') on the attention mesh -> [B, ...] replicated on the expert mesh."""
        self._same_cluster(sub)
        plan = plan or self.plan(x)
        m = self.spec.attention.count
        check_input(x, self.sub.batch_sharding, plan.bytes_per_instance * m, plan, "a2e input")
        rows = x.shape[0] // m
        fn, rounds = self._program("a2e", plan)
        xg = self._to_global(x, (rows,) + x.shape[1:])
        out = fn(xg)
        self._count("a2e", rounds)
        return self._from_global(out, x.shape, self.sub.replicated_sharding)

    def e2a(self, y: jax.Array, plan: TransferPlan | None = None, sub: SubMeshes | None = None) -> jax.Array:
        """[n, B, ...] P('expert') partials on the expert mesh -> their sum, [B, ...] P('attn') on the attention mesh."""
        self._same_cluster(sub)
        n, m = self.spec.experts.count, self.spec.attention.count
        if y.ndim < 2 or y.shape[0] != n:
            raise ValueError(f"e2a input: expected [{n} expert instances, B, ...], got shape {y.shape}")
        plan = plan or plan_transfers(self.spec, y.nbytes // (n * m))
        check_input(y, self.sub.partials_sharding, n * m * plan.bytes_per_instance, plan, "e2a input")
        fn, rounds = self._program("e2a", plan)
        yg = self._to_global(y, (1,) + y.shape[1:])
        out = fn(yg)
        self._count("e2a", rounds)
        return self._from_global(out, y.shape[1:], self.sub.batch_sharding)

    # ------------------------------------------------------------------ fetches

    def to_local(self, x: jax.Array) -> jax.Array:
        """A full copy of ``x`` (an array on the attention or the expert mesh, any sharding) on a
        device of *this* process, in every process. All processes must call it together."""
        if x.ndim == 0:
            raise ValueError("to_local: expected an array with at least one axis, got a scalar")
        side = self._side_of(x)
        mesh = self.sub.attention if side == "attention" else self.sub.experts
        rep = _replicate(mesh)(x)
        side_devs = set(mesh.devices.flat)
        mine = [s.data for s in rep.addressable_shards]
        hops = self._fetch_hops(side)
        if hops:
            fn, rounds = self._program("fetch", (side, hops))
            out = fn(self._to_global(rep, x.shape, sources=side_devs))
            self._count("fetch", rounds, nbytes=rep.nbytes)
            if not mine:  # this process holds no device of that side: take what was sent here
                dst = {self.sub.devices[t.dst] for t in hops}
                mine = [s.data for s in out.addressable_shards if s.device in dst]
        return mine[0]

    def fetch(self, x: jax.Array) -> np.ndarray:
        """``np.asarray`` of an attention- or expert-side array, on every process."""
        return np.asarray(self.to_local(x))

    # ------------------------------------------------------------------ programs

    # -- lowering ahead: a program traced and lowered for given shapes, neither compiled nor run (so no
    # collective): a live rescale compiles a new layout's programs in a thread while the old one serves

    def lower_a2e(self, x: jax.ShapeDtypeStruct, plan: TransferPlan) -> tuple[list, jax.ShapeDtypeStruct]:
        """``a2e``'s program for activations shaped like ``x`` (P("attn")), lowered; and its output's
        shape (replicated on the expert mesh)."""
        rows = x.shape[0] // self.spec.attention.count
        fn, _ = self._program("a2e", plan)
        xg = self._global_struct((rows,) + tuple(x.shape[1:]), x.dtype)
        return [fn.lower(xg)], jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sub.replicated_sharding)

    def lower_e2a(self, y: jax.ShapeDtypeStruct, plan: TransferPlan) -> tuple[list, jax.ShapeDtypeStruct]:
        """``e2a``'s program for partials shaped like ``y`` ([n, B, ...] P("expert")), lowered; and its
        output's shape ([B, ...] P("attn") on the attention mesh)."""
        fn, _ = self._program("e2a", plan)
        yg = self._global_struct((1,) + tuple(y.shape[1:]), y.dtype)
        return [fn.lower(yg)], jax.ShapeDtypeStruct(y.shape[1:], y.dtype, sharding=self.sub.batch_sharding)

    def lower_to_local(self, x: jax.ShapeDtypeStruct) -> tuple[list, jax.ShapeDtypeStruct]:
        """``to_local``'s programs for an array shaped like ``x`` (on the attention or the expert mesh),
        lowered; and the shape of what it returns here (one device of this process)."""
        side = self._side_of(x)
        mesh = self.sub.attention if side == "attention" else self.sub.experts
        replicate = _replicate(mesh)
        programs = [replicate.lower(x)] if replicate.runs_here else []  # none: no device of that side here
        hops = self._fetch_hops(side)
        if hops:
            fn, _ = self._program("fetch", (side, hops))
            programs.append(fn.lower(self._global_struct(tuple(x.shape), x.dtype)))
        mine = [dev for dev in mesh.devices.flat if dev.process_index == jax.process_index()]
        if not mine:  # what the fetch hop brought to this process's first device
            dst = {self.sub.devices[t.dst] for t in hops}
            mine = [dev for dev in self._local if dev in dst]
        out = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(mine[0]))
        return programs, out

    def _global_struct(self, shard_shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """The shape ``_to_global`` gives a per-device shard of ``shard_shape``."""
        shape = (len(self.sub.devices) * shard_shape[0],) + tuple(shard_shape[1:])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, P(XFER)))

    def _program(self, kind: str, key):
        if (kind, key) not in self._programs:
            builder = {"a2e": self._build_a2e, "e2a": self._build_e2a, "fetch": self._build_fetch}[kind]
            self._programs[kind, key] = builder(key)
        return self._programs[kind, key]

    def _build_a2e(self, plan: TransferPlan):
        spec = self.spec
        m = spec.attention.count
        own = np.full(spec.num_devices, -1, np.int32)  # block a device starts with (attention instance leads)
        for i, inst in enumerate(spec.attention.devices):
            own[inst[0]] = i
        rounds = schedule_rounds(plan.a2e)
        replay_a2e(spec, own, rounds)

        def body(local):  # local [R, ...]: this device's rows block (or zeros)
            me = jax.lax.axis_index(XFER)
            o = jnp.asarray(own)[me]
            slot = (jnp.arange(m) == o).reshape((m,) + (1,) * local.ndim)
            buf = jnp.where(slot, local[None], jnp.zeros_like(local)[None])
            buf = run_a2e_rounds(buf, rounds, spec.num_devices, me)
            return buf.reshape((m * local.shape[0],) + local.shape[1:])

        return self._jit(body), rounds

    def _build_e2a(self, plan: TransferPlan):
        spec = self.spec
        m = spec.attention.count
        source = np.zeros(spec.num_devices, bool)  # first device of each expert instance
        for inst in spec.experts.devices:
            source[inst[0]] = True
        block = np.zeros(spec.num_devices, np.int32)  # the rows block an attention device returns
        for i, inst in enumerate(spec.attention.devices):
            block[list(inst)] = i
        rounds = schedule_rounds(plan.e2a)
        include = replay_e2a(spec, rounds)

        def body(local):  # local [1, B, ...]: this device's partial (or zeros)
            me = jax.lax.axis_index(XFER)
            part = local[0]
            own = jnp.where(jnp.asarray(source)[me], part, jnp.zeros_like(part))
            own = own.reshape((m, part.shape[0] // m) + part.shape[1:])
            buf = run_e2a_rounds(own, rounds, include, spec.num_devices, me)
            return jax.lax.dynamic_index_in_dim(buf, jnp.asarray(block)[me], 0, keepdims=False)

        return self._jit(body), rounds

    def _build_fetch(self, key):
        _, hops = key
        rounds = schedule_rounds(hops)

        def body(local):  # local [B, ...]: a full copy on that side's devices, zeros elsewhere
            out = local
            for r in rounds:
                out = out + jax.lax.ppermute(local, XFER, r.perm)
            return out

        return self._jit(body), rounds

    def _fetch_hops(self, side: str) -> tuple[Transfer, ...]:
        """One hop per process holding no device of ``side``: from a device of that side (round
        robin) to the process's first device."""
        spec = self.spec
        flat = spec.attention.flat if side == "attention" else spec.experts.flat
        have = {self.sub.devices[d].process_index for d in flat}
        first: dict[int, int] = {}
        for d, dev in enumerate(self.sub.devices):
            first.setdefault(dev.process_index, d)
        hops = []
        for k, (_, dst) in enumerate(sorted((p, d) for p, d in first.items() if p not in have)):
            src = flat[k % len(flat)]
            hops.append(Transfer(src, dst, (), 0, 1, "fetch", spec.node_of(src) != spec.node_of(dst)))
        return tuple(hops)

    def _jit(self, body):
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=P(XFER), out_specs=P(XFER), check_vma=False)
        return jax.jit(mapped)

    # ------------------------------------------------------------------ sub-mesh <-> global mesh

    def _to_global(self, x: jax.Array, shard_shape: tuple[int, ...], sources=None) -> jax.Array:
        """x's per-device shards as one array [D * shard_shape[0], ...] P('xfer') on the global
        mesh (zero-copy); devices without a shard of x (or not in ``sources``) contribute zeros."""
        held = {s.device: s.data for s in x.addressable_shards}
        arrays = []
        for dev in self._local:
            data = held.get(dev) if sources is None or dev in sources else None
            if data is None or data.shape != shard_shape:
                data = self._zero(dev, shard_shape, x.dtype)
            arrays.append(data)
        shape = (len(self.sub.devices) * shard_shape[0],) + tuple(shard_shape[1:])
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(self.mesh, P(XFER)), arrays, dtype=x.dtype)

    def _from_global(self, out: jax.Array, shape, sharding: NamedSharding) -> jax.Array:
        """The shards of a global-mesh result that belong to ``sharding``'s devices, as one array."""
        held = {s.device: s.data for s in out.addressable_shards}
        arrays = [held[dev] for dev in sharding.mesh.devices.flat if dev in held]
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays, dtype=out.dtype)

    def _zero(self, dev, shape, dtype) -> jax.Array:
        key = (dev, tuple(shape), jnp.dtype(dtype))
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape, dtype), dev)
        return self._zeros[key]

    def _side_of(self, x: jax.Array) -> str:
        devs = set(x.sharding.device_set)
        if devs <= set(self.sub.attention.devices.flat):
            return "attention"
        if devs <= set(self.sub.experts.devices.flat):
            return "experts"
        raise ValueError(
            f"to_local: expected an array on the attention or the expert mesh, got devices {sorted(d.id for d in devs)}"
        )

    def _same_cluster(self, sub: SubMeshes | None) -> None:
        if sub is not None and sub is not self.sub and sub.spec != self.spec:
            raise ValueError(f"this transfer was built for {self.spec.source}, not {sub.spec.source}")

    def _count(self, kind: str, rounds: list[Round], nbytes: int | None = None) -> None:
        hops = [t for r in rounds for t in r.hops]
        if nbytes is not None:  # a fetch hop carries the whole array, sized at run time
            hops = [dataclasses.replace(t, nbytes=nbytes) for t in hops]
        self.counts[kind] = self.counts[kind] + TransferCounts.of(hops)
        self.collectives[kind] += len(rounds)


_REPLICATE: dict = {}


def _replicate(mesh: Mesh):
    if mesh not in _REPLICATE:
        _REPLICATE[mesh] = ProcessLocal(jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P())), mesh)
    return _REPLICATE[mesh]
