"""QLLM per-expert queues: each MoE layer of a best-effort step routes its tokens into per-expert FIFO
queues that are served in rounds, with pause points after the attention side, after the routing and
between rounds. The rounds give the fused program's logits; latency-sensitive requests that arrive at
those pause points merge into the step, their assignments served ahead of the waiting ones (or, with
``ls_merge=False``, run at once as their own step); every request keeps its standalone greedy tokens;
the policy sees the stage and the queue depths."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.demo import demo_config, demo_params
from jaxmoe.assembly import QLLMConfig
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.qllm.expert_queues import expert_bounds
from jaxmoe.qllm.policy import QLLMPolicy
from jaxmoe.runtime.monolithic import MonolithicExecutor, queue_depth

BE = SamplingParams(max_tokens=12, ignore_eos=True)
LS = SamplingParams(max_tokens=4, ignore_eos=True)
# (engine step, pause point after a MoE layer's routing of that step) at which each LS request
# arrives: step 0 is a BE prefill, the later ones BE decodes (a step holding a merged LS request that
# still decodes is not pausable: the arrivals are spaced so every one finds a BE-only step)
ARRIVALS = [(0, 0), (6, 4), (11, 2)]


def _after_routing(executor) -> bool:
    return executor.expert_queue_depth() is not None


def test_expert_bounds_cover_every_expert_once():
    assert expert_bounds(8, 1) == [(0, 8)]
    assert expert_bounds(8, 3) == [(0, 3), (3, 5), (5, 8)]
    assert expert_bounds(4, 9) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # at most one round per expert
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="expert_queues"):
            expert_bounds(8, bad)


def test_queue_depth_counts_what_waits():
    queued = np.array([[0, 5], [7, 5], [-1, -1], [2, 6]])  # row 2: a padding token (queued nowhere)
    assert queue_depth(queued, 8).tolist() == [1, 0, 1, 0, 0, 2, 1, 1]
    served = np.where(queued < 5, -1, queued)  # a round served experts 0 .. 4
    assert queue_depth(served, 8).tolist() == [0, 0, 0, 0, 0, 2, 1, 1]


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
    points = []

    def pause_point(n):
        points.append((n, queued.pause_stage, queued.expert_queue_depth()))

    want = np.asarray(fused.forward(tokens, batch, last))
    got = np.asarray(queued.forward(tokens, batch, last, between_layers=pause_point))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    bounds = expert_bounds(cfg.moe.num_experts, rounds)
    R, L = len(bounds), cfg.num_layers
    # per MoE layer: after attention, after routing, between rounds; then the layer boundary (the last
    # one before the head)
    assert [stage for _, stage, _ in points] == (["attention", "routing"] + ["experts"] * (R - 1) + ["layer"]) * L
    assert all((d is None) == (stage in ("attention", "layer")) for _, stage, d in points)
    assert queued.expert_queue_depth() is None
    top_k, real = cfg.moe.top_k, 8 + 6
    layer0 = [d for n, stage, d in points if n == 0 and d is not None]
    assert layer0[0].sum() == real * top_k  # after routing every real token waits at its top-k experts
    for (_, hi), d in zip(bounds, layer0[1:]):  # what waits shrinks round by round
        assert d[:hi].sum() == 0 and d[hi:].tolist() == layer0[0][hi:].tolist()


@pytest.mark.slow
def test_latency_sensitive_work_runs_nested_inside_moe_layers_with_exact_tokens(tiny_llm, drive, metric_families):
    """``ls_merge=False``: LS work that arrives inside a MoE layer runs at once as its own step while
    the BE step waits with its queues; tokens stay exact; the queue depth at the pause is exported."""
    llm = tiny_llm(layer_preemption=True, expert_queues=4, ls_merge=False)
    assert drive(llm, ARRIVALS, BE, LS, counts=_after_routing)[1] == 0
    engine = llm.engine
    assert engine.scheduler.preemptions["expert_pause"]["be"] >= len(ARRIVALS)
    depth = engine.layer_hook.expert_queue_depth  # at the latest pause (late in a layer it may be all 0)
    assert len(depth) == 8
    assert engine.layer_hook.paused_state_bytes_max > 0
    families = metric_families(engine)
    assert [s.value for s in families["jaxmoe_expert_queue_depth"].samples] == depth
    levels = {s.labels["level"] for s in families["jaxmoe_preemptions"].samples if s.value}
    assert "expert" in levels
    assert families["jaxmoe_paused_state_bytes_max"].samples[0].value == engine.layer_hook.paused_state_bytes_max


@pytest.mark.slow
def test_latency_sensitive_work_merges_into_the_expert_queues_with_exact_tokens(tiny_llm, drive):
    """With merges on (the default), every LS arrival inside a MoE layer joins the step there: its
    rows catch up, its assignments enter the queues ahead of the BE ones; no nested step. Tokens stay
    exact."""
    llm = tiny_llm(layer_preemption=True, expert_queues=4)
    assert drive(llm, ARRIVALS, BE, LS, counts=_after_routing)[1] == 0
    hook = llm.engine.layer_hook
    assert hook.queue_merges >= len(ARRIVALS) and hook.layer_pauses == 0
    assert llm.engine.scheduler.preemptions["expert_pause"]["be"] == 0


def test_expert_queues_settings_are_checked():
    with pytest.raises(ValueError, match="layer_preemption"):
        QLLMConfig(expert_queues=2, layer_preemption=False)
    with pytest.raises(ValueError, match="expert_queues"):
        QLLMConfig(expert_queues=-1, layer_preemption=True)
    with pytest.raises(ValueError, match="sequential schedule only"):
        LLM("tiny-random", mesh="meshes/cpu-8.yaml", expert_queues=2, num_blocks=64, pipeline="findep")


@pytest.mark.slow
def test_the_policy_sees_the_stages_and_ls_tokens_jump_the_queues(tiny_llm):
    """``pause_at_layer``'s ``layer`` is a ``PausePoint``: its stage ("attention", "routing", "experts"
    inside a MoE layer, "layer" at a layer boundary) and, after the routing, the depth of every
    expert's queue. An LS prompt that arrives at the first expert pause point of a BE decode step
    merges there: the next pause point shows the BE queues exactly as they were (the LS assignments,
    at every expert, were served first), and every token is the standalone one."""
    seen = []

    class Recording(QLLMPolicy):
        name = "recording"

        def pause_at_layer(self, running, waiting, layer):
            seen.append((int(layer), layer.stage, layer.queue_depth, bool(waiting.ls_prefill)))
            return super().pause_at_layer(running, waiting, layer)

    llm = tiny_llm(expert_queues=4, policy=Recording())
    engine, prompt = llm.engine, "urgent a"
    alone = {p: llm.generate([p], BE, priority="be")[0].token_ids for p in ("best effort one", "three")}
    alone[prompt] = llm.generate([prompt], LS, priority="ls")[0].token_ids
    ids = {p: engine.add_request(p, BE, "be") for p in ("best effort one", "three")}
    engine.step()  # the BE prefills

    def poll():  # the LS prompt arrives at the step's first pause point between expert rounds
        if prompt not in ids and engine.executor.pause_stage == "experts":
            ids[prompt] = engine.add_request(prompt, LS, "ls")

    engine.poll = poll
    seen.clear()
    finished = {out.request_id: out.token_ids for out in engine.step() if out.finished}
    assert {"attention", "routing", "experts", "layer"} == {stage for _, stage, _, _ in seen}
    assert all((d is None) == (stage in ("attention", "layer")) for _, stage, d, _ in seen)
    at = next(i for i, (_, _, _, ls) in enumerate(seen) if ls)  # where the LS prompt waited: it merged
    routing = [d for _, stage, d, _ in seen[:at] if stage == "routing"]
    assert len(routing) == 1 and len(routing[0]) == 8 and sum(routing[0]) == 2 * 2  # 2 BE decode tokens, top-2
    assert seen[at][:2] == (0, "experts") and seen[at + 1][:2] == (0, "experts")
    assert seen[at + 1][2] == seen[at][2]  # the BE assignments still wait as they did: the LS ones went first
    hook = engine.layer_hook
    assert hook.ls_merges == hook.queue_merges == 1 and hook.layer_pauses == 0
    for out in engine.run_until_done(timeout=120).values():
        finished[out.request_id] = out.token_ids
    assert all(finished[rid] == alone[p] for p, rid in ids.items())
