"""Expert replica slots moved between devices with collectives: the cross-process path of
``set_placement`` (``expert_program.relayout_layer``) and of live re-scaling's expert re-shard
(``rescale.reshard_experts``).

Slot arrays are [S, ...] sharded P("expert"): each expert device holds its instance's block of C
rows. Under ``jax.distributed`` those devices may belong to several processes, and
``jax.device_put`` cannot copy a row to a device of another process (docs/multi_host.md).
As in ``cross_process`` (A2E / E2A), a collective can: every process joins one jitted
``shard_map`` over a 1-D mesh ``"xfer"`` of the devices involved (old and new expert devices, in
spec device order) and

  * each device starts its new block [C_new, ...] from the rows it already holds (``keep``:
    the old row kept on this device, -1: nothing, zeros unless a row arrives);
  * the rows that move are packed into *rounds*: hops (source device -> destination device, k
    rows) with distinct sources, distinct destinations and the same k. One round is one
    ``jax.lax.ppermute``: each source sends the k rows of its *old* block, each destination
    writes them into its new block. Only the rows that move cross devices, each once per
    destination device.

The row tables (what each device keeps, sends and where it writes what arrives) are traced inputs
sharded over ``"xfer"``; the program is compiled per round structure (each round's device pairs
and k, the arrays' shapes), so layers with the same moves share one program. ``FixedRounds`` fixes
that structure in advance (every pair that may move rows, k rows a pair padded to a bucket; a
padding row is written nowhere): a plan whose copies change from call to call (the KV blocks of
the sequences live at a rescale's swap) then runs a program compiled ahead (``SlotMover.lower``). Every process must
make the same calls in the same order: the plan is a pure function of the placements and the
spec, which every process has. In one process the same program is a plain in-process ppermute
(tests compare it with the ``device_put`` path).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.runtime.transfer_rounds import XFER


@dataclasses.dataclass(frozen=True)
class RowCopy:
    """Row ``src_row`` of device ``src``'s old block becomes row ``dst_row`` of device ``dst``'s
    new block (devices: spec device indices)."""

    src: int
    src_row: int
    dst: int
    dst_row: int


@dataclasses.dataclass(frozen=True)
class SlotRound:
    """Hops run as one ``ppermute``: (src, dst) device pairs (distinct sources, distinct
    destinations), each moving k rows: ``rows[i]`` = (source rows, destination rows) of pair i."""

    pairs: tuple[tuple[int, int], ...]
    rows: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

    @property
    def k(self) -> int:
        return len(self.rows[0][0])


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """How every new block is made from the old ones.

    ``devices``: the spec device indices involved (ascending; mesh position = index here);
    ``old_rows`` / ``new_rows``: rows per old / new block; ``keep[d]``: per new row of device d,
    the old row of the *same* device it keeps (-1: none); ``copies``: the rows that move.
    """

    devices: tuple[int, ...]
    old_rows: int
    new_rows: int
    keep: dict[int, tuple[int, ...]]
    copies: tuple[RowCopy, ...]

    def rounds(self) -> list[SlotRound]:
        """The copies grouped per (src, dst) pair (k rows each, in row order), packed greedily
        into rounds of pairs with distinct sources, distinct destinations and equal k. Sources send
        their old blocks, which no round changes, so rounds need no ordering among themselves."""
        by_pair: dict[tuple[int, int], list[RowCopy]] = defaultdict(list)
        for c in self.copies:
            by_pair[c.src, c.dst].append(c)
        rounds: list[list] = []  # [k, pairs, rows, senders, receivers]
        for (src, dst), cs in sorted(by_pair.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            k = len(cs)
            for r in rounds:
                if r[0] == k and src not in r[3] and dst not in r[4]:
                    break
            else:
                r = [k, [], [], set(), set()]
                rounds.append(r)
            r[1].append((src, dst))
            r[2].append((tuple(c.src_row for c in cs), tuple(c.dst_row for c in cs)))
            r[3].add(src)
            r[4].add(dst)
        return [SlotRound(tuple(r[1]), tuple(r[2])) for r in rounds]

    def check(self) -> None:
        """Every new row is written at most once (kept or copied), from a row that exists."""
        for d, rows in self.keep.items():
            if len(rows) != self.new_rows or any(not -1 <= r < self.old_rows for r in rows):
                raise ValueError(f"slot plan: bad keep rows {rows} for device {d}")
        written = {(d, r) for d, rows in self.keep.items() for r, o in enumerate(rows) if o >= 0}
        for c in self.copies:
            if (c.dst, c.dst_row) in written or c.src == c.dst:
                raise ValueError(f"slot plan: {c} writes a row twice or copies within a device")
            if not (0 <= c.src_row < self.old_rows and 0 <= c.dst_row < self.new_rows):
                raise ValueError(f"slot plan: {c} is out of range")
            written.add((c.dst, c.dst_row))


class SlotMover:
    """Runs ``SlotPlan``s on the devices of one cluster (``devices``: the cluster's jax devices in
    spec order, ``SubMeshes.devices``). Programs and meshes are cached per structure.
    ``collectives``: ppermute rounds launched; ``rows_moved``: rows copied between devices
    (``rows_across_processes`` of them between devices of different processes); ``rows_sent``: rows
    the rounds carried (``rows_moved`` plus the padding of ``FixedRounds``)."""

    def __init__(self, devices):
        self.devices = list(devices)
        self._meshes: dict = {}
        self._programs: dict = {}
        self._zeros: dict = {}
        self.collectives = 0
        self.rows_moved = 0
        self.rows_across_processes = 0
        self.rows_sent = 0  # rows each round's ppermute carried, padding included (FixedRounds)

    def run(
        self, plan: SlotPlan, old: dict, sharding: NamedSharding, num_rows: int, fixed: "FixedRounds | None" = None
    ) -> dict:
        """``old``: name -> array whose shard on each old device is its [old_rows, ...] block;
        ``sharding``: the results' sharding, [num_rows, ...] arrays whose shard on each new device
        is its [new_rows, ...] block. Devices of the plan with no old block start from zeros.
        ``fixed``: run the plan in these rounds (its copies padded; the program ``lower`` compiled
        ahead for the same structure and shapes, else compiled now). Returns name -> the new
        arrays. All processes must call it together."""
        plan.check()
        mesh = self._mesh(plan.devices)
        D = len(plan.devices)
        pos = {d: i for i, d in enumerate(plan.devices)}
        if fixed is None:
            rounds = plan.rounds()
            round_tables = [_round_tables(r, pos, D, plan.new_rows) for r in rounds]
        else:
            fixed = fixed.for_plan(plan)
            rounds = fixed.rounds_for(plan)
            round_tables = [_round_tables(r, pos, D, plan.new_rows, fixed.k) for r in rounds]
        tables = [_keep_table(plan, D)] + [t for pair in round_tables for t in pair]
        table_sharding = NamedSharding(mesh, P(XFER))
        # each process fills its own devices' rows (``jax.device_put`` of a host array onto devices of
        # several processes first checks with a collective, compiled per shape, that all passed the same)
        tables = [
            jax.make_array_from_callback((t.size,), table_sharding, lambda i, t=t.reshape(-1): t[i], dtype=t.dtype)
            for t in tables
        ]
        names = sorted(old)
        olds = [self._to_global(old[k], plan, mesh) for k in names]
        pairs = tuple(r.pairs for r in rounds)
        ks = tuple(fixed.k for _ in rounds) if fixed is not None else tuple(r.k for r in rounds)
        key = self._key(plan.devices, plan.new_rows, pairs, ks, [(a.shape, a.dtype) for a in olds])
        if key not in self._programs:
            self._programs[key] = self._build(mesh, pairs, pos, len(names))
        outs = self._programs[key](tuple(olds), tuple(tables))
        self.rows_sent += sum(len(r.pairs) * k for r, k in zip(rounds, ks))
        self.collectives += len(rounds)
        self.rows_moved += len(plan.copies)
        self.rows_across_processes += sum(
            1 for c in plan.copies if self.devices[c.src].process_index != self.devices[c.dst].process_index
        )
        return {k: self._from_global(o, sharding, num_rows) for k, o in zip(names, outs)}

    # ------------------------------------------------------------------ the program

    def lower(self, fixed: "FixedRounds", old: dict) -> list["AheadProgram"]:
        """The program ``run(plan, old, ..., fixed)`` runs, for every k of ``fixed.buckets``, lowered
        (no data moves, no collective); each ``AheadProgram.compile()`` puts its executable where
        ``run`` looks, so ``run`` compiles nothing. ``old``: name -> (shape, dtype) of the arrays
        ``run`` gets (global [num_rows, ...] shapes: only their trailing dimensions matter)."""
        mesh = self._mesh(fixed.devices)
        pos = {d: i for i, d in enumerate(fixed.devices)}
        D = len(fixed.devices)
        sharding = NamedSharding(mesh, P(XFER))
        names = sorted(old)
        olds = [
            jax.ShapeDtypeStruct((D * fixed.old_rows,) + tuple(old[k][0][1:]), old[k][1], sharding=sharding)
            for k in names
        ]
        lowered = []
        for k in fixed.buckets:
            pairs = fixed.rounds
            key = self._key(
                fixed.devices, fixed.new_rows, pairs, tuple(k for _ in pairs), [(a.shape, a.dtype) for a in olds]
            )
            if key in self._programs:
                continue
            tables = [jax.ShapeDtypeStruct((D * fixed.new_rows,), np.int32, sharding=sharding)]
            tables += [jax.ShapeDtypeStruct((D * k,), np.int32, sharding=sharding) for _ in range(2 * len(pairs))]
            program = self._build(mesh, pairs, pos, len(names)).lower(tuple(olds), tuple(tables))
            lowered.append(AheadProgram(self._programs, key, program))
        return lowered

    @staticmethod
    def _key(devices, new_rows, pairs, ks, shapes) -> tuple:
        return (devices, new_rows, pairs, ks, tuple((tuple(s), jnp.dtype(d)) for s, d in shapes))

    def _build(self, mesh: Mesh, pairs: tuple, pos: dict[int, int], n_arrays: int):
        perms = [tuple((pos[s], pos[d]) for s, d in round_pairs) for round_pairs in pairs]

        def body(olds, tables):
            keep, rest = tables[0], tables[1:]
            outs = []
            for old in olds:  # old: [old_rows, ...] this device's block (zeros if it had none)
                mask = (keep >= 0).reshape((-1,) + (1,) * (old.ndim - 1))
                new = jnp.where(mask, jnp.take(old, jnp.maximum(keep, 0), axis=0), jnp.zeros((), old.dtype))
                for r, perm in enumerate(perms):
                    send, recv = rest[2 * r : 2 * r + 2]
                    got = jax.lax.ppermute(jnp.take(old, send, axis=0), XFER, perm)
                    new = new.at[recv].set(got, mode="drop")
                outs.append(new)
            return tuple(outs)

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(tuple([P(XFER)] * n_arrays), tuple([P(XFER)] * (1 + 2 * len(perms)))),
            out_specs=tuple([P(XFER)] * n_arrays),
            check_vma=False,
        )
        return jax.jit(mapped)

    # ------------------------------------------------------------------ arrays <-> the plan's mesh

    def _mesh(self, devices: tuple[int, ...]) -> Mesh:
        if devices not in self._meshes:
            self._meshes[devices] = Mesh(np.array([self.devices[d] for d in devices], dtype=object), (XFER,))
        return self._meshes[devices]

    def _to_global(self, arr: jax.Array, plan: SlotPlan, mesh: Mesh) -> jax.Array:
        """This process' old blocks of ``arr`` as one [D * old_rows, ...] P('xfer') array (no copy);
        plan devices without a block of ``arr`` contribute zeros."""
        shape = (plan.old_rows,) + tuple(arr.shape[1:])
        held = {s.device: s.data for s in arr.addressable_shards}
        me = jax.process_index()
        blocks = []
        for d in plan.devices:
            dev = self.devices[d]
            if dev.process_index != me:
                continue
            data = held.get(dev)
            if data is None or data.shape != shape:
                data = self._zero(dev, shape, arr.dtype)
            blocks.append(data)
        full = (len(plan.devices) * plan.old_rows,) + tuple(arr.shape[1:])
        return jax.make_array_from_single_device_arrays(full, NamedSharding(mesh, P(XFER)), blocks, dtype=arr.dtype)

    def _from_global(self, out: jax.Array, sharding: NamedSharding, num_rows: int) -> jax.Array:
        """The new blocks of ``sharding``'s devices as one [num_rows, ...] array (no copy)."""
        held = {s.device: s.data for s in out.addressable_shards}
        devs = list(sharding.mesh.devices.flat)
        missing = [d.id for d in devs if d.process_index == jax.process_index() and d not in held]
        if missing:
            raise ValueError(f"slot moves: devices {missing} of the new sharding are not in the plan")
        arrays = [held[d] for d in devs if d in held]
        shape = (num_rows,) + tuple(out.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=out.dtype)

    def _zero(self, dev, shape, dtype) -> jax.Array:
        key = (dev, tuple(shape), jnp.dtype(dtype))
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape, dtype), dev)
        return self._zeros[key]


