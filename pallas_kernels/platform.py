"""The platform kernels are chosen for: this process's JAX backend, or, while programs are traced
and lowered ahead for another platform (``jaxmoe lower``: CUDA or TPU programs built on a CPU
host), that platform.

Every implementation choice that depends on the platform (the expert-FFN form that "auto" picks,
whether a C++ XLA:CPU kernel can run, the compiled Pallas backend of the grouped matmul and of
AEBS) asks ``target_platform()``, never ``jax.default_backend()`` directly, so a program lowered
inside ``lowering_for("cuda")`` holds what a CUDA process would run.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxmoe_target_platform", default=None)


def normalize(platform: str) -> str:
    """``cpu`` / ``gpu`` / ``tpu`` for a JAX platform or backend name (``cuda`` and ``rocm`` are
    ``gpu``); raises ValueError for anything else."""
    name = _ALIASES.get(platform.lower(), platform.lower())
    if name not in PLATFORMS:
        raise ValueError(f"platform must be one of cpu, cuda, rocm, gpu, tpu, got {platform!r}")
    return name


def target_platform() -> str:
    """The platform the programs being traced now will run on (``cpu`` / ``gpu`` / ``tpu``)."""
    target = _TARGET.get()
    return target if target is not None else normalize(jax.default_backend())


def lowering_ahead() -> bool:
    """True inside ``lowering_for`` a platform other than this process's backend: no device of the
    target platform exists here, so nothing may ask one (e.g. for its compute capability)."""
    target = _TARGET.get()
    return target is not None and target != normalize(jax.default_backend())


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[str]:
    """Trace programs for ``platform`` (a JAX platform name) in this block; yields its normalized
    name."""
    token = _TARGET.set(normalize(platform))
    try:
        yield _TARGET.get()
    finally:
        _TARGET.reset(token)
