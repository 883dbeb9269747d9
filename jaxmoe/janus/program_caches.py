"""The runtime's layout-keyed caches of compiled programs, and letting go of them after a live
rescale (``live_rescale`` calls ``forget_cached_programs`` at the swap)."""

from __future__ import annotations

from jaxmoe.runtime.attention_program import make_attention_programs
from jaxmoe.runtime.disaggregated import _sub_meshes
from jaxmoe.runtime.expert_program import make_expert_program


def forget_cached_programs() -> None:
    """Drop the layout-keyed caches of sub-meshes and attention / expert programs after a swap.

    The serving executor holds its own programs; those of the layouts no longer served are freed
    with their executors (at Python's next garbage collection: executors hold reference cycles).
    XLA:CPU maps memory for every compiled program, so without this each layout a long-running
    server visits would keep its programs (~3.4k mappings per layout of the tiny model) until the
    kernel's ``vm.max_map_count``; a layout visited again is rebuilt in the background (its
    programs loaded from the persistent compilation cache)."""
    for cache in (make_attention_programs, make_expert_program, _sub_meshes):
        cache.cache_clear()
