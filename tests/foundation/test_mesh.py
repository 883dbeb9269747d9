"""Mesh files: every shipped file loads, describe() text, sub-meshes, and every bad-file error names its field."""

import copy
import dataclasses
from pathlib import Path

import jax
import pytest
import yaml

from jaxmoe.mesh import ATTN_AXES, EXPERT_AXES, MeshConfigError, build_meshes, load_mesh

MESHES = Path(__file__).resolve().parents[2] / "meshes"
SHIPPED = sorted(MESHES.glob("*.yaml"))
REAL = ["h100-2x8.yaml", "tpu-v5e-16.yaml"]

BASE = {  # meshes/cpu-8.yaml as a dict; bad cases below mutate a copy
    "platform": "cpu",
    "nodes": 2,
    "devices_per_node": 4,
    "attention": {"instances": 2, "devices_per_instance": 1},
    "experts": {"instances": 6, "devices_per_instance": 1, "slots_per_instance": 4},
    "shared_experts": "attention",
    "transfer": {
        "mode": "adaptive",
        "direct_max_destinations": 2,
        "direct_min_bytes": "4MiB",
        "multicast_min_bytes": "1MiB",
    },
}


def test_shipped_files_exist():
    names = {p.name for p in SHIPPED}
    assert {"cpu-8.yaml", "cpu-8-4a4e.yaml", "cpu-8-1a7e.yaml", "monolithic.yaml", *REAL} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_file_loads(path):
    spec = load_mesh(path)
    assert spec.source == str(path)
    assert spec.experts.total_slots >= 8
    spec.validate_for(spec.experts.total_slots)  # exactly full is fine
    text = spec.describe()
    assert str(path) in text and "transfer:" in text and "attn[0]" in text and "expert[0]" in text


