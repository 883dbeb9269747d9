"""The mesh-file modules do not depend on feature packages: the ``brownout:`` section is handed
over as written (``ClusterSpec.brownout``) and validated by ``jaxmoe.brownout.config.mesh_brownout``."""

from __future__ import annotations

import pytest

import ast
from pathlib import Path

import jaxmoe


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.slow
def test_mesh_modules_do_not_import_brownout():
    root = Path(jaxmoe.__file__).parent
    for name in ("mesh.py", "mesh_file.py"):
        bad = {m for m in _imports(root / name) if m.startswith("jaxmoe.brownout")}
        assert not bad, f"{name} imports {bad}"
