"""Tensor parallelism inside an attention instance (``attention.devices_per_instance`` > 1,
``jaxmoe.runtime.attention_tp``): the heads and the KV cache are really split over an instance's
devices, and logits (relative error < 1e-5) and greedy tokens equal both the monolithic executor
and the same layout with one device per attention instance.
"""

from __future__ import annotations

import dataclasses
import re

import jax

import numpy as np
import pytest
import yaml

from jaxmoe.checkpoint.model import load_model
from jaxmoe.mesh import MeshConfigError, load_mesh
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.runtime import attention_tp
from jaxmoe.runtime.disaggregated import DisaggregatedExecutor
from jaxmoe.runtime.expert_program import relayout_layer
from jaxmoe import LLM, SamplingParams
from test_disaggregated import ENGINE, _greedy, _logits, _rel_err

TP2 = "meshes/cpu-8-tp2.yaml"  # 2 attention instances x 2 devices + 4 experts
TP4 = "meshes/cpu-8-tp4.yaml"  # 1 attention instance x 4 devices + 4 experts
TP2X2 = "meshes/cpu-8-tp2x2.yaml"  # 2 attention x 2 devices + 2 expert instances x 2 devices
# TP2's expert side, with 2 attention instances of one device each (devices 0 and 2)
ONE_DEVICE = {
    "platform": "cpu",
    "nodes": 2,
    "devices_per_node": 4,
    "attention": {"devices": [0, 2]},
    "experts": {"devices": [4, 5, 6, 7], "slots_per_instance": 4},
}


@pytest.fixture(scope="module")
def llms(checkpoint_dir):
    """llms(family, mesh=None) -> LLM, built once per module."""
    made = {}

    def get(family, mesh=None):
        key = (family, str(mesh))
        if key not in made:
            made[key] = LLM(checkpoint_dir(family), dtype="float32", mesh=mesh, **ENGINE)
        return made[key]

    return get


