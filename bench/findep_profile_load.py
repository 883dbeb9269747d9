"""Benchmark: how far two FinDEP profiles' stage times move when other processes load the machine.

One executor of a tiny Mixtral on ``meshes/cpu-8.yaml``; its sweep points (micro-batch rows x 16
attended tokens, the sequential schedule) are warmed up, then timed ``--repeats`` rounds quiet and
``--repeats`` rounds with ``--burners`` CPU-burning subprocesses added (bounded by a deadline). Per
stage and statistic, the per-point estimates summed over the sweep, quiet / loaded, and how far
apart they are: ``min`` (the least of the steps' layer means, the profile's estimate until
2026-12-08), ``layer-min`` (the mean over layers of each layer's least time, ``measure.phase_time``,
what ``jaxmoe profile`` uses now), ``median``.

Run (from the repository root):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python bench/findep_profile_load.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

STAGES = ("attention", "a2e", "expert", "e2a")
BURN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()

    from tiny_checkpoints import make_checkpoint

    from jaxmoe.assembly import RuntimeConfig, build_engine
    from jaxmoe.engine.config import EngineConfig
    from jaxmoe.findep.measure import phase_per_layer, phase_time, synthetic_batch, timed_step, warm_up
    from jaxmoe.runtime.pipeline import Pipeline

    ckpt = make_checkpoint("mixtral", os.path.join(tempfile.mkdtemp(), "mixtral"))
    config = RuntimeConfig(model=str(ckpt), dtype="float32", mesh="meshes/cpu-8.yaml", engine=EngineConfig(8, 16))
    ex = build_engine(config).executor
    moe = list(ex.moe_layers)
    ex.pipeline = Pipeline(1, "PP", 1)
    points = [synthetic_batch(ex, int(r), 16) for r in args.rows.split(",")]
    for p in points:
        warm_up(ex, p)

    def rounds() -> list[list[dict]]:
        records = [[] for _ in points]
        ex.timing = True
        try:
            for _ in range(args.repeats):
                for p, recs in zip(points, records):
                    recs.append(timed_step(ex, p))
        finally:
            ex.timing = False
        return records

    quiet_load = os.getloadavg()
    quiet = rounds()
    burners = [subprocess.Popen([sys.executable, "-c", BURN.format(s=600)]) for _ in range(args.burners)]
    time.sleep(1)
    try:
        loaded_load = os.getloadavg()
        loaded = rounds()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"quiet at load {quiet_load}, loaded ({args.burners} burners) at load {loaded_load}")
    stats = {
        "min": lambda r, s: phase_per_layer(r, s, moe, min),
        "layer-min": lambda r, s: phase_time(r, s, moe, min),
        "median": lambda r, s: phase_per_layer(r, s, moe, statistics.median),
    }
    for name, f in stats.items():
        row = []
        for s in STAGES:
            a, b = sum(f(r, s) for r in quiet), sum(f(r, s) for r in loaded)
            row.append(f"{s} {a * 1e3:.2f}/{b * 1e3:.2f} ms {abs(a - b) / min(a, b) * 100:.1f} %")
        print(f"{name:10s} " + " | ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
