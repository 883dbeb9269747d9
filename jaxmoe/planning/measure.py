"""Measured FinDEP profiles: time the disaggregated runtime's own per-layer programs, fit the stages.

``jaxmoe profile --mesh FILE --model DIR`` (FinDEP, arXiv:2512.21487, section 4.1). For every point
of a sweep (micro-batch rows per attention instance x tokens attended) one step runs through
``DisaggregatedExecutor.forward`` in timing mode, which blocks after every phase and records its
wall time per layer. The median over repeats of the mean over MoE layers gives one sample of each
stage; ``LinearModel.fit`` turns the samples into the alpha-beta models the solver uses:

========== ============================================ =========================================
stage      work terms of a sample                       phase timed
========== ============================================ =========================================
attention  (tokens, tokens x attended) per instance     ``attention``
shared     tokens per instance                          ``shared`` (when the model has shared
                                                        experts on the attention side)
a2e, e2a   bytes one attention instance sends           ``a2e`` / ``e2a``
expert     tokens of the step, all attention instances  ``expert`` (gate, AEBS, grouped matmul)
========== ============================================ =========================================

The synthetic batches read and write real KV blocks of the instance that owns each row, so the
attention program does the same work as in serving; token ids and KV contents do not change the
time of any program.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import jax
import numpy as np

from jaxmoe.models.attention import AttentionBatch
from jaxmoe.planning.linear import LinearModel
from jaxmoe.planning.profile import Profile, ProfileError, StageModels, dims_of, mesh_identity, model_identity

STAGES = ("attention", "a2e", "expert", "e2a")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Where to measure: rows (m_a, sequences per attention instance) x attended tokens."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (16, 128)
    tokens: int = 1  # new tokens per row (1: decode)
    repeats: int = 5

    def __post_init__(self):
        for name in ("rows", "contexts"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ProfileError(f"{name} must be positive integers, got {values!r}")
        if len(set(self.rows)) < 2:
            raise ProfileError(f"rows needs at least 2 distinct sizes to fit a model, got {self.rows!r}")
        if self.tokens < 1 or self.repeats < 1:
            raise ProfileError(f"tokens and repeats must be >= 1, got {self.tokens} and {self.repeats}")
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


def time_phases(executor, args, repeats: int) -> list[dict]:
    """Run ``executor.forward(*args)`` once to compile, then ``repeats`` times in timing mode (every
    phase blocked on and timed per layer); the timing records (``executor.timings``), one per step.
    The executor's timing mode is restored afterwards. Shared by FinDEP's profile and the JANUS
    scaling profile (``jaxmoe.scaling.fit``)."""
    was = executor.timing
    try:
        executor.timing = False
        jax.block_until_ready(executor.forward(*args))  # compile
        executor.timing = True
        records = []
        for _ in range(repeats):
            executor.forward(*args)
            records.append(executor.timings[-1])
    finally:
        executor.timing = was
    return records


def phase_per_layer(records: list[dict], phase: str, layers, stat=statistics.median) -> float:
    """``stat`` (default: the median) over the steps of a phase's mean time over ``layers`` (seconds)."""
    return stat([statistics.fmean(r[phase][i] for i in layers) for r in records])


def measure_samples(
    executor, sweep: Sweep = Sweep(), progress: Callable[[str], None] | None = None
) -> dict[str, list[list[float]]]:
    """Samples ``{stage: [[work terms..., seconds], ...]}`` of the executor's programs over the sweep.

    Each point runs once to compile, then ``repeats`` timed steps (``time_phases``)."""
    cfg = executor.cfg
    moe = list(executor.moe_layers)
    if not moe:
        raise ProfileError("the model has no MoE layer: nothing to profile")
    hidden_bytes = cfg.hidden_size * _dtype_bytes(executor)
    ag = executor.num_attention
    samples: dict[str, list[list[float]]] = {s: [] for s in STAGES}
    shared_layers = [i for i in moe if i in executor.shared_layers]
    for context in sweep.contexts:
        for rows in sweep.rows:
            records = time_phases(executor, synthetic_batch(executor, rows, context, sweep.tokens), sweep.repeats)
            t = {s: phase_per_layer(records, s, moe) for s in STAGES}
            tok = rows * sweep.tokens  # per attention instance
            samples["attention"].append([tok, tok * context, t["attention"]])
            samples["a2e"].append([tok * hidden_bytes, t["a2e"]])
            samples["expert"].append([tok * ag, t["expert"]])
            samples["e2a"].append([tok * hidden_bytes, t["e2a"]])
            if shared_layers:
                samples.setdefault("shared", []).append([tok, phase_per_layer(records, "shared", shared_layers)])
            if progress is not None:
                ms = ", ".join(f"{s} {t[s] * 1e3:.3f}" for s in STAGES)
                progress(f"rows {rows:>4} context {context:>5}: {ms} ms")
    return samples


