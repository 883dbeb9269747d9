"""Validation of a mesh file's contents into a ``ClusterSpec`` (``jaxmoe.mesh``): the fields and their
types as pydantic models, then the device layout (which instance owns which devices).

Every error is one ``MeshConfigError`` line naming the file, the field (``experts.devices[1]``) and the
problem (``one_line`` turns pydantic's first error into one); the field reference is docs/mesh_files.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, ValidationError

from jaxmoe.mesh_spec import (
    PLATFORMS,
    SHARED_EXPERTS,
    TRANSFER_MODES,
    ClusterSpec,
    Instances,
    MeshConfigError,
    TransferPolicy,
)


def _device_lists(value):
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list (one entry per instance)")
    return value


def _device_list(entry):
    """One instance's devices: a device index or a non-empty list of them."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        return [entry]
    if not isinstance(entry, list) or not entry:
        raise ValueError(f"expected a device index or a non-empty list of them, got {entry!r}")
    return entry


class _Model(BaseModel):
    # strict: a YAML "2" is not the integer 2, true is not 1; unknown keys are errors
    model_config = ConfigDict(extra="forbid", strict=True)


Count = Annotated[int, Field(ge=1)]
Instance = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_device_list)]


class _Side(_Model):
    # None: not given (an explicit null is refused: only left-out fields take their default)
    instances: Count = None
    devices_per_instance: Count = None
    devices: Annotated[list[Instance], BeforeValidator(_device_lists)] = None


class _Experts(_Side):
    slots_per_instance: Count


class _Transfer(_Model):
    mode: Literal[TRANSFER_MODES] = TransferPolicy.mode
    direct_max_destinations: Annotated[int, Field(ge=0)] = TransferPolicy.direct_max_destinations
    direct_min_bytes: ByteSize = TransferPolicy.direct_min_bytes  # 65536, '64KiB', '4 MiB', '1.5GB'
    multicast_min_bytes: ByteSize = TransferPolicy.multicast_min_bytes


class _MeshFile(_Model):
    platform: Literal[PLATFORMS]
    nodes: Count
    devices_per_node: Count
    monolithic: bool = False
    attention: _Side = None  # required unless monolithic (checked with the layout)
    experts: _Experts
    shared_experts: Literal[SHARED_EXPERTS] = "attention"
    transfer: _Transfer = _Transfer()
    brownout: dict[Any, Any] = None  # handed over as written: the brownout package validates it


def one_line(exc: ValidationError, src: str, model: type[BaseModel], prefix: str = "") -> MeshConfigError:
    """The first of pydantic's errors (an unknown key first: a typo also makes its field missing) as one
    line ``SRC: field.path[i]: problem``; ``prefix`` names the section ``model`` validated."""
    errors = [{**e, "type": "extra_forbidden" if e["type"] == "invalid_key" else e["type"]} for e in exc.errors()]
    e = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc, value, ctx, unknown = e["loc"], e.get("input"), e.get("ctx", {}), e["type"] == "extra_forbidden"
    field = prefix
    for i, part in enumerate(loc):  # [i]: a list index; an unknown key is a key, whatever its type
        key = not isinstance(part, int) or (unknown and i == len(loc) - 1)
        field += f".{part}" if key and field else str(part) if key else f"[{part}]"
    for part in loc[:-1] if unknown else ():  # the model of the mapping holding it
        model = model.model_fields[part].annotation if isinstance(part, str) else model
    keys = ", ".join(f.alias or name for name, f in model.model_fields.items())
    expected = ctx.get("expected", "").replace("'", "").replace(" or ", ", ")  # a Literal's options
    msg = _MESSAGES.get(e["type"], f"{e['msg'][0].lower()}{e['msg'][1:]}, got ".replace("{", "{{") + "{value!r}")
    msg = msg.format(**{**ctx, "expected": expected}, keys=keys, kind=type(value).__name__, value=value)
    return MeshConfigError(f"{src}: {field or '(top level)'}: {msg}")


_MESSAGES = {  # pydantic's error type -> the problem, in the words of docs/mesh_files.md
    "missing": "missing",
    "extra_forbidden": "unknown key (expected one of: {keys})",
    "model_type": "expected a mapping, got {kind}",
    "dict_type": "expected a mapping, got {kind}",
    "int_type": "expected an integer, got {kind} {value!r}",
    "bool_type": "expected true or false, got {value!r}",
    "greater_than_equal": "must be >= {ge}, got {value}",
    "literal_error": "expected one of {expected}, got {value!r}",
    "byte_size": "expected bytes (an integer >= 0 or e.g. '64KiB', '4MiB'), got {value!r}",
    "byte_size_unit": "expected bytes (an integer >= 0 or e.g. '64KiB', '4MiB'), got {value!r}",
    "value_error": "{error}",
}


def parse(raw: Any, src: str) -> ClusterSpec:
    """The ClusterSpec of a parsed mesh file; ``src`` names it in errors (``MeshConfigError``: file, field, problem)."""

    def err(field: str, msg: str) -> MeshConfigError:
        return MeshConfigError(f"{src}: {field}: {msg}")

    raw = dict(raw) if isinstance(raw, Mapping) else raw
    if isinstance(raw, dict) and raw.get("monolithic") is True and "attention" in raw:  # whatever it holds
        raise err("attention", "not allowed with monolithic: true (both sides use the experts' devices)")
    try:
        top = _MeshFile.model_validate(raw)
    except ValidationError as exc:
        raise one_line(exc, src, _MeshFile) from None
    nodes, per_node, total = top.nodes, top.devices_per_node, top.nodes * top.devices_per_node
    if not top.monolithic and "attention" not in top.model_fields_set:
        raise err("attention", "missing")
    sides = {"experts": top.experts} if top.monolithic else {"attention": top.attention, "experts": top.experts}

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
    for name, side in sides.items():
        if side.devices is None:
            continue
        for i, ids in enumerate(side.devices):
            for d in ids:
                if d >= total:
                    raise err(
                        f"{name}.devices[{i}]",
                        f"device {d} does not exist: nodes {nodes} x devices_per_node {per_node} "
                        f"= {total} devices (0..{total - 1})",
                    )
                if d in owner:
                    raise err(f"{name}.devices[{i}]", f"device {d} is already used by {owner[d]}")
                owner[d] = f"{name} instance {i}"
        layout[name] = [tuple(ids) for ids in side.devices]
        check_shape(name, layout[name])
        for key, want in (("instances", len(side.devices)), ("devices_per_instance", len(side.devices[0]))):
            if getattr(side, key) not in (None, want):
                raise err(f"{name}.{key}", f"{getattr(side, key)} does not match devices (which gives {want})")

    for name, side in sides.items():
        if name in layout:
            continue
        if side.instances is None:
            raise err(f"{name}.instances", "missing (give instances or devices)")
        n, k = side.instances, side.devices_per_instance or 1
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

    experts = Instances(tuple(layout["experts"]), top.experts.slots_per_instance)
    attention = Instances(experts.devices) if top.monolithic else Instances(tuple(layout["attention"]))
    t = top.transfer
    policy = TransferPolicy(t.mode, t.direct_max_destinations, int(t.direct_min_bytes), int(t.multicast_min_bytes))
    return ClusterSpec(
        top.platform, nodes, per_node, attention, experts, top.shared_experts, policy, top.monolithic, src, top.brownout
    )
