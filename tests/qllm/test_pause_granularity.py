"""The pause granularity of layer preemption's default (``qllm.granularity``): measured, the finest
whose pausable steps cost within 2 % of the fused step's, else step-level preemption (every step fused).
The timings are injected here (``LayerPreemption.time_step``), so the choice is known; tokens stay
exactly the standalone ones with whatever is chosen."""

from __future__ import annotations

import math

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.qllm import granularity
from jaxmoe.qllm.layer_preemption import LayerPreemption

BE = SamplingParams(max_tokens=6, ignore_eos=True)
LS = SamplingParams(max_tokens=3, ignore_eos=True)
ARRIVALS = [(1, 0), (2, 1), (3, 0)]  # (engine step, pause point of it) per LS prompt


def test_candidates_and_choice():
    assert granularity.candidates([8]) == [1, 2, 3, 4, 8]  # per number of calls, the finest
    assert granularity.candidates([1, 7]) == [1, 2, 3, 4, 7]
    assert granularity.choose({1: 0.05, 2: 0.019, 4: 0.0}) == 2
    assert granularity.choose({1: 0.021, 4: 0.03}) == 0  # none within 2 %: step-level
    assert granularity.choose({1: 0.05, 2: 0.04}, budget=0.05) == 1
    assert granularity.decode_shapes([(1, 1), (4, 16), (8, 1), (2, 1)]) == [(1, 1), (8, 1)]
    assert granularity.decode_shapes([(4, 16), (1, 32)]) == [(1, 32)]


def _calls_cost(per_call: float):
    """A ``StepTimer`` where the fused step takes 1 s and a pausable one ``per_call`` more per program
    call (embed, one ``layers`` call per ``every`` layers of each group, head)."""

    def time_step(engine, rows, tokens, every):
        if every == 0:
            return 1.0
        sizes = engine.runner.executor.layer_group_sizes()
        return 1.0 + per_call * (2 + sum(math.ceil(n / every) for n in sizes))

    return time_step


@pytest.mark.slow
@pytest.mark.parametrize("per_call,chosen", [(0.001, 1), (0.004, 2), (0.01, 0)])
def test_costly_calls_make_the_pauses_coarser_and_tokens_stay_exact(per_call, chosen, tiny_llm, drive, metric_families):
    """The 4-layer model (one layer group): 6 calls per pausable step at every layer, 4 at every 2nd, 3
    at every 4th. Cheap calls: every layer; 0.4 % per call: every layer costs 2.4 %, every 2nd 1.6 %,
    so 2; 1 % per call: none within 2 %, so step-level (no step pauses, every step fused, the LS
    arrivals wait for the step's end). Measured at the first step that could pause (no warm-up with a
    poll here); tokens equal the standalone ones; ``jaxmoe_pause_every`` says what was chosen."""
    llm = tiny_llm(pause_every=None)  # the default: measured
    engine, hook = llm.engine, llm.engine.layer_hook
    assert isinstance(hook, LayerPreemption) and hook.pause_every is None
    hook.time_step = _calls_cost(per_call)
    points, between = [], hook.between_layers
    hook.between_layers = lambda engine, layer: points.append(int(layer)) or between(engine, layer)
    fused, step = [], llm.executor._step
    llm.executor._step = lambda *a: fused.append(1) or step(*a)
    inside, overdue = drive(llm, ARRIVALS, BE, LS)
    assert hook.pause_every == chosen and set(hook.pause_costs) == {1, 2, 4}
    assert hook.pause_costs[4] == pytest.approx(3 * per_call)
    if chosen:
        assert llm.executor.pause_every == chosen and llm.executor.split_step
        assert set(points) == set(range(chosen, 5, chosen))  # the last (4) is the one before the head
        assert inside >= 2 and overdue == 0  # seen mid-step (one may merge into a step it already joined)
    else:
        assert not hook.pauses_steps and not llm.executor.split_step
        assert points == [] and (inside, overdue) == (0, 3) and fused  # step-level: fused steps
    gauge = metric_families(engine)["jaxmoe_pause_every"].samples[0]
    assert gauge.value == chosen


@pytest.mark.slow
@pytest.mark.parametrize("per_call", [None, 0.001], ids=["real-timings", "cheap-calls"])
def test_warm_up_measures_on_the_real_steps_and_compiles_what_the_choice_runs(per_call):
    """With a serving loop's poll (``AsyncEngine`` sets it before warm-up), warm-up measures the decode
    shapes' steps (real timings: the choice follows the costs it logs, whatever this machine gives)
    and then compiles the programs of the choice: the layer-by-layer ones where steps pause, the fused
    ones where none does (with injected cheap calls: every layer). An explicit ``pause_every`` or
    ``layer_preemption=True`` is not measured."""
    from jaxmoe.compilation import compile_events
    from jaxmoe.engine.warmup import warm_up

    assert LLM("tiny-random", pause_every=2, num_blocks=16).engine.layer_hook.pause_every == 2
    assert LLM("tiny-random", layer_preemption=True, num_blocks=16).engine.layer_hook.pause_every == 1
    llm = LLM("tiny-random", num_blocks=16, max_num_seqs=2, max_prefill_chunk=16, max_model_len=64)
    engine, hook = llm.engine, llm.engine.layer_hook
    engine.poll = lambda: None
    if per_call is not None:
        hook.time_step = _calls_cost(per_call)
    shapes = [(1, 1), (2, 1), (1, 16)]
    warm_up(engine, shapes, progress=False, workers=2)
    assert set(hook.pause_costs) == {1, 2, 4} and all(math.isfinite(c) for c in hook.pause_costs.values())
    assert hook.pause_every == granularity.choose(hook.pause_costs)
    assert per_call is None or hook.pause_every == 1  # cheap calls: every layer
    assert llm.executor.split_step == hook.pauses_steps
    if hook.pauses_steps:
        assert llm.executor.pause_every == hook.pause_every
    before = compile_events()["programs"]
    for rows, tokens in shapes:  # what a served step of the choice runs: compiled already
        engine.runner.warm(rows, tokens, layer_by_layer=hook.pauses_steps)
    assert compile_events()["programs"] == before
