"""What a mesh file describes, as values: ``ClusterSpec`` (the platform, nodes x devices per node,
the attention and expert instances and their devices, expert slots, where shared experts run, the
A2E/E2A transfer policy) and ``MeshConfigError``. ``mesh_file`` validates a file into one;
``mesh`` maps one onto jax devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PLATFORMS = ("cpu", "gpu", "tpu")
TRANSFER_MODES = ("adaptive", "direct", "two_phase")
SHARED_EXPERTS = ("attention", "experts")
ATTN_AXES = ("attn", "attn_tp")  # attention mesh: (instances, devices per instance)
EXPERT_AXES = ("expert", "expert_tp")  # expert mesh: (instances, devices per instance)


class MeshConfigError(ValueError):
    """A mesh file is malformed or does not fit the model / the devices; names the field."""


@dataclasses.dataclass(frozen=True)
class Instances:
    """One side of the cluster: the device indices owned by each instance."""

    devices: tuple[tuple[int, ...], ...]  # devices[i] = device indices of instance i
    slots_per_instance: int | None = None  # expert slots C per instance (experts side only)

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def devices_per_instance(self) -> int:
        return len(self.devices[0])

    @property
    def flat(self) -> tuple[int, ...]:
        """All device indices of this side, instance by instance."""
        return tuple(d for inst in self.devices for d in inst)

    @property
    def total_slots(self) -> int:
        return self.count * (self.slots_per_instance or 0)


@dataclasses.dataclass(frozen=True)
class TransferPolicy:
    """A2E/E2A policy (JANUS 3.2); see jaxmoe.runtime.transfer.choose_strategy."""

    mode: str = "adaptive"  # adaptive | direct | two_phase
    direct_max_destinations: int = 2  # "few destinations": at most this many expert devices
    direct_min_bytes: int = 4 << 20  # adaptive: m-to-n direct if few destinations and >= this per attention instance
    multicast_min_bytes: int = 1 << 20  # two-phase: multicast if many destinations or >= this per attention node


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A validated mesh file. Frozen and hashable (usable as a cache key)."""

    platform: str
    nodes: int
    devices_per_node: int
    attention: Instances
    experts: Instances
    shared_experts: str = "attention"
    transfer: TransferPolicy = TransferPolicy()
    monolithic: bool = False
    source: str = "<dict>"
    # the ``brownout:`` section as written (a mapping; ``jaxmoe.brownout.config.mesh_brownout``
    # validates it); None: no brownout. A serving setting, not part of the layout: equality and
    # hashing ignore it.
    brownout: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def validate_for(self, num_experts: int) -> None:
        """Raise MeshConfigError unless the expert slots can hold `num_experts` routed experts."""
        c, n = self.experts.slots_per_instance, self.experts.count
        if c * n < num_experts:
            raise MeshConfigError(
                f"{self.source}: experts.slots_per_instance: {c} slots x {n} instances = {c * n} < {num_experts} experts"
            )

    def describe(self) -> str:
        """Human-readable layout (what `jaxmoe mesh show FILE` prints)."""
        a, e, t = self.attention, self.experts, self.transfer
        kind = "monolithic (attention and experts share devices)" if self.monolithic else "disaggregated"
        lines = [
            f"{self.source}",
            f"  platform {self.platform}: {_plural(self.nodes, 'node')} x {_plural(self.devices_per_node, 'device')}"
            f" = {_plural(self.num_devices, 'device')}, {kind}",
        ]
        used = set(a.flat) | set(e.flat)
        for node in range(self.nodes):
            devs = range(node * self.devices_per_node, (node + 1) * self.devices_per_node)
            ai = [i for i, inst in enumerate(a.devices) if self.node_of(inst[0]) == node]
            ei = [i for i, inst in enumerate(e.devices) if self.node_of(inst[0]) == node]
            idle = [d for d in devs if d not in used]
            parts = [
                f"attention {_ranges(ai)}" if ai else "",
                f"experts {_ranges(ei)}" if ei else "",
                f"idle devices {_ranges(idle)}" if idle else "",
            ]
            lines.append(f"  node {node} ({_devs(devs)}): " + "; ".join(p for p in parts if p))
        for title, side, axes, extra in (
            ("attention", a, ATTN_AXES, ""),
            ("experts", e, EXPERT_AXES, f", {e.slots_per_instance} slots each = {e.total_slots} slots"),
        ):
            shared = "; shared experts run here" if self.shared_experts == title else ""
            split = "attention heads" if title == "attention" else "expert FFN columns"
            tp = f"; tensor parallel: {split} split over {axes[1]!r}" if side.devices_per_instance > 1 else ""
            lines.append(
                f"  {title}: {_plural(side.count, 'instance')} x {_plural(side.devices_per_instance, 'device')}"
                f" (mesh axes {axes[0]!r} x {axes[1]!r}){extra}{tp}{shared}"
            )
            name = "attn" if title == "attention" else "expert"
            lines += [
                f"    {name}[{i}]: {_devs(inst)} (node {self.node_of(inst[0])})" for i, inst in enumerate(side.devices)
            ]
        lines.append(f"  transfer: {t.mode}")
        if t.mode == "direct":
            lines.append("    always direct m-to-n (every attention instance to every expert device)")
        else:
            lines += [
                f"    few destinations: <= {t.direct_max_destinations} expert devices (this layout has {len(e.flat)})",
                f"    direct m-to-n: if few destinations and >= {_fmt_bytes(t.direct_min_bytes)} per attention instance"
                if t.mode == "adaptive"
                else "    direct m-to-n: never (mode two_phase)",
                f"    two-phase: phase 2 unicast if few destinations and < {_fmt_bytes(t.multicast_min_bytes)}"
                " per attention node, else multicast inside each expert node",
            ]
        if self.brownout is not None:
            lines.append(f"  brownout: {', '.join(f'{k} {v}' for k, v in self.brownout.items())}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- helpers


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _devs(devices) -> str:
    return ("device " if len(devices) == 1 else "devices ") + _ranges(devices)


def _ranges(values) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    values, out = list(values), []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]}-{values[j]}" if j > i else f"{values[i]}")
        i = j + 1
    return ",".join(out)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"
