"""Layer-level preemption is on by default on the monolithic executor, with pause points only where a
measurement finds them within 2 % of the fused step (``test_pause_granularity.py``): ``LLM(...)`` and
``jaxmoe serve`` attach it unless ``layer_preemption=False`` / ``--no-layer-preemption``; it stays off
by default on a mesh file (the disaggregated executor) and in deterministic mode, where
``layer_preemption=True`` / ``--layer-preemption`` still turns it on (``--expert-queues`` implies
it). A step runs layer by layer only where a request can arrive during it (a serving loop's poll):
``LLM.generate``'s steps stay one fused program with it on."""

from __future__ import annotations

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.assembly import QLLMConfig, RuntimeConfig
from jaxmoe.cli import build_parser
from jaxmoe.engine.config import EngineConfig
from jaxmoe.qllm.layer_preemption import LayerPreemption
from jaxmoe.server.cli import runtime_config

TINY = dict(num_blocks=32, block_size=8, max_num_seqs=4)


@pytest.mark.slow
def test_llm_has_layer_preemption_by_default_and_offline_steps_never_pause():
    assert LLM("tiny-random", layer_preemption=False, **TINY).engine.layer_hook is None
    llm = LLM("tiny-random", **TINY)
    assert isinstance(llm.engine.layer_hook, LayerPreemption)
    # offline generation: nothing can arrive mid-step, so no step is pausable, and each runs the fused
    # step program, as with layer preemption off (no ``split_step``: it would cost 6-18 % CPU time)
    assert not llm.executor.split_step
    calls, fused = [], []
    forward, step = llm.executor.forward, llm.executor._step
    llm.executor.forward = lambda *a, **kw: calls.append(kw.get("between_layers")) or forward(*a, **kw)
    llm.executor._step = lambda *a: fused.append(1) or step(*a)
    llm.generate(["hello", "there"], SamplingParams(max_tokens=3, ignore_eos=True), priority="be")
    assert calls and all(c is None for c in calls) and len(fused) == len(calls)
    # a serving loop's poll: steps may pause, and those that do not run the same programs as those that do
    llm.engine.poll = lambda: None
    assert llm.executor.split_step
    llm.engine.poll = None
    assert not llm.executor.split_step


def test_the_setting():
    assert QLLMConfig().preempts(RuntimeConfig())  # monolithic: on by default
    assert not QLLMConfig(layer_preemption=False).preempts(RuntimeConfig())
    assert not QLLMConfig().preempts(RuntimeConfig(mesh="meshes/cpu-8.yaml"))  # a mesh file: off by default
    assert not QLLMConfig().preempts(RuntimeConfig(engine=EngineConfig(deterministic=True)))
    assert not QLLMConfig().preempts(RuntimeConfig(engine=EngineConfig(async_scheduling=True)))  # would sync steps
    assert QLLMConfig(layer_preemption=True).preempts(RuntimeConfig(engine=EngineConfig(async_scheduling=True)))
    assert QLLMConfig(expert_queues=2).preempts(RuntimeConfig(mesh="meshes/cpu-8.yaml"))  # its rounds pause
    assert QLLMConfig(layer_preemption=True).preempts(RuntimeConfig(mesh="meshes/cpu-8.yaml"))
    with pytest.raises(ValueError, match="expert_queues needs layer_preemption"):
        QLLMConfig(layer_preemption=False, expert_queues=2)
    with pytest.raises(ValueError, match="layer_preemption"):
        QLLMConfig(layer_preemption="yes")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,on",
    [
        ((), True),
        (("--layer-preemption",), True),
        (("--no-layer-preemption",), False),
        (("--expert-queues", "2"), True),
        (("--deterministic",), False),
        (("--deterministic", "--layer-preemption"), True),
        (("--mesh", "meshes/cpu-8.yaml"), False),
    ],
)
def test_serve_flags(flags, on):
    args = build_parser().parse_args(["serve", "--model", "tiny-random", *flags])
    config = runtime_config(args)[0]
    assert config.qllm.preempts(config) is on
    assert config.engine.pause_every is None  # measured where the default applies, else 1
    args = build_parser().parse_args(["serve", "--model", "tiny-random", *flags, "--pause-every", "3"])
    assert runtime_config(args)[0].engine.pause_every == 3
