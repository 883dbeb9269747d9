"""The mesh-file validator against a recorded snapshot of its behaviour: every shipped file loads into
the same spec (and the same brownout settings), and a grid of single-field mutations (each field
deleted, or set to a value of another type, out of range, empty, ...) is accepted into the same spec
or refused with the same one-line error. ``mesh_file_snapshot.json`` was written from the validator
before it moved onto pydantic and changed on purpose since: a byte size that is not one, e.g.
``true`` or ``-1``, now says "expected bytes" rather than "expected an integer" / "must be >= 0"; the
``brownout:`` section took per-phase ``prefill_threshold`` / ``decode_threshold`` keys.
Regenerate it only for a deliberate change of behaviour::

    python -c "import sys; sys.path.insert(0, 'tests/foundation'); import test_mesh_file_snapshot as t; t.write()"
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from jaxmoe.brownout.config import mesh_brownout
from jaxmoe.mesh import MeshConfigError, load_mesh

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("mesh_file_snapshot.json")
DELETE = "<deleted>"
VALUES = [DELETE, None, "x", "2", -1, 0, 1, 3, 1.5, True, [], {}, [0], [[0, 1]], [[0], [4]], 99, "4KiB", 0.5]
BASES = {  # shipped files whose fields the mutations cover: counts, explicit devices, monolithic, brownout
    "cpu-8": ["platform", "nodes", "devices_per_node", "monolithic", "attention", "experts", "shared_experts"]
    + ["transfer", "brownout", "colour", "attention.instances", "attention.devices_per_instance"]
    + ["attention.devices", "experts.instances", "experts.devices_per_instance", "experts.slots_per_instance"]
    + ["experts.devices", "experts.colour", "transfer.mode", "transfer.direct_max_destinations"]
    + ["transfer.direct_min_bytes", "transfer.multicast_min_bytes", "transfer.colour"],
    "cpu-8-1a7e": ["attention.devices", "experts.devices", "attention.instances", "experts.devices_per_instance"],
    "monolithic": ["monolithic", "attention", "experts.instances", "experts.devices"],
    "cpu-8-brownout": ["brownout", "brownout.threshold", "brownout.salc", "brownout.use_full_brownout"]
    + ["brownout.slo_ttft_ms", "brownout.slo_tpot_ms", "brownout.tw", "brownout.warning_factor"]
    + ["brownout.increment", "brownout.shrink_ratio", "brownout.period", "brownout.colour"],
}


def cases():
    """(name, raw mapping) for every shipped file and every mutation of ``BASES``."""
    for path in sorted((ROOT / "meshes").glob("*.yaml")):
        yield path.stem, yaml.safe_load(path.read_text())
    for base, fields in BASES.items():
        raw = yaml.safe_load((ROOT / "meshes" / f"{base}.yaml").read_text())
        for field in fields:
            for value in VALUES:
                yield f"{base}: {field} = {value!r}", _with(raw, field, value)


def _with(raw, field, value):
    raw = copy.deepcopy(raw)
    *parents, leaf = field.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value == DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = copy.deepcopy(value)
    return raw


def outcome(raw) -> dict:
    """What loading ``raw`` gives: the spec's fields and the brownout settings, or the error line."""
    try:
        spec = load_mesh(raw)
        brownout = mesh_brownout(spec)
    except MeshConfigError as exc:
        return {"error": str(exc)}
    fields = dataclasses.asdict(spec)
    fields.pop("source")
    fields["brownout_settings"] = None if brownout is None else dataclasses.asdict(brownout)
    return json.loads(json.dumps(fields))  # tuples as lists, as in the file


def write() -> None:
    rows = sorted((json.dumps(name), json.dumps(outcome(raw), sort_keys=True)) for name, raw in cases())
    SNAPSHOT.write_text("{\n" + ",\n".join(f"{name}: {value}" for name, value in rows) + "\n}\n")  # a case a line