def test_cpu8_layout():
    spec = load_mesh(MESHES / "cpu-8.yaml")
    assert dataclasses.replace(load_mesh(BASE), source=spec.source) == spec
    assert spec.attention.devices == ((0,), (1,))
    assert spec.experts.devices == ((2,), (3,), (4,), (5,), (6,), (7,))
    assert spec.experts.slots_per_instance == 4 and spec.experts.total_slots == 24
    assert [spec.node_of(d) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert spec.transfer.direct_min_bytes == 4 << 20 and spec.transfer.multicast_min_bytes == 1 << 20
    assert not spec.monolithic and spec.shared_experts == "attention"
    hash(spec)  # frozen and hashable: usable as a cache key


def test_describe_contents():
    text = load_mesh(MESHES / "cpu-8.yaml").describe()
    for needle in [
        "platform cpu: 2 nodes x 4 devices = 8 devices, disaggregated",
        "node 0 (devices 0-3): attention 0-1; experts 0-1",
        "node 1 (devices 4-7): experts 2-5",
        "attention: 2 instances x 1 device",
        "attn[1]: device 1 (node 0)",
        "experts: 6 instances x 1 device",
        "4 slots each = 24 slots",
        "expert[5]: device 7 (node 1)",
        "shared experts run here",
        "transfer: adaptive",
        "<= 2 expert devices (this layout has 6)",
        ">= 4 MiB per attention instance",
        "< 1 MiB per attention node",
    ]:
        assert needle in text, needle
    mono = load_mesh(MESHES / "monolithic.yaml").describe()
    assert "monolithic" in mono and "1 node x 1 device = 1 device" in mono


def test_explicit_devices_and_idle():
    spec = load_mesh(
        {
            **BASE,
            "attention": {"devices": [[4, 5], [0, 1]]},
            "experts": {"instances": 2, "devices_per_instance": 2, "slots_per_instance": 8},
        }
    )
    assert spec.attention.devices == ((4, 5), (0, 1))
    assert spec.experts.devices == ((2, 3), (6, 7))  # count-based side fills the lowest free devices
    spec = load_mesh({**BASE, "experts": {"instances": 4, "slots_per_instance": 4}})
    assert "idle devices 6-7" in spec.describe()


def test_transfer_defaults_and_byte_units():
    spec = load_mesh({k: v for k, v in BASE.items() if k not in ("transfer", "shared_experts")})
    assert spec.transfer.mode == "adaptive" and spec.shared_experts == "attention"
    spec = load_mesh({**BASE, "transfer": {"direct_min_bytes": 1000, "multicast_min_bytes": "64 KiB"}})
    assert spec.transfer.direct_min_bytes == 1000 and spec.transfer.multicast_min_bytes == 64 << 10


def test_build_meshes_cpu8():
    sub = build_meshes(load_mesh(MESHES / "cpu-8.yaml"))
    assert sub.attention.axis_names == ATTN_AXES and sub.attention.devices.shape == (2, 1)
    assert sub.experts.axis_names == EXPERT_AXES and sub.experts.devices.shape == (6, 1)
    assert [d.id for d in sub.attention.devices.flat] == [0, 1]
    assert [d.id for d in sub.experts.devices.flat] == [2, 3, 4, 5, 6, 7]
    assert [sub.node_of(d) for d in jax.devices()] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_build_meshes_monolithic_and_tp():
    sub = build_meshes(load_mesh(MESHES / "monolithic.yaml"))
    assert list(sub.attention.devices.flat) == list(sub.experts.devices.flat) == [jax.devices()[0]]
    spec = load_mesh(
        {
            "platform": "cpu",
            "nodes": 2,
            "devices_per_node": 4,
            "monolithic": True,
            "experts": {"instances": 4, "devices_per_instance": 2, "slots_per_instance": 2},
        }
    )
    sub = build_meshes(spec)
    assert sub.attention.devices.shape == sub.experts.devices.shape == (4, 2)
    assert (sub.attention.devices == sub.experts.devices).all()


@pytest.mark.parametrize("name", REAL)
def test_real_cluster_files_validate_without_devices(name):
    spec = load_mesh(MESHES / name)
    assert spec.num_devices == 16 and spec.platform in ("gpu", "tpu")
    spec.validate_for(128)
    with pytest.raises(MeshConfigError, match=r"(nodes|platform): "):
        build_meshes(spec)  # 8 CPU devices here


def test_too_few_devices_and_wrong_platform():
    with pytest.raises(MeshConfigError, match=r"nodes: .* 16 devices but only 8 jax devices exist"):
        build_meshes(load_mesh({**BASE, "nodes": 4}))
    with pytest.raises(MeshConfigError, match=r"platform: the file says gpu but the jax devices are cpu"):
        build_meshes(load_mesh({**BASE, "platform": "gpu"}))


def test_validate_for_names_slots(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({**BASE, "experts": {"instances": 3, "slots_per_instance": 2}}))
    spec = load_mesh(path)
    spec.validate_for(6)
    with pytest.raises(MeshConfigError) as info:
        spec.validate_for(8)
    assert str(info.value) == f"{path}: experts.slots_per_instance: 2 slots x 3 instances = 6 < 8 experts"


def _with(path, value):
    """BASE with `path` ('a.b') set to value, or deleted when value is DELETE."""
    raw = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return raw


class _Delete:
    """The marker for "remove this key"; its repr keeps test ids equal across processes (pytest-xdist)."""

    def __repr__(self):
        return "DELETE"


DELETE = _Delete()
BAD = [
    # unknown keys
    ("colour", "blue", r"colour: unknown key"),
    ("experts.colour", "blue", r"experts\.colour: unknown key"),
    ("transfer.fastest", True, r"transfer\.fastest: unknown key"),
    # wrong types / values
    ("nodes", "two", r"nodes: expected an integer, got str"),
    ("devices_per_node", True, r"devices_per_node: expected an integer, got bool"),
    ("nodes", 0, r"nodes: must be >= 1"),
    ("platform", "cuda", r"platform: expected one of cpu, gpu, tpu"),
    ("monolithic", "yes", r"monolithic: expected true or false"),
    ("shared_experts", "both", r"shared_experts: expected one of attention, experts"),
    ("attention", 2, r"attention: expected a mapping"),
    ("attention.instances", 0, r"attention\.instances: must be >= 1"),
    ("experts.slots_per_instance", 1.5, r"experts\.slots_per_instance: expected an integer"),
    ("transfer.mode", "fast", r"transfer\.mode: expected one of adaptive, direct, two_phase"),
    ("transfer.direct_min_bytes", "lots", r"transfer\.direct_min_bytes: expected bytes"),
    ("transfer.direct_max_destinations", -1, r"transfer\.direct_max_destinations: must be >= 0"),
    ("experts", {"devices": "2-7", "slots_per_instance": 4}, r"experts\.devices: expected a non-empty list"),
    ("attention", {"devices": [[0], "x"]}, r"attention\.devices\[1\]: expected a device index"),
    # more devices than nodes x devices_per_node
    ("experts.instances", 7, r"experts\.instances: 7 instances x 1 devices = 7 devices but only 6 of the 8"),
    (
        "attention",
        {"devices": [[0], [8]]},
        r"attention\.devices\[1\]: device 8 does not exist: nodes 2 x devices_per_node 4",
    ),
    # overlapping instances
    (
        "attention",
        {"devices": [[0], [0]]},
        r"attention\.devices\[1\]: device 0 is already used by attention instance 0",
    ),
    # shapes
    ("attention", {"devices": [[0], [1, 2]]}, r"attention\.devices: every instance needs the same number of devices"),
    (
        "experts",
        {"devices": [[3, 4]], "slots_per_instance": 4},
        r"experts\.devices\[0\]: instance spans nodes \[0, 1\]",
    ),
    # missing fields
    ("nodes", DELETE, r"nodes: missing"),
    ("platform", DELETE, r"platform: missing"),
    ("attention", DELETE, r"attention: missing"),
    ("experts.slots_per_instance", DELETE, r"experts\.slots_per_instance: missing"),
    ("experts.instances", DELETE, r"experts\.instances: missing \(give instances or devices\)"),
    ("monolithic", True, r"attention: not allowed with monolithic: true"),
]


@pytest.mark.parametrize("path,value,pattern", BAD, ids=[f"{b[0]}={b[1]!r}"[:40] for b in BAD])
def test_bad_field_is_named(path, value, pattern):
    with pytest.raises(MeshConfigError, match=r"^<dict>: " + pattern):
        load_mesh(_with(path, value))


def test_overlap_between_sides_is_named():
    raw = {**BASE, "attention": {"devices": [0, 1]}, "experts": {"devices": [1, 2, 3], "slots_per_instance": 4}}
    with pytest.raises(
        MeshConfigError, match=r"^<dict>: experts\.devices\[0\]: device 1 is already used by attention instance 1"
    ):
        load_mesh(raw)


def test_instances_must_match_explicit_devices():
    raw = _with("attention", {"instances": 3, "devices": [0, 1]})
    with pytest.raises(MeshConfigError, match=r"attention\.instances: 3 does not match devices \(which gives 2\)"):
        load_mesh(raw)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("experts.colour", "blue")))
    with pytest.raises(MeshConfigError, match=rf"^{bad}: experts\.colour: unknown key"):
        load_mesh(bad)
    bad.write_text("nodes: [1,\n")
    with pytest.raises(MeshConfigError, match=r"not valid YAML"):
        load_mesh(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(MeshConfigError, match=r"\(top level\): expected a mapping"):
        load_mesh(bad)
    with pytest.raises(MeshConfigError, match=r"cannot read"):
        load_mesh(tmp_path / "missing.yaml")
