"""XLA compilation: the persistent compilation cache, and a count of the programs compiled.

``enable_persistent_cache()`` points JAX's on-disk cache at ``~/.cache/jaxmoe/xla`` (or
``$JAXMOE_COMPILATION_CACHE``; ``off`` disables it; a cache directory set through JAX's own
config wins), so a second start loads its programs instead of compiling them.
``compile_events()`` counts backend compiles and persistent-cache loads in this process: serving
reads it after warm-up to prove that no step compiles while traffic runs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

ENV = "JAXMOE_COMPILATION_CACHE"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # compiles and persistent-cache loads
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_counts = {"programs": 0, "cache_hits": 0, "compile_seconds": 0.0}
_listening = False


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxmoe" / "xla"


def enable_persistent_cache(path: str | Path | None = None) -> Path | None:
    """Turn the persistent compilation cache on (idempotent); returns its directory, or None when
    disabled (``$JAXMOE_COMPILATION_CACHE=off``)."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    setting = str(path) if path is not None else os.environ.get(ENV, "")
    if setting.lower() in ("off", "0", "none", "false"):
        return None
    directory = Path(setting) if setting else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _counts["programs"] += 1
            _counts["compile_seconds"] += seconds


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


def compile_events() -> dict[str, float]:
    """Programs this process got from XLA so far: ``programs`` (compiled or loaded from the
    persistent cache), ``cache_hits`` (loaded), ``compiles`` (= programs - cache_hits) and
    ``compile_seconds`` (time in both)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
        return dict(_counts, compiles=_counts["programs"] - _counts["cache_hits"])
