"""Serving load benchmark: QLLM vs FCFS scheduling under Poisson load with 20% LS requests.

How it drives the engine: in-process, through ``AsyncEngine`` (the same path the gRPC/HTTP
servers use, minus the network), with an asyncio client per request. Every (policy, rate) run
uses a fresh ``LLMEngine`` over ONE shared executor, so the compiled programs are reused.

Workload (the same seeded requests for every policy at a given rate):

* arrivals: Poisson process (exponential gaps) at ``rate`` requests/s;
* 20% of requests are latency-sensitive (LS), picked at random, as in the QLLM paper (qllm.txt);
* prompt and output lengths: lognormal, a ShareGPT-like long-tailed shape scaled down to fit
  a small CPU run: prompt median 48 tokens (sigma 0.8, clipped to [8, 192]), output median 24
  tokens (sigma 0.7, clipped to [4, 64]); outputs are forced to that length (``ignore_eos``);
* prompts are random printable bytes (the demo model's tokenizer is byte-level), greedy decoding.

Measured per request at the client: TTFT = first token - submission, TPOT = (last - first) /
(tokens - 1). Reported per class: P50/P90/P99 of both, plus throughput (output tokens/s and
finished requests/s over the run's makespan) and preemptions.

Engine geometry: 512-token KV blocks (one per sequence, so the block-table width never changes),
max_num_seqs 8, max_batch_tokens 64 (chunked prefill). Before measuring, every (rows, tokens)
bucket is compiled; ``new shapes`` in the table counts step shapes first seen during a measured
run (each would be a compile, i.e. a latency spike) and should be 0.

Run (CPU, demo model, ~4 minutes on 2 cores):
  python bench/serve_load.py                             # rates 1.5,3,6 req/s, 48 requests each
  python bench/serve_load.py --out /tmp/serving.md      # also write the markdown table
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import numpy as np

from jaxmoe.engine.async_engine import AsyncEngine
from jaxmoe.engine.engine import EngineConfig, LLMEngine
from jaxmoe.engine.buckets import bucket as _bucket
from jaxmoe.engine.model_runner import Row
from jaxmoe.sampling import SamplingParams
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.assembly import RuntimeConfig, build_executor
from jaxmoe.checkpoint.model import load_model


@dataclasses.dataclass
class Req:
    arrival: float
    prompt: list[int]
    max_tokens: int
    priority: str


@dataclasses.dataclass
class Result:
    priority: str
    ttft: float | None
    tpot: float | None
    tokens: int
    end: float
    rejected: bool = False


def make_workload(args, rate: float) -> list[Req]:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    plen = np.clip(rng.lognormal(np.log(args.prompt_median), args.prompt_sigma, n), 8, args.prompt_max).astype(int)
    olen = np.clip(rng.lognormal(np.log(args.output_median), args.output_sigma, n), 4, args.output_max).astype(int)
    ls = rng.random(n) < args.ls_fraction
    return [
        Req(float(a), [256] + rng.integers(32, 127, p - 1).tolist(), int(o), "ls" if l else "be")
        for a, p, o, l in zip(arrivals, plen, olen, ls)
    ]


async def _one(ae: AsyncEngine, req: Req, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
    submit = time.monotonic()
    try:
        stream = await ae.add_async(
            req.prompt, SamplingParams(max_tokens=req.max_tokens, ignore_eos=True), req.priority
        )
    except OverloadedError:
        return Result(req.priority, None, None, 0, time.monotonic(), rejected=True)
    first = last = None
    n = 0
    async for out in stream:
        if out.delta_token_ids:
            last = time.monotonic()
            first = first or last
            n = len(out.token_ids)
    tpot = (last - first) / (n - 1) if n > 1 else None
    return Result(req.priority, first - submit if first else None, tpot, n, time.monotonic())


async def _drive(ae: AsyncEngine, workload: list[Req]) -> tuple[list[Result], float]:
    t0 = time.monotonic()
    results = await asyncio.gather(*(_one(ae, r, t0) for r in workload))
    return results, max(r.end for r in results) - t0


def run(cfg, executor, tokenizer, econf: EngineConfig, workload: list[Req]) -> dict:
    engine = LLMEngine(cfg, executor, tokenizer, econf)
    ae = AsyncEngine(engine).start()
    try:
        results, makespan = asyncio.run(_drive(ae, workload))
        preempt = ae.call(lambda e: {k: dict(v) for k, v in e.scheduler.preemptions.items()})
    finally:
        ae.shutdown(abort_inflight=True)
    done = [r for r in results if not r.rejected]
    row = {
        "makespan": makespan,
        "tok_s": sum(r.tokens for r in done) / makespan,
        "req_s": len(done) / makespan,
        "rejected": len(results) - len(done),
        "preempt": preempt,
    }
    for cls in ("ls", "be"):
        mine = [r for r in done if r.priority == cls]
        row[cls] = {
            "n": len(mine),
            "ttft": _pcts([r.ttft for r in mine if r.ttft is not None]),
            "tpot": _pcts([r.tpot for r in mine if r.tpot is not None]),
        }
    return row


def _pcts(xs) -> tuple[float, float, float]:
    if not xs:
        return (float("nan"),) * 3
    return tuple(float(v) for v in np.percentile(xs, [50, 90, 99]))


def _ms(p) -> str:
    return "/".join(f"{v * 1000:.0f}" for v in p)


def precompile(engine: LLMEngine) -> int:
    """Compile every (rows, tokens per row) bucket a run can hit, by running dummy rows through the
    model runner (KV written to block 0, which no request owns yet). With one block per sequence
    (block_size >= max_model_len) the block-table width is always 1, so this grid is complete."""
    c = engine.config
    sp = SamplingParams(max_tokens=1)
    sizes = [1 << i for i in range(_bucket(c.max_num_seqs).bit_length())]
    lens = [1 << i for i in range(_bucket(c.max_batch_tokens).bit_length())]
    for b in sizes:
        for t in lens:
            engine.runner.run([Row([1] * t, 0, [0], sp) for _ in range(b)])
    return len(sizes) * len(lens)


def track_shapes(executor) -> set:
    """Record the shape of every step the executor runs (to count compiles during a run)."""
    seen: set = set()
    for name in ("forward",):
        method = getattr(executor, name, None)
        if method is None:
            continue

        def recording(tokens, batch, logits_index, *args, _method=method, _name=name, **kwargs):
            seen.add((_name, np.shape(tokens), np.shape(batch.block_tables), logits_index is None))
            return _method(tokens, batch, logits_index, *args, **kwargs)

        setattr(executor, name, recording)
    return seen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--rates", default="1.5,3,6", help="request rates (req/s), comma separated")
    p.add_argument("--policies", default="qllm,fcfs")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--ls-fraction", type=float, default=0.2)
    p.add_argument("--prompt-median", type=float, default=48)
    p.add_argument("--prompt-sigma", type=float, default=0.8)
    p.add_argument("--prompt-max", type=int, default=192)
    p.add_argument("--output-median", type=float, default=24)
    p.add_argument("--output-sigma", type=float, default=0.7)
    p.add_argument("--output-max", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=512, help="one block per sequence: few shapes to compile")
    p.add_argument("--num-blocks", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")

    t_start = time.monotonic()
    cfg, params, tokenizer = load_model(args.model)
    base = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        max_waiting=100_000,
        max_model_len=args.max_model_len,
    )
    executor = build_executor(cfg, params, RuntimeConfig(engine=base))
    shapes = track_shapes(executor)
    n = precompile(LLMEngine(cfg, executor, tokenizer, base))
    print(f"compiled {n} step shapes in {time.monotonic() - t_start:.1f}s", flush=True)

    rows = []
    for rate in rates:
        workload = make_workload(args, rate)
        for policy in policies:
            before = len(shapes)
            row = run(cfg, executor, tokenizer, dataclasses.replace(base, policy=policy), workload)
            row.update(rate=rate, policy=policy, new_shapes=len(shapes) - before)
            rows.append(row)
            print(
                f"rate {rate:g} {policy}: {row['tok_s']:.0f} tok/s, LS TTFT p50/p90/p99 {_ms(row['ls']['ttft'])} ms, "
                f"BE TTFT {_ms(row['be']['ttft'])} ms ({row['makespan']:.1f}s)",
                flush=True,
            )

    table = render(rows, args, time.monotonic() - t_start)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


def render(rows, args, total_s: float) -> str:
    lines = [
        f"{args.num_requests} requests per run, {args.ls_fraction:.0%} LS, max_num_seqs={args.max_num_seqs}, "
        f"max_batch_tokens={args.max_batch_tokens}; total bench time {total_s:.0f}s. TTFT/TPOT in ms as P50/P90/P99.",
        "",
        "| rate (req/s) | policy | tok/s | req/s | LS n | LS TTFT | LS TPOT | BE n | BE TTFT | BE TPOT "
        "| preempt keep-KV (LS/BE) | preempt recompute (LS/BE) | new shapes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pk, pr = r["preempt"]["keep_kv"], r["preempt"]["recompute"]
        lines.append(
            f"| {r['rate']:g} | {r['policy']} | {r['tok_s']:.0f} | {r['req_s']:.2f} | {r['ls']['n']} "
            f"| {_ms(r['ls']['ttft'])} | {_ms(r['ls']['tpot'])} | {r['be']['n']} | {_ms(r['be']['ttft'])} "
            f"| {_ms(r['be']['tpot'])} | {pk['ls']}/{pk['be']} | {pr['ls']}/{pr['be']} | {r['new_shapes']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
