"""QLLM per-expert queues: a best-effort step's MoE layers serve their experts in rounds with a pause
point between rounds. The rounds give the fused program's logits; latency-sensitive requests that
arrive between expert rounds run at once and every request keeps its standalone greedy tokens; the
queue depth at a pause is what the gating left for the experts not yet served."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.demo import demo_config, demo_params
from jaxmoe.assembly import QLLMConfig
from jaxmoe.engine.stats import EngineStats
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.qllm.expert_queues import expert_bounds
from jaxmoe.runtime.monolithic import MonolithicExecutor, queue_depth
from jaxmoe.server.metrics import _EngineCollector

BE = SamplingParams(max_tokens=12, ignore_eos=True)
LS = SamplingParams(max_tokens=4, ignore_eos=True)
BE_PROMPTS = ["best effort one", "best effort number two", "three"]
LS_PROMPTS = ["urgent a", "urgent bb", "urgent ccc"]
# (engine step, expert pause point of that step) at which each LS request arrives: step 0 is a BE
# prefill, the later ones BE decodes
ARRIVALS = [(0, 0), (6, 4), (9, 2)]


def test_expert_bounds_cover_every_expert_once():
    assert expert_bounds(8, 1) == [(0, 8)]
    assert expert_bounds(8, 3) == [(0, 3), (3, 5), (5, 8)]
    assert expert_bounds(4, 9) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # at most one round per expert
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="expert_queues"):
            expert_bounds(8, bad)


def test_queue_depth_counts_what_waits():
    ids = np.array([[0, 5], [7, 5], [-1, -1], [2, 6]])  # row 2: a padding token (queued nowhere)
    assert queue_depth(ids, 5, 8).tolist() == [0, 0, 0, 0, 0, 2, 1, 1]
    assert queue_depth(ids, 0, 8).sum() == 6


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [1, 3, 8])
def test_expert_rounds_give_the_fused_logits(rounds):
    cfg = demo_config()
    params = demo_params(cfg, seed=1)
    fused = MonolithicExecutor(cfg, params, 64, 8)
    queued = MonolithicExecutor(cfg, params, 64, 8, expert_rounds=expert_bounds(cfg.moe.num_experts, rounds))
    rng = np.random.default_rng(rounds)
    tokens = rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    positions = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    slots = np.stack([np.arange(8), 16 + np.arange(8)]).astype(np.int32)
    slots[1, 6:] = -1  # padding
    tables = np.array([[0, 0], [2, 0]], np.int32)
    batch = AttentionBatch(positions, slots, tables)
    last = np.array([7, 5], np.int32)
    calls, depths = [], []

    def pause_point(n):
        calls.append(n)
        depths.append(queued.expert_queue_depth())

    want = np.asarray(fused.forward(tokens, batch, last))
    got = np.asarray(queued.forward(tokens, batch, last, between_layers=pause_point))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    R, L = len(expert_bounds(cfg.moe.num_experts, rounds)), cfg.num_layers
    assert len(calls) == (L - 1) + L * (R - 1)  # layer boundaries + expert-round boundaries
    inside = [d for d in depths if d is not None]
    assert len(inside) == L * (R - 1) and queued.expert_queue_depth() is None
    top_k, real = cfg.moe.top_k, 8 + 6
    for r, d in enumerate(inside[: R - 1]):  # layer 0: what waits shrinks round by round
        lo_next = expert_bounds(cfg.moe.num_experts, rounds)[r + 1][0]
        assert d[:lo_next].sum() == 0 and 0 < d.sum() <= real * top_k


def _drive(llm):
    """Serve the BE prompts; each LS prompt arrives at the expert pause point ``ARRIVALS`` names;
    every request's tokens must equal its standalone tokens."""
    engine, executor = llm.engine, llm.executor
    alone = {p: llm.generate([p], BE, priority="be")[0].token_ids for p in BE_PROMPTS}
    alone.update({p: llm.generate([p], LS, priority="ls")[0].token_ids for p in LS_PROMPTS})
    state = {"step": 0, "point": 0}
    pending = list(zip(ARRIVALS, LS_PROMPTS))
    ids = {}

    def poll():  # what AsyncEngine does at a pause point: admit what arrived
        if executor.expert_queue_depth() is None:
            return  # a layer boundary
        for (s, k), prompt in list(pending):
            if s == state["step"] and k == state["point"]:
                ids[prompt] = engine.add_request(prompt, LS, "ls")
                pending.remove(((s, k), prompt))
        state["point"] += 1

    engine.poll = poll
    ids.update({p: engine.add_request(p, BE, "be") for p in BE_PROMPTS})
    finished = {}
    while engine.has_work() or pending:
        assert state["step"] < 200
        state["point"] = 0
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        state["step"] += 1
    for p, rid in ids.items():
        assert finished[rid] == alone[p], p
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.slow
def test_latency_sensitive_work_runs_between_expert_rounds_with_exact_tokens():
    llm = LLM(
        "tiny-random",
        dtype="float32",
        num_blocks=64,
        block_size=8,
        max_num_seqs=8,
        layer_preemption=True,
        expert_queues=4,
        ls_merge=False,  # LS decodes too run nested between expert rounds (else they merge at a layer boundary)
    )
    _drive(llm)
    engine = llm.engine
    assert engine.scheduler.preemptions["expert_pause"]["be"] >= len(ARRIVALS)
    depth = engine.layer_hook.expert_queue_depth
    assert len(depth) == 8 and sum(depth) > 0
    assert engine.layer_hook.paused_state_bytes_max > 0

    class Async:  # what the server's collector reads
        compiles_after_warmup = None

        def snapshot(self):
            return EngineStats().snapshot(engine, in_flight=0, step_errors=0)

    families = {f.name: f for f in _EngineCollector(Async()).collect()}
    assert [s.value for s in families["jaxmoe_expert_queue_depth"].samples] == depth
    levels = {s.labels["level"] for s in families["jaxmoe_preemptions"].samples if s.value}
    assert "expert" in levels
    assert families["jaxmoe_paused_state_bytes_max"].samples[0].value == engine.layer_hook.paused_state_bytes_max


