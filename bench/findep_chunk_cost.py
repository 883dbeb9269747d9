"""Is a stage's time linear in its work on the CPU mesh? The FinDEP alpha-beta models assume it.

    PYTHONPATH=. python bench/findep_chunk_cost.py [--rows 4] [--seq 128] [--chunks 1,2,4,8] [--steps 9]

Runs the sequential schedule with the expert side cut into r2 chunks (``Pipeline(1, "PP", r2)``) on
the same prefill batch (the random DeepSeek-V2-style checkpoint of ``bench/findep.py``), in timing
mode (every phase blocked and timed), the r2 values interleaved round by round so that machine load
hits them alike, and prints each phase's time per layer summed over the chunks (median of --steps).
With linear stage models the sums would not fall with r2 (r2 chunks of m tokens cost r2 alpha +
beta m r2): a falling expert sum means the expert program costs less per token in smaller chunks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

PHASES = ("attention", "shared", "a2e", "expert", "e2a", "split", "join")


def main(argv=None) -> int:
    import jax

    from bench.findep import Runner, write_checkpoint
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.runtime.pipeline import Pipeline

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4, help="sequences per attention instance")
    ap.add_argument("--seq", type=int, default=128, help="prefill tokens per sequence")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=9)
    args = ap.parse_args(argv)
    cfg, params, _ = load_model(write_checkpoint(Path(tempfile.mkdtemp()) / "dsv2"), "float32")
    run = Runner(cfg, params, "meshes/cpu-8.yaml", 2 * args.seq, args.rows)
    ex, batch = run.ex, run.batch(args.rows, args.seq)
    pipes = [Pipeline(1, "PP", int(r)) for r in args.chunks.split(",")]
    for p in pipes:  # compile
        ex.pipeline = p
        jax.block_until_ready(ex.forward(*batch))
    ex.timing = True
    moe = list(ex.moe_layers)
    res = {p: {k: [] for k in PHASES} for p in pipes}
    for _ in range(args.steps):
        for p in pipes:
            ex.pipeline = p
            jax.block_until_ready(ex.forward(*batch))
            rec = ex.timings[-1]
            for k in PHASES:
                res[p][k].append(sum(rec[k].get(i, 0.0) for i in moe) / len(moe) * 1e3)
    tokens = args.rows * args.seq * run.ag
    print(
        f"# {tokens} tokens per step ({args.rows} x {args.seq} per attention instance, {run.ag} instances), "
        f"jax {jax.__version__}, median of {args.steps} interleaved steps, load average "
        + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    )
    print("\n| r2 | expert tokens per chunk | " + " | ".join(PHASES) + " |\n|" + "---|" * (len(PHASES) + 2))
    for p in pipes:
        cells = [f"{statistics.median(res[p][k]):.2f}" for k in PHASES]
        print(f"| {p.r2} | {tokens // p.r2} | " + " | ".join(cells) + " |")
    print("\n(ms per MoE layer, summed over the chunks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
