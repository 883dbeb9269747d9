"""A2E / E2A transfers between the attention and expert sub-meshes (JANUS 3.2).

Data contract (one call each per layer):
  a2e: x [B, ...] sharded P("attn") on the attention mesh (attention instance i holds
       rows block i)  ->  x [B, ...] replicated on the expert mesh. JANUS gates on the
       expert side, so every expert device gets all tokens' full activations.
  e2a: y [n, B, ...] sharded P("expert") on the expert mesh (y[j] = the partial output
       of expert instance j, zeros for experts it does not host)  ->  sum_j y[j],
       [B, ...] sharded P("attn") on the attention mesh.

A *plan* (pure Python, from the ClusterSpec and the bytes per attention instance) lists
every hop: src device -> dst device, the row blocks it carries, bytes, phase, and
whether it crosses nodes. Strategies:
  direct               every attention instance sends to every expert device (m x n);
                       every expert instance sends each attention device its rows.
  two_phase_unicast    phase 1 gathers an attention node's blocks on its leader device;
                       phase 2 sends that aggregate to every expert device (JANUS case 1).
  two_phase_multicast  phase 1 as above; phase 2 sends one aggregate per (attention
                       node, expert node) to the expert node's hub, which multicasts the
                       full batch inside its node (case 2).
  E2A mirrors it: reduce inside each expert node on its hub first (two-phase), then send
  rows back, to every attention device (unicast) or to each attention node's leader,
  which scatters them inside its node (multicast).
`choose_strategy` picks one from the mesh file's transfer policy.

Execution walks the plan hop by hop with one `jax.device_put` per Transfer (a jit cannot
take inputs on one mesh and return outputs on another); concatenation and summation
happen on the receiving device. So the plan's counters are exactly the hops executed, and
``host_ops`` (the same walk, dry) counts the host calls a direction makes besides the hops.
This is single-controller: every device must be addressable from this process
(``LocalTransfer``); across processes ``cross_process.CrossProcessTransfer`` runs the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.mesh import ClusterSpec, SubMeshes

DIRECT = "direct"
UNICAST = "two_phase_unicast"
MULTICAST = "two_phase_multicast"
STRATEGIES = (DIRECT, UNICAST, MULTICAST)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One device-to-device hop (one jax.device_put)."""

    src: int  # spec device index
    dst: int  # spec device index
    blocks: tuple[int, ...]  # attention instances whose rows it carries, in order
    nbytes: int
    phase: int  # 1 (direct, gather, reduce) or 2 (send, multicast, scatter)
    step: str  # direct | gather | send | multicast (a2e); direct | reduce | send | scatter (e2a)
    cross_node: bool


@dataclasses.dataclass(frozen=True)
class TransferCounts:
    """Hops and bytes, split intra-node / cross-node."""

    intra: int = 0
    cross: int = 0
    intra_bytes: int = 0
    cross_bytes: int = 0

    @property
    def transfers(self) -> int:
        return self.intra + self.cross

    @property
    def nbytes(self) -> int:
        return self.intra_bytes + self.cross_bytes

    def __add__(self, other: TransferCounts) -> TransferCounts:
        return TransferCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @classmethod
    def of(cls, transfers) -> TransferCounts:
        transfers = list(transfers)
        cross = [t for t in transfers if t.cross_node]
        intra = [t for t in transfers if not t.cross_node]
        return cls(len(intra), len(cross), sum(t.nbytes for t in intra), sum(t.nbytes for t in cross))


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Every hop of one layer's A2E and E2A."""

    strategy: str
    bytes_per_instance: int  # bytes of one attention instance's rows block
    a2e: tuple[Transfer, ...]
    e2a: tuple[Transfer, ...]

    def counts(self, direction: str | None = None) -> TransferCounts:
        """Per-layer counters for 'a2e', 'e2a', or both (None)."""
        if direction is None:
            return self.counts("a2e") + self.counts("e2a")
        return TransferCounts.of(getattr(self, direction))

    def summary(self) -> str:
        def line(name):
            c = self.counts(name)
            return f"{name} {c.transfers} hops ({c.cross} cross-node, {c.cross_bytes} B cross / {c.nbytes} B)"

        return f"{self.strategy}: {line('a2e')}; {line('e2a')}"


