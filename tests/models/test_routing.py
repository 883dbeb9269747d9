"""The expert-routing contract (``models.routing``): top-k is the router's choice; BrownoutServe's
Algorithm 1 (``brownout.routing.BrownoutRouting``) at threshold 1 chooses what top-k chooses; both run
through the same executor API (``routing=`` / ``routing_state``) on both executors, and with QLLM's
expert rounds; no core module imports a feature package."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.brownout.config import BrownoutError
from jaxmoe.brownout.routing import BrownoutRouting, set_threshold, split_reference, threshold
from jaxmoe.compilation import compile_events
from jaxmoe.config import from_hf_config
from jaxmoe.demo import DEMO_HF_CONFIG, demo_params
from jaxmoe.checkpoint.model import load_model
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.router import route
from jaxmoe.models.routing import ExpertRouting, TopKRouting, extra_experts, logical_params
from jaxmoe.qllm.expert_queues import expert_bounds
from jaxmoe.runtime.monolithic import MonolithicExecutor

ROOT = Path(__file__).resolve().parents[2]
CFG = from_hf_config({**DEMO_HF_CONFIG, "num_hidden_layers": 2})  # 8 experts, top-2
WAYS = 2  # united experts of 2 originals each: U = 4


def _united(params: dict, cfg) -> dict:
    """``params`` with united experts as ``brownout.united.attach`` gives them (each the mean of its
    group's weights, the distillation's start): ``united`` [U, ...] and ``united_groups`` [E]."""
    E = cfg.moe.num_experts
    groups = np.arange(E) // WAYS
    layers = []
    for layer in params["layers"]:
        if "moe" in layer:
            moe = layer["moe"]
            united = {
                k: jnp.stack([jnp.mean(moe[k][groups == u], axis=0) for u in range(E // WAYS)])
                for k in ("w_gate", "w_up", "w_down")
            }
            layer = dict(layer, moe=dict(moe, united=united, united_groups=jnp.asarray(groups, jnp.int32)))
        layers.append(layer)
    return dict(params, layers=layers)


def _jit_route(routing):
    """``routing.route`` over ``CFG``'s MoE settings as one compiled program (the executors run it so)."""
    return jax.jit(lambda moe, x, valid, state: routing.route(moe, CFG.moe, x, valid, state))


