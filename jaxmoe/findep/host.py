"""What the hardware running a disaggregated step can overlap, measured (``profile.HostModel``).

``measure_host`` times two busy programs (a loop of matmuls), one on the attention and one on the
expert sub-mesh, each alone and both dispatched together: concurrency = (alone + alone) /
together (the CPU mesh's 8 host devices share the same cores: about 1). ``measure_dispatch``
dispatches a tiny program on the expert sub-mesh many times back to back (host seconds per program:
the floor of any program's host cost). ``fit_host`` turns both into a HostModel, which the step-time
model (``schedule.Host``) uses for its work and dispatch bounds (FinDEP, arXiv:2512.21487, assumes
separate hardware: no host).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.findep.profile import HostModel, ProfileError


def measure_dispatch(executor, counts: tuple[int, ...] = (50, 100, 200), repeats: int = 3) -> list[list[float]]:
    """Dispatch samples [[programs, host seconds], ...]: a tiny program on the expert sub-mesh
    dispatched ``programs`` times back to back (asynchronously; each waits for the one before), the
    host's time until the last one is dispatched (median of ``repeats``)."""
    x = jax.device_put(jnp.zeros((executor.sub.experts.devices.size,), jnp.float32), executor.sub.replicated_sharding)
    f = jax.jit(lambda v: v + 1.0)
    jax.block_until_ready(f(x))
    out = []
    for n in counts:
        ts = []
        for _ in range(repeats):
            y = x
            t0 = time.perf_counter()
            for _ in range(n):
                y = f(y)
            ts.append(time.perf_counter() - t0)
            jax.block_until_ready(y)
        out.append([float(n), statistics.median(ts)])
    return out


def _busy_program(mesh, work: int, iters: int):
    """A loop of matmuls over all the devices of a mesh (rows sharded), ready to call."""
    axes = tuple(mesh.axis_names)
    n = 256
    x = jax.device_put(jnp.full((mesh.devices.size * work, n), 0.01, jnp.float32), NamedSharding(mesh, P(axes)))
    w = jax.device_put(jnp.eye(n, dtype=jnp.float32), NamedSharding(mesh, P()))
    f = jax.jit(lambda x, w: jax.lax.fori_loop(0, iters, lambda i, y: jnp.tanh(y @ w), x))
    jax.block_until_ready(f(x, w))
    return lambda: f(x, w)


def measure_host(executor, repeats: int = 7, sizes: tuple[int, ...] = (64, 256)) -> list[list[float]]:
    """Concurrency samples [[alone on the attention mesh, alone on the expert mesh, both together], ...]
    (seconds, medians of ``repeats``): busy programs of ``sizes`` rows per device (see the module
    docstring)."""

    def timed(fs):
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready([f() for f in fs])
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out = []
    for work in sizes:
        a = _busy_program(executor.sub.attention, work, 16)
        b = _busy_program(executor.sub.experts, work, 16)
        out.append([timed([a]), timed([b]), timed([a, b])])
    return out


def fit_host(
    concurrency: list[list[float]],
    dispatch: list[list[float]],
    full: float = 0.9,
    timing_scale: float = 1.0,
    sync_samples: list[list[float]] | None = None,
) -> HostModel:
    """A HostModel from ``measure_host``'s and ``measure_dispatch``'s samples.

    Per pair, c = (a + b) / together, against the most a pair can overlap, (a + b) / max(a, b). When
    the median pair reaches ``full`` of that, the sub-meshes are separate hardware: concurrency
    None (no work bound; the paper's model); otherwise the median c (at least 1). dispatch: the
    median of seconds / programs."""
    if not concurrency:
        raise ProfileError("fit_host needs at least one concurrency sample [alone, alone, together]")
    for p in concurrency:
        if len(p) != 3 or min(p) <= 0:
            raise ProfileError(f"a concurrency sample is [alone, alone, together] seconds > 0, got {p!r}")
    c = statistics.median((a + b) / ab for a, b, ab in concurrency)
    share = statistics.median(((a + b) / ab) / ((a + b) / max(a, b)) for a, b, ab in concurrency)
    d = statistics.median(t / n for n, t in dispatch) if dispatch else 0.0
    return HostModel(
        concurrency=None if share >= full else max(1.0, c),
        dispatch=d,
        timing_scale=timing_scale,
        samples={
            "concurrency": [list(map(float, p)) for p in concurrency],
            "dispatch": dispatch,
            "sync": sync_samples or [],
        },
    )
