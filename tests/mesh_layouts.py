"""Mesh layouts and transfer inputs shared by the transfer, slot-move and multi-process tests."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

MESHES = Path(__file__).resolve().parents[1] / "meshes"
CPU8 = {"platform": "cpu", "nodes": 2, "devices_per_node": 4}
LAYOUTS = {
    "cpu-8": MESHES / "cpu-8.yaml",  # 2A (node 0) + 6E (2 on node 0, 4 on node 1)
    "4a4e": MESHES / "cpu-8-4a4e.yaml",
    "1a7e": MESHES / "cpu-8-1a7e.yaml",
    "monolithic-1": MESHES / "monolithic.yaml",
    # attention on both nodes, instance order not node order
    "interleaved": {
        **CPU8,
        "attention": {"devices": [4, 0, 5, 1]},
        "experts": {"devices": [2, 3, 6, 7], "slots_per_instance": 4},
    },
    # 2-device (tensor-parallel) instances on both sides
    "tp2": {
        **CPU8,
        "attention": {"devices": [[0, 1], [4, 5]]},
        "experts": {"devices": [[2, 3], [6, 7]], "slots_per_instance": 4},
    },
    "monolithic-8": {**CPU8, "monolithic": True, "experts": {"instances": 8, "slots_per_instance": 2}},
}


def _inputs(spec, sub, rows=2, width=8, seed=0):
    m, n = spec.attention.count, spec.experts.count
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows * m, width), dtype=np.float32)
    y = rng.standard_normal((n, rows * m, width), dtype=np.float32)
    return x, y, jax.device_put(x, sub.batch_sharding), jax.device_put(y, sub.partials_sharding)
