"""The pause points of a step run layer by layer (QLLM layer-level preemption), kept in step with the
device.

JAX dispatches asynchronously: the host reaches the boundary after layer n while the device may
still be computing layer 1. A pause decision taken at dispatch time sees only the requests that
arrived before the step's burst of dispatches (measured with ``bench/qllm.py``: every
latency-sensitive arrival was seen at a step boundary, none between layers). ``PausePoints`` keeps
the host one program ahead of the device: at each boundary it first waits for the output of the
program dispatched before the previous boundary, so the hook runs when the device has really
reached (almost) that point, while the next program is already queued (the device does not idle).
"""

from __future__ import annotations

from typing import Callable

import jax


class PausePoints:
    def __init__(self, hook: Callable[[int], None], every: int = 1):
        """``hook(n)``: the engine's ``between_layers`` (``n``: layers done so far); ``every``: only
        at layer boundaries where ``n`` is a multiple of it."""
        self.hook, self.every = hook, every
        self._previous = None

    def __call__(self, layers_done: int, *outputs):
        """A boundary after the program(s) that produce ``outputs`` (dispatched, maybe not done); what
        the hook returns (e.g. rows to merge into the step, ``executor.RowMerge``)."""
        if layers_done % self.every:
            return None
        return self.inside(layers_done, *outputs)

    def inside(self, layers_done: int, *outputs):
        """A pause point inside a layer (per-expert queues: after its attention side, after its
        routing, between expert rounds), whatever ``every`` says; otherwise as a boundary."""
        if self._previous is not None:
            jax.block_until_ready(self._previous)
        self._previous = outputs
        return self.hook(layers_done)

    def last(self, layers_done: int, *outputs):
        """The pause point after the last layer (before the head): no program is queued behind it, so
        it waits for ``outputs`` themselves, and the hook runs when every layer is done; an arrival
        during the last layers is seen here, not at the step's end."""
        jax.block_until_ready((self._previous, outputs))
        self._previous = None
        return self.hook(layers_done)
