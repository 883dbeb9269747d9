"""The import layering (docs/architecture.md): every import points down or sideways, never up; and no
module over 400 lines.

kernels <- foundation <- models <- runtime <- engine <- library API <- serving / cli, and the
control plane (placement, controller, planning, scaling) is never imported by the per-step hot path.
Read from the source with ``ast``: every import counts, also those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (installed package name, folder): server/ and pallas_kernels/ install under jaxmoe (setup.py)
PACKAGES = [
    ("jaxmoe.pallas_kernels", ROOT / "pallas_kernels"),
    ("jaxmoe.server", ROOT / "server"),
    ("jaxmoe", ROOT / "jaxmoe"),
]

# the most specific prefix wins
LAYERS = {
    "jaxmoe.pallas_kernels": 0,
    "jaxmoe.config": 1,
    "jaxmoe.mesh": 1,
    "jaxmoe.compilation": 1,
    "jaxmoe.tokenizer": 1,
    "jaxmoe.checkpoint": 1,
    "jaxmoe.brownout.config": 1,
    "jaxmoe.brownout.routing": 4,
    "jaxmoe.kv_layout": 1,
    "jaxmoe.mesh_file": 1,
    "jaxmoe.models": 2,
    "jaxmoe.sampling": 2,
    "jaxmoe.demo": 2,
    "jaxmoe.runtime": 3,
    "jaxmoe.engine": 4,
    "jaxmoe.brownout.salc": 4,
    "jaxmoe.brownout.controller": 4,
    "jaxmoe": 5,
    "jaxmoe.llm": 5,
    "jaxmoe.brownout": 5,
    "jaxmoe.train": 5,
    "jaxmoe.findep": 5,
    "jaxmoe.janus.scaling": 5,
    "jaxmoe.server": 6,
    "jaxmoe.cli": 6,
}
CONTROL_PLANE = ("jaxmoe.janus.placement", "jaxmoe.janus.placement_controller", "jaxmoe.findep", "jaxmoe.janus.scaling")
HOT_PATH = ("jaxmoe.pallas_kernels", "jaxmoe.models", "jaxmoe.sampling", "jaxmoe.runtime", "jaxmoe.engine")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer(module: str) -> int:
    best = max((p for p in LAYERS if _within(module, p)), key=len)
    return LAYERS[best]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES:
        for path in folder.rglob("*.py"):
            if "tests" in path.relative_to(folder).parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.setdefault(".".join([package, *parts]), path)
    return found


def imports(module: str, path: Path, known: dict) -> set[str]:
    """The jaxmoe modules ``module`` imports (``from a import b`` counts as a.b when that is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if _within(m, "jaxmoe") and m != module}


def test_every_module_is_in_a_layer():
    assert "jaxmoe.server.app" in modules() and "jaxmoe.pallas_kernels.aebs.api" in modules()
    for module in modules():
        layer(module)  # raises if no prefix matches


def test_imports_point_down():
    known = modules()
    upward = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, path in known.items()
        for d in imports(m, path, known)
        if layer(d) > layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_hot_path_does_not_import_the_control_plane():
    known = modules()
    hot = [m for m in known if any(_within(m, p) for p in HOT_PATH) and not any(_within(m, c) for c in CONTROL_PLANE)]
    bad = [
        f"{m} imports {d}"
        for m in hot
        for d in imports(m, known[m], known)
        if any(_within(d, c) for c in CONTROL_PLANE)
    ]
    assert not bad, "\n".join(bad)


def test_the_library_never_imports_the_serving_package():
    known = modules()
    bad = [
        m
        for m, path in known.items()
        if not _within(m, "jaxmoe.server")
        and m != "jaxmoe.cli"
        and any(_within(d, "jaxmoe.server") for d in imports(m, path, known))
    ]
    assert not bad, bad


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a runtime module importing the engine is found."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from jaxmoe.engine.engine import LLMEngine\n")
    found = imports("jaxmoe.runtime.bad", path, modules())
    assert "jaxmoe.engine.engine" in found and layer("jaxmoe.engine.engine") > layer("jaxmoe.runtime.bad")


def test_no_module_over_400_lines():
    """Small files with one job (the generated protobuf code aside)."""
    long = {
        m: n for m, path in modules().items() if "_pb2" not in m and (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long
