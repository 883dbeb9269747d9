"""BrownoutServe in the disaggregated executor (8 CPU devices): Algorithm 1 in the expert program on
the expert sub-mesh, with replicas and AEBS, against the monolithic executor.

threshold 1 = the monolithic original model's tokens; full brownout at threshold 0 and partial
brownout at 0.5, and per-phase thresholds (prefill 1, decode 0) = the monolithic executor's tokens
with the same brownout config (layouts 2a6e and 4a4e); moving the threshold recompiles nothing; the distinct experts a step uses equal a direct
reading of Algorithm 1 on the routing of the activations A2E delivered, and brownout lowers them.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from jaxmoe import LLM, BrownoutConfig, BrownoutError, SamplingParams
from jaxmoe.brownout.routing import BrownoutRouting, set_threshold, split_reference
from jaxmoe.brownout.routing import threshold as brownout_threshold
from jaxmoe.compilation import compile_events
from jaxmoe.engine.model_runner import Row
from jaxmoe.models.router import route

pytestmark = pytest.mark.slow  # every test here builds engines on the 8-device mesh

ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[3, 9, 27, 81, 11], [5, 25, 17], [2, 4, 8, 16, 32, 64]]
LAYOUTS = ["meshes/cpu-8.yaml", "meshes/cpu-8-4a4e.yaml"]  # 2a6e (24 slots: replicas), 4a4e (16 slots)


@pytest.fixture(scope="module")
def united(checkpoint_dir, tmp_path_factory):
    """The tiny Mixtral checkpoint with united experts (k = 2, a short distillation)."""
    from jaxmoe.brownout.united import unite

    corpus = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "bisect.py", "heapq.py"):
        shutil.copy(stdlib / name, corpus / name)
    out = tmp_path_factory.mktemp("united") / "m"
    unite(checkpoint_dir("mixtral"), 2, out, tokens=512, steps=20, corpus=str(corpus), progress=False)
    return out


@pytest.fixture(scope="module")
def llms(united):
    """llms(mesh, full) -> LLM with brownout (threshold set by the test), built once."""
    made = {}

    def get(mesh=None, full=False):
        if (mesh, full) not in made:
            made[mesh, full] = LLM(
                united, dtype="float32", mesh=mesh, brownout=BrownoutConfig(1.0, use_full_brownout=full), **ENGINE
            )
        return made[mesh, full]

    return get


def _greedy(llm, threshold):
    """Greedy tokens at ``threshold`` (both phases), or per phase with a (prefill, decode) pair."""
    prefill, decode = threshold if isinstance(threshold, tuple) else (threshold, threshold)
    set_threshold(llm.executor, prefill, "prefill")
    set_threshold(llm.executor, decode, "decode")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mesh", LAYOUTS)
def test_threshold_one_is_the_monolithic_original_model(llms, checkpoint_dir, mesh):
    want = [o.token_ids for o in LLM(checkpoint_dir("mixtral"), dtype="float32", **ENGINE).generate(PROMPTS, GREEDY)]
    assert _greedy(llms(mesh), 1.0) == want


@pytest.mark.parametrize("mesh", LAYOUTS)
@pytest.mark.parametrize("threshold,full", [(0.0, True), (0.5, False), (0.0, False), ((1.0, 0.0), False)])
def test_brownout_equals_the_monolithic_executor(llms, mesh, threshold, full):
    want = _greedy(llms(None, full), threshold)
    assert want != _greedy(llms(None, full), 1.0)  # brownout changes this model's tokens
    assert _greedy(llms(mesh, full), threshold) == want


def test_moving_the_threshold_on_a_mesh_does_not_recompile(llms):
    dis = llms(LAYOUTS[0])
    _greedy(dis, 0.7)
    before = compile_events()["programs"]
    for threshold in (0.2, 1.0, 0.0, 0.55):
        _greedy(dis, threshold)
    assert compile_events()["programs"] == before


@pytest.mark.parametrize("threshold,full", [(1.0, False), (0.4, False), (0.0, False), (0.3, True)])
def test_activated_experts_follow_algorithm_1(llms, threshold, full):
    """The expert program's count of distinct original / united experts equals the split read
    directly from Algorithm 1 (``split_reference``) on the routing of the activations A2E delivered."""
    dis = llms(LAYOUTS[0], full)
    ex = dis.executor
    set_threshold(ex, threshold)
    sent, seen = {}, {}

    def observe(phase, layer, out):
        if phase == "a2e":
            sent[layer] = np.asarray(out)
        if phase == "expert":
            seen[layer] = np.asarray(out[3])

    rows = [Row(p, 0, [i]) for i, p in enumerate(PROMPTS)]
    tokens, batch, last, _ = dis.engine.runner.prepare(rows)
    ex.observer = observe
    try:
        ex.forward(tokens, batch, last)
    finally:
        ex.observer = None
    got = ex.activated_experts()
    for i in ex.moe_layers:
        moe = ex.params["layers"][i]["moe"]
        groups = np.asarray(moe["united_groups"])
        xe = sent[i]
        ids = np.asarray(route(moe, ex.cfg.moe, xe.reshape(-1, xe.shape[-1]))[0])
        valid = np.zeros(xe.shape[:2], bool)
        valid[: batch.slots.shape[0]] = batch.slots >= 0
        valid = valid.reshape(-1)
        orig, uni = split_reference(ids, valid, groups, threshold, full)
        want = (len(set(orig[valid].ravel()) - {-1}), len(set(uni[valid].ravel()) - {-1}))
        assert got[i] == want == tuple(int(v) for v in seen[i])
        if threshold == 1.0:
            assert want == (len(set(ids[valid].ravel())), 0)
        else:
            assert sum(want) < len(set(ids[valid].ravel()))  # brownout reads fewer weight sets
    set_threshold(ex, 1.0)


def test_bad_brownout_input_on_a_mesh(llms, checkpoint_dir):
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

    with pytest.raises(BrownoutError, match="no united experts"):
        LLM(checkpoint_dir("mixtral"), mesh=LAYOUTS[0], brownout=BrownoutConfig(0.5), **ENGINE)
    cfg, params, _ = load_model(checkpoint_dir("mixtral"), "float32")
    with pytest.raises(BrownoutError, match="MoE layer 0: no united experts"):
        DisaggregatedExecutor(cfg, params, 64 * 8, 8, LAYOUTS[0], routing=BrownoutRouting(), routing_state=0.5)
    ex = llms(LAYOUTS[0]).executor
    for bad in (1.5, -0.2, float("nan")):
        with pytest.raises(BrownoutError, match=f"got {bad!r}"):
            set_threshold(ex, bad)
    assert 0 <= brownout_threshold(ex) <= 1  # the bad values were not taken


def test_activated_experts_are_exported(llms):
    """Engine stats and the Prometheus gauge ``jaxmoe_activated_experts`` carry the last step's count."""
    import http.client

    from jaxmoe.server.app import ServeOptions, ServerThread

    dis = llms(LAYOUTS[0])
    _greedy(dis, 0.0)
    used = dis.executor.activated_experts()
    st = ServerThread(dis.engine, ServeOptions(warmup=False))
    server = st.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        st.stop()
        set_threshold(dis.executor, 1.0)
    united = sum(u for _, u in used.values())
    assert united > 0 and f'jaxmoe_activated_experts{{kind="united"}} {float(united)}' in text
    assert f'jaxmoe_activated_experts{{kind="original"}} {float(sum(o for o, _ in used.values()))}' in text


