"""Fit a ``ScalingProfile`` (``scaling.fitted``) from the engine's own measurements on a mesh.

1. **Parts** (``measure_parts``; ``measure_layouts`` for several layouts, with two-phase and with
   direct transfers): on an executor of layout aXeY, one synthetic decode step per
   (rows per attention instance, tokens attended) of the sweep, with random token ids (rows route to
   different experts), run in timing mode -- ``planning.measure.time_phases``, the loop
   ``jaxmoe profile`` uses for FinDEP's stage models. Per layer: the attention, A2E, expert and E2A
   times of the least-contended repeat, the activated experts of the busiest expert instance and
   of all of them (``executor.activated_per_instance``) and the host calls and bytes of the layout's transfer plan.
2. **Step** (``decode_tpot``): the real engine's decode TPOT on that layout (``LLMEngine``: ``batch``
   requests of ``prompt`` tokens, all prefilled in one step, then ``output`` greedy tokens; the
   median step of the least-contended round), fitted against the parts predicted for the same
   (layout, batch, context).

``fit_profile`` turns both into the JSON profile (``LinearModel.fit``: non-negative least squares,
R² per fit; ``fit_llm`` names the model and dtype of an ``LLM``). ``profile_mesh`` does all of it
for a model on a list of layouts of one mesh; ``bench/scaling_model.py`` runs the same pieces with
the TPOTs of every layout measured in interleaved rounds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxmoe.mesh import ClusterSpec
from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.measure import phase_per_layer, synthetic_batch, time_phases
from jaxmoe.findep.profile import ProfileError, model_identity
from jaxmoe.runtime.transfer import plan_transfers
from jaxmoe.janus.scaling.fitted import (
    FittedPerfModel,
    ScalingDims,
    ScalingFits,
    ScalingProfile,
    attention_terms,
    expert_terms,
    layout_spec,
    mesh_family,
    step_terms,
    transfer_terms,
)

PARTS = ("attention", "expert", "a2e", "e2a")


@dataclasses.dataclass(frozen=True)
class FitSweep:
    """Where the parts are measured on every layout: rows per attention instance x contexts."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (32, 128)
    repeats: int = 5
    seed: int = 0

    def __post_init__(self):
        for name in ("rows", "contexts"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ProfileError(f"{name} must be positive integers, got {values!r}")
        if self.repeats < 1:
            raise ProfileError(f"repeats must be >= 1, got {self.repeats}")


@dataclasses.dataclass(frozen=True)
class StepPoint:
    """One measured decode TPOT of the engine."""

    attention: int
    experts: int
    batch: int
    context: float
    tpot: float  # seconds (median decode step)


def measure_parts(
    executor,
    sweep: FitSweep = FitSweep(),
    table_width: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[list[float]]]:
    """``{part: [[terms..., seconds], ...]}`` of one executor's programs over the sweep."""
    moe = list(executor.moe_layers)
    if not moe:
        raise ProfileError("the model has no MoE layer: nothing to profile")
    a, n = executor.num_attention, executor.num_expert_instances
    hidden_bytes = executor.cfg.hidden_size * int(np.dtype(executor.params["embed"].dtype).itemsize)
    spec = executor.sub.spec
    samples: dict[str, list[list[float]]] = {p: [] for p in PARTS}
    for context in sweep.contexts:
        for rows in sweep.rows:
            args = synthetic_batch(executor, rows, context, seed=sweep.seed + rows, table_width=table_width)
            records = time_phases(executor, args, sweep.repeats)
            t = {p: phase_per_layer(records, p, moe, min) for p in PARTS}  # least contended, as decode_tpot
            t["attention"] = phase_per_layer(records, "attention", range(executor.cfg.num_layers), min)
            per_instance = executor.activated_per_instance()
            busiest = statistics.fmean(max(per_instance[i]) for i in moe)
            activated = statistics.fmean(sum(per_instance[i]) for i in moe)
            plan = plan_transfers(spec, rows * hidden_bytes)
            samples["attention"].append([*attention_terms(a, rows, context), t["attention"]])
            fallback = executor.expert_side.program.fallback_above
            samples["expert"].append([*expert_terms(n, busiest, activated, a * rows, fallback), t["expert"]])
            for d in ("a2e", "e2a"):
                samples[d].append([*transfer_terms(spec, plan, d), t[d]])
            if progress is not None:
                ms = ", ".join(f"{p} {t[p] * 1e3:.3f}" for p in PARTS)
                progress(
                    f"{a}a{n}e rows {rows:>3} context {context:>4}: {ms} ms/layer, activated {busiest:.2f} / {activated:.2f}"
                )
    return samples


def decode_tpot(engine, batch: int, prompt: int, output: int, seed: int = 0, rounds: int = 1) -> StepPoint:
    """The engine's decode TPOT: ``batch`` requests of ``prompt`` random tokens prefilled in one step,
    then ``output`` greedy tokens each, after a short warm-up round of the same batch (which compiles
    its shapes); the median decode step of each of ``rounds`` rounds, the least of them (on a shared
    machine other jobs only ever add time: the least-contended round is the closest to the engine's
    own). The engine must be idle."""
    cfg = engine.config
    if engine.has_work():
        raise ProfileError("decode_tpot needs an idle engine")
    if batch < 1 or prompt < 1 or output < 2 or rounds < 1:
        raise ProfileError(
            f"batch, prompt and rounds must be >= 1 and output >= 2, got {batch}, {prompt}, {rounds}, {output}"
        )
    if batch > cfg.max_num_seqs or prompt > cfg.max_prefill_chunk or batch * prompt > cfg.max_batch_tokens:
        raise ProfileError(
            f"batch {batch} x prompt {prompt} must fit one prefill step: max_num_seqs {cfg.max_num_seqs}, "
            f"max_prefill_chunk {cfg.max_prefill_chunk}, max_batch_tokens {cfg.max_batch_tokens}"
        )
    from jaxmoe.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.cfg.vocab_size

    def run(tokens: int) -> list[float]:
        for _ in range(batch):
            ids = [int(t) for t in rng.integers(3, min(vocab, 250), size=prompt)]
            engine.add_request(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
        times = []
        while engine.has_work():
            t = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t)
            failed = [o.error for o in outs if o.error is not None]
            if failed:
                raise ProfileError(f"a request failed while measuring: {failed[0]}")
        return times

    run(3)
    tpot = min(statistics.median(run(output)[1:]) for _ in range(rounds))  # step 0 prefills every prompt
    ex = engine.executor
    return StepPoint(ex.num_attention, ex.num_expert_instances, batch, prompt + output / 2, tpot)


def fit_parts(samples: dict[str, list[list[float]]]) -> dict[str, LinearModel]:
    out = {}
    for part in PARTS:
        pts = np.asarray(samples[part], np.float64)
        out[part] = LinearModel.fit(pts[:, :-1], pts[:, -1])
    return out


def fit_profile(
    samples: dict[str, list[list[float]]],
    steps: Sequence[StepPoint],
    base: ClusterSpec,
    dims: ScalingDims,
    *,
    model: str,
    dtype: str,
    device: str = "unknown",
    source: str = "fitted",
) -> ScalingProfile:
    """The profile from part samples (``measure_parts``, several layouts concatenated) and engine
    TPOTs (``decode_tpot``): the parts first, then the step model against their predicted sum."""
    parts = fit_parts(samples)
    identity = LinearModel(alpha=0.0, betas=(0.0, 1.0))  # step = the parts' sum, to predict the parts
    draft = ScalingProfile(
        mesh=mesh_family(base),
        model=model,
        dtype=dtype,
        device=device,
        source=source,
        dims=dims,
        fits=ScalingFits(**parts, step=identity),
    )
    pm = FittedPerfModel(draft, base, kv_tokens=1 << 30, max_batch=1 << 30)
    rows = []
    for p in steps:
        pred = pm.parts(p.batch, p.context, p.attention, p.experts)
        rows.append([*step_terms(pred["rows"], pred["sum"]), p.tpot])
    if len(rows) < 3:
        raise ProfileError(f"the step model needs at least 3 measured TPOTs, got {len(rows)}")
    pts = np.asarray(rows, np.float64)
    step = LinearModel.fit(pts[:, :-1], pts[:, -1])
    return draft.model_copy(
        update={
            "fits": ScalingFits(**parts, step=step),
            "samples": {**{k: list(map(list, v)) for k, v in samples.items()}, "step": pts.tolist()},
        }
    )


def dims_of(cfg, spec: ClusterSpec, dtype_bytes: int, fallback_above: int | None = None) -> ScalingDims:
    return ScalingDims(
        layers=cfg.num_layers,
        moe_layers=cfg.num_moe_layers,
        experts=cfg.moe.num_experts,
        top_k=cfg.moe.top_k,
        hidden=cfg.hidden_size,
        dtype_bytes=dtype_bytes,
        slots_per_instance=spec.experts.slots_per_instance,
        num_devices=spec.num_devices,
        fallback_above=fallback_above,
    )


def build_llm(model, base: ClusterSpec, attention: int, experts: int, two_phase: bool = True, **llm_kwargs):
    """An ``LLM`` of ``model`` on layout aXeY of ``base``'s devices."""
    from jaxmoe.llm import LLM

    return LLM(model, mesh=layout_spec(base, attention, experts, two_phase), **llm_kwargs)


def measure_layouts(
    model,
    base: ClusterSpec,
    layouts: Sequence[tuple[int, int]],
    sweep: FitSweep = FitSweep(),
    direct_sweep: FitSweep | None = FitSweep(rows=(1, 8), contexts=(32,), repeats=3),
    progress: Callable[[str], None] | None = None,
    **llm_kwargs,
) -> dict[str, list[list[float]]]:
    """Part samples (``measure_parts``) of every layout, on the executor of an ``LLM`` built as
    ``build_llm`` builds it (the block tables as wide as its engine's). ``direct_sweep``: the parts
    are also measured over this sweep with direct transfers, so the transfer fits see the hop counts
    of both plans (None: not)."""
    samples: dict[str, list[list[float]]] = {p: [] for p in PARTS}
    for a, e in layouts:
        for two_phase, where in ((True, sweep), (False, direct_sweep)):
            if where is None:
                continue
            llm = build_llm(model, base, a, e, two_phase, **llm_kwargs)
            part = measure_parts(llm.executor, where, llm.engine.runner.max_blocks_per_seq, progress)
            for k, v in part.items():
                samples[k] += v
            del llm
    return samples


def profile_mesh(
    model,
    base: ClusterSpec,
    layouts: Sequence[tuple[int, int]],
    batches: Sequence[int],
    *,
    sweep: FitSweep = FitSweep(),
    prompt: int = 48,
    output: int = 24,
    rounds: int = 1,
    direct_sweep: FitSweep | None = FitSweep(rows=(1, 8), contexts=(32,), repeats=3),
    progress: Callable[[str], None] | None = None,
    **llm_kwargs,
) -> tuple[ScalingProfile, list[StepPoint]]:
    """Measure the parts (``measure_layouts``) and the engine's TPOT at ``batches`` on every layout
    (``decode_tpot`` with ``rounds``), and fit the profile. ``llm_kwargs`` go to ``LLM`` (dtype,
    num_blocks, block_size, max_num_seqs, ...)."""
    if not layouts:
        raise ProfileError("no layout to profile")
    samples = measure_layouts(model, base, layouts, sweep, direct_sweep, progress, **llm_kwargs)
    steps: list[StepPoint] = []
    for a, e in layouts:
        llm = build_llm(model, base, a, e, **llm_kwargs)
        for b in batches:
            steps.append(decode_tpot(llm.engine, b, prompt, output, sweep.seed, rounds))
            if progress is not None:
                progress(f"{a}a{e}e batch {b}: engine decode step {steps[-1].tpot * 1e3:.2f} ms")
    where = (
        f"layouts {_names(layouts)}, batches {list(batches)}, rows {list(sweep.rows)}, contexts {list(sweep.contexts)}"
    )
    return fit_llm(llm, base, samples, steps, where), steps


def fit_llm(llm, base: ClusterSpec, samples, steps: Sequence[StepPoint], where: str = "") -> ScalingProfile:
    """``fit_profile`` for the model and dtype ``llm`` (an ``LLM``) serves, on ``base``'s devices."""
    dt = np.dtype(llm.executor.params["embed"].dtype)
    device = jax.devices()[0]
    return fit_profile(
        samples,
        steps,
        base,
        dims_of(llm.cfg, base, dt.itemsize, llm.executor.expert_side.program.fallback_above),
        model=model_identity(llm.cfg),
        dtype=str(dt),
        device=f"{device.platform}: {device.device_kind}",
        source=f"fitted from the engine's measurements on {where}",
    )


def _names(layouts) -> str:
    return ", ".join(f"{a}a{e}e" for a, e in layouts)
