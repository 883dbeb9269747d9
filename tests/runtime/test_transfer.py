"""A2E / E2A: the plan (hops, counters, adaptive choice) and its execution between sub-meshes on 8 CPU devices."""

import jax
import numpy as np
import pytest

from jaxmoe.mesh import build_meshes, load_mesh
from jaxmoe.runtime import transfer as T
from jaxmoe.runtime import transfer_walk as W

from mesh_layouts import CPU8, LAYOUTS, MESHES, _inputs  # noqa: F401  (CPU8, MESHES: the other tests')


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    spec = load_mesh(LAYOUTS[request.param])
    return spec, build_meshes(spec)


@pytest.mark.parametrize("strategy", T.STRATEGIES)
def test_a2e_e2a_values_and_hops(layout, strategy, monkeypatch):
    spec, sub = layout
    x, y, x_attn, y_exp = _inputs(spec, sub)
    plan = T.plan_transfers(spec, x.nbytes // spec.attention.count, strategy)

    hops = []  # (src node, dst node, bytes) of every device_put the execution makes
    real_put = jax.device_put

    def spy(value, device=None, **kw):
        (src,) = value.devices()
        hops.append((sub.node_of(src), sub.node_of(device), value.nbytes))
        return real_put(value, device, **kw)

    calls = []  # every array operation of the walk
    for name in ("first", "rows", "concat", "add"):
        real = getattr(W.JaxOps, name)
        monkeypatch.setattr(W.JaxOps, name, lambda self, *a, _real=real: calls.append(1) or _real(self, *a))
    monkeypatch.setattr(jax, "device_put", spy)
    x_exp = T.a2e(x_attn, plan, sub)
    a2e_hops, hops[:], a2e_calls, calls[:] = list(hops), [], len(calls), []
    y_attn = T.e2a(y_exp, plan, sub)
    e2a_hops, e2a_calls = list(hops), len(calls)
    monkeypatch.undo()

    # a2e: every expert device holds all activations
    assert x_exp.sharding.is_equivalent_to(sub.replicated_sharding, 2)
    assert {s.device for s in x_exp.addressable_shards} == set(sub.experts.devices.flat)
    for shard in x_exp.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x)
    # e2a: the sum of all partials, batch-sharded over attention instances
    assert y_attn.sharding.is_equivalent_to(sub.batch_sharding, 2)
    np.testing.assert_allclose(np.asarray(y_attn), y.sum(0), rtol=1e-5, atol=1e-5)

    # the plan's counters are exactly what ran
    for direction, ran in (("a2e", a2e_hops), ("e2a", e2a_hops)):
        counted = T.TransferCounts.of(T.Transfer(0, 0, (), nbytes, 1, "", src != dst) for src, dst, nbytes in ran)
        assert counted == plan.counts(direction), direction
    # ... and so are the dry run's host calls
    ops = W.host_ops(spec, plan)
    assert ops["a2e"] == W.HostOps(len(a2e_hops), a2e_calls, len(sub.experts.devices.flat))
    assert ops["e2a"] == W.HostOps(len(e2a_hops), e2a_calls, len(sub.attention.devices.flat))


def test_cpu8_two_phase_cuts_cross_node_transfers():
    spec = load_mesh(MESHES / "cpu-8.yaml")
    b = 1024
    direct, unicast, multicast = (T.plan_transfers(spec, b, s) for s in T.STRATEGIES)
    # direct: 2 attention x 6 experts; the 4 experts on node 1 are cross-node
    assert direct.counts("a2e") == T.TransferCounts(intra=4, cross=8, intra_bytes=4 * b, cross_bytes=8 * b)
    assert direct.counts("e2a") == T.TransferCounts(intra=4, cross=8, intra_bytes=4 * b, cross_bytes=8 * b)
    # multicast: 1 gather + 1 send per expert node (one cross) + 1 + 3 multicasts
    assert multicast.counts("a2e") == T.TransferCounts(
        intra=6, cross=1, intra_bytes=b + 2 * b + 4 * 2 * b, cross_bytes=2 * b
    )
    assert [t.step for t in multicast.a2e] == [
        "gather",
        "send",
        "multicast",
        "send",
        "multicast",
        "multicast",
        "multicast",
    ]
    assert multicast.counts("e2a").cross == 1
    for plan in (unicast, multicast):
        for direction in ("a2e", "e2a"):
            assert plan.counts(direction).cross < direct.counts(direction).cross
        assert plan.counts().cross_bytes < direct.counts().cross_bytes
    assert {t.phase for t in multicast.a2e if t.step == "gather"} == {1}
    assert all(
        not t.cross_node
        for t in multicast.a2e + multicast.e2a
        if t.step in ("gather", "multicast", "reduce", "scatter")
    )


