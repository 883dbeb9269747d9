"""Layer-level preemption is on by default where it was measured to cost <= 2 % when nothing preempts
(the monolithic executor outside deterministic mode): ``LLM`` and ``jaxmoe serve`` attach QLLM's layer
hook unless told not to (``layer_preemption=False``, ``--no-layer-preemption``). A step runs layer by
layer only where a request can arrive during it (a serving loop's poll): ``LLM.generate``'s steps stay
one fused program."""

from __future__ import annotations

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.assembly import QLLMConfig, RuntimeConfig
from jaxmoe.cli import build_parser
from jaxmoe.qllm.layer_preemption import LayerPreemption
from jaxmoe.server.cli import runtime_config

TINY = dict(num_blocks=32, block_size=8, max_num_seqs=4)


def test_llm_has_layer_preemption_by_default_and_turns_it_off():
    llm = LLM("tiny-random", **TINY)
    assert isinstance(llm.engine.layer_hook, LayerPreemption)
    assert LLM("tiny-random", layer_preemption=False, **TINY).engine.layer_hook is None
    assert LLM("tiny-random", deterministic=True, **TINY).engine.layer_hook is None  # one program path
    # offline generation: nothing can arrive mid-step, so no step runs layer by layer
    calls = []
    forward = llm.executor.forward
    llm.executor.forward = lambda *a, **kw: calls.append(kw.get("between_layers")) or forward(*a, **kw)
    llm.generate(["hello", "there"], SamplingParams(max_tokens=3, ignore_eos=True), priority="be")
    assert calls and all(c is None for c in calls)


def test_the_default_is_on_only_for_the_monolithic_executor():
    assert QLLMConfig().preempts(RuntimeConfig())
    assert not QLLMConfig().preempts(RuntimeConfig(mesh="meshes/cpu-8.yaml"))  # not measured there: opt-in
    assert QLLMConfig(layer_preemption=True).preempts(RuntimeConfig(mesh="meshes/cpu-8.yaml"))
    assert not QLLMConfig(layer_preemption=False).preempts(RuntimeConfig())
    with pytest.raises(ValueError, match="expert_queues needs layer_preemption"):
        QLLMConfig(layer_preemption=False, expert_queues=2)
    with pytest.raises(ValueError, match="layer_preemption"):
        QLLMConfig(layer_preemption="yes")


@pytest.mark.parametrize("flags,on", [((), True), (("--layer-preemption",), True), (("--no-layer-preemption",), False)])
def test_serve_flags(flags, on):
    args = build_parser().parse_args(["serve", "--model", "tiny-random", *flags])
    config = runtime_config(args)[0]
    assert config.qllm.preempts(config) is on
