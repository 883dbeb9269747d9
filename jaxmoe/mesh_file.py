"""Validation of a mesh file's contents, field by field, into a ``ClusterSpec`` (``jaxmoe.mesh``).

Every error is a ``MeshConfigError`` naming the file, the field (``experts.devices[1]``) and the
problem; the field reference is docs/mesh_files.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from jaxmoe.mesh_spec import (
    PLATFORMS,
    SHARED_EXPERTS,
    TRANSFER_MODES,
    ClusterSpec,
    Instances,
    MeshConfigError,
    TransferPolicy,
)

_TOP = (
    "platform",
    "nodes",
    "devices_per_node",
    "monolithic",
    "attention",
    "experts",
    "shared_experts",
    "transfer",
    "brownout",
)
_SIDE = ("instances", "devices_per_instance", "devices")
_TRANSFER = tuple(f.name for f in dataclasses.fields(TransferPolicy))
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse(raw: Any, src: str) -> ClusterSpec:
    """The ClusterSpec of a parsed mesh file; ``src`` names it in errors (``MeshConfigError``: file, field, problem)."""

    def err(field: str, msg: str) -> MeshConfigError:
        return MeshConfigError(f"{src}: {field}: {msg}")

    def mapping(value, field, allowed, required=()):
        if not isinstance(value, Mapping):
            raise err(field or "(top level)", f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise err(_join(field, key), f"unknown key (expected one of: {', '.join(allowed)})")
        for key in required:
            if key not in value:
                raise err(_join(field, key), "missing")
        return value

    def integer(value, field, minimum=1):
        if isinstance(value, bool) or not isinstance(value, int):
            raise err(field, f"expected an integer, got {type(value).__name__} {value!r}")
        if value < minimum:
            raise err(field, f"must be >= {minimum}, got {value}")
        return value

    def choice(value, field, options):
        if value not in options:
            raise err(field, f"expected one of {', '.join(options)}, got {value!r}")
        return value

    def nbytes(value, field):
        if isinstance(value, str):
            m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
            if not m or m.group(2).lower() not in _UNITS:
                raise err(field, f"expected bytes (an integer or e.g. '64KiB', '4MiB'), got {value!r}")
            return int(m.group(1)) * _UNITS[m.group(2).lower()]
        return integer(value, field, minimum=0)

    top = mapping(raw, "", _TOP, ("platform", "nodes", "devices_per_node", "experts"))
    platform = choice(top["platform"], "platform", PLATFORMS)
    nodes = integer(top["nodes"], "nodes")
    per_node = integer(top["devices_per_node"], "devices_per_node")
    monolithic = top.get("monolithic", False)
    if not isinstance(monolithic, bool):
        raise err("monolithic", f"expected true or false, got {monolithic!r}")
    total = nodes * per_node
    if monolithic and "attention" in top:
        raise err("attention", "not allowed with monolithic: true (both sides use the experts' devices)")
    if not monolithic and "attention" not in top:
        raise err("attention", "missing")

    sides = {"experts": top["experts"]} if monolithic else {"attention": top["attention"], "experts": top["experts"]}
    for name, value in sides.items():
        allowed = _SIDE + (("slots_per_instance",) if name == "experts" else ())
        mapping(value, name, allowed, ("slots_per_instance",) if name == "experts" else ())

    owner: dict[int, str] = {}  # device index -> "attention instance 0"
    layout: dict[str, list[tuple[int, ...]]] = {}

    def check_shape(name, insts):
        sizes = sorted({len(inst) for inst in insts})
        if len(sizes) > 1:
            raise err(f"{name}.devices", f"every instance needs the same number of devices, got {sizes}")
        for i, inst in enumerate(insts):
            if len({d // per_node for d in inst}) > 1:
                raise err(f"{name}.devices[{i}]", f"instance spans nodes {sorted({d // per_node for d in inst})}")

    # Explicit device lists first, then count-based sides from the lowest free devices.
    for name, value in sides.items():
        if "devices" not in value:
            continue
        lists = value["devices"]
        if not isinstance(lists, list) or not lists:
            raise err(f"{name}.devices", "expected a non-empty list (one entry per instance)")
        insts = []
        for i, entry in enumerate(lists):
            field = f"{name}.devices[{i}]"
            ids = [entry] if isinstance(entry, int) and not isinstance(entry, bool) else entry
            if not isinstance(ids, list) or not ids:
                raise err(field, f"expected a device index or a non-empty list of them, got {entry!r}")
            for d in ids:
                integer(d, field, minimum=0)
                if d >= total:
                    raise err(
                        field,
                        f"device {d} does not exist: nodes {nodes} x devices_per_node {per_node} "
                        f"= {total} devices (0..{total - 1})",
                    )
                if d in owner:
                    raise err(field, f"device {d} is already used by {owner[d]}")
                owner[d] = f"{name} instance {i}"
            insts.append(tuple(ids))
        check_shape(name, insts)
        for key, want in (("instances", len(insts)), ("devices_per_instance", len(insts[0]))):
            if key in value and integer(value[key], f"{name}.{key}") != want:
                raise err(f"{name}.{key}", f"{value[key]} does not match devices (which gives {want})")
        layout[name] = insts

    for name, value in sides.items():
        if name in layout:
            continue
        if "instances" not in value:
            raise err(f"{name}.instances", "missing (give instances or devices)")
        n = integer(value["instances"], f"{name}.instances")
        k = integer(value.get("devices_per_instance", 1), f"{name}.devices_per_instance")
        free = [d for d in range(total) if d not in owner]
        if n * k > len(free):
            raise err(
                f"{name}.instances",
                f"{n} instances x {k} devices = {n * k} devices but only {len(free)} "
                f"of the {total} devices (nodes {nodes} x devices_per_node {per_node}) are free",
            )
        layout[name] = [tuple(free[i * k : (i + 1) * k]) for i in range(n)]
        check_shape(name, layout[name])
        for i, inst in enumerate(layout[name]):
            owner.update({d: f"{name} instance {i}" for d in inst})

    experts = Instances(
        tuple(layout["experts"]), integer(top["experts"]["slots_per_instance"], "experts.slots_per_instance")
    )
    attention = Instances(experts.devices) if monolithic else Instances(tuple(layout["attention"]))

    shared = choice(top.get("shared_experts", "attention"), "shared_experts", SHARED_EXPERTS)
    t = mapping(top.get("transfer", {}), "transfer", _TRANSFER)
    default = TransferPolicy()
    policy = TransferPolicy(
        mode=choice(t.get("mode", default.mode), "transfer.mode", TRANSFER_MODES),
        direct_max_destinations=integer(
            t.get("direct_max_destinations", default.direct_max_destinations),
            "transfer.direct_max_destinations",
            minimum=0,
        ),
        direct_min_bytes=nbytes(t.get("direct_min_bytes", default.direct_min_bytes), "transfer.direct_min_bytes"),
        multicast_min_bytes=nbytes(
            t.get("multicast_min_bytes", default.multicast_min_bytes), "transfer.multicast_min_bytes"
        ),
    )
    brownout = None
    if "brownout" in top:  # handed over as written: the brownout package validates it (mesh_brownout)
        if not isinstance(top["brownout"], Mapping):
            raise err("brownout", f"expected a mapping, got {type(top['brownout']).__name__}")
        brownout = dict(top["brownout"])
    return ClusterSpec(platform, nodes, per_node, attention, experts, shared, policy, monolithic, src, brownout)


def _join(field: str, key: Any) -> str:
    return f"{field}.{key}" if field else str(key)
