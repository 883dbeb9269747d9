"""The plan of an A2E / E2A transfer (JANUS 3.2): pure Python, from the ClusterSpec and the bytes per
attention instance, listing every hop: src device -> dst device, the row blocks it carries, bytes,
phase, and whether it crosses nodes (``transfer`` runs it; ``transfer_walk`` walks it). Strategies:
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
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

from jaxmoe.mesh import ClusterSpec

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


# --------------------------------------------------------------------------- helpers


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
