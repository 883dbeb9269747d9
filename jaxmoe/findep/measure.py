"""Measured FinDEP profiles: time the disaggregated runtime's own per-layer programs, fit the stages.

``jaxmoe profile --mesh FILE --model DIR`` (FinDEP, arXiv:2512.21487, section 4.1). For every point
of a sweep (micro-batch rows per attention instance x tokens attended) one step runs through
``DisaggregatedExecutor.forward`` in timing mode, which blocks after every phase and records its
wall time per layer. With ``Sweep.stat="min"`` (the default) the mean over MoE layers of each
layer's least time over the repeats gives one sample of each stage (``phase_time``); with
``"median"`` or ``"trimmed"`` (the mean of the middle half) that statistic of the steps' means over
MoE layers. The least, because load from other processes only ever slows a program down; it does
not remove a change of that load between two profiles (docs/findep.md has the measured agreement).
``LinearModel.fit`` turns the samples into the alpha-beta models the solver uses:

========== ============================================ =========================================
stage      work terms of a sample                       phase timed
========== ============================================ =========================================
attention  (tokens, tokens x attended) per instance     ``attention``
shared     tokens per instance                          ``shared`` (when the model has shared
                                                        experts on the attention side)
a2e, e2a   bytes one attention instance sends           ``a2e`` / ``e2a``
expert     tokens of the step, all attention instances  ``expert`` (gate, AEBS, grouped matmul)
========== ============================================ =========================================

With ``Sweep.chunks`` the points also run with the expert side cut into r2 chunks (the sequential
schedule with r2 > 1), so the A2E / expert / E2A models see the small chunks FinDEP's r2 makes
(a sample's work and time are per chunk).

Compilation is excluded: every point is first run until a call compiles nothing (the second call
of a shape can compile again, e.g. when the KV cache it gets back has another layout than the fresh
one), and a timed call during which any program compiled (``compilation.compile_events``) is
discarded and run again. The repeats run in rounds over all the points (round j times every point
once), so a burst of load from other processes spreads over the sweep as one more noisy sample per
point instead of shifting a few points, and the median drops it.

The host (``profile.HostModel``): what the hardware overlaps, measured by ``planning.host``
(concurrency of a busy pair, per-program dispatch), and ``timing_scale``: the share of the blocked
(timing-mode) time the sequential steps take asynchronously, by which the stage samples are scaled.
The executor's heavier host work, such as the per-device copies of A2E / E2A, is part of the stage
times, which are timed from dispatch to ready.

The synthetic batches read and write real KV blocks of the instance that owns each row, so the
attention program does the same work as in serving; token ids and KV contents do not change the
time of any program.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxmoe.compilation import compile_events
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.host import fit_host, measure_dispatch, measure_host
from jaxmoe.findep.profile import (
    Profile,
    ProfileError,
    StageModels,
    dims_of,
    mesh_identity,
    model_identity,
)
from jaxmoe.runtime.pipeline import Pipeline

STAGES = ("attention", "a2e", "expert", "e2a")


def trimmed_mean(values, share: float = 0.25) -> float:
    """The mean of ``values`` without the lowest and the highest ``share`` of them (at least one value kept)."""
    v = sorted(values)
    cut = min(int(len(v) * share), (len(v) - 1) // 2)
    return statistics.fmean(v[cut : len(v) - cut])


STATS = {"median": statistics.median, "trimmed": trimmed_mean, "min": min}


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Where to measure: rows (m_a, sequences per attention instance) x attended tokens."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (16, 128)
    tokens: int = 1  # new tokens per row (1: decode)
    repeats: int = 5
    chunks: tuple[int, ...] = (1,)  # expert-side chunks r2 each point also runs with
    host: bool = True  # measure the host's concurrency and dispatch time
    stat: str = "min"  # over repeats: "min" (load from other processes only slows), "median", "trimmed"
    warmup: int = 4  # at most this many untimed calls per point until one compiles nothing

    def __post_init__(self):
        for name in ("rows", "contexts", "chunks"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ProfileError(f"{name} must be positive integers, got {values!r}")
        if len(set(self.rows)) < 2:
            raise ProfileError(f"rows needs at least 2 distinct sizes to fit a model, got {self.rows!r}")
        if self.stat not in STATS:
            raise ProfileError(f"stat must be one of {tuple(STATS)}, got {self.stat!r}")
        if self.tokens < 1 or self.repeats < 1 or self.warmup < 1:
            raise ProfileError(
                f"tokens, repeats and warmup must be >= 1, got {self.tokens}, {self.repeats} and {self.warmup}"
            )
        if self.tokens > min(self.contexts):
            raise ProfileError(f"tokens {self.tokens} exceeds the smallest context {min(self.contexts)}")

    @property
    def max_context(self) -> int:
        return max(self.contexts)


def synthetic_batch(executor, rows: int, context: int, tokens: int = 1, *, seed: int | None = None, table_width=None):
    """(tokens [B, T], AttentionBatch, logits_index [B]) for ``rows`` sequences per attention
    instance, each writing ``tokens`` new tokens at the end of ``context`` attended positions in
    blocks of the instance that owns the row. ``seed``: random token ids (rows route to different
    experts; None: all ids 1); ``table_width``: block table width (the engine's
    ``max_blocks_per_seq``, so the programs are the ones serving compiles; default: the context's)."""
    kv = executor.kv_layout
    ag, blocks_per_instance = kv.num_instances, kv.blocks_per_instance
    blocks = kv.blocks_for(context)
    if blocks > blocks_per_instance:
        raise ProfileError(
            f"context {context} needs {blocks} KV blocks per sequence, an instance holds {blocks_per_instance}"
        )
    width = blocks if table_width is None else table_width
    if width < blocks:
        raise ProfileError(f"table_width {width} is less than the {blocks} blocks context {context} needs")
    B = ag * rows
    first = kv.first_block(np.arange(B) // rows)  # first block of each row's instance
    tables = (first[:, None] + np.minimum(np.arange(width), blocks - 1)[None, :]).astype(np.int32)
    positions = np.broadcast_to(np.arange(context - tokens, context, dtype=np.int32), (B, tokens)).copy()
    slots = np.stack([kv.slots(t, p) for t, p in zip(tables, positions)]).astype(np.int32)
    if seed is None:
        ids = np.ones((B, tokens), np.int32)
    else:
        ids = np.random.default_rng(seed).integers(3, executor.cfg.vocab_size, size=(B, tokens)).astype(np.int32)
    return ids, AttentionBatch(positions, slots, tables), np.full((B,), tokens - 1, np.int32)


def programs_compiled() -> int:
    """Programs this process has compiled (or loaded from the persistent cache) so far."""
    return int(compile_events()["programs"])


def warm_up(executor, args, max_calls: int = 4) -> int:
    """Run ``executor.forward(*args)`` (not timed) until a call compiles nothing, at most ``max_calls``
    times; returns the calls made. A shape's second call can compile again (the KV cache it gets back
    from the first has the programs' output layout, not the fresh cache's)."""
    for n in range(1, max_calls + 1):
        before = programs_compiled()
        jax.block_until_ready(executor.forward(*args))
        if programs_compiled() == before:
            return n
    return max_calls


def timed_step(executor, args, retries: int = 3) -> dict:
    """One timing-mode step (``executor.timing`` must be on): its record (``executor.timings[-1]``).
    A step during which a program compiled is run again (at most ``retries`` times; then
    ProfileError): compile time is never part of a sample."""
    for _ in range(retries + 1):
        before = programs_compiled()
        executor.forward(*args)
        if programs_compiled() == before:
            return executor.timings[-1]
    raise ProfileError(f"every one of {retries + 1} timed steps compiled a program: the shape does not settle")


def time_phases(executor, args, repeats: int, warmup: int = 4) -> list[dict]:
    """Warm up (``warm_up``: compile, until a call compiles nothing), then ``repeats`` steps in timing
    mode (every phase blocked on and timed per layer; a step that compiled is run again); the timing
    records (``executor.timings``), one per step. The executor's timing mode is restored afterwards.
    Shared by FinDEP's profile and the JANUS scaling profile (``jaxmoe.janus.scaling.fit``)."""
    was = executor.timing
    try:
        executor.timing = False
        warm_up(executor, args, warmup)
        executor.timing = True
        records = [timed_step(executor, args) for _ in range(repeats)]
    finally:
        executor.timing = was
    return records


def phase_per_layer(records: list[dict], phase: str, layers, stat=statistics.median) -> float:
    """``stat`` (default: the median) over the steps of a phase's mean time over ``layers`` (seconds)."""
    return stat([statistics.fmean(r[phase][i] for i in layers) for r in records])


def phase_time(records: list[dict], phase: str, layers, stat=statistics.median) -> float:
    """A phase's time per layer over the steps: with ``min`` the mean over ``layers`` of each layer's
    least time over the steps (every layer's program runs the same work, so each run of it is one
    sample: a layer a burst of other processes' load slowed in one step counts with its quickest
    step, where the least of the steps' means needs one step that no burst touched in any layer);
    any other ``stat``: ``phase_per_layer``."""
    if stat is not min:
        return phase_per_layer(records, phase, layers, stat)
    return statistics.fmean(min(r[phase][i] for r in records) for i in layers)


def measure_samples(
    executor, sweep: Sweep = Sweep(), progress: Callable[[str], None] | None = None
) -> dict[str, list[list[float]]]:
    """Samples ``{stage: [[work terms..., seconds], ...]}`` of the executor's programs over the sweep.

    Each point is first warmed up (``warm_up``), then the ``repeats`` timed steps run in rounds over
    all the points (``timed_step``; see the module docstring); the executor's pipeline is restored
    afterwards."""
    cfg = executor.cfg
    moe = list(executor.moe_layers)
    if not moe:
        raise ProfileError("the model has no MoE layer: nothing to profile")
    hidden_bytes = cfg.hidden_size * _dtype_bytes(executor)
    ag = executor.num_attention
    samples: dict[str, list[list[float]]] = {s: [] for s in STAGES}
    shared_layers = [i for i in moe if i in executor.shared_layers]
    was_pipeline, was_timing = executor.pipeline, executor.timing
    agg = STATS[sweep.stat]
    points = []  # (rows, context, pipeline, args, r2 that runs)
    try:
        executor.timing = False
        for context in sweep.contexts:
            for rows in sweep.rows:
                args = synthetic_batch(executor, rows, context, sweep.tokens)
                for r2 in sweep.chunks:
                    executor.pipeline = Pipeline(1, "PP", r2)
                    warm_up(executor, args, sweep.warmup)
                    points.append((rows, context, executor.pipeline, args, executor.last_pipeline.r2))
        records: list[list[dict]] = [[] for _ in points]
        executor.timing = True
        for _ in range(sweep.repeats):
            for (_, _, pipe, args, _), recs in zip(points, records):
                executor.pipeline = pipe
                recs.append(timed_step(executor, args))
        executor.timing = False
        for (rows, context, pipe, args, r2), recs in zip(points, records):
            executor.pipeline = pipe
            t = {s: phase_time(recs, s, moe, agg) / r2 for s in STAGES}
            tok = rows * sweep.tokens  # per attention instance
            chunk = tok / r2
            if r2 == 1 or 1 not in sweep.chunks:
                samples["attention"].append([tok, tok * context, t["attention"] * r2])  # (not per chunk)
                if shared_layers:
                    shared = phase_time(recs, "shared", shared_layers, agg)
                    samples.setdefault("shared", []).append([tok, shared])
            if sweep.host and r2 == 1:  # what blocking after every program adds (a chain)
                samples.setdefault("sync", []).append(_sync(executor, args, recs, sweep.repeats, agg))
            samples["a2e"].append([chunk * hidden_bytes, t["a2e"]])
            samples["expert"].append([chunk * ag, t["expert"]])
            samples["e2a"].append([chunk * hidden_bytes, t["e2a"]])
            if progress is not None:
                ms = ", ".join(f"{s} {t[s] * 1e3:.3f}" for s in STAGES[1:])
                progress(
                    f"rows {rows:>4} context {context:>5} r2 {r2:>3}: attention "
                    f"{t['attention'] * r2 * 1e3:.3f}, per chunk {ms} ms"
                )
    finally:
        executor.pipeline, executor.timing = was_pipeline, was_timing
    return samples


def _sync(executor, args, records, repeats: int, agg=statistics.median) -> list[float]:
    """[programs, blocked seconds, asynchronous seconds] of one step: the timing-mode records' total
    (every phase timed from dispatch to ready) and the same step run asynchronously, as in serving."""
    count, was = [], executor.timing
    executor.timing = False
    executor.observer = lambda phase, layer, out: count.append(phase)
    try:
        jax.block_until_ready(executor.forward(*args))
        executor.observer = None
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(executor.forward(*args))
            times.append(time.perf_counter() - t0)
    finally:
        executor.observer, executor.timing = None, was
    total = agg([sum(v if isinstance(v, float) else sum(v.values()) for v in r.values()) for r in records])
    return [float(len(count)), total, agg(times)]


def timing_scale(samples: dict[str, list[list[float]]]) -> float:
    """What share of the timing-mode (blocked) time the same sequential steps took run asynchronously:
    the median over the sweep's points of asynchronous / blocked, at most 1. In the sequential schedule
    every program waits for the one before, so on any hardware the asynchronous step is the chain of
    the programs' own times; blocking after each adds a wait and a wake-up (on a loaded machine a
    scheduler slice each). A ratio, not seconds per program: taking seconds off every sample would
    erase the real start-up cost of small programs (the alphas that price many chunks) where the
    estimate runs high."""
    pts = [p for p in samples.get("sync") or [] if p[1] > 0 and p[2] > 0]
    return min(1.0, statistics.median(p[2] / p[1] for p in pts)) if pts else 1.0


def fit_stages(
    samples: dict[str, list[list[float]]], scale: float = 1.0, convex: tuple[str, ...] = ("expert",)
) -> StageModels:
    """Alpha-beta models of every stage from ``measure_samples``' points, each sample (one program)
    times ``scale`` (``timing_scale``: the asynchronous share of the blocked time).

    The stages in ``convex`` are fitted with a second, non-negative term on the square of the work
    (alpha + beta x + gamma x²; ``StageModels.expert_time``) when the samples need it: on XLA:CPU a
    1024-token expert program costs about 1.8x two 512-token ones (BENCHMARKS.md). Where gamma
    comes out 0 the plain alpha-beta model is kept."""
    models = {}
    for stage in STAGES + ("shared",):
        if samples.get(stage):
            pts = np.asarray(samples[stage], np.float64)
            x, t = pts[:, :-1], pts[:, -1] * scale
            model = LinearModel.fit(x, t)
            if stage in convex and x.shape[1] == 1 and len(t) >= 3:
                quad = LinearModel.fit(np.concatenate([x, x * x], axis=1), t)
                if quad.betas[1] > 0:
                    model = quad
            models[stage] = model
    return StageModels(**models)


def profile_executor(executor, sweep: Sweep = Sweep(), progress=None) -> Profile:
    """Measure and fit a Profile for a DisaggregatedExecutor's (mesh, model, dtype)."""
    spec = executor.sub.spec
    samples = measure_samples(executor, sweep, progress)
    host, scale = None, timing_scale(samples)
    if sweep.host:
        host = fit_host(
            measure_host(executor), measure_dispatch(executor), timing_scale=scale, sync_samples=samples.get("sync")
        )
        if progress is not None:
            c = "unlimited" if host.concurrency is None else f"{host.concurrency:.2f}"
            progress(
                f"host: concurrency {c}, dispatch {host.dispatch * 1e3:.3f} ms per program, asynchronous "
                f"steps took {scale:.2f} of the blocked time"
            )
    devices = executor.sub.attention.devices.flat[0]
    return Profile(
        mesh=mesh_identity(spec),
        model=model_identity(executor.cfg),
        dtype=_dtype_name(executor),
        device=f"{devices.platform}: {devices.device_kind}",
        source=f"measured by jaxmoe profile (rows {list(sweep.rows)}, contexts {list(sweep.contexts)}, "
        f"chunks {list(sweep.chunks)}, tokens {sweep.tokens}, {sweep.stat} of {sweep.repeats})",
        dims=dims_of(executor.cfg, spec, _dtype_bytes(executor)),
        stages=fit_stages({k: v for k, v in samples.items() if k != "sync"}, scale),
        host=host,
        samples=samples,
    )


def _dtype_bytes(executor) -> int:
    return int(np.dtype(executor.params["embed"].dtype).itemsize)


def _dtype_name(executor) -> str:
    return str(np.dtype(executor.params["embed"].dtype))


def plot_profile(profile: Profile, path):
    """Measured points against the fitted stage models (like FinDEP's Fig. 7), as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ProfileError("plotting needs matplotlib: pip install 'jaxmoe[plot]'") from None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    st = profile.stages
    pts = {k: np.asarray(v) for k, v in profile.samples.items()}
    ax = axes[0]
    att = pts["attention"]
    for ctx in sorted({round(p[1] / p[0]) for p in att}):
        sel = att[np.isclose(att[:, 1] / att[:, 0], ctx)]
        sel = sel[np.argsort(sel[:, 0])]
        ax.plot(sel[:, 0], sel[:, 2] * 1e3, "o", label=f"measured, attended {ctx}")
        ax.plot(sel[:, 0], [st.attention(x, x * ctx) * 1e3 for x in sel[:, 0]], "-", color=ax.lines[-1].get_color())
    ax.set(title=f"attention  R²={st.attention.r2:.3f}", xlabel="tokens per instance", ylabel="time (ms)")
    for ax, stage, label in ((axes[1], "expert", "tokens per step"), (axes[2], "a2e", "bytes per instance")):
        p = pts[stage][np.argsort(pts[stage][:, 0])]
        model = getattr(st, stage)
        fit = st.expert_time if stage == "expert" else model
        ax.plot(p[:, 0], p[:, 1] * 1e3, "o", label=f"{stage} measured")
        ax.plot(p[:, 0], [fit(x) * 1e3 for x in p[:, 0]], "-", label=f"{stage} fit R²={model.r2:.3f}")
        if stage == "a2e":
            q = pts["e2a"][np.argsort(pts["e2a"][:, 0])]
            ax.plot(q[:, 0], q[:, 1] * 1e3, "s", label="e2a measured")
            ax.plot(q[:, 0], [st.e2a(x) * 1e3 for x in q[:, 0]], "--", label=f"e2a fit R²={st.e2a.r2:.3f}")
        ax.set(title=stage if stage == "expert" else "a2e / e2a", xlabel=label, ylabel="time (ms)")
    for ax in axes:  # below the panels: over no data
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.suptitle(
        f"Stage times measured on {profile.mesh} (points) against the fitted stage models (lines)\n"
        f"{profile.model} ({profile.dtype}, {profile.device})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