def _batch():
    """Two rows of 8 tokens, the second with 2 padding tokens (slot -1)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (2, 8)).astype(np.int32)
    positions = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    slots = np.stack([np.arange(8), 16 + np.arange(8)]).astype(np.int32)
    slots[1, 6:] = -1
    return tokens, AttentionBatch(positions, slots, np.array([[0, 0], [2, 0]], np.int32)), np.array([7, 5], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_top_k_routing_is_the_router(checkpoint_dir, family):
    cfg, params, _ = load_model(checkpoint_dir(family), "float32")
    moe = next(layer["moe"] for layer in params["layers"] if "moe" in layer)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((13, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(np.arange(13) % 5 != 4)
    routing = TopKRouting()
    assert (
        isinstance(routing, ExpertRouting) and routing.extra_experts(moe) == 0 and extra_experts(routing, params) == 0
    )
    ids, weights = route(moe, cfg.moe, x)
    got_ids, got_weights = routing.route(routing.logical_params(moe), cfg.moe, x, None, None)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got_weights), np.asarray(weights))
    masked, _ = routing.route(moe, cfg.moe, x, valid, None)  # padding activates no expert
    np.testing.assert_array_equal(np.asarray(masked), np.where(np.asarray(valid)[:, None], np.asarray(ids), -1))


@pytest.mark.slow
def test_brownout_at_threshold_one_chooses_what_top_k_chooses():
    params = _united(demo_params(CFG, seed=2), CFG)
    moe = params["layers"][0]["moe"]
    E, K = CFG.moe.num_experts, CFG.moe.top_k
    x = jnp.asarray(np.random.default_rng(3).standard_normal((29, CFG.hidden_size)), jnp.float32)
    valid = jnp.asarray(np.arange(29) % 7 != 6)
    top_ids, top_weights = _jit_route(TopKRouting())(moe, x, valid, None)
    for full in (False, True):
        routing = BrownoutRouting(full)
        logical = routing.logical_params(moe)
        assert logical["w_gate"].shape[0] == E + 4 and "united" not in logical
        assert logical_params(routing, params)["layers"][0]["moe"].keys() == logical.keys()
        assert routing.logical_params(logical).keys() == logical.keys()  # logical form in, the same out
        assert routing.extra_experts(moe) == routing.extra_experts(logical) == extra_experts(routing, params) == 4
        for state in (1.0, None):  # None: threshold 1
            ids, weights = map(np.asarray, _jit_route(routing)(logical, x, valid, state))
            assert ids.shape == (29, 2 * K)
            np.testing.assert_array_equal(ids[:, :K], np.asarray(top_ids))
            assert (ids[:, K:] == -1).all() and (weights[:, K:] == 0).all()
            np.testing.assert_array_equal(weights[:, :K], np.where(ids[:, :K] >= 0, np.asarray(top_weights), 0))


@pytest.mark.slow
def test_brownout_routes_united_experts_as_logical_experts_e_plus_u():
    """At threshold 0.4, partial brownout: the kept originals, then united experts as E + u, exactly
    the split read from Algorithm 1; the same choice of one token's two group members is merged."""
    params = _united(demo_params(CFG, seed=2), CFG)
    moe = params["layers"][0]["moe"]
    E, K = CFG.moe.num_experts, CFG.moe.top_k
    x = jnp.asarray(np.random.default_rng(4).standard_normal((40, CFG.hidden_size)), jnp.float32)
    valid = np.ones(40, bool)
    routing = BrownoutRouting()
    ids, weights = map(np.asarray, _jit_route(routing)(routing.logical_params(moe), x, jnp.asarray(valid), 0.4))
    top, top_w = map(np.asarray, route(moe, CFG.moe, x))
    orig, united = split_reference(top, valid, np.asarray(moe["united_groups"]), 0.4, False)
    np.testing.assert_array_equal(ids[:, :K], orig)
    assert (ids[:, K:] >= E).any()
    for t in range(40):
        want: dict[int, float] = {}
        for j in range(K):
            if united[t, j] >= 0:
                want[E + int(united[t, j])] = want.get(E + int(united[t, j]), 0.0) + float(top_w[t, j])
        got = {int(e): float(w) for e, w in zip(ids[t, K:], weights[t, K:]) if e >= 0}
        assert got == pytest.approx(want)


def test_brownout_needs_united_experts():
    params = demo_params(CFG, seed=2)
    with pytest.raises(BrownoutError, match="MoE layer 0: no united experts"):
        extra_experts(BrownoutRouting(), params)
    with pytest.raises(BrownoutError, match="MoE layer 0: no united experts"):
        MonolithicExecutor(CFG, params, 64, 8, routing=BrownoutRouting(), routing_state=0.5)


@pytest.fixture(scope="module")
def executors():
    """(top-k executor, brownout executor) over the same parameters with united experts."""
    params = _united(demo_params(CFG, seed=1), CFG)
    top = MonolithicExecutor(CFG, params, 64, 8)
    brown = MonolithicExecutor(CFG, params, 64, 8, routing=BrownoutRouting(), routing_state=1.0)
    return params, top, brown


