"""How a transfer plan runs (``transfer.a2e`` / ``transfer.e2a``): the walk over its hops, each
device's chunks of rows cut, concatenated (A2E) or summed (E2A) and copied on, written once over
array operations that either move real arrays (``JaxOps``) or only count the host calls
(``host_ops``: the same walk, dry, on row counts). On a CPU mesh every hop is a host call, so
these counts, not the bytes, set a transfer's time (``scaling.fitted`` prices them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxmoe.mesh import ClusterSpec
from jaxmoe.runtime.transfer_plan import TransferPlan


def walk_a2e(spec: ClusterSpec, plan: TransferPlan, blocks: list, ops: Ops) -> list:
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


def walk_e2a(spec: ClusterSpec, plan: TransferPlan, partials: list, ops: Ops) -> list:
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
    copies (the plan's hops), ``ops`` array operations (slices, concatenations, sums, picks; one small
    jitted program each) and ``shards`` single-device arrays assembled into the result. On a CPU mesh, where every hop
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
        ("a2e", walk_a2e, [_Rows(1)] * spec.attention.count),
        ("e2a", walk_e2a, [_Rows(spec.attention.count)] * spec.experts.count),
    ):
        ops = _CountingOps()
        shards = len(walk(spec, plan, inputs, ops))
        out[direction] = HostOps(ops.puts, ops.ops, shards)
    return out


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Rows of `blocks` (in order) held on one device; `parts` = expert partials summed in (e2a)."""

    blocks: tuple[int, ...]
    parts: frozenset[int]
    data: jax.Array


class Ops(Protocol):
    """The array operations a transfer walk runs: on devices (``JaxOps``) or counted (``_CountingOps``)."""

    def put(self, data, device: int): ...
    def first(self, data): ...  # data[0]
    def rows(self, data, start: int, stop: int): ...
    def concat(self, pieces: list): ...
    def add(self, a, b): ...


class JaxOps:
    """The walk's array operations on devices. Each is a jitted program run where its inputs are: a
    jitted call costs the host ~5 us, an eager index or slice ~35-40 us (Python indexing rules), and
    an E2A step on the CPU mesh runs 16 of them per layer."""

    def __init__(self, devices):
        self.devices = devices

    def put(self, data, device: int):
        return jax.device_put(data, self.devices[device])

    def first(self, data):
        return _first(data)

    def rows(self, data, start: int, stop: int):
        return _rows(data, start, stop)

    def concat(self, pieces: list):
        return _concat(tuple(pieces))

    def add(self, a, b):
        return _add(a, b)


_first = jax.jit(lambda data: data[0])
_rows = jax.jit(lambda data, start, stop: jax.lax.slice_in_dim(data, start, stop), static_argnums=(1, 2))
_concat = jax.jit(jnp.concatenate)
_add = jax.jit(jnp.add)


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


def _cut(chunk: _Chunk, blocks: tuple[int, ...], ops: Ops):
    """The rows of `blocks` (a subset of chunk.blocks) from one chunk."""
    if blocks == chunk.blocks:
        return chunk.data
    rows = chunk.data.shape[0] // len(chunk.blocks)
    pos = [chunk.blocks.index(b) for b in blocks]
    if pos == list(range(pos[0], pos[0] + len(pos))):
        return ops.rows(chunk.data, pos[0] * rows, (pos[-1] + 1) * rows)
    return ops.concat([ops.rows(chunk.data, p * rows, (p + 1) * rows) for p in pos])


def _gather(chunks: list[_Chunk], blocks: tuple[int, ...], ops: Ops):
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


def _sum(chunks: list[_Chunk], blocks: tuple[int, ...], ops: Ops):
    """E2A: sum the rows of `blocks` over chunks holding disjoint sets of partials (largest sets first)."""
    parts, picked = frozenset(), []
    for chunk in sorted(chunks, key=lambda c: -len(c.parts)):
        if set(blocks) <= set(chunk.blocks) and not parts & chunk.parts:
            parts |= chunk.parts
            picked.append(_cut(chunk, blocks, ops))
    if not picked:
        raise RuntimeError(f"transfer plan bug: no partials for blocks {blocks} on this device")
    return parts, functools.reduce(ops.add, picked)