def fit_stages(samples: dict[str, list[list[float]]]) -> StageModels:
    """Alpha-beta models of every stage from ``measure_samples``' points."""
    models = {}
    for stage in STAGES + ("shared",):
        if samples.get(stage):
            pts = np.asarray(samples[stage], np.float64)
            models[stage] = LinearModel.fit(pts[:, :-1], pts[:, -1])
    return StageModels(**models)


def profile_executor(executor, sweep: Sweep = Sweep(), progress=None) -> Profile:
    """Measure and fit a Profile for a DisaggregatedExecutor's (mesh, model, dtype)."""
    spec = executor.sub.spec
    samples = measure_samples(executor, sweep, progress)
    devices = executor.sub.attention.devices.flat[0]
    return Profile(
        mesh=mesh_identity(spec),
        model=model_identity(executor.cfg),
        dtype=_dtype_name(executor),
        device=f"{devices.platform}: {devices.device_kind}",
        source=f"measured by jaxmoe profile (rows {list(sweep.rows)}, contexts {list(sweep.contexts)}, "
        f"tokens {sweep.tokens}, median of {sweep.repeats})",
        dims=dims_of(executor.cfg, spec, _dtype_bytes(executor)),
        stages=fit_stages(samples),
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
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    st = profile.stages
    pts = {k: np.asarray(v) for k, v in profile.samples.items()}
    ax = axes[0]
    att = pts["attention"]
    for ctx in sorted({round(p[1] / p[0]) for p in att}):
        sel = att[np.isclose(att[:, 1] / att[:, 0], ctx)]
        sel = sel[np.argsort(sel[:, 0])]
        ax.plot(sel[:, 0], sel[:, 2] * 1e3, "o", label=f"measured, attended {ctx}")
        ax.plot(sel[:, 0], [st.attention(x, x * ctx) * 1e3 for x in sel[:, 0]], "-", color=ax.lines[-1].get_color())
    ax.set(title=f"attention  R²={st.attention.r2:.3f}", xlabel="tokens per instance", ylabel="ms")
    ax.legend(fontsize=7)
    for ax, stage, label in ((axes[1], "expert", "tokens per step"), (axes[2], "a2e", "bytes per instance")):
        p = pts[stage][np.argsort(pts[stage][:, 0])]
        model = getattr(st, stage)
        ax.plot(p[:, 0], p[:, 1] * 1e3, "o", label=f"{stage} measured")
        ax.plot(p[:, 0], [model(x) * 1e3 for x in p[:, 0]], "-", label=f"{stage} fit R²={model.r2:.3f}")
        if stage == "a2e":
            q = pts["e2a"][np.argsort(pts["e2a"][:, 0])]
            ax.plot(q[:, 0], q[:, 1] * 1e3, "s", label="e2a measured")
            ax.plot(q[:, 0], [st.e2a(x) * 1e3 for x in q[:, 0]], "--", label=f"e2a fit R²={st.e2a.r2:.3f}")
        ax.set(title=stage if stage == "expert" else "a2e / e2a", xlabel=label, ylabel="ms")
        ax.legend(fontsize=7)
    fig.suptitle(f"{profile.model} on {profile.mesh} ({profile.dtype}, {profile.device})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
