"""Prefix caching benchmark: TTFT with automatic prefix caching on vs off, on two workloads.

How it drives the engine: in-process, through ``AsyncEngine`` (the path the HTTP/gRPC servers use,
minus the network), one asyncio client per request, TTFT measured at the client (first streamed
token - submission). Both modes run on one executor (compiled programs shared); every mode gets a
fresh ``LLMEngine`` (an empty cache), warmed on every step shape before the clock starts.

Workloads (seeded; token ids drawn uniformly from the vocabulary; greedy, ``ignore_eos``):

* ``shared``: a shared 1024-token system prompt + a 64-token question per request, 128 new tokens,
  ``--requests`` requests arriving every ``--gap`` seconds (open loop);
* ``chat``: ``--conversations`` multi-turn chats run side by side, ``--turns`` turns each; turn i's
  prompt is a 256-token system prompt + the earlier turns (48-token user messages and the 32-token
  answers the model gave) + a new 48-token user message; a chat sends its next turn when the
  previous answer is complete.

Reported per workload and mode: TTFT P50 / P90, the prompt tokens read from the cache, output
tokens/s over the run, and the P50 TTFT ratio off / on. The same shared workload served over HTTP by
``jaxmoe serve`` and by vLLM, both with prefix caching: ``bench/prefix_cache_vs_vllm.py``.

``--modes "caching on,no in-flight sharing"`` measures what sharing a prefix still being computed
brings: the second mode lets no request wait for blocks a running prefill computes
(``max_prefix_wait_steps = 0``), so requests arriving during the first prefill compute the prefix again.

``--deterministic`` also runs the ``shared`` workload in deterministic (batch-invariant) mode to
measure its throughput cost (``EngineConfig.deterministic``; ``--deterministic-impl dense`` for its
fixed-shape form).

Run (CPU, demo model, a few minutes on 2 cores):
  python bench/prefix_cache.py --out bench/results/prefix-cache.md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import numpy as np

from jaxmoe.engine.async_engine import AsyncEngine
from jaxmoe.engine.engine import EngineConfig, LLMEngine
from jaxmoe.assembly import RuntimeConfig, build_executor
from jaxmoe.checkpoint.model import load_model
from jaxmoe.sampling import SamplingParams


@dataclasses.dataclass
class Run:
    workload: str
    mode: str
    ttfts: list[float]
    cached: int
    prompt_tokens: int
    out_tokens: int
    seconds: float

    def p(self, q: float) -> float:
        return float(np.percentile(self.ttfts, q))


def make_engine(cfg, executor, tok, base: EngineConfig, **over) -> LLMEngine:
    config = dataclasses.replace(base, **over)
    if config.deterministic:  # its own executor: the batch-invariant kernels (EngineConfig.deterministic)
        executor = build_executor(cfg, executor.params, RuntimeConfig(engine=config))
    engine = LLMEngine(cfg, executor, tok, config)
    for rows, tokens in engine.runner.plan.shapes():
        engine.runner.warm(rows, tokens)
    return engine


async def one(ae, prompt, max_tokens) -> tuple[float, object]:
    t0 = time.perf_counter()
    stream = await ae.add_async(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, last = None, None
    async for out in stream:
        if ttft is None and out.token_ids:
            ttft = time.perf_counter() - t0
        last = out
    return ttft, last


async def shared_workload(ae, rng, vocab, n: int, gap: float):
    system = rng.integers(10, vocab, 1024).tolist()
    prompts = [system + rng.integers(10, vocab, 64).tolist() for _ in range(n)]

    async def later(i, p):
        await asyncio.sleep(i * gap)
        return await one(ae, p, 128)

    return await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))


async def chat_workload(ae, rng, vocab, conversations: int, turns: int):
    async def chat(c):
        await asyncio.sleep(0.3 * c)
        history = rng.integers(10, vocab, 256).tolist()
        results = []
        for _ in range(turns):
            history = history + rng.integers(10, vocab, 48).tolist()
            ttft, out = await one(ae, history, 32)
            results.append((ttft, out))
            history = history + list(out.token_ids)
        return results

    per_chat = await asyncio.gather(*(chat(c) for c in range(conversations)))
    return [r for rs in per_chat for r in rs]


def run(engine, workload: str, mode: str, args, vocab) -> Run:
    rng = np.random.default_rng(args.seed)
    ae = AsyncEngine(engine).start()
    try:
        t0 = time.perf_counter()
        if workload == "shared":
            res = asyncio.run(shared_workload(ae, rng, vocab, args.requests, args.gap))
        else:
            res = asyncio.run(chat_workload(ae, rng, vocab, args.conversations, args.turns))
        seconds = time.perf_counter() - t0
    finally:
        ae.shutdown()
    outs = [o for _, o in res]
    return Run(
        workload,
        mode,
        [t for t, _ in res],
        sum(o.num_cached_tokens for o in outs),
        sum(len(o.prompt_token_ids) for o in outs),
        sum(len(o.token_ids) for o in outs),
        seconds,
    )


def table(runs: list[Run]) -> str:
    lines = [
        "| workload | mode | requests | TTFT P50 (s) | TTFT P90 (s) | cached / prompt tokens | output tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.workload} | {r.mode} | {len(r.ttfts)} | {r.p(50):.3f} | {r.p(90):.3f} | "
            f"{r.cached} / {r.prompt_tokens} | {r.out_tokens / r.seconds:.1f} |"
        )
    by = {(r.workload, r.mode): r for r in runs}
    for w in ("shared", "chat"):
        if (w, "caching off") in by and (w, "caching on") in by:
            ratio = by[w, "caching off"].p(50) / by[w, "caching on"].p(50)
            lines.append(f"\n{w}: TTFT P50 caching off / on = **{ratio:.2f}x**")
        if (w, "no in-flight sharing") in by and (w, "caching on") in by:
            ratio = by[w, "no in-flight sharing"].p(50) / by[w, "caching on"].p(50)
            lines.append(f"\n{w}: TTFT P50 without / with in-flight sharing = **{ratio:.2f}x**")
    if ("shared", "deterministic") in by:
        on, det = by["shared", "caching on"], by["shared", "deterministic"]
        cost = 1 - (det.out_tokens / det.seconds) / (on.out_tokens / on.seconds)
        lines.append(f"\ndeterministic mode throughput cost (shared workload, caching on): **{100 * cost:.1f} %**")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between arrivals (shared workload)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="shared,chat")
    ap.add_argument(
        "--max-batch-tokens",
        type=int,
        default=512,
        help="tokens per step (512: one prefill chunk, so a second prompt never starts beside the first)",
    )
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--deterministic-impl", default="auto", help="auto (the CPU kernels where they run) or dense")
    ap.add_argument(
        "--modes",
        default="caching off,caching on",
        help="comma-separated: caching off, caching on, no in-flight sharing (caching on, but a request does "
        "not wait for a prefix a running prefill is computing: computes it again)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cfg, params, tok = load_model(args.model)
    base = EngineConfig(
        block_size=16, num_blocks=1024, max_num_seqs=8, max_batch_tokens=args.max_batch_tokens, max_prefill_chunk=512
    )
    executor = build_executor(cfg, params, RuntimeConfig(engine=base))
    known = {
        "caching off": dict(prefix_caching=False),
        "caching on": dict(prefix_caching=True),
        "no in-flight sharing": dict(prefix_caching=True),  # caching on, nobody waits for a prefix in flight
    }
    modes = [(m, known[m]) for m in args.modes.split(",")]
    if args.deterministic:
        det = dict(prefix_caching=True, deterministic=True, expert_impl=args.deterministic_impl)
        modes.append(("deterministic", det))
    runs = []
    for workload in args.workloads.split(","):
        for mode, over in modes:
            if mode == "deterministic" and workload != "shared":
                continue
            engine = make_engine(cfg, executor, tok, base, **over)
            if mode == "no in-flight sharing":
                engine.scheduler.max_prefix_wait_steps = 0
            r = run(engine, workload, mode, args, cfg.vocab_size)
            print(f"{workload:7s} {mode:13s} TTFT P50 {r.p(50):.3f}s P90 {r.p(90):.3f}s cached {r.cached}", flush=True)
            runs.append(r)
    text = table(runs)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
