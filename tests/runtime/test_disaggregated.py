"""Disaggregated executor == monolithic executor (fp32, 8 CPU devices), whatever the layout and
whichever replica serves each expert.

Equivalence is checked through the public API: ``LLM(path, mesh=...)`` vs ``LLM(path)``, on
prefill + teacher-forced decode logits (``runner.forward(rows, all_logits=True)``, real positions
only, relative error < 1e-5) and on greedy generation of 16 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import ModelRunner, Row
from jaxmoe.checkpoint.model import load_model
from jaxmoe.mesh import load_mesh
from jaxmoe.models.router import route
from jaxmoe.runtime.disaggregated import DisaggregatedExecutor
from jaxmoe.janus.placement import coactivation
from jaxmoe.runtime.replicas import ReplicaLayout, default_placement
from jaxmoe.runtime.transfer import plan_transfers

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)
PROMPTS = [[7, 21, 33, 5, 90, 17, 64, 12, 48, 101, 9], [11, 3, 77, 29, 54]]
TABLES = [[40, 5], [9, 50]]  # non-contiguous; every row has blocks in both attention instances' slot ranges
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
# 1 attention + 7 expert instances x 4 slots; 8 experts with 2-3 replicas on different instances,
# 4 slots unused (zeros): instance 6 hosts replicas only.
FORCED_1A7E = [0, 1, 2, -1, 3, 4, 5, 6, 7, 0, 1, -1, 2, 3, 4, 5, 6, 7, 0, -1, 1, 2, 3, -1, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def llms(checkpoint_dir):
    """llms(family, mesh=None) -> LLM, built once per module (tests restore what they change)."""
    made = {}

    def get(family, mesh=None):
        key = (family, str(mesh))
        if key not in made:
            made[key] = LLM(checkpoint_dir(family), dtype="float32", mesh=mesh, **ENGINE)
        return made[key]

    return get


def _rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _logits(llm, steps: int = 3) -> list[np.ndarray]:
    """Prefill logits of two rows (real positions), then `steps` teacher-forced decode steps."""
    runner = llm.engine.runner
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, TABLES)]
    prefill = np.asarray(runner.forward(rows, all_logits=True))
    out = [prefill[i, : len(p)] for i, p in enumerate(PROMPTS)]
    for step in range(steps):
        rows = [Row([int(20 + 7 * step + i)], len(p) + step, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES))]
        out.append(np.asarray(runner.forward(rows)))
    return out


def _greedy(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_equivalent(mono, dis):
    for got, want in zip(_logits(dis), _logits(mono)):
        assert _rel_err(got, want) < 1e-5
    assert _greedy(dis) == _greedy(mono)


# --------------------------------------------------------------------------- equivalence


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_cpu8(llms, family):
    """2 attention + 6 expert instances, default placement (24 slots: every expert replicated)."""
    assert_equivalent(llms(family), llms(family, "meshes/cpu-8.yaml"))


@pytest.mark.slow
def test_4a4e_deepseek_v3(llms):
    """4 attention + 4 experts; 16 experts in exactly 16 slots (no redundancy), sigmoid group routing."""
    dis = llms("deepseek_v3", "meshes/cpu-8-4a4e.yaml")
    assert_equivalent(llms("deepseek_v3"), dis)
    assert dis.executor.placement() == default_placement(16, 4, 4)


@pytest.mark.slow
def test_1a7e_redundant_default_placement(llms):
    dis = llms("mixtral", "meshes/cpu-8-1a7e.yaml")
    layout = dis.executor.layouts[0]
    assert all(len(layout.replicas(e)) >= 3 for e in range(8))  # 28 slots for 8 experts
    assert_equivalent(llms("mixtral"), dis)


@pytest.mark.slow
def test_1a7e_forced_placement_uses_replicas(llms):
    """Experts with 2-3 replicas on different instances and unused slots; the replica-only
    instance 6 really serves tokens, and results do not change."""
    dis = llms("mixtral", "meshes/cpu-8-1a7e.yaml")
    ex = dis.executor
    old = ex.placement()
    activated = []
    ex.set_placement(FORCED_1A7E)
    ex.observer = lambda phase, layer, out: phase == "expert" and activated.append(np.asarray(out[2]))
    try:
        assert_equivalent(llms("mixtral"), dis)
    finally:
        ex.observer = None
        ex.set_placement(old)
    loads = np.stack(activated)
    assert loads.shape[1] == 7 and loads[:, 6].sum() > 0  # AEBS sent work to replica-only instance 6


@pytest.mark.slow
def test_set_placement_between_generates(llms, checkpoint_dir):
    dis = llms("mixtral", "meshes/cpu-8-1a7e.yaml")
    ex = dis.executor
    before = _greedy(dis)
    old = ex.placement()
    moved = ex.set_placement(FORCED_1A7E)
    try:
        assert moved > 0 and ex.placement() == FORCED_1A7E
        # slot s now holds expert FORCED_1A7E[s]'s weights, unused slots are zeros
        w = np.asarray(ex.params["layers"][1]["moe"]["w_down"])
        ref = np.asarray(load_model(checkpoint_dir("mixtral"), dtype="float32")[1]["layers"][1]["moe"]["w_down"])
        for s, e in enumerate(FORCED_1A7E):
            np.testing.assert_array_equal(w[s], ref[e] if e >= 0 else 0)
        assert _greedy(dis) == before == _greedy(llms("mixtral"))
    finally:
        ex.set_placement(old)
    assert _greedy(dis) == before


@pytest.mark.slow
def test_shared_experts_on_expert_side(llms):
    """shared_experts: experts — the shared FFN (with Qwen2's sigmoid gate) split over expert instances."""
    spec = dict(
        platform="cpu",
        nodes=2,
        devices_per_node=4,
        attention={"instances": 2},
        experts={"instances": 6, "slots_per_instance": 2},
        shared_experts="experts",
    )
    dis = llms("qwen2_moe", load_mesh(spec))
    assert dis.executor.moe_layers == [1, 2]  # layer 0 is dense (mlp_only_layers)
    assert "shared" not in dis.executor._attn_layers[1]
    assert "shared" in dis.executor.expert_side.layers[1]
    assert_equivalent(llms("qwen2_moe"), dis)


# --------------------------------------------------------------------------- placement on devices


@pytest.mark.slow
@pytest.mark.parametrize("order,r2", [("ASAS", 1), ("AASS", 2)])
def test_fine_grained_pipeline_equals_monolithic(llms, checkpoint_dir, order, r2):
    """FinDEP: rows in r1 = 2 micro-batches per step, shared experts as their own program dispatched
    after the experts; the same logits and greedy tokens as the monolithic runtime."""
    mono = llms("deepseek_v2")
    dis = LLM(
        checkpoint_dir("deepseek_v2"),
        dtype="float32",
        mesh="meshes/cpu-8.yaml",
        executor_kwargs={"pipeline": {"r1": 2, "order": order, "r2": r2}},
        **ENGINE,
    )
    executor = dis.engine.executor
    seen = []
    executor.observer = lambda phase, layer, out: seen.append((phase, layer))
    prompts = PROMPTS + [[5, 9, 13], [60, 61, 62, 63]]  # 4 rows: 2 per attention instance
    want = [o.token_ids for o in mono.generate(prompts, GREEDY)]
    assert [o.token_ids for o in dis.generate(prompts, GREEDY)] == want
    executor.observer = None
    last = executor.cfg.num_layers - 1
    attention = [p for p in seen if p == ("attention", last)]
    heads = [p for p in seen if p[0] == "head"]
    assert len(attention) == len(heads) and len(heads) > 2 * 14  # two micro-batches in (most) steps
    experts = [p for p in seen if p == ("expert", last)]
    # prefill micro-batches (2 rows x 5+ tokens per instance) run in r2 chunks; decode (1 token) in one
    assert (len(experts) > len(attention)) == (r2 > 1)
    assert (("split", last) in seen) == (r2 > 1)
    order_seen = [p for p, layer in seen if layer == last and p in ("attention", "shared")][:4]
    assert order_seen == (
        ["attention", "shared"] * 2 if order == "ASAS" else ["attention", "attention", "shared", "shared"]
    )
    for got, ref in zip(_logits(dis), _logits(mono)):
        assert _rel_err(got, ref) < 1e-5


def test_pipeline_settings_are_checked():
    from jaxmoe.runtime.pipeline import Pipeline

    assert Pipeline.parse({"r1": 4, "order": "AASS"}).micro_batches(6) == 3
    assert Pipeline.parse({"r1": 4, "r2": 4}).for_batch(6, 5) == Pipeline(3, "ASAS", 2)  # 2 rows x 5 tokens
    assert Pipeline.parse("sequential") == Pipeline(1, "PP", 1)
    for bad, match in (
        ({"r1": 0}, "r1"),
        ({"r2": 0}, "r2=0|r2 must"),
        ({"order": "SASA"}, "order"),
        ({"r3": 2}, "unknown"),
        ("fastest", "'fastest'"),
    ):
        with pytest.raises(ValueError, match=match):
            Pipeline.parse(bad)


@pytest.mark.slow
def test_programs_run_on_their_sub_meshes(llms):
    dis = llms("deepseek_v2", "meshes/cpu-8.yaml")  # 2 attention (devices 0-1), 6 experts (2-7)
    ex = dis.executor
    devices = ex.sub.devices
    attn = {devices[d] for d in ex.sub.spec.attention.flat}
    experts = {devices[d] for d in ex.sub.spec.experts.flat}
    seen = {}
    ex.observer = lambda phase, layer, out: seen.setdefault((phase, layer), out)
    try:
        _logits(dis, steps=1)
    finally:
        ex.observer = None
    h, xn, cache = seen[("attention", 1)]
    assert h.sharding.device_set == xn.sharding.device_set == attn
    assert all(a.sharding.device_set == attn for a in cache.values())
    assert seen[("a2e", 1)].sharding.device_set == experts
    partials = seen[("expert", 1)][0]
    assert partials.sharding.device_set == experts and partials.shape[0] == 6
    assert seen[("e2a", 1)].sharding.device_set == attn
    assert seen[("head", None)].sharding.device_set == attn
    assert ("expert", 0) not in seen  # DeepSeek layer 0 is dense: no expert program, no transfers
    # weights: routed experts only on expert devices, attention weights only on attention devices
    assert ex.params["layers"][1]["moe"]["w_gate"].sharding.device_set == experts
    assert ex.params["layers"][1]["attn"]["o"].sharding.device_set == attn
    assert ex.params["layers"][1]["shared"]["w_gate"].sharding.device_set == attn


@pytest.mark.slow
def test_transfer_counts_per_layer(llms):
    dis = llms("qwen3_moe", "meshes/cpu-8.yaml")
    ex = dis.executor
    before = {i: s["steps"] for i, s in ex.transfer_stats().items()}
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, TABLES)]
    dis.engine.runner.forward(rows)  # padded to [2, 16] tokens
    stats = ex.transfer_stats()
    assert sorted(stats) == ex.moe_layers == [0, 1, 2]
    nbytes = 16 * ex.cfg.hidden_size * 4  # one attention instance's rows: 1 x 16 tokens x D fp32
    plan = plan_transfers(ex.sub.spec, nbytes)
    assert plan.counts("a2e").transfers > 0 and plan.counts("e2a").transfers > 0
    for i, s in stats.items():
        assert s["steps"] == before[i] + 1
        assert s["strategy"] == plan.strategy
        assert s["a2e_transfers"] >= plan.counts("a2e").transfers
        assert s["a2e_bytes"] >= plan.counts("a2e").nbytes
    # cumulative counters grow by exactly one plan per layer per step
    dis.engine.runner.forward(rows)
    for i, s in ex.transfer_stats().items():
        assert s["a2e_transfers"] - stats[i]["a2e_transfers"] == plan.counts("a2e").transfers
        assert s["e2a_transfers"] - stats[i]["e2a_transfers"] == plan.counts("e2a").transfers
        assert s["a2e"]["cross"] - stats[i]["a2e"]["cross"] == plan.counts("a2e").cross


