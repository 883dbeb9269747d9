"""``jaxmoe serve --autoscale`` logic: the scaling controller driving live re-scaling (``Autoscaler``),
with a controlled clock and a stand-in controller; and the real controller's candidate layouts."""

from __future__ import annotations

import pytest

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe import LLM, SamplingParams
from jaxmoe.janus.scaling.autoscale import Autoscaler, attach, layouts_that_fit
from jaxmoe.janus.scaling.controller import Layout

ENGINE = dict(dtype="float32", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=16, max_batch_tokens=32)


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(checkpoint_dir("mixtral"), mesh="meshes/cpu-8.yaml", **ENGINE)


class Scripted:
    """A controller that answers the next layout of its script (the ``Autoscaler``'s controller
    interface: ``decide(window, serving)``)."""

    def __init__(self, script):
        self.script, self.current, self.loads = list(script), None, []

    def decide(self, window, serving: Layout) -> Layout:
        self.loads.append(window.load)
        self.current = self.script.pop(0)
        return self.current


def test_layouts_that_fit_the_cpu_mesh():
    got = layouts_that_fit(8, 8, 4)
    assert Layout(8, 2, 6) in got and Layout(8, 4, 4) in got and Layout(3, 1, 2) in got
    assert all(a.attention + a.experts <= 8 and a.experts * 4 >= 8 for a in got)
    assert Layout(2, 1, 1) not in got  # 4 slots cannot hold 8 experts


def test_layouts_that_fit_count_instances_of_k_devices():
    """Tensor-parallel instances (a rescale keeps their devices per instance): 2-device attention and
    expert instances with 8 slots each on 8 devices."""
    got = layouts_that_fit(8, 8, 8, attention_devices=2, expert_devices=2)
    assert set(got) == {
        Layout(4, 1, 1),
        Layout(6, 1, 2),
        Layout(8, 1, 3),
        Layout(6, 2, 1),
        Layout(8, 2, 2),
        Layout(8, 3, 1),
    }
    assert Layout(8, 2, 4) in layouts_that_fit(8, 8, 4, attention_devices=2)
    assert all(a.attention * 2 + a.experts <= 8 for a in layouts_that_fit(8, 8, 4, attention_devices=2))


def test_attach_builds_the_real_controller(llm):
    scaler = attach(llm.engine, slo_tpot_s=0.05, interval_s=3600)
    assert scaler in llm.engine.hooks
    assert scaler.controller.current == Layout(8, 2, 6)
    assert Layout(8, 4, 4) in scaler.controller.layouts
    shape = scaler.controller.pm.model
    assert shape.experts == 8 and 0 < shape.expert_bytes_total < shape.expert_bytes_total + shape.other_bytes_total
    try:
        decision = scaler.decide()  # a real decision over the fitting layouts
        assert decision.layout in scaler.controller.layouts
    finally:
        llm.engine.hooks.remove(scaler)
        if LiveRescaler.of(llm.engine).job is not None:  # it may have started one: let it finish
            assert LiveRescaler.of(llm.engine).job.wait_ready(300)
            LiveRescaler.of(llm.engine).apply()
        if llm.executor.num_attention != 2:
            llm.rescale(2, 6)


@pytest.mark.slow
def test_autoscaler_rescales_the_engine_when_the_decision_changes(llm):
    engine = llm.engine
    now = [0.0]
    ctl = Scripted([Layout(8, 2, 6), Layout(8, 4, 4)])
    scaler = Autoscaler(engine, ctl, interval_s=10.0, clock=lambda: now[0])
    engine.add_hook(scaler)
    for i in range(3):
        engine.add_request([5 + i, 9, 11], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert not scaler.decisions  # before the interval
    now[0] = 10.0
    engine.step()
    d = scaler.decisions[-1]
    assert d.layout == Layout(8, 2, 6) and not d.started  # already serving it
    assert d.load.rate == pytest.approx(0.3) and d.load.output_tokens == 30
    now[0] = 20.0
    engine.step()
    assert scaler.decisions[-1].started and LiveRescaler.of(engine).job is not None
    job = LiveRescaler.of(engine).job
    for _ in range(5000):
        if job.done() or not engine.has_work():
            break
        engine.step()
    assert job.wait_ready(300)
    LiveRescaler.of(engine).apply()  # idle: swapped now (serving, it is swapped at the next step)
    assert job.result(60).attention == 4 and llm.executor.num_attention == 4


def test_serve_autoscale_needs_a_mesh_and_an_slo(capsys):
    from jaxmoe.cli import main

    assert main(["serve", "--autoscale", "--model", "tiny-random"]) == 2
    assert "--autoscale needs --mesh and --slo-tpot-ms" in capsys.readouterr().err


def test_attach_uses_the_fitted_model_when_a_profile_is_given(llm, tmp_path):
    """With a scaling profile for the served mesh, model and dtype the controller's model is the
    fitted one (``FittedPerfModel``, through the ``DisaggregatedPerf`` protocol); a profile made for
    another model is refused, naming the field."""
    from jaxmoe.findep.linear import LinearModel
    from jaxmoe.findep.profile import ProfileError, model_identity
    from jaxmoe.janus.scaling.autoscale import fitted_model
    from jaxmoe.janus.scaling.fit import dims_of
    from jaxmoe.janus.scaling.fitted import FittedPerfModel, ScalingFits, ScalingProfile, mesh_family

    ex = llm.executor
    lin = lambda n: LinearModel(alpha=1e-3, betas=(1e-4,) * n)  # noqa: E731
    fits = ScalingFits(attention=lin(4), expert=lin(3), a2e=lin(2), e2a=lin(2), step=lin(2))
    prof = ScalingProfile(
        mesh=mesh_family(ex.sub.spec),
        model=model_identity(ex.cfg),
        dtype="float32",
        device="test",
        source="given",
        dims=dims_of(ex.cfg, ex.sub.spec, 4),
        fits=fits,
    )
    path = prof.save(tmp_path / "scaling.json")
    scaler = attach(llm.engine, slo_tpot_s=0.05, interval_s=3600, profile=path)
    try:
        assert isinstance(scaler.controller.pm, FittedPerfModel)
        assert scaler.controller.pm.kv_capacity(2, 8) == 4  # max_num_seqs of the engine
    finally:
        llm.engine.hooks.remove(scaler)
    with pytest.raises(ProfileError, match="model"):
        fitted_model(llm.engine, prof.model_copy(update={"model": "another"}))
    # a directory: the profile made for this mesh, model and dtype when it holds one, else none
    found = tmp_path / "profiles"
    found.mkdir()
    assert fitted_model(llm.engine, found) is None
    prof.model_copy(update={"model": "another"}).save(found)  # another model's: not picked
    assert fitted_model(llm.engine, found) is None
    assert prof.save(found).name == prof.filename
    assert isinstance(fitted_model(llm.engine, found), FittedPerfModel)


@pytest.mark.slow
def test_scaling_profile_needs_autoscale(capsys):
    from jaxmoe.cli import main

    assert main(["serve", "--scaling-profile", "p.json", "--model", "tiny-random", "--mesh", "meshes/cpu-8.yaml"]) == 2
    assert "--scaling-profile is the --autoscale performance model" in capsys.readouterr().err