def choose_strategy(spec: ClusterSpec, bytes_per_instance: int) -> str:
    """The mesh file's transfer policy applied to one layer's traffic.

    Destinations are the expert devices; "few" means <= direct_max_destinations.
      direct mode:     always m-to-n.
      adaptive mode:   m-to-n when destinations are few and each attention instance sends
                       >= direct_min_bytes (messages are already large, so aggregating saves
                       no per-message overhead and only adds a hop); otherwise two-phase.
      two-phase (both modes): unicast (case 1) when destinations are few and every
                       attention node's aggregate is < multicast_min_bytes, else multicast.
    """
    policy = spec.transfer
    few = len(spec.experts.flat) <= policy.direct_max_destinations
    if policy.mode == "direct" or (policy.mode == "adaptive" and few and bytes_per_instance >= policy.direct_min_bytes):
        return DIRECT
    node_bytes = bytes_per_instance * max(len(b) for _, b in _attention_nodes(spec))
    return UNICAST if few and node_bytes < policy.multicast_min_bytes else MULTICAST


@functools.lru_cache(maxsize=256)
def plan_transfers(spec: ClusterSpec, bytes_per_instance: int, strategy: str | None = None) -> TransferPlan:
    """All hops of one layer; `strategy` overrides the mesh file's policy. Cached."""
    strategy = strategy or choose_strategy(spec, bytes_per_instance)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown transfer strategy {strategy!r}; expected one of {STRATEGIES}")
    attn, exp = spec.attention.devices, spec.experts.devices
    everything = tuple(range(len(attn)))
    a2e: list[Transfer] = []
    e2a: list[Transfer] = []

    def hop(out, src, dst, blocks, phase, step):
        if src != dst:  # data already on the device: nothing moves
            cross = spec.node_of(src) != spec.node_of(dst)
            out.append(Transfer(src, dst, tuple(blocks), len(blocks) * bytes_per_instance, phase, step, cross))

    if strategy == DIRECT:
        for i, inst in enumerate(attn):
            for dst in spec.experts.flat:
                hop(a2e, inst[0], dst, (i,), 1, "direct")
        for inst in exp:
            for i, a_inst in enumerate(attn):
                for dst in a_inst:
                    hop(e2a, inst[0], dst, (i,), 1, "direct")
        return TransferPlan(strategy, bytes_per_instance, tuple(a2e), tuple(e2a))

    a_nodes = _attention_nodes(spec)  # [(leader device, attention instances on that node)]
    e_nodes = _expert_nodes(spec)  # [(hub device, expert devices, expert instances on that node)]
    # A2E phase 1: gather each attention node's blocks on its leader.
    for lead, blocks in a_nodes:
        for i in blocks[1:]:
            hop(a2e, attn[i][0], lead, (i,), 1, "gather")
    # A2E phase 2.
    for hub, devs, _ in e_nodes:
        if strategy == UNICAST:
            for dst in devs:
                for lead, blocks in a_nodes:
                    hop(a2e, lead, dst, blocks, 2, "send")
        else:
            for lead, blocks in a_nodes:
                hop(a2e, lead, hub, blocks, 2, "send")
            for dst in devs:
                hop(a2e, hub, dst, everything, 2, "multicast")
    # E2A phase 1: reduce each expert node's partials on its hub.
    for hub, _, insts in e_nodes:
        for j in insts:
            hop(e2a, exp[j][0], hub, everything, 1, "reduce")
    # E2A phase 2.
    for hub, _, _ in e_nodes:
        if strategy == UNICAST:
            for i, a_inst in enumerate(attn):
                for dst in a_inst:
                    hop(e2a, hub, dst, (i,), 2, "send")
        else:
            for lead, blocks in a_nodes:
                hop(e2a, hub, lead, blocks, 2, "send")
    if strategy == MULTICAST:
        for lead, blocks in a_nodes:
            for i in blocks:
                for dst in attn[i]:
                    hop(e2a, lead, dst, (i,), 2, "scatter")
    return TransferPlan(strategy, bytes_per_instance, tuple(a2e), tuple(e2a))


