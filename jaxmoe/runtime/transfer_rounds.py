"""Transfer plans as ppermute rounds, for ``cross_process.CrossProcessTransfer``.

``schedule_rounds`` packs a plan's hops into rounds (one ``jax.lax.ppermute`` each);
``run_a2e_rounds`` / ``run_e2a_rounds`` execute them inside the transfer's ``shard_map`` over the
``"xfer"`` axis; ``replay_a2e`` / ``replay_e2a`` replay them on the host when a program is built
(every expert device gets every block, every attention device every partial exactly once).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.runtime.transfer import Transfer

XFER = "xfer"  # the global mesh axis: one position per cluster device, in spec device order


@dataclasses.dataclass(frozen=True)
class Round:
    """Hops run together as one ``ppermute``: distinct sources, distinct destinations, k blocks each."""

    hops: tuple[Transfer, ...]
    k: int

    @property
    def perm(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.src, t.dst) for t in self.hops)


def schedule_rounds(hops: Sequence[Transfer]) -> list[Round]:
    """Pack hops (in plan order) into ppermute rounds that are equivalent to running them one by one.

    A hop goes to the earliest round with the same block count, a free source and a free
    destination that is (a) after the last round delivering to its source (it forwards what it
    received) and (b) not before the last round in which its destination sends (in a round sends
    read the buffer before receives are added, so that one may be the same round).
    """
    rounds: list[list] = []  # [k, hops, senders, receivers]
    last_recv: dict[int, int] = defaultdict(lambda: -1)
    last_send: dict[int, int] = defaultdict(lambda: -1)
    for t in hops:
        k = len(t.blocks)
        lo = max(last_recv[t.src] + 1, last_send[t.dst], 0)
        for r in range(lo, len(rounds)):
            rk, _, senders, receivers = rounds[r]
            if rk == k and t.src not in senders and t.dst not in receivers:
                break
        else:
            rounds.append([k, [], set(), set()])
            r = len(rounds) - 1
        rounds[r][1].append(t)
        rounds[r][2].add(t.src)
        rounds[r][3].add(t.dst)
        last_recv[t.dst] = max(last_recv[t.dst], r)
        last_send[t.src] = max(last_send[t.src], r)
    return [Round(tuple(h), k) for k, h, _, _ in rounds]


def _tables(r: Round, num_devices: int):
    send = np.zeros((num_devices, r.k), np.int32)
    recv = np.zeros((num_devices, r.k), np.int32)
    receives = np.zeros(num_devices, bool)
    for t in r.hops:
        send[t.src] = t.blocks
        recv[t.dst] = t.blocks
        receives[t.dst] = True
    return send, recv, receives


def run_a2e_rounds(buf: jax.Array, rounds: list[Round], num_devices: int, me) -> jax.Array:
    """Inside the shard_map: every round, senders send buf[blocks], receivers store them (a block
    that arrives again carries the same rows)."""
    for r in rounds:
        send, recv, receives = _tables(r, num_devices)
        got = jax.lax.ppermute(jnp.take(buf, jnp.asarray(send)[me], axis=0), XFER, r.perm)
        buf = jnp.where(jnp.asarray(receives)[me], buf.at[jnp.asarray(recv)[me]].set(got), buf)
    return buf


def run_e2a_rounds(own: jax.Array, rounds: list[Round], include: list[np.ndarray], num_devices: int, me):
    """Inside the shard_map: a device's value for block b is acc[b] (the sum of the partial sums it
    received, pairwise disjoint) plus its own partial where ``include[round][device, b]`` (its own
    partial is not already inside what it received). Senders send their value's blocks, receivers
    add them to acc. Returns the value after the last round."""
    acc = jnp.zeros_like(own)

    def value(inc):
        return acc + jnp.where(jnp.asarray(inc)[me].reshape((-1,) + (1,) * (own.ndim - 1)), own, 0)

    for r, inc in zip(rounds, include):
        send, recv, _ = _tables(r, num_devices)
        got = jax.lax.ppermute(jnp.take(value(inc), jnp.asarray(send)[me], axis=0), XFER, r.perm)
        acc = acc.at[jnp.asarray(recv)[me]].add(got)  # zeros on devices that receive nothing
    return value(include[-1])  # include has one table per round plus one for the end


def replay_a2e(spec, own: np.ndarray, rounds: list[Round]) -> None:
    """Host check: every hop sends blocks its source holds; every expert device ends with all blocks."""
    held = {d: ({int(own[d])} if own[d] >= 0 else set()) for d in range(spec.num_devices)}
    for r in rounds:
        before = {d: set(v) for d, v in held.items()}
        for t in r.hops:
            if not set(t.blocks) <= before[t.src]:
                raise RuntimeError(f"cross-process a2e schedule bug at hop {t}: its source lacks blocks")
            held[t.dst] |= set(t.blocks)
    everything = set(range(spec.attention.count))
    for d in spec.experts.flat:
        if held[d] != everything:
            raise RuntimeError(f"cross-process a2e schedule bug: expert device {d} gets blocks {sorted(held[d])}")


def replay_e2a(spec, rounds: list[Round]) -> list[np.ndarray]:
    """Host replay of E2A as ``transfer_walk._sum`` does it: a device's value for a block is the
    disjoint union of the partial sums it received plus its own partial unless one of those
    already includes it (monolithic layouts: an expert device that is also an attention device
    gets its own partial back inside its node's sum). Returns ``include`` tables [devices, m]:
    one per round (at its start) and one for the end; raises unless received sums are pairwise
    disjoint and every attention device ends with each expert instance's partial exactly once."""
    m, n, D = spec.attention.count, spec.experts.count, spec.num_devices
    own = {d: frozenset() for d in range(D)}
    for j, inst in enumerate(spec.experts.devices):
        own[inst[0]] = frozenset({j})
    acc = {d: [frozenset() for _ in range(m)] for d in range(D)}

    def snapshot():
        inc = np.array([[not (own[d] & acc[d][b]) for b in range(m)] for d in range(D)], bool)
        val = {d: [acc[d][b] | (own[d] if inc[d, b] else frozenset()) for b in range(m)] for d in range(D)}
        return inc, val

    include = []
    for r in rounds:
        inc, val = snapshot()
        include.append(inc)
        for t in r.hops:
            for b in t.blocks:
                if acc[t.dst][b] & val[t.src][b]:
                    raise RuntimeError(
                        f"cross-process e2a schedule bug at hop {t}: partials "
                        f"{sorted(acc[t.dst][b] & val[t.src][b])} would arrive twice"
                    )
                acc[t.dst][b] = acc[t.dst][b] | val[t.src][b]
    inc, val = snapshot()
    include.append(inc)
    for i, inst in enumerate(spec.attention.devices):
        for d in inst:
            if val[d][i] != frozenset(range(n)):
                raise RuntimeError(
                    f"cross-process e2a schedule bug: attention device {d} gets partials {sorted(val[d][i])} of {n}"
                )
    return include
