"""Tests for pallas_kernels.grouped_matmul (CPU interpret mode, small shapes).

pallas (interpret) == ragged_dot == loop == padded einsum on random inputs with
empty groups, groups spanning several tiles, unaligned group boundaries,
a single group, rows belonging to no group and -1 router slots; fp32 and bf16.
The TPU and Mosaic GPU kernels are also run under their own interpreters and
cross-lowered (compile-free) for TPU / CUDA at real model sizes.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.pallas_kernels.grouped_matmul import dispatch, combine, grouped_swiglu, kernel, make_group_metadata
from jaxmoe.pallas_kernels.grouped_matmul import kernel_gpu

TILING = {"tiling_gate_up": (16, 32, 32), "tiling_down": (16, 32, 32)}


def _weights(key, g, d, f, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    s = 1.0 / np.sqrt(d)
    return tuple(
        (jax.random.normal(k, shp) * s).astype(dtype) for k, shp in ((k1, (g, d, f)), (k2, (g, d, f)), (k3, (g, f, d)))
    )


def _tol(dtype, ref):
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) + 1e-6
    return dict(rtol=2e-5, atol=2e-5 * scale) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2 * scale)


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


CASES = {
    # sizes, total rows M (rows past sum(sizes) belong to no group)
    "mixed": ([0, 37, 3, 0, 17, 5], 70),  # empty first/middle, 37 > tile
    "single": ([29], 29),
    "all_empty": ([0, 0, 0], 24),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_swiglu_impls_agree(case, dtype):
    sizes, m = CASES[case]
    g, d, f = len(sizes), 64, 96
    kx, kw = jax.random.split(jax.random.PRNGKey(list(CASES).index(case)))
    x = jax.random.normal(kx, (m, d)).astype(dtype)
    ws = _weights(kw, g, d, f, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    run = lambda impl, **kw: jax.jit(functools.partial(grouped_swiglu, impl=impl, **kw))(x, gs, *ws)
    ref = run("ragged_dot")
    assert ref.dtype == dtype
    outs = {"pallas": run("pallas", kernel_options=TILING), "loop": run("loop"), "einsum": run("einsum")}
    for name, y in outs.items():
        assert y.dtype == dtype and y.shape == (m, d), name
        np.testing.assert_allclose(_f32(y), _f32(ref), err_msg=name, **_tol(dtype, ref))
    total = sum(sizes)
    assert np.all(_f32(outs["pallas"])[total:] == 0)
    if total:
        assert float(jnp.max(jnp.abs(ref[:total].astype(jnp.float32)))) > 0


@pytest.mark.slow
def test_metadata_covers_each_group_tile_pair():
    sizes = jnp.asarray([0, 37, 3, 0, 17, 5, 0], jnp.int32)
    m, tm = 80, 16
    meta = make_group_metadata(sizes, m, tm)
    na = int(meta.num_active[0])
    offs = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    want = [
        (gi, t) for gi in range(7) for t in range(m // tm) if max(offs[gi], t * tm) < min(offs[gi + 1], (t + 1) * tm)
    ]
    got = list(zip(np.asarray(meta.group_ids[:na]).tolist(), np.asarray(meta.m_tile_ids[:na]).tolist()))
    assert got == want
    assert meta.group_ids.shape[0] == kernel.num_work_items(m, 7, tm) >= na
    # Padding items repeat the last active one (no extra DMA on TPU).
    assert set(np.asarray(meta.group_ids[na:]).tolist()) <= {want[-1][0]}
    assert set(np.asarray(meta.m_tile_ids[na:]).tolist()) <= {want[-1][1]}


@pytest.mark.slow
def test_dispatch_combine_round_trip():
    t, k, g, d = 11, 3, 5, 8
    kx, ki, kw = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (t, d))
    ids = jax.random.randint(ki, (t, k), -1, g)  # includes -1 (dropped)
    ids = ids.at[0].set(-1)  # a token with every slot dropped
    w = jax.random.uniform(kw, (t, k)) + 0.1
    xs, gs, info = jax.jit(dispatch, static_argnums=2)(x, ids, g)
    ids_np = np.asarray(ids).reshape(-1)
    valid = ids_np >= 0
    assert xs.shape == (t * k, d)
    np.testing.assert_array_equal(np.asarray(gs), np.bincount(ids_np[valid], minlength=g))
    order = np.asarray(info.sort_idx)
    keys = np.where(valid, ids_np, g)[order]
    assert np.all(np.diff(keys) >= 0)  # sorted
    for key in range(g + 1):  # stable
        assert np.all(np.diff(order[keys == key]) > 0)
    assert np.all(keys[valid.sum() :] == g)  # dropped last
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(x)[order // k])
    np.testing.assert_array_equal(order[np.asarray(info.inv_idx)], np.arange(t * k))
    # Garbage (NaN) in rows of dropped slots must not leak through combine.
    ys = jnp.where((jnp.arange(t * k) < valid.sum())[:, None], xs, jnp.nan)
    y = combine(ys, w, info)
    want = np.einsum("tk,tkd->td", np.where(valid.reshape(t, k), w, 0), np.asarray(x)[:, None, :].repeat(k, 1))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(y[0]) == 0)


@pytest.mark.slow
def test_tpu_kernel_under_tpu_interpreter():
    """TPU-faithful interpreter: NaN-initialised outputs, block write-back."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    sizes, m = [7, 0, 20, 1, 9], 40
    x = jax.random.normal(jax.random.PRNGKey(3), (m, 64))
    ws = _weights(jax.random.PRNGKey(4), 5, 64, 96, jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(
        functools.partial(
            kernel.grouped_swiglu_pallas,
            interpret=pltpu.InterpretParams(),
            tiling_gate_up=(16, 32, 32),
            tiling_down=(16, 32, 32),
        )
    )(x, gs, *ws)
    ref = grouped_swiglu(x, gs, *ws, impl="ragged_dot")
    np.testing.assert_allclose(np.asarray(y[:37]), np.asarray(ref[:37]), **_tol(jnp.float32, ref))


@pytest.mark.slow
def test_gpu_kernel_under_mosaic_gpu_interpreter():
    params = kernel_gpu.gpu_interpret_params()
    if params is None:
        pytest.skip("Mosaic GPU interpreter not available in this jax")
    sizes, m, d, f = [30, 0, 50, 3, 12], 100, 128, 128  # 2 row tiles of 64
    dtype = jnp.bfloat16
    x = jax.random.normal(jax.random.PRNGKey(5), (m, d)).astype(dtype)
    ws = _weights(jax.random.PRNGKey(6), len(sizes), d, f, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    y = kernel_gpu.grouped_swiglu_mgpu(x, gs, *ws, block_n=64, interpret=params)
    ref = grouped_swiglu(x, gs, *ws, impl="ragged_dot")
    total = sum(sizes)
    np.testing.assert_allclose(_f32(y)[:total], _f32(ref)[:total], **_tol(dtype, ref))


_SIZES = {"deepseek_v2_lite": (64, 2048, 1408), "mixtral": (8, 4096, 14336)}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("model", list(_SIZES))
def test_cross_lowering_at_model_sizes(platform, model):
    """Lowers (no compile, no device) the compiled kernels for TPU / Hopper."""
    g, d, f = _SIZES[model]
    s = jax.ShapeDtypeStruct
    args = (
        s((48, d), jnp.bfloat16),
        s((g,), jnp.int32),
        s((g, d, f), jnp.bfloat16),
        s((g, d, f), jnp.bfloat16),
        s((g, f, d), jnp.bfloat16),
    )
    fn = (
        kernel_gpu.grouped_swiglu_mgpu
        if platform == "cuda"
        else functools.partial(kernel.grouped_swiglu_pallas, interpret=False)
    )
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    except (ImportError, ModuleNotFoundError) as e:  # dialect not in this jaxlib
        pytest.skip(f"cannot cross-lower for {platform}: {e}")
    want = "mosaic_gpu" if platform == "cuda" else "tpu_custom_call"
    assert len(re.findall(want, text)) >= 2


@pytest.mark.slow
def test_backend_selection_is_explicit():
    x = jnp.ones((4, 8))
    ws = _weights(jax.random.PRNGKey(0), 2, 8, 16, jnp.float32)
    gs = jnp.asarray([2, 2], jnp.int32)
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError):
            grouped_swiglu(x, gs, *ws, impl="pallas", interpret=False)
    with pytest.raises(ValueError):
        grouped_swiglu(x, gs, *ws, impl="nope")