@pytest.mark.slow
def test_both_routings_through_one_executor_api(executors):
    """Threshold 1 gives the top-k executor's logits (and tokens); moving the threshold changes them,
    recompiles nothing, and ``set_threshold`` refuses an executor without brownout and bad values."""
    params, top, brown = executors
    tokens, batch, last = _batch()
    assert (top.routing, top.routing_state, threshold(top)) == (TopKRouting(), None, None)
    assert threshold(brown) == 1.0 and brown.num_logical_experts == CFG.moe.num_experts + 4
    want = np.asarray(top.forward(tokens, batch, last))
    np.testing.assert_allclose(np.asarray(brown.forward(tokens, batch, last)), want, rtol=1e-5, atol=1e-5)
    assert (np.asarray(brown.forward(tokens, batch, last)).argmax(-1) == want.argmax(-1)).all()
    before = compile_events()["programs"]
    outs = []
    for t in (0.5, 0.0):
        set_threshold(brown, t)
        outs.append(np.asarray(brown.forward(tokens, batch, last)))
    assert compile_events()["programs"] == before
    assert not np.allclose(outs[1], want, atol=1e-3)  # choices moved to united experts: other logits
    with pytest.raises(ValueError, match="built without brownout"):
        set_threshold(top, 0.5)
    with pytest.raises(BrownoutError, match="got 1.5"):
        set_threshold(brown, 1.5)
    assert threshold(brown) == 0.0
    # the executor's params (logical form) build an executor with the same routing and outputs
    again = MonolithicExecutor(CFG, brown.params, 64, 8, routing=BrownoutRouting(), routing_state=0.0)
    np.testing.assert_allclose(np.asarray(again.forward(tokens, batch, last)), outs[1], rtol=1e-5, atol=1e-5)
    set_threshold(brown, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("state", [1.0, 0.5])
def test_brownout_with_expert_rounds_gives_the_fused_logits(executors, state):
    """QLLM's expert rounds over the E + U logical experts (united experts included) with brownout:
    the fused program's logits, and the queue depth counts united experts too."""
    params, _, brown = executors
    L = CFG.moe.num_experts + 4
    rounds = expert_bounds(L, 3)
    queued = MonolithicExecutor(
        CFG, params, 64, 8, routing=BrownoutRouting(), routing_state=state, expert_rounds=rounds
    )
    tokens, batch, last = _batch()
    set_threshold(brown, state)
    want = np.asarray(brown.forward(tokens, batch, last))
    depths = []
    got = np.asarray(
        queued.forward(tokens, batch, last, between_layers=lambda n: depths.append(queued.expert_queue_depth()))
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    inside = [d for d in depths if d is not None]
    # after each MoE layer's routing and between its rounds
    assert len(inside) == CFG.num_layers * len(rounds) and all(len(d) == L for d in inside)
    assert inside[1][: rounds[1][0]].sum() == 0 < inside[0][: rounds[1][0]].sum()  # the first round's are served
    if state < 1:
        assert any(d[CFG.moe.num_experts :].sum() > 0 for d in inside)  # united experts queue like originals
    with pytest.raises(ValueError, match="expert_rounds must be contiguous"):
        MonolithicExecutor(CFG, params, 64, 8, expert_rounds=expert_bounds(L, 3))  # top-k: only E experts
    set_threshold(brown, 1.0)


@pytest.mark.slow  # compiles the disaggregated programs on 8 CPU devices
def test_one_routing_gives_the_same_logits_on_both_executors(executors):
    """Brownout at 0.5 and 0 on the disaggregated executor (united experts placed in replica slots
    beside the originals) gives the monolithic executor's logits; so does top-k."""
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

    params, top, brown = executors
    tokens, batch, last = _batch()
    dis = DisaggregatedExecutor(CFG, params, 64, 8, "meshes/cpu-8.yaml", routing=BrownoutRouting(), routing_state=0.5)
    assert dis.slots_per_instance == dis.sub.spec.experts.slots_per_instance + 1  # + ceil(4 / 6)
    for t in (0.5, 0.0):
        set_threshold(brown, t)
        set_threshold(dis, t)
        want = np.asarray(brown.forward(tokens, batch, last))
        np.testing.assert_allclose(np.asarray(dis.forward(tokens, batch, last)), want, rtol=2e-4, atol=2e-4)
    set_threshold(brown, 1.0)
    plain = DisaggregatedExecutor(CFG, params, 64, 8, "meshes/cpu-8.yaml")
    want = np.asarray(top.forward(tokens, batch, last))
    np.testing.assert_allclose(np.asarray(plain.forward(tokens, batch, last)), want, rtol=2e-4, atol=2e-4)