@pytest.mark.slow
def test_timing_mode_records_the_host_share_of_every_layer(llms):
    """Timing mode records, per layer, the calling thread's CPU time inside the layer's program calls
    (``bench/disaggregated_layers.py``'s host column): present for every layer, positive, and no more
    than the layer's blocked wall time, of which it is a part."""
    dis = llms("qwen3_moe", "meshes/cpu-8.yaml")
    ex = dis.executor
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, TABLES)]
    ex.timing = True
    try:
        dis.engine.runner.forward(rows)
    finally:
        ex.timing = False
    record = ex.timings[-1]
    layers = range(ex.cfg.num_layers)
    assert sorted(record["host"]) == list(layers)
    for i in layers:
        wall = sum(record[phase].get(i, 0.0) for phase in ("attention", "a2e", "expert", "shared", "e2a"))
        assert 0 < record["host"][i] <= wall + 1e-3
    assert 0 < record["host_step"] <= record["embed"] + record["head"] + 1e-3


def test_expert_activation_counts_and_coactivation(llms):
    """The expert program's counters equal the routing of the activations A2E delivered
    (computed again on the host with the same router), padding excluded."""
    dis = llms("qwen3_moe", "meshes/cpu-8.yaml")
    ex = dis.executor
    before, coact_before = ex.expert_activation_counts(), ex.expert_coactivation()
    sent = {}
    ex.observer = lambda phase, layer, out: sent.__setitem__(layer, np.asarray(out)) if phase == "a2e" else None
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, TABLES)]
    tokens, batch, last, _ = dis.engine.runner.prepare(rows)
    try:
        ex.forward(tokens, batch, last)
    finally:
        ex.observer = None
    after, coact_after = ex.expert_activation_counts(), ex.expert_coactivation()
    k, tokens = ex.cfg.moe.top_k, sum(map(len, PROMPTS))  # padding tokens are not counted
    assert len(after) == 3 and all(len(c) == ex.cfg.moe.num_experts for c in after)
    for b, a in zip(before, after):
        assert sum(a) - sum(b) == tokens * k and all(x >= y for x, y in zip(a, b))
    for n, i in enumerate(ex.moe_layers):
        xe = sent[i]  # [B, T, D]: rows padded to a multiple of the attention instances
        ids = np.asarray(route(ex.params["layers"][i]["moe"], ex.cfg.moe, xe.reshape(-1, xe.shape[-1]))[0])
        valid = np.zeros(xe.shape[:2], bool)  # rows beyond the batch: padding added by the executor
        valid[: batch.slots.shape[0]] = batch.slots >= 0
        real = ids[valid.reshape(-1)]
        np.testing.assert_array_equal(coact_after[n] - coact_before[n], coactivation(real, ex.cfg.moe.num_experts))
        assert list(np.diagonal(coact_after[n])) == after[n]
    assert ex.expert_activation_counts() == after  # reading does not lose or add counts


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aebs_plus", "random"])
def test_replica_policies(llms, checkpoint_dir, policy):
    """Other replica selection policies pick other replicas, never other results (one prefill)."""
    cfg, params, _ = load_model(checkpoint_dir("mixtral"), dtype="float32")
    ex = DisaggregatedExecutor(
        cfg, params, 64 * 8, 8, "meshes/cpu-8-1a7e.yaml", replica_policy=policy, placement=FORCED_1A7E
    )
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, TABLES)]
    want = np.asarray(llms("mixtral").engine.runner.forward(rows))
    assert _rel_err(ModelRunner(ex, 8, 8).forward(rows), want) < 1e-5


