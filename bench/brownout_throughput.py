"""Benchmark: decode throughput and activated experts per step under brownout (BrownoutServe,
arXiv:2507.17133) on the trained demo model, at (ways k, threshold) = original, (2, 0), (4, 0.2),
(8, 0.4), side by side in one process.

Each configuration is one ``LLM``: the original ``LLM("demo")``, or ``LLM(ROOT/demo-uK-GROUPING,
brownout=BrownoutConfig(threshold))`` (united experts made by ``jaxmoe unite``, e.g. by
``bench/brownout_quality.py``), once with the monolithic executor and, with ``--mesh``, once with
the disaggregated one (``meshes/cpu-8.yaml``: 2 attention + 6 expert instances with replicas and
AEBS). Workload: ``--batch`` held-out prompts of ``--prompt-len`` tokens, greedy, ignore_eos.

* decode tokens/s = batch x (N - 1) / (time of a generation of N tokens - time of one of 1 token)
  (the prefill and first token cancel out), N = ``--new-tokens``; the configurations run in turn,
  ``--repeats`` rounds, the median per configuration (load from other jobs hits all alike);
* activated experts per step: distinct experts (original + united) the decode steps read, summed
  over the MoE layers, counted by the disaggregated executor's expert program
  (``activated_experts()``) in an untimed run; the original model reads at most 8 per layer.

Run (from the repository root; needs the united-expert directories):
  PYTHONPATH=. .venv/bin/python bench/brownout_throughput.py --root RUNS --mesh meshes/cpu-8.yaml
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = [(None, None), (2, 0.0), (4, 0.2), (8, 0.4)]


def make(root: str, ways, threshold, mesh, grouping: str):
    from jaxmoe import LLM, BrownoutConfig

    kw = dict(dtype="float32", num_blocks=128, block_size=16, max_num_seqs=16, **({"mesh": mesh} if mesh else {}))
    if ways is None:
        return LLM("demo", **kw)
    return LLM(f"{root}/demo-u{ways}-{grouping}", brownout=BrownoutConfig(threshold), **kw)


def timed(llm, prompts, n: int) -> float:
    from jaxmoe import SamplingParams

    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t0


def activated_per_decode_step(llm, prompts, n: int) -> float:
    from jaxmoe import SamplingParams

    seen = []

    class Count:  # a step hook: the distinct experts each step read
        def before_step(self, engine):
            pass

        def after_step(self, engine, outputs):
            if engine.last_step_ran:
                seen.append(sum(o + u for o, u in engine.executor.activated_experts().values()))

    hook = llm.engine.add_hook(Count())
    try:
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        llm.engine.hooks.remove(hook)
    return statistics.mean(seen[1:])  # the first step is the prefill


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/brownout")
    ap.add_argument("--grouping", default="index")
    ap.add_argument("--mesh", default=None, help="also run the disaggregated executor on this mesh file")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax

    from bench.brownout_quality import heldout_prompts

    prompts = heldout_prompts(args.batch, args.prompt_len, 0)
    executors = [None] + ([args.mesh] if args.mesh else [])
    llms = {(c, m): make(args.root, *c, m, args.grouping) for m in executors for c in CONFIGS}
    for llm in llms.values():  # compile every program the timed runs use
        timed(llm, prompts, 1), timed(llm, prompts, args.new_tokens)
    rates = {key: [] for key in llms}
    load = os.getloadavg()[0]
    for _ in range(args.repeats):
        for key, llm in llms.items():
            t1, tn = timed(llm, prompts, 1), timed(llm, prompts, args.new_tokens)
            rates[key].append(args.batch * (args.new_tokens - 1) / (tn - t1))
    used = {c: activated_per_decode_step(llms[c, args.mesh], prompts, 8) for c in CONFIGS} if args.mesh else {}
    print(
        f"\njax {jax.__version__}, batch {args.batch}, {args.new_tokens} new tokens, {args.repeats} rounds, "
        f"grouping {args.grouping}; load average {load:.2f} -> {os.getloadavg()[0]:.2f}\n"
    )
    head = "| (ways, threshold) | monolithic decode tok/s | vs original |"
    if args.mesh:
        moe = llms[CONFIGS[0], None].cfg.num_moe_layers
        head += (
            f" disaggregated ({args.mesh}) tok/s | vs original | activated experts / decode step ({moe} MoE layers) |"
        )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    base = {m: statistics.median(rates[CONFIGS[0], m]) for m in executors}
    for c in CONFIGS:
        name = "original" if c[0] is None else f"({c[0]}, {c[1]})"
        r = statistics.median(rates[c, None])
        line = f"| {name} | {r:.1f} | {r / base[None]:.2f}x |"
        if args.mesh:
            d = statistics.median(rates[c, args.mesh])
            line += f" {d:.1f} | {d / base[args.mesh]:.2f}x | {used[c]:.1f} |"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
