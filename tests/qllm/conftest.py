"""What the QLLM tests share: the tiny engine they build, the driver that serves best-effort prompts
while latency-sensitive ones arrive at scripted pause points (checking every request's tokens against
its standalone tokens), and the metric families a server would export."""

from __future__ import annotations

import pytest

from jaxmoe import LLM

BE_PROMPTS = ["best effort one", "best effort number two", "three"]
LS_PROMPTS = ["urgent a", "urgent bb", "urgent ccc"]


def _tiny_llm(**kw) -> LLM:
    # these tests drive the merge itself: every merge the executor can take (the cost model would run
    # the tiny model's prompts nested: a prompt pads the call it joins; ``test_the_cost_model...``)
    kw.setdefault("ls_merge_tokens", None)
    # a pause point after every layer unless a test asks otherwise (the default measures the granularity,
    # which on a small model may choose step-level preemption: ``test_pause_granularity.py``)
    kw.setdefault("pause_every", 1)
    return LLM("tiny-random", dtype="float32", num_blocks=64, block_size=8, max_num_seqs=8, **kw)


def _below_iteration(hook) -> int:
    """Latency-sensitive work run inside a best-effort step: nested steps and merged requests."""
    return hook.layer_pauses + hook.ls_merges


def _drive(llm, arrivals, be, ls, counts=None):
    """Serve ``BE_PROMPTS`` (params ``be``) while ``LS_PROMPTS`` (params ``ls``) arrive as ``arrivals``
    scripts them: (engine step, pause point of that step) per LS prompt, the pause points numbered
    from 0 among those of the step where ``counts(executor)`` holds (None: every one). An arrival
    whose step had no such pause point comes before the next step (overdue). Asserts every request's
    tokens equal its standalone tokens and every KV block is free after. Returns (LS work run inside
    a BE step: nested steps + merged requests, overdue arrivals)."""
    engine = llm.engine
    alone = {p: llm.generate([p], be, priority="be")[0].token_ids for p in BE_PROMPTS}
    alone.update({p: llm.generate([p], ls, priority="ls")[0].token_ids for p in LS_PROMPTS})
    state = {"step": 0, "point": 0}
    pending = list(zip(arrivals, LS_PROMPTS))
    ids = {}

    def poll():  # what AsyncEngine does at a pause point: admit what arrived
        if counts is not None and not counts(llm.executor):
            return
        for (s, k), prompt in list(pending):
            if s == state["step"] and k == state["point"]:
                ids[prompt] = engine.add_request(prompt, ls, "ls")
                pending.remove(((s, k), prompt))
        state["point"] += 1

    engine.poll = poll
    hook = engine.layer_hook
    before = _below_iteration(hook)
    ids.update({p: engine.add_request(p, be, "be") for p in BE_PROMPTS})
    finished, overdue = {}, 0
    while engine.has_work() or pending:
        assert state["step"] < 300
        for (s, k), prompt in list(pending):  # overdue: its step ran fused (not pausable) or never paused
            if s < state["step"]:
                ids[prompt] = engine.add_request(prompt, ls, "ls")
                pending.remove(((s, k), prompt))
                overdue += 1
        state["point"] = 0
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        state["step"] += 1
    for p, rid in ids.items():
        assert finished[rid] == alone[p], p
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return _below_iteration(hook) - before, overdue


def _metric_families(engine) -> dict:
    """The Prometheus families the server's collector exports for ``engine``, by name."""
    from jaxmoe.engine.stats import EngineStats
    from jaxmoe.server.metrics import _EngineCollector

    class Async:  # what the server's collector reads
        compiles_after_warmup = None

        def snapshot(self):
            return EngineStats().snapshot(engine, in_flight=0, step_errors=0)

    return {f.name: f for f in _EngineCollector(Async()).collect()}


@pytest.fixture
def tiny_llm():
    """``tiny_llm(**kw)``: the 4-layer random test model on a small KV cache (float32)."""
    return _tiny_llm


@pytest.fixture
def drive():
    """``drive(llm, arrivals, be, ls, counts=None)``: see ``_drive``."""
    return _drive


@pytest.fixture
def metric_families():
    """``metric_families(engine)``: the server's metric families for ``engine``, by name."""
    return _metric_families