def a2e(x_attn: jax.Array, plan: TransferPlan, sub_meshes: SubMeshes) -> jax.Array:
    """[B, ...] P('attn') on the attention mesh -> [B, ...] replicated on the expert mesh."""
    spec, devices = sub_meshes.spec, sub_meshes.devices
    check_input(x_attn, sub_meshes.batch_sharding, spec.attention.count * plan.bytes_per_instance, plan, "a2e input")
    shards = {s.device: s.data for s in x_attn.addressable_shards}
    blocks = [shards[devices[inst[0]]] for inst in spec.attention.devices]
    outs = _walk_a2e(spec, plan, blocks, _JaxOps(devices))
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
    outs = _walk_e2a(spec, plan, partials, _JaxOps(devices))
    return jax.make_array_from_single_device_arrays(y_expert.shape[1:], sub_meshes.batch_sharding, outs)


def _walk_a2e(spec: ClusterSpec, plan: TransferPlan, blocks: list, ops: _Ops) -> list:
    """A2E's hops with ``ops``: attention instance i's rows (``blocks[i]``, on its first device)
    -> all rows on every expert device (``spec.experts.flat`` order)."""
    held: dict[int, list[_Chunk]] = defaultdict(list)
    for i, inst in enumerate(spec.attention.devices):
        held[inst[0]].append(_Chunk((i,), frozenset(), blocks[i]))
    for t in plan.a2e:
        data = _gather(held[t.src], t.blocks, ops)
        held[t.dst].append(_Chunk(t.blocks, frozenset(), ops.put(data, t.dst)))
    everything = tuple(range(spec.attention.count))
    return [_gather(held[d], everything, ops) for d in spec.experts.flat]


def _walk_e2a(spec: ClusterSpec, plan: TransferPlan, partials: list, ops: _Ops) -> list:
    """E2A's hops with ``ops``: expert instance j's partial output of every row (``partials[j]``,
    [1, B, ...] on its first device) -> the sum of all partials, each attention device its
    instance's rows (``spec.attention.devices`` order)."""
    n, m = spec.experts.count, spec.attention.count
    everything = tuple(range(m))
    held: dict[int, list[_Chunk]] = defaultdict(list)
    for j, inst in enumerate(spec.experts.devices):
        held[inst[0]].append(_Chunk(everything, frozenset({j}), ops.first(partials[j])))
    for t in plan.e2a:
        parts, data = _sum(held[t.src], t.blocks, ops)
        held[t.dst].append(_Chunk(t.blocks, parts, ops.put(data, t.dst)))
    outs = []
    for i, inst in enumerate(spec.attention.devices):
        for d in inst:
            parts, data = _sum(held[d], (i,), ops)
            if len(parts) != n:  # every partial must arrive exactly once
                raise RuntimeError(f"transfer plan bug: attention device {d} got partials {sorted(parts)} of {n}")
            outs.append(data)
    return outs


@dataclasses.dataclass(frozen=True)
class HostOps:
    """What one direction of a transfer costs the host, besides the bytes: ``puts`` device-to-device
    copies (the plan's hops), ``ops`` eager array operations (slices, concatenations, sums, picks)
    and ``shards`` single-device arrays assembled into the result. On a CPU mesh, where every hop
    is a host call, these counts, not the bytes, set a transfer's time (``scaling.fitted``)."""

    puts: int = 0
    ops: int = 0
    shards: int = 0


@functools.lru_cache(maxsize=256)
def host_ops(spec: ClusterSpec, plan: TransferPlan) -> dict[str, HostOps]:
    """``{"a2e": HostOps, "e2a": HostOps}`` of running ``plan`` on ``spec``'s devices: the same walk
    as ``a2e`` / ``e2a``, dry (``_CountingOps``: row counts instead of arrays). Cached."""
    out = {}
    for direction, walk, inputs in (
        ("a2e", _walk_a2e, [_Rows(1)] * spec.attention.count),
        ("e2a", _walk_e2a, [_Rows(spec.attention.count)] * spec.experts.count),
    ):
        ops = _CountingOps()
        shards = len(walk(spec, plan, inputs, ops))
        out[direction] = HostOps(ops.puts, ops.ops, shards)
    return out


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


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Rows of `blocks` (in order) held on one device; `parts` = expert partials summed in (e2a)."""

    blocks: tuple[int, ...]
    parts: frozenset[int]
    data: jax.Array


def _attention_nodes(spec: ClusterSpec) -> list[tuple[int, tuple[int, ...]]]:
    """(leader device, attention instances) per attention node, by node id."""
    nodes: dict[int, list[int]] = defaultdict(list)
    for i, inst in enumerate(spec.attention.devices):
        nodes[spec.node_of(inst[0])].append(i)
    return [(spec.attention.devices[b[0]][0], tuple(b)) for _, b in sorted(nodes.items())]


def _expert_nodes(spec: ClusterSpec) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(hub device, expert devices, expert instances) per expert node, by node id."""
    nodes: dict[int, list[int]] = defaultdict(list)
    for j, inst in enumerate(spec.experts.devices):
        nodes[spec.node_of(inst[0])].append(j)
    exp = spec.experts.devices
    return [(exp[js[0]][0], tuple(d for j in js for d in exp[j]), tuple(js)) for _, js in sorted(nodes.items())]


