"""Re-placement cost: ``relayout_layer`` by ``jax.device_put`` vs by ``slot_moves`` collectives.

One process, 8 host CPU devices, meshes/cpu-8-1a7e.yaml (7 expert instances x 4 slots), one MoE
layer of E=8 experts [D, F] float32. For each placement change (default -> FORCED -> SPLIT ->
SWAPPED, the placements of the 2-process test) it times both paths: the first collective call
(compiles the round structure) and the median of warm repeats. The collective path is what runs when
the expert side spans processes; here both run in one process, so the ratio is the collective
mechanism's overhead on the same copies, not a network measurement.

    PYTHONPATH=. python bench/slot_moves.py [--hidden 256 --ffn 512 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe.mesh import build_meshes, load_mesh  # noqa: E402
from jaxmoe.runtime.expert_program import place_layer, relayout_layer  # noqa: E402
from jaxmoe.runtime.replicas import ReplicaLayout, default_placement  # noqa: E402
from tests.multiprocess_worker import FORCED_1A7E, SPLIT_1A7E, SWAPPED_1A7E  # noqa: E402

E = 8


def _timed(fn) -> float:
    t = time.perf_counter()
    out, _ = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    spec = load_mesh("meshes/cpu-8-1a7e.yaml")
    sub = build_meshes(spec)
    N, C = spec.experts.count, spec.experts.slots_per_instance
    rng = np.random.default_rng(0)
    D, F = args.hidden, args.ffn
    layer = {
        "moe": {
            "router": rng.standard_normal((D, E), dtype=np.float32),
            "w_gate": rng.standard_normal((E, D, F), dtype=np.float32),
            "w_up": rng.standard_normal((E, D, F), dtype=np.float32),
            "w_down": rng.standard_normal((E, F, D), dtype=np.float32),
        }
    }
    placements = [default_placement(E, N, C), FORCED_1A7E, SPLIT_1A7E, SWAPPED_1A7E]
    layouts = [ReplicaLayout(tuple(p), E, N, C) for p in placements]
    rows = []
    for name, old, new in zip(("forced", "split", "swapped"), layouts, layouts[1:]):
        placed = place_layer(layer, old, sub, False)
        first = _timed(lambda: relayout_layer(placed, old, new, sub, collective=True))
        coll = [_timed(lambda: relayout_layer(placed, old, new, sub, collective=True)) for _ in range(args.repeats)]
        dput = [_timed(lambda: relayout_layer(placed, old, new, sub, collective=False)) for _ in range(args.repeats)]
        _, moved = relayout_layer(placed, old, new, sub)
        row = {
            "change": name,
            "slots_moved": moved,
            "mib_moved": moved * 3 * D * F * 4 / 2**20,
            "collective_first_s": round(first, 4),
            "collective_warm_s": round(statistics.median(coll), 4),
            "device_put_s": round(statistics.median(dput), 4),
        }
        row["collective_over_device_put"] = round(row["collective_warm_s"] / row["device_put_s"], 2)
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