# United experts in the replica placement: logical experts E + u on the 2a6e layout (6 instances x
# (4 + ceil(4 / 6)) = 30 slots for 8 originals + 4 united experts). United expert 8 has 4 replicas,
# 9 has 3; slots -1 are unused.
REPLICATED_UNITED = [
    *[0, 1, 8, 9, -1],
    *[2, 3, 8, 10, -1],
    *[4, 5, 8, 11, -1],
    *[6, 7, 9, 10, 11],
    *[0, 2, 4, 6, 8],
    *[1, 3, 5, 7, 9],
]


@pytest.fixture(scope="module")
def replicated(united):
    """full -> LLM on 2a6e whose placement replicates united experts (REPLICATED_UNITED)."""
    made = {}

    def get(full=False):
        if full not in made:
            made[full] = LLM(
                united,
                dtype="float32",
                mesh=LAYOUTS[0],
                brownout=BrownoutConfig(1.0, use_full_brownout=full),
                executor_kwargs={"placement": REPLICATED_UNITED},
                **ENGINE,
            )
        return made[full]

    return get


def test_united_experts_are_logical_experts_of_the_placement(llms):
    """The default placement over E + U logical experts: every united expert has a slot, spare slots
    hold replicas of originals and united experts alike."""
    ex = llms(LAYOUTS[0]).executor
    E = ex.cfg.moe.num_experts
    assert ex.slots_per_instance == 4 + 1  # the mesh file's 4, + ceil(4 united / 6 instances)
    placement = ex.placement()
    assert len(placement) == 6 * 5 and set(placement) == set(range(E + 4))
    assert [placement.count(E + u) for u in range(4)] == [2, 2, 2, 2]  # default_placement's spare slots


