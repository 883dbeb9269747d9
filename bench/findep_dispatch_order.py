"""Is the event model's dispatch order kept? Dispatch and completion times of a pipelined step's programs.

The disaggregated executor dispatches a step in the order of FinDEP's event model
(``findep.schedule.dispatch_order``, attached to every plan by ``findep.online``). This runs prefill
steps on the CPU mesh under a fixed configuration and a profile that makes attention, or the
experts, the bottleneck, with ``record_dispatch`` on (the host time each program was dispatched)
and one watcher thread per program output (the time it was seen ready: an upper bound of its
completion). It reports, per configuration:

* whether the recorded dispatch order equals the event model's (``order == model``);
* the reorderings the old layer-by-layer dispatch could not do, as dispatched and as completed:
  chunk c's E2A before chunk c+1's expert program, and layer t+1's attention of micro-batch 0
  before the last micro-batch's experts of layer t (pairs the model orders that way, and how many
  of them completed in that order too);
* completion inversions: pairs of programs on the same sub-mesh that completed in the opposite
  order to their dispatch by more than 1 ms.

The overlap itself needs separate hardware (an accelerator): on the CPU mesh the 8 devices share
the host's cores.

    PYTHONPATH=. python bench/findep_dispatch_order.py [--model tiny-random] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe import LLM  # noqa: E402
from jaxmoe.engine.model_runner import Row  # noqa: E402
from jaxmoe.findep.online import pipeline_chooser  # noqa: E402
from jaxmoe.findep.paper_profile import paper_profile  # noqa: E402
from jaxmoe.findep.profile import dims_of, mesh_identity, model_identity  # noqa: E402
from jaxmoe.runtime.pipeline import TASKS  # noqa: E402

SIDE = {"attention": "attention", "shared": "attention", "a2e": "experts", "expert": "experts", "e2a": "attention"}


def scaled_profile(llm, stage: str, factor: float):
    spec = llm.engine.executor.sub.spec
    base = paper_profile(dims_of(llm.cfg, spec, 4), mesh_identity(spec), model_identity(llm.cfg), "float32")
    m = getattr(base.stages, stage)
    m = m.model_copy(update={"alpha": m.alpha * factor, "betas": tuple(b * factor for b in m.betas)})
    return base.model_copy(update={"stages": base.stages.model_copy(update={stage: m})})


class Completion:
    """The executor's observer: one thread per program output notes when it is ready."""

    def __init__(self):
        self.ready: list[float | None] = []
        self.threads: list[threading.Thread] = []

    def __call__(self, phase, layer, out) -> None:
        n = len(self.ready)
        self.ready.append(None)
        leaf = jax.tree.leaves(out)[0]  # the first output (the KV cache may be donated meanwhile)

        def watch():
            jax.block_until_ready(leaf)
            self.ready[n] = time.perf_counter()

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> list[float]:
        for t in self.threads:
            t.join(timeout=120)
        return self.ready


def run_case(llm, value, profile, prompts, tables, steps: int) -> dict:
    ex = llm.engine.executor
    ex.pipeline = pipeline_chooser(value, llm.cfg, ex.sub.spec, "float32", 4, profile=profile)
    rows = [Row(p, 0, t) for p, t in zip(prompts, tables)]
    llm.engine.runner.forward(rows)  # compile
    stats = {"steps": steps, "order_is_model": 0, "e2a_before_next_expert": [0, 0, 0], "next_layer_first": [0, 0, 0]}
    inversions = pairs = 0
    for _ in range(steps):
        ex.record_dispatch, done = True, Completion()
        ex.observer = done
        try:
            np.asarray(llm.engine.runner.forward(rows))
        finally:
            ex.record_dispatch, ex.observer = False, None
        ready = done.join()
        log = [(p, i, k, c, t0) for p, i, k, c, t0, _ in ex.last_dispatch]
        ran = ex.last_pipeline
        tasks = [(p, i, k, c) for p, i, k, c, _ in log if p in TASKS]
        model = [t for t in ran.dispatch if t[0] != "shared" or t[1] in ex.shared_layers]
        stats["order_is_model"] += tasks == model
        where = {(p, i, k, c): n for n, (p, i, k, c, _) in enumerate(log) if p in TASKS}

        def count(key, first, second):
            if first in where and second in where:
                a, b = where[first], where[second]
                stats[key][0] += 1
                stats[key][1] += a < b
                stats[key][2] += a < b and ready[a] <= ready[b]

        for t in ex.moe_layers:
            for k in range(ran.r1):
                for c in range(ran.r2 - 1):
                    count("e2a_before_next_expert", ("e2a", t, k, c), ("expert", t, k, c + 1))
            if ran.r1 > 1 and t + 1 < llm.cfg.num_layers:
                count("next_layer_first", ("attention", t + 1, 0, -1), ("expert", t, ran.r1 - 1, 0))
        same = [(n, SIDE[p]) for n, (p, *_rest) in enumerate(log) if p in SIDE]
        for x, (a, sa) in enumerate(same):
            for b, sb in same[x + 1 :]:
                if sa == sb:
                    pairs += 1
                    inversions += ready[b] + 1e-3 < ready[a]
        dispatch_ms = (log[-1][4] - log[0][4]) * 1e3
        stats.setdefault("dispatch_ms", []).append(round(dispatch_ms, 2))
        stats.setdefault("step_ms", []).append(round((max(ready) - log[0][4]) * 1e3, 2))
    stats["pipeline"] = {"order": ran.order, "r1": ran.r1, "r2": ran.r2}
    stats["programs"] = len(log)
    stats["completion_inversions"] = f"{inversions}/{pairs}"
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--mesh", default="meshes/cpu-8.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="prompt tokens per sequence")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", mesh=args.mesh, num_blocks=64, block_size=8, max_num_seqs=8)
    kv = llm.engine.executor.kv_layout
    prompts = [[3 + (7 * i + j) % 200 for j in range(args.tokens)] for i in range(8)]
    blocks, rows = -(-args.tokens // 8), 8 // kv.num_instances  # rows per attention instance
    tables = [
        [int(kv.first_block(np.array([i // rows]))[0]) + (i % rows) * blocks + b for b in range(blocks)]
        for i in range(8)
    ]
    cases = [
        ("ASAS r1=2 r2=2, attention-bound", {"order": "ASAS", "r1": 2, "r2": 2}, ("attention", 50.0)),
        ("ASAS r1=2 r2=4, expert-bound", {"order": "ASAS", "r1": 2, "r2": 4}, ("expert", 50.0)),
        ("AASS r1=2 r2=2, expert-bound", {"order": "AASS", "r1": 2, "r2": 2}, ("expert", 50.0)),
        ("PP r1=2, attention-bound", {"order": "PP", "r1": 2}, ("attention", 50.0)),
    ]
    out = {}
    for name, value, (stage, factor) in cases:
        out[name] = run_case(llm, value, scaled_profile(llm, stage, factor), prompts, tables, args.steps)
        print(name, json.dumps(out[name]), flush=True)


if __name__ == "__main__":
    main()
