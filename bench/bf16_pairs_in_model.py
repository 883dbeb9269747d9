"""bfloat16 expert panels in pairs of rows (the AVX512-BF16 dot's layout) against plain panels, in the
model: two ``LLM``s of one checkpoint in one process, one stored each way, the same model-runner
step (a decode batch or a prefill chunk) timed on each in turn (noise between processes on a shared
machine is larger than the difference).

    PYTHONPATH=. python bench/bf16_pairs_in_model.py --ckpt /tmp/jaxmoe-bench-107m --batch 1 --tokens 256
    PYTHONPATH=. python bench/bf16_pairs_in_model.py --ckpt /tmp/jaxmoe-bench-107m --batch 16 --context 100
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import Row
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="tiny-random", help="a checkpoint directory or a built-in model")
    ap.add_argument("--batch", type=int, default=1, help="rows of the step")
    ap.add_argument("--context", type=int, default=100, help="tokens already in each row's cache")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per row (1: decode; more: a prefill chunk)")
    ap.add_argument("--alternations", type=int, default=6)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per turn (default 20 decode, 5 prefill)")
    args = ap.parse_args(argv)
    if not cpu_kernel.has_bf16_dot():
        print("note: this CPU has no AVX512-BF16; pairs are widened in the kernel's tile")
    rng = random.Random(0)
    blocks = (args.context + args.tokens) // 16 + 1
    rows = [
        Row(
            [rng.randrange(3, 250) for _ in range(args.tokens)],
            args.context,
            list(range(i * blocks, (i + 1) * blocks)),
            SamplingParams(),
        )
        for i in range(args.batch)
    ]
    found, runners = cpu_kernel.has_bf16_dot, {}
    try:
        for name, pairs in (("pairs", True), ("panels", False)):
            cpu_kernel.has_bf16_dot = lambda pairs=pairs: pairs
            llm = LLM(args.ckpt, dtype="bfloat16", block_size=16, num_blocks=max(64, args.batch * blocks))
            for _ in range(3):  # compile and warm
                llm.engine.runner.run(rows)
            runners[name] = llm.engine.runner
    finally:
        cpu_kernel.has_bf16_dot = found
    steps = args.steps or (20 if args.tokens == 1 else 5)
    ms = {name: [] for name in runners}
    for turn in range(args.alternations):
        for name in runners if turn % 2 == 0 else reversed(list(runners)):
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                runners[name].run(rows)
                times.append(time.perf_counter() - t)
            ms[name].append(statistics.median(times) * 1e3)
    a, b = statistics.median(ms["pairs"]), statistics.median(ms["panels"])
    print(
        f"bf16, batch {args.batch}, context {args.context}, {args.tokens} new token(s) per row: pairs {a:.2f} ms, "
        f"panels {b:.2f} ms, pairs {b / a:.3f}x; per turn: "
        + "; ".join(f"{n} {', '.join(f'{v:.2f}' for v in vs)}" for n, vs in ms.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