class _Ops(Protocol):
    """The array operations a transfer walk runs: on devices (``_JaxOps``) or counted (``_CountingOps``)."""

    def put(self, data, device: int): ...
    def first(self, data): ...  # data[0]
    def rows(self, data, start: int, stop: int): ...
    def concat(self, pieces: list): ...
    def add(self, a, b): ...


class _JaxOps:
    def __init__(self, devices):
        self.devices = devices

    def put(self, data, device: int):
        return jax.device_put(data, self.devices[device])

    def first(self, data):
        return data[0]

    def rows(self, data, start: int, stop: int):
        return data[start:stop]

    def concat(self, pieces: list):
        return jnp.concatenate(pieces)

    def add(self, a, b):
        return a + b


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A dry run's stand-in for an array: its row count."""

    n: int

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)


class _CountingOps:
    def __init__(self):
        self.puts = self.ops = 0

    def put(self, data, device: int):
        self.puts += 1
        return data

    def first(self, data):
        self.ops += 1
        return data

    def rows(self, data, start: int, stop: int):
        self.ops += 1
        return _Rows(stop - start)

    def concat(self, pieces: list):
        self.ops += 1
        return _Rows(sum(p.n for p in pieces))

    def add(self, a, b):
        self.ops += 1
        return a


def _cut(chunk: _Chunk, blocks: tuple[int, ...], ops: _Ops):
    """The rows of `blocks` (a subset of chunk.blocks) from one chunk."""
    if blocks == chunk.blocks:
        return chunk.data
    rows = chunk.data.shape[0] // len(chunk.blocks)
    pos = [chunk.blocks.index(b) for b in blocks]
    if pos == list(range(pos[0], pos[0] + len(pos))):
        return ops.rows(chunk.data, pos[0] * rows, (pos[-1] + 1) * rows)
    return ops.concat([ops.rows(chunk.data, p * rows, (p + 1) * rows) for p in pos])


def _gather(chunks: list[_Chunk], blocks: tuple[int, ...], ops: _Ops):
    """A2E: concatenate the rows of `blocks` from the chunks a device holds (longest runs first)."""
    pieces, i = [], 0
    while i < len(blocks):
        chunk = max((c for c in chunks if blocks[i] in c.blocks), key=lambda c: len(c.blocks))
        start, run = chunk.blocks.index(blocks[i]), 1
        while i + run < len(blocks) and chunk.blocks[start + run : start + run + 1] == (blocks[i + run],):
            run += 1
        pieces.append(_cut(chunk, blocks[i : i + run], ops))
        i += run
    return pieces[0] if len(pieces) == 1 else ops.concat(pieces)


def _sum(chunks: list[_Chunk], blocks: tuple[int, ...], ops: _Ops):
    """E2A: sum the rows of `blocks` over chunks holding disjoint sets of partials (largest sets first)."""
    parts, picked = frozenset(), []
    for chunk in sorted(chunks, key=lambda c: -len(c.parts)):
        if set(blocks) <= set(chunk.blocks) and not parts & chunk.parts:
            parts |= chunk.parts
            picked.append(_cut(chunk, blocks, ops))
    if not picked:
        raise RuntimeError(f"transfer plan bug: no partials for blocks {blocks} on this device")
    return parts, functools.reduce(ops.add, picked)


def check_input(x: jax.Array, sharding, nbytes: int, plan: TransferPlan, what: str) -> None:
    """Raise ValueError unless x has the sharding and size the transfer plan was made for."""
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
        raise ValueError(f"{what}: expected sharding {sharding}, got {x.sharding}")
    if x.nbytes != nbytes:
        raise ValueError(
            f"{what}: the plan was made for {plan.bytes_per_instance} bytes per attention instance "
            f"({nbytes} bytes here) but the array has {x.nbytes}; make one plan per batch shape"
        )