COLLECTIVE = re.compile(r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\(")


def _shard_shapes(arr) -> set[tuple[int, ...]]:
    return {tuple(s.data.shape) for s in arr.addressable_shards}


def assert_same(a, b):
    for got, want in zip(_logits(a), _logits(b)):
        assert _rel_err(got, want) < 1e-5
    assert _greedy(a) == _greedy(b)


@pytest.mark.slow
def test_gqa_heads_split_2x2(llms):
    """Mixtral (4 query heads, 2 KV heads) on 2 instances x 2 devices: each device holds 2 query
    heads and 1 KV head; same logits and tokens as one device per instance and as monolithic."""
    tp = llms("mixtral", TP2)
    ex = tp.executor
    assert ex.attention.tp.size == 2 and ex.attention.tp.kv_repeat == 1
    attn = ex.params["layers"][0]["attn"]
    D, hd = tp.cfg.hidden_size, tp.cfg.attn.head_dim
    assert _shard_shapes(attn["q"]) == {(D, 2 * hd)}  # 2 of 4 query heads per device
    assert _shard_shapes(attn["k"]) == {(D, hd)}  # 1 of 2 KV heads
    assert _shard_shapes(attn["o"]) == {(2 * hd, D)}
    slots = ex.num_cache_slots
    assert _shard_shapes(ex.cache[0]["k"]) == {(slots // 2, 1, hd)}  # slots over instances, heads over devices
    assert_same(tp, llms("mixtral", ONE_DEVICE))
    assert_same(tp, llms("mixtral"))


def test_local_tp_layer_only_sums_inside_the_instance(llms):
    """The per-instance attention program of a 2 x 2 layout: its only collective is the all-reduce
    of the partial output projections between the two devices of each instance (no gathering of
    weights or KV heads), so each device really computes only its own heads."""
    ex = llms("mixtral", TP2).executor
    B, T, NB = 4, 4, 4
    rows = ex.attention.rows
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)  # noqa: E731
    x = spec((B, T, ex.cfg.hidden_size), np.float32)
    batch = AttentionBatch(spec((B, T), np.int32), spec((B, T), np.int32), spec((B, NB), np.int32))
    hlo = ex.attention.layer.lower(ex._attn_layers[0], x, x, batch, ex.cache[0], True).compile().as_text()
    found = [line for line in hlo.splitlines() if COLLECTIVE.search(line)]
    assert len(found) == 1 and "all-reduce" in found[0] and "replica_groups={{0,1},{2,3}}" in found[0]


@pytest.mark.slow
def test_gqa_kv_heads_replicated_1x4(llms):
    """Qwen3-MoE (4 query heads, 2 KV heads, q/k norms) on one instance of 4 devices: the KV heads
    are fewer than the devices, so each is repeated twice (device t holds the KV head of its query head)."""
    tp = llms("qwen3_moe", TP4)
    ex = tp.executor
    assert ex.attention.tp.kv_repeat == 2
    hd = tp.cfg.attn.head_dim
    assert _shard_shapes(ex.cache[0]["k"]) == {(ex.num_cache_slots, 1, hd)}
    assert _shard_shapes(ex.params["layers"][0]["attn"]["q"]) == {(tp.cfg.hidden_size, hd)}
    assert_same(tp, llms("qwen3_moe"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [TP2, TP4])
def test_mla_heads_split(llms, mesh):
    """DeepSeek-V3 (MLA, 4 heads): q_b / kv_b columns and o rows split; the compressed KV cache is
    one per token for all heads, so it is kept whole on every device of an instance."""
    tp = llms("deepseek_v3", mesh)
    ex, a = tp.executor, tp.cfg.attn
    k = load_mesh(mesh).attention.devices_per_instance
    layer = ex.params["layers"][0]["attn"]
    q = layer["q_b"] if "q_b" in layer else layer["q"]
    assert _shard_shapes(q) == {(q.shape[0], q.shape[1] // k)}
    assert _shard_shapes(layer["kv_b"]) == {(a.kv_lora_rank, a.num_heads // k * (a.qk_nope_head_dim + a.v_head_dim))}
    n = load_mesh(mesh).attention.count
    assert _shard_shapes(ex.cache[0]["ckv"]) == {(ex.num_cache_slots // n, a.kv_lora_rank)}
    assert_same(tp, llms("deepseek_v3"))


def test_heads_that_do_not_split(checkpoint_dir):
    """3 devices per instance for 4 heads: a MeshConfigError naming the field and both numbers."""
    cfg, params, _ = load_model(checkpoint_dir("mixtral"), dtype="float32")
    mesh = {
        "platform": "cpu",
        "nodes": 1,
        "devices_per_node": 8,
        "attention": {"instances": 1, "devices_per_instance": 3},
        "experts": {"instances": 4, "slots_per_instance": 2},
    }
    with pytest.raises(MeshConfigError, match=r"attention\.devices_per_instance: 3 devices .* 4 attention heads"):
        DisaggregatedExecutor(cfg, params, 64, 8, mesh)


def test_kv_heads_that_do_not_split(checkpoint_dir):
    """12 query heads, 6 KV heads, 4 devices: neither 6 % 4 nor 4 % 6 is 0."""
    cfg, _, _ = load_model(checkpoint_dir("mixtral"), dtype="float32")
    cfg = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, num_heads=12, num_kv_heads=6))
    spec = load_mesh(TP4)
    with pytest.raises(MeshConfigError, match=r"attention\.devices_per_instance: 4 devices .* 6 KV heads"):
        attention_tp.plan(cfg, spec)
    fewer = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, num_heads=12, num_kv_heads=2))
    plan = attention_tp.plan(fewer, spec)
    assert (plan.kv_repeat, plan.cfg.attn.num_kv_heads, plan.local_cfg.attn.num_heads) == (2, 4, 3)


def test_expand_kv_keeps_the_groups():
    """Repeating KV head j next to itself: query head h still reads original KV head h // (H / KVH)."""
    cfg = type("C", (), {})()
    cfg.attn = type("A", (), {"head_dim": 3})()
    w = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 6)  # [D=2, KVH=2 x hd=3]
    out = np.asarray(attention_tp.expand_kv({"k": w, "v": w}, cfg, 2)["k"]).reshape(2, 4, 3)
    heads = w.reshape(2, 2, 3)
    for j in range(4):
        np.testing.assert_array_equal(out[:, j], heads[:, j // 2])


@pytest.mark.slow
def test_expert_ffn_columns_split(llms):
    """2 attention x 2 devices + 2 expert instances x 2 devices (DeepSeek-V3: 16 experts, shared
    experts): each expert device holds its instance's 8 slots with half of the FFN columns; same
    logits and tokens as monolithic, also after ``set_placement`` moves replicas."""
    tp = llms("deepseek_v3", TP2X2)
    ex, F = tp.executor, tp.cfg.moe.intermediate_size
    moe = ex.params["layers"][ex.moe_layers[0]]["moe"]
    D = tp.cfg.hidden_size
    assert _shard_shapes(moe["w_gate"]) == {(8, D, F // 2)}
    assert _shard_shapes(moe["w_down"]) == {(8, F // 2, D)}
    assert_same(tp, llms("deepseek_v3"))
    old = ex.placement()
    swapped = old[8:] + old[:8]  # every expert to the other instance
    try:
        assert ex.set_placement(swapped) == 16 * len(ex.moe_layers)  # every slot of every MoE layer moved
        assert _shard_shapes(ex.params["layers"][ex.moe_layers[0]]["moe"]["w_up"]) == {(8, D, F // 2)}
        assert_same(tp, llms("deepseek_v3"))
    finally:
        ex.set_placement(old)


def test_expert_columns_that_do_not_split(checkpoint_dir):
    cfg, params, _ = load_model(checkpoint_dir("mixtral"), dtype="float32")
    F = cfg.moe.intermediate_size
    k = next(k for k in range(3, 8) if F % k)
    mesh = {
        "platform": "cpu",
        "nodes": 1,
        "devices_per_node": 8,
        "attention": {"instances": 1},
        "experts": {"instances": 1, "devices_per_instance": k, "slots_per_instance": 8},
    }
    with pytest.raises(MeshConfigError, match=rf"experts\.devices_per_instance: {k} devices .* intermediate size {F}"):
        DisaggregatedExecutor(cfg, params, 64, 8, mesh)


@pytest.mark.slow
def test_tp_with_micro_batches_and_shared_experts_on_the_expert_side(checkpoint_dir, llms):
    """FinDEP micro-batches (r1 = 2, ASAS, expert work in r2 = 2 chunks) over tensor-parallel
    instances on both sides, Qwen2-MoE's shared experts on the expert side (not split over
    expert_tp, added once after the instance's sum): the same greedy tokens as monolithic."""
    mesh = dict(yaml.safe_load(open(TP2X2)), shared_experts="experts")
    pipeline = {"order": "ASAS", "r1": 2, "r2": 2}
    llm = LLM(checkpoint_dir("qwen2_moe"), dtype="float32", mesh=mesh, pipeline=pipeline, **ENGINE)
    assert llm.executor.shared_on_experts and not llm.executor.shared_layers
    prompts = [[7, 21, 33, 5], [11, 3, 77], [9, 8, 1, 2, 60], [4, 4]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert llm.executor.last_pipeline.r1 == 2
    assert got == [o.token_ids for o in llms("qwen2_moe").generate(prompts, greedy)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ragged_dot", "pallas"])
def test_expert_columns_split_with_each_expert_ffn(checkpoint_dir, llms, impl):
    """The split FFN columns through the other expert-FFN implementations (Pallas: interpret mode on CPU)."""
    llm = LLM(checkpoint_dir("mixtral"), dtype="float32", mesh=TP2X2, expert_impl=impl, **ENGINE)
    assert llm.executor.expert_impl == impl
    prompts, greedy = [[7, 21, 33, 5, 90], [11, 3, 77]], SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in llms("mixtral").generate(prompts, greedy)]
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want


def test_mesh_show_says_what_is_split():
    text = load_mesh(TP2X2).describe()
    assert "2 instances x 2 devices (mesh axes 'attn' x 'attn_tp'); tensor parallel: attention heads split" in text
    assert "tensor parallel: expert FFN columns split over 'expert_tp'" in text
    assert "tensor parallel" not in load_mesh("meshes/cpu-8.yaml").describe()


def test_collective_slot_moves_refuse_split_columns(llms):
    """Cross-process slot moves (``slot_moves``: ppermute rounds of whole slots) do not carry split
    FFN columns: forced on a tensor-parallel expert side they raise, naming the field, and change nothing."""
    ex = llms("deepseek_v3", TP2X2).executor
    i = ex.moe_layers[0]
    layout, before = ex.layouts[i], ex.placement()
    with pytest.raises(NotImplementedError, match=r"experts\.devices_per_instance: 2 \(FFN columns split\)"):
        relayout_layer(ex.expert_side.layers[i], layout, layout, ex.sub, collective=True)
    assert ex.placement() == before


@pytest.mark.slow
def test_rescaled_tp_layout_repeats_kv_heads_once(llms):
    """Live re-scaling of a layout whose 4-device attention instance repeats each of the 2 GQA KV
    heads twice (``attention_tp.expand_kv``): the new layout (1a3e, still 4 devices per attention
    instance) holds the same attention weights, split the same way, not repeated a second time;
    and its first forward gives the launch layout's logits."""
    from jaxmoe.janus.reshard import build_rescaled, rescaled_spec

    ex = llms("qwen3_moe", TP4).executor
    assert ex.attention.tp.kv_repeat == 2
    spec = rescaled_spec(ex.sub.spec, 1, 3)
    new, stats = build_rescaled(ex, spec, ex.num_cache_slots)
    assert new.sub.spec.attention.devices == ((0, 1, 2, 3),) and new.num_expert_instances == 3
    for old_layer, new_layer in zip(ex.params["layers"], new.params["layers"]):
        for name, w in old_layer["attn"].items():
            got = new_layer["attn"][name]
            assert got.shape == w.shape and got.sharding.spec == w.sharding.spec, name
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w), err_msg=name)
    # expert devices 4-6 stay, and 1a4e held every expert twice: nothing to copy
    assert stats.expert_slots_local == 3 * 4 * len(ex.moe_layers) and stats.expert_slots_copied == 0
    tokens = np.array([[7, 21, 33, 5]], np.int32)
    batch = AttentionBatch(
        np.arange(4, dtype=np.int32)[None], np.arange(4, dtype=np.int32)[None], np.zeros((1, 8), np.int32)
    )
    want = np.asarray(ex.forward(tokens, batch, np.array([3], np.int32)))
    ex.reset_cache()
    got = np.asarray(new.forward(tokens, batch, np.array([3], np.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
