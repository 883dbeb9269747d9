"""Warm-up: compile every step program serving can meet before the first request arrives.

Where the executor can lower its step ahead (``runtime.executor.LowersAhead``: the monolithic one),
warm-up traces and lowers each shape's programs on the calling thread and compiles them on a pool
of ``compile_workers()`` threads as they come (XLA compiles without holding the GIL, so on a
2-core machine two compiles run side by side, and tracing the next shape overlaps them); nothing
is run; where the engine may pause a step (layer-level preemption), each shape's layer-by-layer
programs (``LowersAhead.lower_layers``) go to the same pool. Otherwise each shape runs once on
padding rows (and once more layer by layer where the engine may pause a step), one after the other.
First a layer hook may choose how often steps pause (``choose_granularity``: QLLM's default measures it
and may choose none, then only the fused programs compile).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

from jaxmoe.progress import progress as progress_reporter

ENV_WORKERS = "JAXMOE_COMPILE_WORKERS"


class WarmupCancelled(RuntimeError):
    """``warm_up`` stopped early because its ``cancel`` event was set."""


def compile_workers() -> int:
    """Programs compiled at once: ``$JAXMOE_COMPILE_WORKERS``, else the CPU cores this process may
    run on."""
    setting = os.environ.get(ENV_WORKERS, "").strip()
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"{ENV_WORKERS} must be a positive integer, got {setting!r}")
        return int(setting)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warm_up(
    engine,
    shapes: list[tuple[int, int]] | None = None,
    progress: bool | None = None,
    cancel: threading.Event | None = None,
    workers: int | None = None,
    scoring: bool = False,
) -> float:
    """Compile the programs of each shape of ``engine.runner.plan.shapes()`` (rows per attention
    instance, tokens per row): lowered ahead and compiled on ``workers`` threads (default
    ``compile_workers()``) where the executor allows (the layer-by-layer programs too when the
    engine may pause a step), else by running the shape once on padding rows that write no KV (and
    layer by layer too when the engine may pause a step). With
    ``scoring`` (what ``jaxmoe serve`` does), also the programs of prompt scoring (``echo`` with
    logprobs, ``prompt_logprobs``) per prefill token bucket, by running them on padding. Returns the
    seconds spent. ``progress``: True a tqdm bar on stderr, False nothing, None (default) a bar on a
    terminal and otherwise a line when it starts, every 10 s and when it ends (``jaxmoe.progress``).
    ``cancel``: set it to stop (``WarmupCancelled``); compiles already started finish in the
    background."""
    t0 = time.monotonic()
    todo = list(shapes if shapes is not None else engine.runner.plan.shapes())
    bar = progress_reporter("jaxmoe warm-up", len(todo), "program", progress)
    pool = concurrent.futures.ThreadPoolExecutor(workers or compile_workers(), thread_name_prefix="jaxmoe-compile")
    try:
        hook = engine.layer_hook
        choose = getattr(hook, "choose_granularity", None)
        if choose is not None:  # e.g. QLLM's: pause points only where their cost is within budget
            bar.set_postfix_str("measuring the pause points' cost")
            choose(engine, todo)
        # steps that may pause run layer by layer
        layered = hook is not None and getattr(hook, "pauses_steps", True)
        run_instead = _lower_and_compile(engine.runner, todo, pool, bar, cancel, t0, layered)
        for rows, tokens in run_instead:
            _check(cancel, t0)
            bar.set_postfix_str(f"{rows}x{tokens}")
            engine.runner.warm(rows, tokens)
            bar.update()
        buckets = sorted({tokens for _, tokens in todo if tokens > 1}) if scoring else []  # prompt logprobs
        bar.total += len(buckets)
        for tokens in buckets:
            _check(cancel, t0)
            bar.set_postfix_str(f"scoring {tokens} tokens")
            engine.runner.warm_scoring(tokens)
            bar.update()
        if engine.config.async_scheduling:  # feeding a step's tokens to the next one on the device
            _check(cancel, t0)
            bar.set_postfix_str("async scheduling's feed")
            bar.total += 1
            engine.runner.warm_feed()
            bar.update()
        if layered:  # the shapes whose layer-by-layer programs could not be lowered ahead
            bar.total += len(run_instead)
            for rows, tokens in run_instead:
                _check(cancel, t0)
                bar.set_postfix_str(f"{rows}x{tokens} layer by layer")
                engine.runner.warm(rows, tokens, layer_by_layer=True)
                bar.update()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
    return time.monotonic() - t0


def _check(cancel: threading.Event | None, t0: float) -> None:
    if cancel is not None and cancel.is_set():
        raise WarmupCancelled(f"warm-up cancelled after {time.monotonic() - t0:.1f}s")


def _lower_and_compile(runner, todo, pool, bar, cancel, t0, layer_by_layer: bool) -> list[tuple[int, int]]:
    """Lower each shape's programs here (``layer_by_layer``: those of a pausable step too) and compile
    them on ``pool``; returns the shapes the runner cannot lower ahead (to be run instead). The
    sampler is lowered once per batch size."""
    pending: set[concurrent.futures.Future] = set()
    batch_sizes: set[int] = set()
    run_instead = []

    def collect(timeout: float | None) -> None:
        done, _ = concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)
        for future in done:
            pending.discard(future)
            future.result()  # a compile error stops warm-up here
            bar.update()

    for rows, tokens in todo:
        _check(cancel, t0)
        bar.set_postfix_str(f"{rows}x{tokens}")
        programs = runner.lower(rows, tokens, sampler=rows not in batch_sizes, layer_by_layer=layer_by_layer)
        if programs is None:
            run_instead.append((rows, tokens))
            continue
        batch_sizes.add(rows)
        bar.total += len(programs) - 1
        pending.update(pool.submit(p.compile) for p in programs)
        if pending:
            collect(0)
    if pending:
        bar.set_postfix_str(f"compiling the last {len(pending)}")
    while pending:
        _check(cancel, t0)
        collect(0.1)
    return run_instead
