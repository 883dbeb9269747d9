"""The JANUS scaling profile (``jaxmoe.janus.scaling.fit`` / ``fitted``): the fit recovers known
coefficients from synthetic measurements, and on a tiny model the profile fitted on the CPU mesh
predicts the engine's decode TPOT of a batch it was not fitted on within a loose bound."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe.mesh import load_mesh
from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.profile import ProfileError
from jaxmoe.janus.reshard import rescaled_spec
from jaxmoe.runtime.transfer import plan_transfers
from jaxmoe.janus.scaling.controller import JANUS, Layout, Load, ScalingController
from jaxmoe.janus.scaling.fit import FitSweep, StepPoint, build_llm, decode_tpot, fit_profile, profile_mesh
from jaxmoe.janus.scaling.fitted import (
    FittedPerfModel,
    ScalingDims,
    ScalingFits,
    ScalingProfile,
    attention_terms,
    expert_terms,
    layout_spec,
    mesh_family,
    transfer_terms,
)

BASE = load_mesh("meshes/cpu-8.yaml")
DIMS = ScalingDims(
    layers=4,
    moe_layers=3,
    experts=8,
    top_k=2,
    hidden=64,
    dtype_bytes=4,
    slots_per_instance=4,
    num_devices=8,
    fallback_above=12,
)
TRUE = ScalingFits(
    attention=LinearModel(alpha=1e-4, betas=(5e-5, 2e-6, 1e-8, 3e-8)),
    expert=LinearModel(alpha=2e-4, betas=(3e-4, 5e-4, 6e-5, 1e-6, 4e-6)),
    a2e=LinearModel(alpha=1e-4, betas=(2e-5, 3e-5, 5e-6, 1e-9)),
    e2a=LinearModel(alpha=3e-4, betas=(4e-5, 2e-5, 7e-6, 2e-9)),
    step=LinearModel(alpha=3e-3, betas=(1e-5, 0.8)),
)


def _profile(fits=TRUE, model="m", dtype="float32") -> ScalingProfile:
    return ScalingProfile(
        mesh=mesh_family(BASE), model=model, dtype=dtype, device="test", source="given", dims=DIMS, fits=fits
    )


def _synthetic_samples(rng):
    """Part samples as ``measure_parts`` records them, timed by the TRUE models."""
    samples = {p: [] for p in ("attention", "expert", "a2e", "e2a")}
    for a, e in ((1, 7), (2, 6), (3, 5), (4, 4)):
        for two_phase in (True, False):
            spec = layout_spec(BASE, a, e, two_phase)
            for rows in (1, 2, 4, 8):
                for context in (32, 128):
                    x = attention_terms(a, rows, context)
                    samples["attention"].append([*x, TRUE.attention(*x)])
                    busiest = float(rng.uniform(1, 4))
                    x = expert_terms(e, busiest, busiest * e * rng.uniform(0.6, 1), a * rows, DIMS.fallback_above)
                    samples["expert"].append([*x, TRUE.expert(*x)])
                    plan = plan_transfers(spec, rows * DIMS.hidden * DIMS.dtype_bytes)
                    for d in ("a2e", "e2a"):
                        x = transfer_terms(spec, plan, d)
                        samples[d].append([*x, getattr(TRUE, d)(*x)])
    return samples


def test_fit_recovers_known_coefficients_and_predicts_like_the_true_model(tmp_path):
    rng = np.random.default_rng(0)
    truth = FittedPerfModel(_profile(), BASE, kv_tokens=4096, max_batch=64)
    steps = [
        StepPoint(a, e, b, 60.0, truth.tpot_disaggregated(b, 60.0, a, e))
        for a, e in ((1, 7), (2, 6), (4, 4))
        for b in (1, 5, 16)
    ]
    prof = fit_profile(_synthetic_samples(rng), steps, BASE, DIMS, model="m", dtype="float32")
    for name in ScalingFits.model_fields:
        got, want = getattr(prof.fits, name), getattr(TRUE, name)
        assert got.alpha == pytest.approx(want.alpha, rel=1e-5, abs=1e-12), name
        assert got.betas == pytest.approx(want.betas, rel=1e-5, abs=1e-12), name
        assert got.r2 == pytest.approx(1.0, abs=1e-9), name
    fitted = FittedPerfModel(ScalingProfile.load(prof.save(tmp_path / "p.json")), BASE, 4096, 64)
    for a, e, b, two_phase, balanced in ((3, 5, 6, True, True), (5, 3, 12, False, False), (6, 2, 3, True, False)):
        want = truth.tpot_disaggregated(b, 200.0, a, e, balanced, two_phase)
        assert fitted.tpot_disaggregated(b, 200.0, a, e, balanced, two_phase) == pytest.approx(want, rel=1e-5)
    # direct transfers have more hops than two-phase on 4a4e (attention node 0 -> expert node 1)
    assert fitted.tpot_disaggregated(8, 60, 4, 4, two_phase=False) > fitted.tpot_disaggregated(8, 60, 4, 4)
    assert fitted.kv_capacity(2, 64) == 64 and fitted.kv_capacity(2, 1024) == 4


def test_profile_identity_and_controller_protocol(tmp_path):
    prof = _profile()
    with pytest.raises(ProfileError, match="model 'm', not 'other'"):
        prof.check(model="other")
    other_mesh = rescaled_spec(BASE, 2, 6, slots_per_instance=2)  # other slots: another family
    with pytest.raises(ProfileError, match="mesh"):
        FittedPerfModel(prof, other_mesh, 4096, 64)
    (tmp_path / "bad.json").write_text('{"kind": "jaxmoe-scaling-profile", "mesh": 3}')
    with pytest.raises(ProfileError, match="bad.json"):
        ScalingProfile.load(tmp_path / "bad.json")
    pm = FittedPerfModel(prof, BASE, 4096, 16)
    ctl = ScalingController(pm, JANUS, [Layout(3, 1, 2), Layout(8, 2, 6), Layout(8, 4, 4)], slo_tpot=1.0)
    assert ctl.decide(Load(rate=0.1, output_tokens=8, context=32)) == Layout(3, 1, 2)  # cheapest meets it
    with pytest.raises(TypeError, match="DisaggregatedPerf"):
        ScalingController(object(), JANUS, [Layout(3, 1, 2)], slo_tpot=1.0)


ENGINE = dict(dtype="float32", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=16, max_batch_tokens=64)


@pytest.mark.slow
def test_profile_fitted_on_the_cpu_mesh_predicts_a_measured_tpot(checkpoint_dir):
    """Fit on two layouts (parts over a small sweep, engine TPOT at batches 1 and 4), then predict the
    engine's TPOT at batch 2 (not fitted on): within a loose bound (the machine is shared and noisy)."""
    path = checkpoint_dir("mixtral")
    sweep = FitSweep(rows=(1, 2), contexts=(8, 24), repeats=2)
    prof, steps = profile_mesh(
        str(path), BASE, [(2, 6), (4, 4)], [1, 4], sweep=sweep, direct_sweep=None, prompt=8, output=6, **ENGINE
    )
    assert len(steps) == 4 and all(p.tpot > 0 for p in steps)
    assert set(prof.r2()) == {"attention", "expert", "a2e", "e2a", "step"}
    assert len(prof.samples["attention"]) == 8 and len(prof.samples["step"]) == 4
    llm = build_llm(str(path), BASE, 4, 4, **ENGINE)
    measured = decode_tpot(llm.engine, 2, 8, 6)
    predicted = FittedPerfModel(prof, BASE, 64 * 8, 4).tpot_disaggregated(2, measured.context, 4, 4)
    assert 0.4 < predicted / measured.tpot < 2.5, (predicted, measured)
    with pytest.raises(ProfileError, match="one prefill step"):
        decode_tpot(llm.engine, 8, 8, 6)


