"""Mesh files (meshes/*.yaml) -> ClusterSpec -> attention and expert sub-meshes.

A mesh file describes a cluster: the platform, `nodes` x `devices_per_node`, which
devices each attention instance and each expert instance owns, the expert slots per
instance, where shared experts run, and the A2E/E2A transfer policy. The field
reference is docs/mesh_files.md.

`load_mesh` validates a file without touching any device (real-cluster files load on
a laptop); `build_meshes` maps the spec onto jax devices. Device *indices* in a spec
run over 0 .. nodes*devices_per_node-1 and device index d lives on node
d // devices_per_node; `build_meshes` pairs index d with the d-th jax device (sorted
by process, then id) and, on multi-process runs, checks that node == process_index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

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


@dataclasses.dataclass(frozen=True, eq=False)
class SubMeshes:
    """jax meshes for both sides of a ClusterSpec (the same devices when monolithic)."""

    spec: ClusterSpec
    attention: Any  # jax.sharding.Mesh, axes ATTN_AXES, shape (attention instances, devices per instance)
    experts: Any  # jax.sharding.Mesh, axes EXPERT_AXES, shape (expert instances, devices per instance)
    devices: tuple  # devices[d] = the jax device for spec device index d
    node_ids: tuple[int, ...]  # node_ids[d] = node of spec device index d

    def node_of(self, device) -> int:
        """Node of a jax device of this cluster."""
        return self.node_ids[self.devices.index(device)]

    @property
    def batch_sharding(self):
        """Attention side, batch split over attention instances: P('attn')."""
        return _named(self.attention, ATTN_AXES[0])

    @property
    def replicated_sharding(self):
        """Expert side, replicated on every expert instance: P()."""
        return _named(self.experts)

    @property
    def partials_sharding(self):
        """Expert side, leading axis split over expert instances: P('expert')."""
        return _named(self.experts, EXPERT_AXES[0])


def load_mesh(path_or_dict: str | Path | Mapping[str, Any]) -> ClusterSpec:
    """Read and validate a mesh file (a path) or an already-parsed mapping."""
    from jaxmoe.mesh_file import parse  # the field-by-field validation (imports this module's types)

    if isinstance(path_or_dict, Mapping):
        return parse(path_or_dict, "<dict>")
    source = str(path_or_dict)
    try:
        raw = yaml.safe_load(Path(path_or_dict).read_text())
    except OSError as exc:
        raise MeshConfigError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise MeshConfigError(f"{source}: not valid YAML: {exc}") from exc
    return parse(raw, source)


def build_meshes(spec: ClusterSpec, devices: Sequence | None = None) -> SubMeshes:
    """Attention and expert meshes for `spec` over `devices` (default: all jax devices)."""
    import jax
    from jax.sharding import Mesh

    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = tuple(devices)
    src = spec.source
    if len(devices) < spec.num_devices:
        raise MeshConfigError(
            f"{src}: nodes: the file describes {spec.nodes} nodes x {spec.devices_per_node} devices = "
            f"{spec.num_devices} devices but only {len(devices)} jax devices exist"
            + (
                f" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={spec.num_devices} before starting)"
                if spec.platform == "cpu" or devices[0].platform == "cpu"
                else ""
            )
        )
    devices = devices[: spec.num_devices]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(devices[0].platform, devices[0].platform)
    if platform != spec.platform:
        raise MeshConfigError(f"{src}: platform: the file says {spec.platform} but the jax devices are {platform}")
    node_ids = tuple(spec.node_of(d) for d in range(spec.num_devices))
    if len({d.process_index for d in devices}) > 1:
        for d, dev in enumerate(devices):
            if dev.process_index != node_ids[d]:
                raise MeshConfigError(
                    f"{src}: devices_per_node: device {d} should be on node {node_ids[d]} "
                    f"but belongs to process {dev.process_index}"
                )

    def mesh(side: Instances, axes):
        grid = np.array([[devices[d] for d in inst] for inst in side.devices], dtype=object)
        return Mesh(grid, axes, axis_types=(jax.sharding.AxisType.Auto,) * 2)

    return SubMeshes(spec, mesh(spec.attention, ATTN_AXES), mesh(spec.experts, EXPERT_AXES), devices, node_ids)


# --------------------------------------------------------------------------- helpers


def _named(mesh, *spec):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*spec))


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
