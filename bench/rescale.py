"""Live re-scaling (JANUS 3.4): the stall a layout change causes while serving, vs a normal step.

Setting: the ``tiny-random`` model (Mixtral-shaped: 4 layers, 8 experts, top-2, hidden 256; fp32) on
the 8 host CPU devices of ``meshes/cpu-8.yaml`` (2 attention + 6 expert instances x 4 slots),
``--concurrency`` requests kept in flight (prefill chunks of at most 64 tokens; prompts of 8-60 tokens, 24-64 greedy output tokens; a
finished one is replaced at once). The layout changes ``--changes`` (default 2a6e -> 4a4e -> 1a7e ->
2a6e) with ``LLMEngine.rescale``: the new layout is built and compiled in a background thread while
the old one serves, then swapped in at a step boundary. Reported per change:

  build_s          background build: new executor, expert re-shard, every step program compiled
                   (or loaded from jaxmoe's persistent compilation cache, ~/.cache/jaxmoe/xla, when
                   an earlier run compiled it: the column after says how many of each;
                   JAXMOE_COMPILATION_CACHE=off compiles all); what a stop-the-world change would stall for (the SGLang anchor of the issue:
                   ~1 s + ~20 ms per layer for an expert rebalance);
  swap_s           at the step boundary: KV blocks of live sequences copied, executor swapped;
  first step       its program calls: decode only, or with a prefill chunk (which takes several
                   times a decode-only step on any layout, rescale or not);
  swap step        swap_s + the first step on the new layout, against (a) the median of all steps
                   before the change, (b) the engine's ``stall_ratio``: the steps before with the
                   same program calls (tokens per row of each call), (c) the steps after the swap
                   (``--after-steps``) with the same program calls, i.e. the same work on the new
                   layout once it runs -- the stall the change itself caused;
  worst after      the largest of the first 5 steps after the swap over the median of the steps
                   after with the same program calls;
  noise            the slowest of the ordinary steps after the swap (2nd to last) over the median of
                   its like steps: how far a step strays with no layout change on this host;
  during build     median and max step while the build ran (it competes for the CPU cores and the
                   GIL; the build thread runs at ``--build-nice``, the GIL switch interval is
                   ``--build-switch-interval`` while it runs);
  KV blocks moved, expert slots kept on their device (no copy) vs copied, bytes copied.

Run:  PYTHONPATH=. python bench/rescale.py [--concurrency 8] [--changes 4a4e,1a7e,2a6e] [--build-nice 10]
      [--build-switch-interval 0.0005] [--model /tmp/jaxmoe-bench-107m --no-initial-warmup] [--full-warmup] [--idle]

A build compiles the shapes the live requests need now (``ShapePlan.shapes_for``; ``--full-warmup``:
every warm-up shape); a shape met after the swap compiles then ("programs compiled after the swap").
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe import LLM, SamplingParams  # noqa: E402
from jaxmoe.compilation import compile_events  # noqa: E402
from jaxmoe.janus import live_rescale as engine_rescale  # noqa: E402


def _like(samples, calls) -> list[float]:
    """Times of the (time, calls) samples whose program calls have the same tokens per row as ``calls``."""
    key = tuple(t for _, t in calls)
    return [dt for dt, c in samples if tuple(t for _, t in c) == key]


def _kind(calls) -> str:
    prefill = [t for _, t in calls if t > 1]
    return (
        "decode"
        if not prefill
        else ("decode + " if len(prefill) < len(calls) else "") + "prefill " + "+".join(map(str, prefill))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--changes", default="4a4e,1a7e,2a6e")
    ap.add_argument("--warm-steps", type=int, default=30, help="steps served before each change")
    ap.add_argument("--after-steps", type=int, default=40, help="steps served after each swap (same-shape baseline)")
    ap.add_argument("--build-nice", type=int, default=engine_rescale.BUILD_NICE, help="niceness of the build thread")
    ap.add_argument(
        "--build-switch-interval",
        type=float,
        default=engine_rescale.BUILD_SWITCH_INTERVAL_S,
        help="the GIL switch interval (s) while a build runs; 0: leave Python's (5 ms)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny-random", help="checkpoint (e.g. /tmp/jaxmoe-bench-107m) or tiny-random")
    ap.add_argument(
        "--full-warmup",
        action="store_true",
        help="each build compiles every warm-up shape (default: the shapes the live requests need now)",
    )
    ap.add_argument(
        "--no-initial-warmup",
        action="store_true",
        help="do not compile every shape of the starting layout first (its steps compile what they meet)",
    )
    ap.add_argument("--idle", action="store_true", help="rescale with no requests in flight: the build alone")
    args = ap.parse_args()
    engine_rescale.BUILD_NICE = args.build_nice
    engine_rescale.BUILD_SWITCH_INTERVAL_S = args.build_switch_interval or None
    changes = [tuple(int(x) for x in c.rstrip("e").split("a")) for c in args.changes.split(",")]
    rng = np.random.default_rng(args.seed)
    llm = LLM(
        args.model,
        mesh="meshes/cpu-8.yaml",
        num_blocks=256,
        block_size=16,
        max_num_seqs=args.concurrency,
        max_prefill_chunk=64,
        max_batch_tokens=128,
    )
    engine = llm.engine
    compile_events()  # start counting (compiles vs persistent-cache loads of each build)
    t0 = time.perf_counter()
    for rows, tokens in [] if args.no_initial_warmup else engine.runner.plan.shapes():
        engine.runner.warm(rows, tokens)
    print(f"warm-up of 2a6e: {time.perf_counter() - t0:.1f}s")
    if args.idle:  # no requests: the build alone (what a rescale of an idle server waits for)
        for attention, experts in changes:
            rescaler = LiveRescaler.of(engine)
            job = rescaler.start(attention, experts, full_warmup=args.full_warmup)
            job.wait_ready()
            rescaler.apply()
            r = job.result(60)
            print(
                f"idle {r.previous} -> {r.attention}a{r.experts}e: build_s {r.build_s:.1f} s, {r.shapes_compiled} of "
                f"{len(engine.runner.plan.shapes())} shapes, swap {r.swap_s * 1e3:.1f} ms; "
                f"load average {os.getloadavg()[0]:.1f}"
            )
        return
    failed = finished = 0

    def top_up():
        while len(engine.scheduler.sequences()) < args.concurrency:
            prompt = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(8, 60)))]
            engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(24, 64)), ignore_eos=True))

    def step(more: bool = True) -> tuple[float, tuple]:
        """One engine step: (its time, the (rows, tokens per row) of its program calls)."""
        nonlocal failed, finished
        if more:
            top_up()
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        failed += sum(o.error is not None for o in outs)
        finished += sum(o.finished for o in outs)
        return dt, tuple(engine.runner.last_calls)

    rows = []
    for attention, experts in changes:
        before = [step() for _ in range(args.warm_steps)]
        ev0 = compile_events()
        job = LiveRescaler.of(engine).start(attention, experts, full_warmup=args.full_warmup)
        during = []
        while not job.ready():
            during.append(step()[0])
        ev1 = compile_events()
        built = (ev1["compiles"] - ev0["compiles"], ev1["cache_hits"] - ev0["cache_hits"])
        programs = ev1["programs"]
        after = [step() for _ in range(1 + args.after_steps)]  # the first runs the swap
        compiled = compile_events()["programs"] - programs
        r = job.result(60)
        normal = statistics.median(dt for dt, _ in before)
        first_t, first_calls = after[0]
        like_after = _like(after[1:], first_calls)
        vs_after = (r.swap_s + first_t) / statistics.median(like_after) if like_after else float("nan")
        worst = max(
            (dt / statistics.median(_like(after[1:], c)) for dt, c in after[:5] if _like(after[1:], c)),
            default=float("nan"),
        )
        # the noise floor: how far ordinary steps stray from their like steps (the busiest like group after)
        groups = {tuple(t for _, t in c) for _, c in after[1:]}
        spread = max(
            (
                max(g) / statistics.median(g)
                for g in (_like(after[1:], [(0, t) for t in k]) for k in groups)
                if len(g) >= 5
            ),
            default=float("nan"),
        )
        rows.append((r, normal, during, vs_after, len(like_after), worst, compiled, _kind(first_calls), built, spread))
        print(
            r.as_dict(),
            f"normal {normal:.4f}s, during build: {len(during)} steps, max {max(during, default=0):.3f}s; "
            f"first step {_kind(first_calls)}: {first_t * 1e3:.1f} ms, like steps after: "
            f"{[round(t * 1e3, 1) for t in like_after]}",
        )
    for _ in range(100_000):  # drain (bounded)
        if not engine.has_work():
            break
        step(more=False)
    bm = engine.block_manager
    print(
        f"\njax {jax.__version__} ({jax.device_count()} {jax.default_backend()} devices), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; concurrency {args.concurrency}; build thread "
        f"nice {args.build_nice}, GIL switch interval during builds {args.build_switch_interval or 'unchanged'}; {finished} requests finished, {failed} failed; "
        f"KV blocks free at the end: {bm.num_free}/{bm.num_blocks}"
    )
    print(
        "| change | build_s (stop-the-world) | build: programs compiled / from the disk cache | swap_s | median step before | first step | swap step / median before "
        "| stall_ratio (like steps before) | swap step / like steps after (n) | worst of 5 after / like | "
        "noise: slowest ordinary step after / its like | "
        "programs compiled after the swap | steps during build: n, median / max (median / normal) | KV blocks moved "
        "| expert slots kept / copied (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r, normal, during, vs_after, n_like, worst, compiled, kind, built, spread in rows:
        mid = statistics.median(during) if during else float("nan")
        print(
            f"| {r.previous} -> {r.attention}a{r.experts}e | {r.build_s:.2f} ({r.shapes_compiled} shapes) | {built[0]} / {built[1]} | {r.swap_s * 1e3:.1f} ms | {normal * 1e3:.1f} ms "
            f"| {kind} | {(r.swap_s + r.first_step_s) / normal:.2f} | {r.stall_ratio:.2f} | {vs_after:.2f} ({n_like}) "
            f"| {worst:.2f} | {spread:.2f} | {compiled} | {len(during)}, {mid * 1e3:.0f} / {max(during, default=0) * 1e3:.0f} ms "
            f"({mid / normal:.1f}x) | {r.kv_blocks_moved} | {r.expert_slots_local} / {r.expert_slots_copied} "
            f"({r.expert_bytes_copied / 2**20:.1f}) |"
        )


if __name__ == "__main__":
    main()