@pytest.mark.slow
def test_expert_queues_with_merges_keep_every_token():
    """With merges on (the default), LS work that arrives between expert rounds still runs nested
    there (rows join only at layer boundaries); the LS decodes that wait at a later layer boundary
    of the same step merge into it. Tokens stay exact."""
    llm = LLM(
        "tiny-random",
        dtype="float32",
        num_blocks=64,
        block_size=8,
        max_num_seqs=8,
        layer_preemption=True,
        expert_queues=4,
    )
    _drive(llm)
    hook = llm.engine.layer_hook
    assert llm.engine.scheduler.preemptions["expert_pause"]["be"] >= len(ARRIVALS) and hook.ls_merges > 0


def test_expert_queues_settings_are_checked():
    with pytest.raises(ValueError, match="layer_preemption"):
        QLLMConfig(expert_queues=2, layer_preemption=False)
    with pytest.raises(ValueError, match="expert_queues"):
        QLLMConfig(expert_queues=-1, layer_preemption=True)
    with pytest.raises(ValueError, match="monolithic executor only"):
        LLM("tiny-random", mesh="meshes/cpu-8.yaml", layer_preemption=True, expert_queues=2, num_blocks=64)


@pytest.mark.slow
def test_the_policy_sees_the_stage_and_the_queue_depths():
    """``pause_at_layer``'s ``layer`` is a ``PausePoint``: between expert groups its stage is
    "experts" with the per-expert queue depths; at a layer boundary "layer" with none. A policy that
    pauses only at layer boundaries gets no pause between expert rounds."""
    from jaxmoe.qllm.policy import QLLMPolicy

    seen = []

    class AtLayerBoundaries(QLLMPolicy):
        name = "at_layer_boundaries"

        def pause_at_layer(self, running, waiting, layer):
            seen.append((int(layer), layer.stage, layer.queue_depth))
            return layer.stage == "layer" and super().pause_at_layer(running, waiting, layer)

    llm = LLM(
        "tiny-random",
        dtype="float32",
        num_blocks=64,
        block_size=8,
        max_num_seqs=8,
        expert_queues=4,
        policy=AtLayerBoundaries(),
    )
    engine = llm.engine
    alone = {p: llm.generate([p], BE, priority="be")[0].token_ids for p in BE_PROMPTS}
    alone[LS_PROMPTS[0]] = llm.generate([LS_PROMPTS[0]], LS, priority="ls")[0].token_ids
    ids = {p: engine.add_request(p, BE, "be") for p in BE_PROMPTS}
    engine.step()  # the BE prefills
    # an LS prompt arrives at the first expert pause point of the next step; it waits to the layer boundary
    engine.poll = lambda: (
        LS_PROMPTS[0] not in ids and ids.update({LS_PROMPTS[0]: engine.add_request(LS_PROMPTS[0], LS, "ls")})
    )
    finished = {out.request_id: out.token_ids for out in engine.run_until_done(timeout=120).values()}
    assert all(finished[rid] == alone[p] for p, rid in ids.items())
    assert engine.layer_hook.ls_merges == 1
    experts = [d for _, stage, d in seen if stage == "experts"]
    assert experts and all(d is not None and len(d) == 8 for d in experts)
    assert all(d is None for _, stage, d in seen if stage == "layer")
    assert llm.engine.scheduler.preemptions["expert_pause"]["be"] == 0  # never paused between expert groups
