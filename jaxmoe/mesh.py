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

from jaxmoe.mesh_file import parse
from jaxmoe.mesh_spec import (  # noqa: F401  (the spec's names, re-exported: part of this API)
    ATTN_AXES,
    ClusterSpec,
    EXPERT_AXES,
    Instances,
    MeshConfigError,
    PLATFORMS,
    SHARED_EXPERTS,
    TRANSFER_MODES,
    TransferPolicy,
)


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


def check_cluster(spec: ClusterSpec, process_count: int, local_device_count: int, platform: str) -> None:
    """Before the model loads on a ``jax.distributed`` cluster: the file's ``nodes`` must be the
    process count, ``devices_per_node`` each process's device count and ``platform`` the devices'
    (``MeshConfigError`` naming the field otherwise)."""
    src = spec.source
    if spec.nodes != process_count:
        raise MeshConfigError(
            f"{src}: nodes: the file describes {spec.nodes} nodes (one process each) but jax.distributed "
            f"reports {process_count} processes"
        )
    if spec.devices_per_node != local_device_count:
        raise MeshConfigError(
            f"{src}: devices_per_node: the file says {spec.devices_per_node} but this process has "
            f"{local_device_count} jax devices"
            + (
                f" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={spec.devices_per_node})"
                if platform == "cpu"
                else ""
            )
        )
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform != spec.platform:
        raise MeshConfigError(f"{src}: platform: the file says {spec.platform} but the jax devices are {platform}")


# --------------------------------------------------------------------------- helpers


def _named(mesh, *spec):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*spec))