def _keep_table(plan: SlotPlan, D: int) -> np.ndarray:
    keep = np.full((D, plan.new_rows), -1, np.int32)
    for i, d in enumerate(plan.devices):
        if d in plan.keep:
            keep[i] = plan.keep[d]
    return keep


def _round_tables(r: SlotRound, pos: dict[int, int], D: int, new_rows: int, k: int | None = None) -> list[np.ndarray]:
    """Rows each device sends, and where it writes what arrives (``new_rows``, out of range, on
    devices that receive nothing, and for the padding rows past a pair's own when ``k`` pads every
    pair to k rows: the write is dropped)."""
    k = r.k if k is None else k
    send = np.zeros((D, k), np.int32)
    recv = np.full((D, k), new_rows, np.int32)
    for (s, d), (src_rows, dst_rows) in zip(r.pairs, r.rows):
        send[pos[s], : len(src_rows)] = src_rows
        recv[pos[d], : len(dst_rows)] = dst_rows
    return [send, recv]


@dataclasses.dataclass(frozen=True)
class FixedRounds:
    """A round structure fixed before the copies are known: ``rounds`` (device pairs per round,
    distinct sources and destinations) covering every (source, destination) pair that may copy
    rows, each pair padded to the same k rows, k the smallest of ``buckets`` that holds the pair
    with the most copies. Rows per pair never exceed ``min(old_rows, new_rows)``, the last bucket."""

    devices: tuple[int, ...]
    old_rows: int
    new_rows: int
    rounds: tuple[tuple[tuple[int, int], ...], ...]
    buckets: tuple[int, ...]
    k: int = 0  # the bucket of the plan being run (``for_plan``)

    @classmethod
    def between(cls, sources, destinations, old_rows: int, new_rows: int, step: int, factor: int = 4) -> "FixedRounds":
        """Every pair of a device of ``sources`` and another of ``destinations``, packed greedily
        into rounds; buckets ``step * factor**i`` rows up to ``min(old_rows, new_rows)`` (a
        pair's rows are padded at most ``factor``-fold, or to ``step``)."""
        pairs = sorted((s, d) for s in set(sources) for d in set(destinations) if s != d)
        rounds: list[list[tuple[int, int]]] = []
        for s, d in pairs:
            r = next((r for r in rounds if all(s != a and d != b for a, b in r)), None)
            if r is None:
                r = []
                rounds.append(r)
            r.append((s, d))
        cap, buckets, k = min(old_rows, new_rows), [], step
        while k < cap:
            buckets.append(k)
            k *= factor
        buckets.append(cap)
        devices = tuple(sorted(set(sources) | set(destinations)))
        return cls(devices, old_rows, new_rows, tuple(tuple(r) for r in rounds), tuple(buckets))

    def for_plan(self, plan: SlotPlan) -> "FixedRounds":
        """These rounds with k: the smallest bucket that holds the plan's busiest pair."""
        if (plan.devices, plan.old_rows, plan.new_rows) != (self.devices, self.old_rows, self.new_rows):
            raise ValueError("fixed rounds: the plan's devices or rows differ from the rounds'")
        per_pair: dict[tuple[int, int], int] = defaultdict(int)
        for c in plan.copies:
            per_pair[c.src, c.dst] += 1
        most = max(per_pair.values(), default=0)
        k = next((b for b in self.buckets if b >= most), None)
        if k is None:
            raise ValueError(f"fixed rounds: a device pair copies {most} rows, more than {self.buckets[-1]}")
        return dataclasses.replace(self, k=k)

    def rounds_for(self, plan: SlotPlan) -> list[SlotRound]:
        """The plan's copies in these rounds (each pair's rows in row order; a pair without copies
        sends nothing that is written)."""
        pairs = {p for r in self.rounds for p in r}
        by_pair: dict[tuple[int, int], list[RowCopy]] = defaultdict(list)
        for c in plan.copies:
            if (c.src, c.dst) not in pairs:
                raise ValueError(f"fixed rounds: {c} is between devices the rounds do not pair")
            by_pair[c.src, c.dst].append(c)
        return [
            SlotRound(
                r,
                tuple((tuple(c.src_row for c in by_pair[p]), tuple(c.dst_row for c in by_pair[p])) for p in r),
            )
            for r in self.rounds
        ]


class AheadProgram:
    """A ``SlotMover`` program lowered ahead: ``compile()`` stores its executable where ``run``
    looks for it (no collective runs)."""

    def __init__(self, programs: dict, key: tuple, lowered):
        self._programs, self._key, self.lowered = programs, key, lowered

    def compile(self):
        compiled = self.lowered.compile()
        self._programs[self._key] = compiled
        return compiled


@functools.lru_cache(maxsize=8)
def mover_for(sub) -> SlotMover:
    """One ``SlotMover`` (and its compiled programs) per cluster (``SubMeshes``)."""
    return SlotMover(sub.devices)
