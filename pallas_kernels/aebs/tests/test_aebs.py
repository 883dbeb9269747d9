"""Tests for pallas_kernels.aebs: kernel == reference, validity, edge cases, aebs_plus.

Run: python -m pytest pallas_kernels/aebs/tests -q
(interpret mode on CPU; shapes are shared across cases to limit recompiles).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxmoe.pallas_kernels.aebs import aebs_jnp, aebs_numpy, aebs_plus_numpy, random_jnp, schedule
from jaxmoe.pallas_kernels.aebs import api, backends

REFS = {"aebs": aebs_numpy, "aebs_plus": aebs_plus_numpy}


def make_placement(rng, E, N, extra, r_max=4, shuffle_rows=False):
    """Each expert gets a primary slot on a random-ish instance; ``extra`` more
    replicas go to random experts on random instances (may repeat an instance)."""
    S = E + extra
    slots = rng.permutation(S)
    rt = -np.ones((E, r_max), np.int64)
    ri = np.zeros(S, np.int64)
    cnt = np.zeros(E, int)
    inst0 = rng.permutation(np.arange(E) % N)
    for e in range(E):
        rt[e, 0], ri[slots[e]] = slots[e], inst0[e]
        cnt[e] = 1
    for s in slots[E:]:
        e = rng.choice(np.flatnonzero(cnt < r_max))
        rt[e, cnt[e]], ri[s] = s, rng.integers(N)
        cnt[e] += 1
    if shuffle_rows:  # holes anywhere in a row must not matter
        for e in range(E):
            rt[e] = rt[e, rng.permutation(r_max)]
    return rt, ri


def make_topk(rng, T, k, E, zipf_s=1.0, empty_frac=0.1):
    p = 1.0 / np.arange(1, E + 1) ** zipf_s
    perm = rng.permutation(E)
    ids = np.stack([perm[rng.choice(E, k, replace=False, p=p / p.sum())] for _ in range(T)])
    ids[rng.random(ids.shape) < empty_frac] = -1
    return ids


def check_valid(ids, rt, ri, N, O, load):
    O, load = np.asarray(O), np.asarray(load)
    assert O.shape == ids.shape and O.dtype == np.int32 and load.shape == (N,)
    assert ((O == -1) == (ids == -1)).all()
    chosen = {}
    for e, p in zip(ids.ravel(), O.ravel()):
        if e < 0:
            continue
        assert p in rt[e], (e, p)  # a replica of its own expert
        assert chosen.setdefault(e, p) == p  # one replica per expert
    expect = np.bincount([ri[p] for p in chosen.values()], minlength=N)
    np.testing.assert_array_equal(load, expect)  # distinct activated replicas


def run(ids, rt, ri, N, policy, impl="kernel", **kw):
    O, load = schedule(jnp.asarray(ids), jnp.asarray(rt), jnp.asarray(ri), N, policy=policy, impl=impl, **kw)
    return np.asarray(O), np.asarray(load)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aebs", "aebs_plus"])
def test_kernel_matches_reference_random(policy):
    rng = np.random.default_rng(1234 if policy == "aebs" else 4321)
    T, k, E, N = 6, 3, 12, 4
    for case in range(24):
        rt, ri = make_placement(rng, E, N, extra=int(rng.integers(1, 20)), shuffle_rows=case % 3 == 0)
        ri = np.pad(ri, (0, E + 20 - len(ri)))  # unused slots: fixed shape, one compile
        ids = make_topk(rng, T, k, E, zipf_s=float(rng.choice([0.0, 1.0, 1.5])))
        O, load = run(ids, rt, ri, N, policy)
        O_ref, load_ref = REFS[policy](ids, rt, ri, N)
        np.testing.assert_array_equal(O, O_ref)
        np.testing.assert_array_equal(load, load_ref)
        check_valid(ids, rt, ri, N, O, load)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aebs", "aebs_plus"])
def test_kernel_matches_reference_larger(policy):
    rng = np.random.default_rng(7)
    T, k, E, N = 64, 8, 160, 8
    rt, ri = make_placement(rng, E, N, extra=32)
    for _ in range(2):
        ids = make_topk(rng, T, k, E, zipf_s=1.0, empty_frac=0.02)
        O, load = run(ids, rt, ri, N, policy)
        O_ref, load_ref = REFS[policy](ids, rt, ri, N)
        np.testing.assert_array_equal(O, O_ref)
        np.testing.assert_array_equal(load, load_ref)


@pytest.mark.slow
def test_kernel_improvement_moves_match_reference():
    """The improved state itself (no final comparison with Algorithm 1), on
    random cases the reference needed forward / backward path moves for."""
    rng = np.random.default_rng(77)
    E, N, T, k, S = 12, 4, 8, 3, 40
    picked = {"forward_moves": [], "backward_moves": []}
    for _ in range(4000):
        rt, ri = make_placement(rng, E, N, extra=int(rng.integers(4, 24)))
        ids = make_topk(rng, T, k, E, zipf_s=float(rng.choice([0.0, 1.0, 2.0])))
        ids[int(rng.integers(2, T + 1)) :] = -1
        stats = {}
        ref = aebs_plus_numpy(ids, rt, ri, N, compare_with_alg1=False, stats=stats)
        for kind, got in picked.items():
            if stats[kind] and len(got) < 5:
                got.append((ids, rt, np.pad(ri, (0, S - len(ri))), ref))
        if all(len(v) == 5 for v in picked.values()):
            break
    assert picked["forward_moves"] and picked["backward_moves"]
    fn = None
    for ids, rt, ri, (O_ref, load_ref) in sum(picked.values(), []):
        d_ids, d_rt, d_it, tkp, width = api._prepare(jnp.asarray(ids), jnp.asarray(rt), jnp.asarray(ri), N)
        fn = fn or jax.jit(
            backends.build(
                E, N, 4, tkp, width, policy="aebs_plus", max_moves=4 * N, backend="interpret", compare_with_alg1=False
            )
        )
        phys, load = fn(d_ids, d_rt, d_it, jnp.arange(width, dtype=jnp.int32))
        np.testing.assert_array_equal(np.asarray(phys)[: T * k].reshape(T, k), O_ref)
        np.testing.assert_array_equal(np.asarray(load)[:N], load_ref)


def _edge_cases():
    """Most cases share one shape (ids [5, 3], E=10, R=3, S=30, N=4): one compile."""
    rng = np.random.default_rng(99)
    pad = lambda ri: np.pad(ri, (0, 30 - len(ri)))
    cases = {}
    rt, ri = make_placement(rng, 10, 4, extra=6, r_max=3)
    cases["T=1"] = (make_topk(rng, 1, 3, 10, empty_frac=0.0), rt, pad(ri), 4)
    rt = np.stack([np.arange(10), np.arange(10, 20), np.arange(20, 30)], 1)
    ri = rng.integers(0, 4, 30)
    cases["all_replicated"] = (make_topk(rng, 5, 3, 10), rt, ri, 4)
    rt = np.concatenate([np.arange(10)[:, None], -np.ones((10, 2), int)], 1)
    cases["none_replicated"] = (make_topk(rng, 5, 3, 10), rt, pad(rng.integers(0, 4, 10)), 4)
    rt, ri = make_placement(rng, 10, 4, extra=8, r_max=3)
    ids = make_topk(rng, 5, 3, 10, empty_frac=0.5)
    ids[2] = -1  # a fully empty token
    cases["empty_slots"] = (ids, rt, pad(ri), 4)
    cases["all_empty"] = (-np.ones((5, 3), int), rt, pad(ri), 4)
    rt, _ = make_placement(rng, 10, 1, extra=8, r_max=3)
    cases["one_instance"] = (make_topk(rng, 5, 3, 10), rt, np.zeros(30, int), 1)
    # Expert 0: slots 7 and 3 on instance 2 plus slot 11 on instance 1.
    rt = -np.ones((6, 3), int)
    rt[:, 0] = [7, 0, 1, 2, 4, 5]
    rt[0, 1:] = [3, 11]
    rt[1, 1] = 6
    ri = np.array([0, 1, 1, 2, 0, 1, 2, 2, 0, 0, 0, 1])
    ids = np.array([[0, 1], [0, 5], [3, -1], [0, 2]])
    cases["two_replicas_one_instance"] = (ids, rt, ri, 3)
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_edge_cases()))
def test_edge_cases(name):
    ids, rt, ri, N = _edge_cases()[name]
    for policy in ("aebs", "aebs_plus"):
        O, load = run(ids, rt, ri, N, policy)
        O_ref, load_ref = REFS[policy](ids, rt, ri, N)
        np.testing.assert_array_equal(O, O_ref)
        np.testing.assert_array_equal(load, load_ref)
        check_valid(ids, rt, ri, N, O, load)
    if name == "one_instance":
        assert load[0] == len(set(ids[ids >= 0].tolist()))
    if name == "all_empty":
        assert (O == -1).all() and (load == 0).all()


def test_two_replicas_on_one_instance_picks_lowest_physical_id():
    ids, rt, ri, N = _edge_cases()["two_replicas_one_instance"]
    # Algorithm 1: experts 2,3,5 (single) -> instances 1,0,1 ... expert 0 has
    # replicas on instances {2, 1}; instance 2 has load 0 -> slot min(7, 3) = 3.
    O, load = run(ids, rt, ri, N, "aebs")
    assert O[0, 0] == 3 and O[1, 0] == 3 and O[3, 0] == 3


def test_tie_breaking_lowest_instance():
    # Expert 0 on instances 1 and 0 (slot 5 -> inst 1, slot 2 -> inst 0), no
    # other load: argmin picks instance 0.
    rt = np.array([[5, 2], [1, -1]])
    ri = np.array([0, 1, 0, 0, 0, 1])
    O, load = run(np.array([[0, -1]]), rt, ri, 2, "aebs")
    assert O[0, 0] == 2 and list(load) == [1, 0]
    O_ref, _ = aebs_numpy(np.array([[0, -1]]), rt, ri, 2)
    assert O_ref[0, 0] == 2


def test_jnp_reference_matches_numpy():
    rng = np.random.default_rng(5)
    f = jax.jit(aebs_jnp, static_argnums=3)
    for case in range(10):
        rt, ri = make_placement(rng, 12, 4, extra=10, shuffle_rows=case % 2 == 0)
        ids = make_topk(rng, 6, 3, 12)
        O, load = f(ids, rt, ri, 4)
        O_ref, load_ref = aebs_numpy(ids, rt, ri, 4)
        np.testing.assert_array_equal(np.asarray(O), O_ref)
        np.testing.assert_array_equal(np.asarray(load), load_ref)


def test_plus_never_worse_and_better_on_skewed_routing():
    rng = np.random.default_rng(2026)
    E, N, k = 64, 8, 6
    gaps_a, gaps_p, max_a, max_p = [], [], [], []
    for trial in range(60):
        rt, ri = make_placement(rng, E, N, extra=16)
        ids = make_topk(rng, int(rng.choice([8, 16, 32])), k, E, zipf_s=1.0, empty_frac=0.0)
        _, la = aebs_numpy(ids, rt, ri, N)
        _, lp = aebs_plus_numpy(ids, rt, ri, N)
        assert lp.max() <= la.max()
        assert (lp.max(), -lp.min()) <= (la.max(), -la.min())
        max_a.append(la.max()), max_p.append(lp.max())
        gaps_a.append(la.max() - la.min()), gaps_p.append(lp.max() - lp.min())
    assert np.mean(max_p) < np.mean(max_a)
    assert np.mean(gaps_p) < np.mean(gaps_a)


@pytest.mark.slow
def test_under_jit():
    rng = np.random.default_rng(11)
    rt, ri = make_placement(rng, 12, 4, extra=8)
    ids = make_topk(rng, 6, 3, 12)

    @jax.jit
    def step(ids, rt, ri):
        a = schedule(ids, rt, ri, 4, policy="aebs")
        b = schedule(ids, rt, ri, 4, policy="aebs_plus")
        c = schedule(ids, rt, ri, 4, policy="aebs_plus", impl="reference")
        d = schedule(ids, rt, ri, 4, policy="random", seed=3)
        return a, b, c, d

    a, b, c, d = step(jnp.asarray(ids), jnp.asarray(rt), jnp.asarray(ri))
    np.testing.assert_array_equal(np.asarray(a[0]), aebs_numpy(ids, rt, ri, 4)[0])
    np.testing.assert_array_equal(np.asarray(b[0]), aebs_plus_numpy(ids, rt, ri, 4)[0])
    np.testing.assert_array_equal(np.asarray(c[0]), np.asarray(b[0]))
    check_valid(ids, rt, ri, 4, *d)


@pytest.mark.slow
def test_random_policy():
    rng = np.random.default_rng(3)
    rt, ri = make_placement(rng, 12, 4, extra=12)
    ids = make_topk(rng, 8, 3, 12, empty_frac=0.0)
    outs = [run(ids, rt, ri, 4, "random", seed=s) for s in range(6)]
    for O, load in outs:
        check_valid(ids, rt, ri, 4, O, load)
    np.testing.assert_array_equal(outs[0][0], run(ids, rt, ri, 4, "random", seed=0)[0])
    assert any((o[0] != outs[0][0]).any() for o in outs[1:])
    O, _ = random_jnp(ids, rt, ri, 4, jax.random.key(0))
    check_valid(ids, rt, ri, 4, O, _)


def test_bad_arguments():
    with pytest.raises(ValueError):
        schedule(np.zeros((1, 1), int), np.zeros((1, 1), int), np.zeros(1, int), 1, policy="x")
    with pytest.raises(ValueError):
        schedule(np.zeros((1, 1), int), np.zeros((1, 1), int), np.zeros(1, int), 1, impl="x")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aebs", "aebs_plus"])
def test_mosaic_gpu_lowering(policy):
    """The GPU path lowers to a Mosaic GPU module (cross-platform, no GPU needed)."""
    T, k, E, N, R = 16, 8, 160, 8, 4
    f = jax.jit(
        lambda a, b, c: api._kernel_schedule(
            a, b, c, num_instances=N, policy=policy, backend="mosaic_gpu", max_moves=32
        )
    )
    args = (jnp.zeros((T, k), jnp.int32), jnp.zeros((E, R), jnp.int32), jnp.zeros((E + 32,), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.slow
def test_mosaic_gpu_interpreter():
    """The plgpu.kernel wrapper (SMEM staging) through the Mosaic GPU interpreter."""
    rng = np.random.default_rng(8)
    rt, ri = make_placement(rng, 12, 4, extra=8)
    ids = make_topk(rng, 5, 3, 12)
    prep = api._prepare(jnp.asarray(ids), jnp.asarray(rt), jnp.asarray(ri), 4)
    d_ids, d_rt, d_it, tkp, width = prep
    for policy in ("aebs", "aebs_plus"):
        fn = backends.build(12, 4, 4, tkp, width, policy=policy, max_moves=16, backend="mosaic_gpu_interpret")
        phys, load = fn(d_ids, d_rt, d_it, jnp.arange(width, dtype=jnp.int32))
        O_ref, load_ref = REFS[policy](ids, rt, ri, 4)
        np.testing.assert_array_equal(np.asarray(phys)[:15].reshape(5, 3), O_ref)
        np.testing.assert_array_equal(np.asarray(load)[:4], load_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["aebs", "aebs_plus"])
def test_compiled_gpu_kernel(policy):
    rng = np.random.default_rng(21)
    rt, ri = make_placement(rng, 160, 8, extra=32)
    for T in (16, 256):
        ids = make_topk(rng, T, 8, 160, empty_frac=0.02)
        O, load = run(ids, rt, ri, 8, policy, interpret=False)
        O_ref, load_ref = REFS[policy](ids, rt, ri, 8)
        np.testing.assert_array_equal(O, O_ref)
        np.testing.assert_array_equal(load, load_ref)


@pytest.mark.slow
def test_mosaic_tpu_kernel_matches_jnp_reference_in_interpret_mode():
    """The Mosaic TPU form (``kernel_tpu``) through the TPU interpreter, on random placements and
    routings (one shape, so one compile), equals the jnp Algorithm 1."""
    E, N, T, k = 16, 4, 6, 3
    f = jax.jit(
        lambda a, b, c: api._kernel_schedule(
            a, b, c, num_instances=N, policy="aebs", backend="mosaic_tpu_interpret", max_moves=0
        )
    )
    rng = np.random.default_rng(30)
    for case in range(4):
        rt, ri = make_placement(rng, E, N, extra=8, shuffle_rows=case % 2 == 1)
        ids = make_topk(rng, T, k, E, empty_frac=0.2)
        ids[0, 0] = E + 3  # outside [0, E): an empty slot
        O, load = f(jnp.asarray(ids), jnp.asarray(rt), jnp.asarray(ri))
        O_ref, load_ref = aebs_jnp(jnp.asarray(ids), jnp.asarray(rt), jnp.asarray(ri), N)
        np.testing.assert_array_equal(np.asarray(O), np.asarray(O_ref))
        np.testing.assert_array_equal(np.asarray(load), np.asarray(load_ref))
        check_valid(np.where((ids >= 0) & (ids < E), ids, -1), rt, ri, N, O, load)


def test_platform_picks_the_aebs_form_and_tpu_lowers_to_mosaic():
    """``schedule(impl="kernel")`` traced for TPU is the Mosaic TPU kernel (a tpu_custom_call), for
    CUDA the Mosaic GPU one; ``auto`` is the kernel there, on CPU the faster measured form."""
    from jaxmoe.pallas_kernels.aebs import resolve_impl
    from jaxmoe.pallas_kernels.platform import lowering_for

    T, k, E, N, R = 16, 8, 128, 12, 2
    args = (jnp.zeros((T, k), jnp.int32), jnp.zeros((E, R), jnp.int32), jnp.zeros((N * 12,), jnp.int32))
    for platform, want in (("tpu", "tpu_custom_call"), ("cuda", "mosaic_gpu")):
        with lowering_for(platform):
            assert resolve_impl("auto") == "kernel"
            f = jax.jit(lambda a, b, c: schedule(a, b, c, N, impl="kernel"))
            assert want in f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    with lowering_for("tpu"):
        assert resolve_impl("auto", policy="aebs_plus") == "reference"
        with pytest.raises(NotImplementedError, match="policy 'aebs' only"):
            jax.jit(lambda a, b, c: schedule(a, b, c, N, policy="aebs_plus", impl="kernel")).trace(*args)
    with lowering_for("cpu"):  # the faster form on CPU per policy (BENCHMARKS.md)
        assert resolve_impl("auto") == "reference" and resolve_impl("auto", policy="aebs_plus") == "kernel"
    with pytest.raises(ValueError, match="aebs_impl must be"):
        resolve_impl("fast")
