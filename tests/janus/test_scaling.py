"""JANUS scaling control plane: the performance model's shape, the controller against brute force,
steady states that satisfy Little's law, the seeded trace, and `jaxmoe simulate`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe.janus.scaling import PerfModel, ScalingController, TraceShape, candidates, simulate, synthesize
from jaxmoe.janus.scaling.controller import JANUS, MONOLITHIC, Layout, Load, steady_state

PM = PerfModel()
LOAD = dict(output_tokens=256.0, context=144.0)


def test_moe_time_grows_linearly_with_activated_experts():
    """JANUS Takeaway #2: memory-bound MoE time is linear in the experts an instance activates."""
    per = PM.model.expert_bytes / PM.hw.memory_bandwidth
    for instances in (6, 8, 16):
        for tokens in (1, 4, 16, 64):
            act = PM.activated_per_instance(tokens, instances, balanced=True)
            assert PM.moe_s(tokens, instances) == pytest.approx(PM.hw.launch_overhead + act * per)
            assert act <= PM.activated_per_instance(tokens, instances, balanced=False) + 1e-9
    assert PM.distinct_experts(10_000) == pytest.approx(PM.model.experts)
    assert PM.activated_per_instance(10_000, 8, True) == PM.model.experts / 8


def test_monolithic_baseline_splits_attention_only_as_far_as_memory_needs():
    """JANUS's SGLang baseline: data-parallel attention groups, tensor-parallel only where the
    weights would not fit beside the expert shard (DeepSeek-V2 on 16 H100s: pairs)."""
    m, hw = PM.model, PM.hw
    assert 16 * (hw.memory - m.other_bytes_total) < m.expert_bytes_total  # full weights on all 16 do not fit
    assert PM.monolithic_tp(16) == 2 and PM.monolithic_tp(32) == 1 and PM.monolithic_tp(64) == 1
    # the MLA cache is not split over a group's GPUs: at tp 2 each sequence's cache is held twice
    per_seq = 144.0 * m.kv_bytes_per_token_layer * m.layers
    free = 16 * (hw.memory - m.other_bytes_total / 2) - m.expert_bytes_total
    assert PM.monolithic_capacity(16, 144.0) == pytest.approx(free / (2 * per_seq))


def test_steady_state_satisfies_littles_law():
    for system, layout in ((JANUS, Layout(9, 2, 7)), (MONOLITHIC, Layout(16))):
        for rate in (1.0, 10.0, 30.0):
            batch, tpot = steady_state(PM, system, layout, Load(rate, **LOAD))
            assert batch == pytest.approx(rate * 256.0 * tpot, rel=1e-3)
    assert steady_state(PM, JANUS, Layout(7, 1, 6), Load(1e6, **LOAD)) is None  # cannot keep up


@pytest.mark.parametrize("rate", [0.5, 8.0, 40.0, 150.0])
def test_controller_picks_the_least_cost_layout_meeting_the_slo(rate):
    layouts = candidates(PM, "janus", max_gpus=48)
    ctl = ScalingController(PM, JANUS, layouts, slo_tpot=0.2, margin=0.85)
    load = Load(rate, **LOAD)
    feasible = [lay for lay in layouts if (s := steady_state(PM, JANUS, lay, load)) is not None and s[1] <= 0.85 * 0.2]
    want = min(feasible, key=lambda lay: (lay.gpus, lay.attention)) if feasible else None
    got = ctl.best(load)
    assert want is not None and got.gpus == want.gpus
    assert got.attention >= 1 and got.experts >= PM.min_expert_instances()


def test_controller_scales_down_only_after_agreeing_decisions():
    ctl = ScalingController(PM, JANUS, candidates(PM, "janus", max_gpus=64), slo_tpot=0.2, down_after=2)
    high = ctl.decide(Load(120.0, **LOAD))
    assert ctl.decide(Load(2.0, **LOAD)) == high  # one low reading: hold
    low = ctl.decide(Load(2.0, **LOAD))
    assert low.gpus < high.gpus
    assert ctl.decide(Load(120.0, **LOAD)) == high  # up at once


def test_trace_is_seeded_and_shaped():
    shape = TraceShape(days=1, mean_rate=10, peak_to_trough=4, bursts_per_day=0, jitter=0)
    a, b = synthesize(shape, 3), synthesize(shape, 3)
    np.testing.assert_array_equal(a, b)
    assert len(a) == 1440 and a.mean() == pytest.approx(10, rel=0.01)
    assert a.max() / a.min() == pytest.approx(4, rel=0.01)
    assert not np.array_equal(synthesize(TraceShape(days=1), 1), synthesize(TraceShape(days=1), 2))
    with pytest.raises(ValueError, match="peak_to_trough"):
        TraceShape(peak_to_trough=0.5)


def test_simulation_counts_gpu_hours_and_attainment():
    rates = synthesize(TraceShape(days=0.25, mean_rate=20), 0)
    fixed = simulate(rates, "monolithic-16", pm=PM)
    assert fixed["gpu_hours"] == pytest.approx(16 * len(rates) / 60)
    janus = simulate(rates, "janus", pm=PM, interval=15, headroom=1.5)
    assert janus["gpu_hours"] < fixed["gpu_hours"] and 0.9 <= janus["slo_attainment"] <= 1.0
    assert len(janus["layouts"]) == -(-len(rates) // 15)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(rates, "magic")


@pytest.mark.slow
def test_simulate_cli_json(capsys, tmp_path):
    from jaxmoe.cli import main

    png = tmp_path / "sim.png"
    assert (
        main(["simulate", "--days", "0.25", "--mean-rate", "20", "--interval", "15", "--json", "--plot", str(png)]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in ("janus", "monolithic_best", "disagg"):
        assert {"gpu_hours", "slo_attainment"} <= set(out[key])
    assert out["janus"]["slo_attainment"] >= 0.99 and png.stat().st_size > 10_000
    assert out["gpu_hours_saved_vs_monolithic"] == pytest.approx(
        1 - out["janus"]["gpu_hours"] / out["monolithic_best"]["gpu_hours"], abs=1e-3
    )
    assert main(["simulate", "--target", "0"]) == 2
    assert "--target" in capsys.readouterr().err
