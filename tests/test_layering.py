"""The import structure (docs/architecture.md): a small core, one package per paper plugged into it, one
assembly, the front ends on top; no import cycles.

core (ops < foundation < models < runtime < engine) <- features (janus, findep, brownout, qllm, train)
<- assembly <- library API (llm, the package face) and the features' drivers (commands, measurement
runs: they build engines) <- serving / cli. Every import points down or
sideways within its layer, never up; a core module never imports a feature package; a feature
imports another feature only where ``FEATURE_EDGES`` says why. Read from the source with ``ast``:
every import counts, also those inside functions.
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

FEATURES = ("jaxmoe.janus", "jaxmoe.findep", "jaxmoe.brownout", "jaxmoe.qllm", "jaxmoe.train")
# the most specific prefix wins
LAYERS = {
    "jaxmoe.pallas_kernels": 0,  # ops
    "jaxmoe.config": 1,  # foundation
    "jaxmoe.mesh": 1,
    "jaxmoe.mesh_file": 1,
    "jaxmoe.mesh_spec": 1,
    "jaxmoe.progress": 1,
    "jaxmoe.options": 1,
    "jaxmoe.quantization": 1,
    "jaxmoe.lazy": 1,
    "jaxmoe.compilation": 1,
    "jaxmoe.tokenizer": 1,
    "jaxmoe.structured_output": 1,
    "jaxmoe.checkpoint": 1,
    "jaxmoe.kv_layout": 1,
    "jaxmoe.demo": 1,
    "jaxmoe.models": 2,
    "jaxmoe.sampling": 2,
    "jaxmoe.runtime": 3,
    "jaxmoe.engine": 4,
    **{feature: 5 for feature in FEATURES},
    "jaxmoe.assembly": 6,
    "jaxmoe": 7,  # the package face (__init__)
    "jaxmoe.llm": 7,
    "jaxmoe.lowering": 7,
    # drivers: a feature's commands and measurement runs, which build engines through the assembly
    "jaxmoe.findep.commands": 7,
    "jaxmoe.janus.scaling.commands": 7,
    "jaxmoe.janus.scaling.fit": 7,
    "jaxmoe.janus.scaling.ablation": 7,
    "jaxmoe.train.commands": 7,
    "jaxmoe.server": 8,
    "jaxmoe.cli": 8,
}
CORE_TOP = 4  # layers 0-4 are the core
# a feature that imports another one, and why
FEATURE_EDGES = {
    (
        "jaxmoe.janus",
        "jaxmoe.findep",
    ): "JANUS's fitted performance model reuses FinDEP's phase timing, fits and profile files",
    ("jaxmoe.brownout", "jaxmoe.train"): "united experts are distilled on the training corpus and model",
    ("jaxmoe.train", "jaxmoe.brownout"): "jaxmoe eval --brownout-threshold and jaxmoe unite are training-side commands",
}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer(module: str) -> int:
    best = max((p for p in LAYERS if _within(module, p)), key=len)
    return LAYERS[best]


def feature(module: str) -> str | None:
    return next((f for f in FEATURES if _within(module, f)), None)


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


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {d for d in imports(m, path, known) if d in known} for m, path in known.items()}


def test_every_module_is_in_a_layer():
    assert "jaxmoe.server.app" in modules() and "jaxmoe.pallas_kernels.aebs.api" in modules()
    for module in modules():
        layer(module)  # raises if no prefix matches


def test_imports_point_down():
    g = graph()
    upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})" for m in g for d in g[m] if layer(d) > layer(m)]
    assert not upward, "\n".join(upward)


def test_the_core_imports_no_feature():
    g = graph()
    bad = [f"{m} imports {d}" for m in g if layer(m) <= CORE_TOP for d in g[m] if feature(d)]
    assert not bad, "\n".join(bad)


def test_features_import_each_other_only_where_declared():
    g = graph()
    bad = [
        f"{m} imports {d}"
        for m in g
        for d in g[m]
        if feature(m) and feature(d) and feature(m) != feature(d) and (feature(m), feature(d)) not in FEATURE_EDGES
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """Tarjan's strongly connected components of the module graph: every one a single module."""
    g = graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_library_never_imports_the_serving_package():
    g = graph()
    bad = [
        m
        for m in g
        if not _within(m, "jaxmoe.server") and m != "jaxmoe.cli"
        for d in g[m]
        if _within(d, "jaxmoe.server")
    ]
    assert not bad, bad


def test_the_checker_sees_an_upward_import_and_a_feature_import(tmp_path):
    """The checker itself: a runtime module importing the engine, or a feature, is found."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from jaxmoe.engine.engine import LLMEngine\n    from jaxmoe.qllm import policy\n")
    found = imports("jaxmoe.runtime.bad", path, modules())
    assert "jaxmoe.engine.engine" in found and layer("jaxmoe.engine.engine") > layer("jaxmoe.runtime.bad")
    assert "jaxmoe.qllm.policy" in found and feature("jaxmoe.qllm.policy") == "jaxmoe.qllm"
