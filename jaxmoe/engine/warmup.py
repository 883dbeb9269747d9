"""Warm-up: compile every step program serving can meet before the first request arrives."""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm


class WarmupCancelled(RuntimeError):
    """``warm_up`` stopped early because its ``cancel`` event was set."""


def warm_up(
    engine,
    shapes: list[tuple[int, int]] | None = None,
    progress: bool | None = None,
    cancel: threading.Event | None = None,
) -> float:
    """Run each shape of ``engine.runner.plan.shapes()`` (rows per attention instance, tokens per row)
    once on padding rows that write no KV (and layer by layer too when the engine may pause a step);
    returns the seconds spent. ``progress``: a tqdm bar on stderr (None: when stderr is a terminal)."""
    t0 = time.monotonic()
    todo = list(shapes if shapes is not None else engine.runner.plan.shapes())
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(todo, desc="jaxmoe warm-up", unit="program", file=sys.stderr, disable=not show)
    for rows, tokens in bar:
        if cancel is not None and cancel.is_set():
            raise WarmupCancelled(f"warm-up cancelled after {time.monotonic() - t0:.1f}s")
        bar.set_postfix_str(f"{rows}x{tokens}")
        engine.runner.warm(rows, tokens)
        if engine.config.layer_preemption:
            engine.runner.warm(rows, tokens, layer_by_layer=True)
    return time.monotonic() - t0