@pytest.mark.parametrize("threshold,full", [(0.0, True), (0.5, False), (0.0, False)])
def test_replicated_united_experts_give_the_monolithic_tokens(llms, replicated, threshold, full):
    ex = replicated(full).executor
    E = ex.cfg.moe.num_experts
    assert ex.placement() == REPLICATED_UNITED
    assert len(ex.expert_side.layouts[ex.moe_layers[0]].replicas(E)) == 4  # united expert 0 (E + 0): 4 replicas
    assert _greedy(replicated(full), threshold) == _greedy(llms(None, full), threshold)


def _observed_step(llm, threshold):
    """One forward of PROMPTS at ``threshold``: (what A2E delivered per layer, the batch)."""
    ex = llm.executor
    set_threshold(ex, threshold)
    sent = {}

    def observe(phase, layer, out):
        if phase == "a2e":
            sent[layer] = np.asarray(out)

    rows = [Row(p, 0, [i]) for i, p in enumerate(PROMPTS)]
    tokens, batch, last, _ = llm.engine.runner.prepare(rows)
    ex.observer = observe
    try:
        ex.forward(tokens, batch, last)
    finally:
        ex.observer = None
    return sent, batch


@pytest.mark.parametrize("threshold", [0.0, 0.4])
def test_aebs_chooses_among_the_united_replicas(replicated, threshold):
    """The activated replicas per instance equal AEBS (the jnp reference) run on a direct reading of
    Algorithm 1: the kept originals, then the united experts E + u (one choice per token and united
    expert), over the placement's replica table."""
    import jax.numpy as jnp

    from jaxmoe.pallas_kernels.aebs.api import schedule

    llm = replicated()
    ex = llm.executor
    sent, batch = _observed_step(llm, threshold)
    got = ex.expert_side.activated_per_instance()
    E = ex.cfg.moe.num_experts
    for i in ex.moe_layers:
        moe = ex.params["layers"][i]["moe"]
        xe = sent[i]
        ids = np.asarray(route(moe, ex.cfg.moe, xe.reshape(-1, xe.shape[-1]))[0])
        valid = np.zeros(xe.shape[:2], bool)
        valid[: batch.slots.shape[0]] = batch.slots >= 0
        valid = valid.reshape(-1)
        orig, uni = split_reference(ids, valid, np.asarray(moe["united_groups"]), threshold, False)
        orig, uni = np.where(valid[:, None], orig, -1), np.where(valid[:, None], uni, -1)
        for t in range(len(uni)):  # two choices of one group: one united-expert choice
            for j in range(uni.shape[1]):
                if uni[t, j] >= 0 and uni[t, j] in uni[t, :j]:
                    uni[t, j] = -1
        logical = np.concatenate([orig, np.where(uni >= 0, uni + E, -1)], axis=1)
        layout = ex.expert_side.layouts[i]
        phys, want = schedule(
            jnp.asarray(logical), layout.replica_table(), layout.replica_instance(), 6, policy="aebs", impl="reference"
        )
        assert got[i] == [int(v) for v in want]
        assert sum(got[i]) == sum(ex.activated_experts()[i])  # each logical expert runs on one replica
        on_united = {int(s) for s in np.asarray(phys).ravel() if s >= 0 and REPLICATED_UNITED[s] >= E}
        assert on_united and all(REPLICATED_UNITED[s] >= E for s in on_united)
    set_threshold(ex, 1.0)