@pytest.mark.slow
def test_scaling_profile_command_writes_what_serve_finds(tmp_path, capsys):
    """``jaxmoe scaling-profile`` fits a profile on the mesh (a small sweep) and writes it under the
    name ``jaxmoe serve --autoscale --scaling-profile DIR`` looks for; a bad layout is named."""
    from jaxmoe.cli import main
    from jaxmoe.janus.scaling.fitted import find_profile

    args = ["scaling-profile", "--model", "tiny-random", "--mesh", "meshes/cpu-8.yaml", "--dtype", "float32"]
    small = ["--layouts", "4a4e", "--batches", "1,2,4", "--rows", "1,2", "--contexts", "8,16,24", "--repeats", "1"]
    small += ["--rounds", "1", "--prompt-tokens", "8", "--output-tokens", "4", "--no-direct", "--max-num-seqs", "4"]
    assert main(args + small + ["--num-blocks", "64", "--out", str(tmp_path)]) == 0
    assert "scaling profile written to" in capsys.readouterr().out
    prof = ScalingProfile.load(next(tmp_path.iterdir()))
    assert find_profile(tmp_path, mesh_family(BASE), prof.model, "float32") is not None
    assert len(prof.samples["attention"]) == 6 and len(prof.samples["step"]) == 3
    assert FittedPerfModel(prof, BASE, 64 * 16, 4).tpot_disaggregated(2, 12, 2, 6) > 0  # any layout of the mesh
    with pytest.raises(SystemExit) as bad:
        main(args + ["--layouts", "2x6", "--out", str(tmp_path)])
    assert bad.value.code == 2
    assert "argument --layouts: '2x6' is not an aXeY layout" in capsys.readouterr().err
