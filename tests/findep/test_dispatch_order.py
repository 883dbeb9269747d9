"""The disaggregated executor dispatches a pipelined step in the order of the solver's event model.

``schedule.dispatch_order`` sorts a step's tasks by their start in the event model (``simulate``);
FinDEP's choosers attach it to every plan (``Pipeline.dispatch``); the executor dispatches in that
order and, with ``record_dispatch``, records what it dispatched. Here: the sequence's properties
(a valid order; E2A right after its expert program when the experts are the bottleneck; layer t+1's
attention of micro-batch 0 before the last micro-batch's experts of layer t when attention is), and
on the cpu-8 mesh the recorded order equals the event model's for several (order, r1, r2) with the
monolithic executor's logits and greedy tokens unchanged.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jaxmoe.findep.paper_profile import paper_profile
from jaxmoe.findep.profile import dims_of, mesh_identity, model_identity
from jaxmoe.findep.schedule import StageTimes, dispatch_order, simulate
from jaxmoe.findep.solver import BatchShape, stage_times
from jaxmoe.runtime.pipeline import TASKS, Pipeline, expected_tasks, program_order

MESH = str(pathlib.Path(__file__).resolve().parents[2] / "meshes" / "cpu-8.yaml")
ATTENTION_BOUND = StageTimes(attention=10.0, shared=0.5, a2e=1.0, expert=1.0, e2a=1.0)
EXPERT_BOUND = StageTimes(attention=1.0, shared=0.5, a2e=1.0, expert=5.0, e2a=1.0)
LAYERS = (False, True, True)  # a dense layer first, as in DeepSeek


def _valid(seq, moe, r2) -> None:
    from jaxmoe.runtime.disaggregated import _check_dependencies

    assert sorted(seq) == sorted(expected_tasks(max(k for _, _, k, _ in seq) + 1, r2, moe).elements())
    _check_dependencies(seq, moe, r2)


def _index(seq, *task):
    return seq.index(tuple(task))


@pytest.mark.parametrize("order", ["ASAS", "AASS", "PP"])
@pytest.mark.parametrize("r1,r2", [(1, 1), (2, 2), (3, 4)])
@pytest.mark.parametrize("times", [ATTENTION_BOUND, EXPERT_BOUND], ids=["attention-bound", "expert-bound"])
def test_dispatch_order_is_the_event_models_and_valid(order, r1, r2, times):
    seq = dispatch_order(times, order, r1, r2, LAYERS)
    _valid(seq, LAYERS, r2)
    _, events = simulate(times, order, r1, r2, LAYERS, timeline=True)
    start = {(e.task, e.layer, e.micro_batch, e.chunk): e.start for e in events}
    starts = [start[t] for t in seq]
    assert starts == sorted(starts)  # in the order the event model starts them
    if times is EXPERT_BOUND:  # chunk c's E2A before chunk c+1's expert program, right after its own
        for t in (1, 2):
            for k in range(r1):
                for c in range(r2 - 1):
                    assert _index(seq, "e2a", t, k, c) < _index(seq, "expert", t, k, c + 1)
                for c in range(r2):
                    between = seq[_index(seq, "expert", t, k, c) + 1 : _index(seq, "e2a", t, k, c)]
                    assert not [x for x in between if x[0] == "expert"], (t, k, c, between)
    if times is ATTENTION_BOUND and r1 > 1 and order != "AASS":  # (AASS: all shared experts come first)
        # layer 2's attention of micro-batch 0 before layer 1's last micro-batch's experts
        assert _index(seq, "attention", 2, 0, -1) < _index(seq, "expert", 1, r1 - 1, 0)


def test_sequential_event_order_is_program_order():
    for times in (ATTENTION_BOUND, EXPERT_BOUND):
        assert dispatch_order(times, "PP", 1, 1, LAYERS) == program_order(Pipeline.sequential(), LAYERS)


def test_a_broken_sequence_is_refused():
    from jaxmoe.runtime.disaggregated import _check_dependencies

    seq = list(program_order(Pipeline(2, "ASAS", 2), LAYERS))
    i = seq.index(("e2a", 1, 0, 0))
    seq[i], seq[i - 1] = seq[i - 1], seq[i]  # E2A before its expert program
    with pytest.raises(ValueError, match=r"\('e2a', 1, 0, 0\) comes before \('expert', 1, 0, 0\)"):
        _check_dependencies(seq, LAYERS, 2)


# ------------------------------------------------------------------ on the cpu-8 mesh

PROMPTS = [[7, 21, 33, 5, 90, 17, 64, 12], [11, 3, 77, 29, 54], [5, 9, 13], [60, 61, 62, 63]] * 2
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=8)


def _profile(llm, scale: dict):
    spec = llm.engine.executor.sub.spec
    base = paper_profile(dims_of(llm.cfg, spec, 4), mesh_identity(spec), model_identity(llm.cfg), "float32")
    stages = {
        k: m.model_copy(update={"alpha": m.alpha * f, "betas": tuple(b * f for b in m.betas)})
        for k, f in scale.items()
        for m in [getattr(base.stages, k)]
    }
    return base.model_copy(update={"stages": base.stages.model_copy(update=stages)})


@pytest.mark.slow
def test_executor_dispatches_in_the_event_models_order_with_unchanged_tokens(checkpoint_dir):
    """DeepSeek-V3 tiny (a dense first layer, shared experts on the attention side) on cpu-8 (2a6e):
    for ASAS r1 = r2 = 2 (attention-bound profile), AASS r1 = r2 = 2 (expert-bound) and PP r1 = 2, the
    recorded dispatches of a prefill equal ``dispatch_order`` under the profile's stage times for
    the step's shape, and the logits (and, for the first, the greedy tokens) are the monolithic
    executor's."""
    from jaxmoe import LLM, SamplingParams
    from jaxmoe.findep.online import pipeline_chooser

    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    path = checkpoint_dir("deepseek_v3")
    mono = LLM(path, dtype="float32", **ENGINE)
    want_tokens = [o.token_ids for o in mono.generate(PROMPTS, greedy)]
    want_logits = _prefill(mono)
    llm = LLM(path, dtype="float32", mesh=MESH, **ENGINE)
    ex = llm.engine.executor
    assert ex.shared_layers, "the check needs shared experts on the attention side"
    attention_bound = _profile(llm, {"attention": 50.0})
    expert_bound = _profile(llm, {"expert": 50.0})
    cases = [
        ({"order": "ASAS", "r1": 2, "r2": 2}, attention_bound),
        ({"order": "AASS", "r1": 2, "r2": 2}, expert_bound),
        ({"order": "PP", "r1": 2}, attention_bound),
    ]
    ex.record_dispatch = True
    crossed = chunked = False
    try:
        for value, profile in cases:
            ex.pipeline = pipeline_chooser(value, llm.cfg, ex.sub.spec, "float32", 4, profile=profile)
            logits = _prefill(llm)
            ran = ex.last_pipeline
            ((rows, tokens, context),) = ex.pipeline.cache  # the prefill's shape, as the chooser keyed it
            shape = BatchShape(rows, tokens, max(context, tokens))
            times = stage_times(profile, shape, rows // ran.r1, ran.r2)
            model = dispatch_order(times, ran.order, ran.r1, ran.r2, tuple(llm.cfg.moe_layers))
            want = [t for t in model if t[0] != "shared" or t[1] in ex.shared_layers]
            got = [(p, i, k, c) for p, i, k, c, *_ in ex.last_dispatch if p in TASKS]
            assert got == want, value
            assert np.abs(logits - want_logits).max() <= 1e-5 * np.abs(want_logits).max(), value
            if value is cases[0][0]:  # (decoding every case would take too long for CI on 2 cores)
                assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want_tokens, value
            last = ran.r1 - 1
            t = next(i for i in ex.moe_layers if i + 1 < llm.cfg.num_layers)
            if ran.r1 > 1 and got.index(("attention", t + 1, 0, -1)) < got.index(("expert", t, last, 0)):
                crossed = True
            if ran.r2 > 1 and got.index(("e2a", t, 0, 0)) < got.index(("expert", t, 0, 1)):
                chunked = True
    finally:
        ex.record_dispatch = False
    assert crossed and chunked  # both reorderings the old layer-by-layer dispatch could not do ran


def _prefill(llm) -> np.ndarray:
    from jaxmoe.engine.model_runner import Row

    tables = [[16 * (i // 2) + 2 * (i % 2), 16 * (i // 2) + 2 * (i % 2) + 1] for i in range(len(PROMPTS))]
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, tables)]
    out = np.asarray(llm.engine.runner.forward(rows, all_logits=True))
    return np.concatenate([out[i, : len(p)] for i, p in enumerate(PROMPTS)])  # the prompts' tokens, no padding