def test_the_snapshot_covers_every_case():
    names = [name for name, _ in cases()]
    assert len(names) == len(set(names)) and set(names) == set(json.loads(SNAPSHOT.read_text()))
    errors = [v for v in json.loads(SNAPSHOT.read_text()).values() if "error" in v]
    assert len(errors) > 200 and all(e["error"].startswith("<dict>: ") and "\n" not in e["error"] for e in errors)


def test_every_case_behaves_as_recorded():
    want = json.loads(SNAPSHOT.read_text())
    diffs = [(name, want[name], got) for name, raw in cases() if (got := outcome(raw)) != want[name]]
    assert not diffs, "\n".join(f"{n}:\n  recorded {w}\n  now      {g}" for n, w, g in diffs[:20])


@pytest.mark.parametrize("path", sorted((ROOT / "meshes").glob("*.yaml")), ids=lambda p: p.name)
def test_a_shipped_file_loaded_by_path_names_itself(path):
    spec = load_mesh(path)
    assert spec.source == str(path)
    assert dataclasses.replace(spec, source="<dict>") == load_mesh(yaml.safe_load(path.read_text()))


def test_bytes_read_as_pydantic_bytesize():
    raw = yaml.safe_load((ROOT / "meshes" / "cpu-8.yaml").read_text())
    raw["transfer"].update(direct_min_bytes="1.5 MiB", multicast_min_bytes="2KB")
    t = load_mesh(raw).transfer
    assert (t.direct_min_bytes, t.multicast_min_bytes) == (3 << 19, 2000) and type(t.direct_min_bytes) is int


def test_many_mistakes_give_one_line_naming_one_field():
    raw = {"platform": "cuda", "nodes": "2", "experts": {"slots_per_instanc": 4, "devices": "x"}, "colour": 1}
    with pytest.raises(MeshConfigError) as info:
        load_mesh(raw)
    text = str(info.value)  # an unknown key first: a typo also leaves its field missing
    assert "\n" not in text and "pydantic" not in text and "validation error" not in text
    assert (
        text
        == "<dict>: experts.slots_per_instanc: unknown key (expected one of: instances, devices_per_instance, devices, slots_per_instance)"
    )
    with pytest.raises(MeshConfigError, match=r"^<dict>: platform: expected one of cpu, gpu, tpu, got 'cuda'$"):
        load_mesh({k: v for k, v in raw.items() if k != "colour"} | {"experts": {"slots_per_instance": 4}})


@pytest.mark.parametrize(
    "section,line",
    [
        (
            {"transfer": {"direct_min_bytes": "4XB"}},
            "transfer.direct_min_bytes: expected bytes (an integer >= 0 or e.g.",
        ),
        ({"brownout": {"tw": 0}}, "brownout.tw: SALC window must be > 0 seconds, got 0"),
    ],
)
def test_jaxmoe_mesh_show_prints_one_line_naming_file_and_field(tmp_path, capsys, section, line):
    from jaxmoe.cli import main

    raw = yaml.safe_load((ROOT / "meshes" / "cpu-8.yaml").read_text()) | section
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["mesh", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxmoe: error: {path}: {line}") and err.count("\n") == 1


def test_a_key_that_is_not_a_string_is_an_unknown_key():
    raw = yaml.safe_load((ROOT / "meshes" / "cpu-8-brownout.yaml").read_text())
    with pytest.raises(MeshConfigError, match=r"^<dict>: 1: unknown key \(expected one of: platform, nodes,"):
        load_mesh({**raw, 1: "x"})
    with pytest.raises(MeshConfigError, match=r"^<dict>: experts\.2: unknown key \(expected one of: instances,"):
        load_mesh({**raw, "experts": {**raw["experts"], 2: 3}})
    with pytest.raises(MeshConfigError, match=r"^<dict>: brownout\.1: unknown key \(expected one of: salc, threshold,"):
        mesh_brownout({**raw, "brownout": {**raw["brownout"], 1: 2}})