def test_plan_is_cached_and_summarised():
    spec = load_mesh(MESHES / "cpu-8.yaml")
    assert T.plan_transfers(spec, 4096) is T.plan_transfers(spec, 4096)
    assert T.plan_transfers(spec, 4096).summary().startswith("two_phase_multicast: a2e 7 hops (1 cross-node")


def _spec(mode="adaptive", dests=2, **thresholds):
    """4 attention instances on node 0, `dests` expert instances on node 1."""
    return load_mesh(
        {
            **CPU8,
            "attention": {"instances": 4},
            "experts": {"devices": list(range(4, 4 + dests)), "slots_per_instance": 8},
            "transfer": {
                "mode": mode,
                "direct_max_destinations": 2,
                "direct_min_bytes": "1MiB",
                "multicast_min_bytes": "1MiB",
                **thresholds,
            },
        }
    )


def test_adaptive_choice_follows_thresholds():
    few = _spec()
    assert T.choose_strategy(few, 2 << 20) == T.DIRECT  # few destinations, large messages: plain m-to-n
    assert T.choose_strategy(few, 1 << 20) == T.DIRECT  # thresholds are inclusive
    assert T.choose_strategy(few, 64 << 10) == T.UNICAST  # small: aggregate; node sends 256 KiB < 1 MiB
    assert T.choose_strategy(few, 512 << 10) == T.MULTICAST  # node aggregate 2 MiB >= multicast_min_bytes
    many = _spec(dests=3)
    for nbytes in (1, 64 << 10, 64 << 20):
        assert T.choose_strategy(many, nbytes) == T.MULTICAST  # many destinations: always two-phase multicast
    assert T.choose_strategy(_spec(direct_max_destinations=3, dests=3), 2 << 20) == T.DIRECT
    assert T.plan_transfers(few, 2 << 20).strategy == T.DIRECT
    assert T.plan_transfers(few, 64 << 10).strategy == T.UNICAST


def test_fixed_modes():
    assert all(T.choose_strategy(_spec("direct", dests=d), b) == T.DIRECT for d in (1, 4) for b in (1, 1 << 30))
    two = _spec("two_phase")
    assert T.choose_strategy(two, 2 << 20) == T.MULTICAST  # never m-to-n
    assert T.choose_strategy(two, 1 << 10) == T.UNICAST
    assert T.choose_strategy(load_mesh(MESHES / "cpu-8.yaml"), 1 << 30) == T.MULTICAST


def test_real_cluster_plans():
    h100 = load_mesh(MESHES / "h100-2x8.yaml")
    plan = T.plan_transfers(h100, 7168 * 2 * 64)  # 64 tokens x 7168 x bf16 per attention instance
    assert plan.strategy == T.MULTICAST
    assert plan.counts("a2e").cross == 1 and plan.counts("a2e").transfers == 3 + 2 + 3 + 7
    assert T.plan_transfers(h100, 1024, T.DIRECT).counts("a2e").cross == 4 * 8
    tpu = load_mesh(MESHES / "tpu-v5e-16.yaml")
    assert T.plan_transfers(tpu, 1024).counts("a2e").cross == 3  # one send per expert host


@pytest.mark.slow
def test_bad_inputs_are_rejected():
    spec = load_mesh(MESHES / "cpu-8.yaml")
    sub = build_meshes(spec)
    x, y, x_attn, y_exp = _inputs(spec, sub)
    with pytest.raises(ValueError, match="one plan per batch shape"):
        T.a2e(x_attn, T.plan_transfers(spec, 8), sub)
    with pytest.raises(ValueError, match="expected sharding"):
        T.a2e(jax.device_put(x, sub.replicated_sharding), T.plan_transfers(spec, x.nbytes // 2), sub)
    with pytest.raises(ValueError, match=r"expected \[6 expert instances"):
        T.e2a(x_attn, T.plan_transfers(spec, x.nbytes // 2), sub)
    with pytest.raises(ValueError, match="unknown transfer strategy"):
        T.plan_transfers(spec, 8, "broadcast")