# --------------------------------------------------------------------------- kernels


@pytest.mark.slow
def test_pallas_kernels_match_reference(checkpoint_dir):
    """Pallas grouped matmul + Pallas AEBS (interpret mode) == plain-XLA reference impls."""
    cfg, params, _ = load_model(checkpoint_dir("mixtral"), dtype="float32")
    spec = "meshes/cpu-8-4a4e.yaml"
    ref = DisaggregatedExecutor(cfg, params, 64 * 8, 8, spec)
    pal = DisaggregatedExecutor(cfg, params, 64 * 8, 8, spec, expert_impl="pallas", aebs_impl="kernel", interpret=True)
    rows = [Row(PROMPTS[1], 0, TABLES[0])]
    a = np.asarray(ModelRunner(ref, 8, 8).forward(rows, all_logits=True))[0, :5]
    b = np.asarray(ModelRunner(pal, 8, 8).forward(rows, all_logits=True))[0, :5]
    assert _rel_err(b, a) < 1e-5


@pytest.mark.slow
def test_cpu_default_expert_ffn_is_the_kernel(checkpoint_dir, monkeypatch):
    """On CPU the expert program's "auto" is the C++ expert kernel over the plain replica slots (it
    runs in the traced program) and gives the padded einsum's logits."""
    import jax

    from jaxmoe.pallas_kernels.expert_ffn import IMPLS, cpu_kernel

    if not cpu_kernel.available():
        pytest.skip(f"cpu_kernel: {cpu_kernel.unavailable_reason()}")
    calls = []
    real = IMPLS["cpu_kernel"]
    monkeypatch.setitem(IMPLS, "cpu_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    jax.clear_caches()  # trace the expert program anew, through the spy
    cfg, params, _ = load_model(checkpoint_dir("mixtral"), dtype="float32")
    spec = "meshes/cpu-8-4a4e.yaml"
    kernel = DisaggregatedExecutor(cfg, params, 64 * 8, 8, spec)
    einsum = DisaggregatedExecutor(cfg, params, 64 * 8, 8, spec, expert_impl="padded_einsum")
    assert kernel.expert_impl == "cpu_kernel"
    rows = [Row(PROMPTS[1][:1], 0, TABLES[0]), Row(PROMPTS[0][:1], 0, TABLES[1])]  # decode-sized
    a = np.asarray(ModelRunner(kernel, 8, 8).forward(rows))
    assert calls, "the expert program did not run the kernel"
    b = np.asarray(ModelRunner(einsum, 8, 8).forward(rows))
    assert _rel_err(a, b) < 1e-5


# --------------------------------------------------------------------------- replicas


def test_default_placement_round_robin_and_redundant():
    p = default_placement(8, 4, 4)  # 16 slots: every expert twice, on two different instances
    layout = ReplicaLayout(tuple(p), 8, 4, 4)
    for e in range(8):
        slots = layout.replicas(e)
        assert len(slots) == 2 and len({s // 4 for s in slots}) == 2
    assert p[0] == 0 and p[4] == 1  # expert e on instance e % N
    assert default_placement(8, 4, 4, redundant=False).count(-1) == 8
    hot = default_placement(4, 2, 4, counts=[100, 1, 1, 1])
    assert hot.count(0) == 2  # the hot expert gets a replica on each instance, first


def test_replica_tables():
    layout = ReplicaLayout(tuple(FORCED_1A7E), 8, 7, 4)
    table, inst = layout.replica_table(), layout.replica_instance()
    assert table.shape == (8, 28 - 8 + 1)
    assert list(table[0][table[0] >= 0]) == [0, 9, 18] and inst[18] == 4
    with pytest.raises(ValueError, match="no slot"):
        ReplicaLayout(tuple([0] * 28), 8, 7, 4)
    with pytest.raises(ValueError, match="entries"):
        ReplicaLayout((0, 1), 8, 7, 4)


@pytest.mark.slow
def test_failed_step_that_deletes_the_cache_is_recovered(llms):
    """A crashed step that took the donated KV cache with it: the engine re-allocates the sharded
    cache (same shapes and shardings) and later requests get the monolithic tokens."""
    from jax import tree

    from jaxmoe.engine.engine import StepFailedError
    from jaxmoe.server.testing import crashing_run

    dis = llms("mixtral", "meshes/cpu-8.yaml")
    layout = [(a.shape, a.sharding) for a in tree.leaves(dis.executor.cache)]
    engine, real_run = dis.engine, dis.engine.runner.run
    engine.runner.run = crashing_run(engine.runner)
    try:
        rid = engine.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(StepFailedError, match="injected device failure") as err:
            engine.step()
    finally:
        engine.runner.run = real_run
    assert err.value.request_ids == [rid]
    engine.abort(rid)
    leaves = tree.leaves(dis.executor.cache)
    assert [(a.shape, a.sharding) for a in leaves] == layout and not any(a.is_deleted() for a in leaves)
    assert _greedy(dis) == _greedy(llms("mixtral"))