def test_brownout_lowers_the_activated_experts_per_instance(replicated):
    """Distinct experts (original + united) and the replicas the instances run, summed over layers,
    fall as the threshold goes down."""
    ex = replicated().executor
    totals, per_instance, busiest = [], [], []
    for threshold in (1.0, 0.6, 0.3, 0.0):
        _observed_step(replicated(), threshold)
        totals.append(sum(o + u for o, u in ex.activated_experts().values()))
        loads = ex.expert_side.activated_per_instance().values()
        per_instance.append(sum(sum(v) for v in loads))
        busiest.append(max(max(v) for v in loads))
    set_threshold(ex, 1.0)
    assert totals == per_instance
    assert all(a >= b for a, b in zip(totals, totals[1:])) and totals[-1] < totals[0]
    assert busiest[-1] < busiest[0]  # the busiest instance runs fewer replicas (this model: 2 -> 1)


def test_the_placement_controller_replicates_hot_united_experts(united, llms):
    """At threshold 0 the united experts carry the load: a rebalance from the measured counts gives
    the busiest united expert more replicas than any original, and the tokens stay the monolithic ones."""
    from jaxmoe.janus.placement_controller import PlacementController

    llm = LLM(united, dtype="float32", mesh=LAYOUTS[0], brownout=BrownoutConfig(0.0), **ENGINE)
    ex = llm.executor
    E = ex.cfg.moe.num_experts
    controller = PlacementController(ex)
    want = _greedy(llms(None), 0.0)
    assert _greedy(llm, 0.0) == want
    counts = np.diagonal(ex.expert_coactivation()[0])
    assert counts.shape == (E + 4,) and counts[E:].sum() > 0
    assert controller.rebalance() is not None
    placement = ex.placement()
    reps = [placement.count(e) for e in range(E + 4)]
    hot = E + int(np.argmax(counts[E:]))
    assert reps[hot] > max(reps[:E]) and reps[hot] >= 2
    assert _greedy(llm, 0.0) == want


@pytest.mark.slow  # the rescale compiles the new layout's programs (tens of seconds on 2 cores)
def test_live_rescale_keeps_brownout_and_the_united_experts(united, llms):
    """Re-scaling 2a6e -> 2a4e moves originals and united experts alike (4 + ceil(4 / 4) slots per
    instance on the new layout); the threshold SALC left is kept; the tokens stay the monolithic ones."""
    small = dict(ENGINE, max_prefill_chunk=16, max_batch_tokens=32)  # few shapes for the rescale to warm up
    llm = LLM(united, dtype="float32", mesh=LAYOUTS[0], brownout=BrownoutConfig(1.0), **small)
    set_threshold(llm.executor, 0.5)
    result = llm.rescale(2, 4)
    ex = llm.executor
    assert (ex.num_expert_instances, ex.slots_per_instance, brownout_threshold(ex)) == (4, 5, 0.5)
    assert set(ex.placement()) - {-1} == set(range(ex.cfg.moe.num_experts + 4))
    assert result is not None
    assert _greedy(llm, 0.5) == _greedy(llms(None), 0.5)


@pytest.mark.parametrize("threshold,full", [(0.0, True), (0.5, False)])
def test_brownout_on_tensor_parallel_instances(llms, threshold, full):
    """meshes/cpu-8-tp2x2.yaml: heads split over 2 devices per attention instance, the slots' FFN
    columns (united experts' too) over 2 devices per expert instance: the monolithic brownout tokens."""
    want = _greedy(llms(None, full), threshold)
    assert _greedy(llms("meshes/cpu-8-tp2x2.yaml", full), threshold) == want
