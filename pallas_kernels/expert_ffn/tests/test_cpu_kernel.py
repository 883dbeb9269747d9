"""The ``cpu_kernel`` expert FFN beyond the shared test base (``test_expert_ffn.py`` runs it on every
case there): weights read in place from a layer stack (bf16 as uint16 bits, as the model stores them),
rows sharing a token, the decode-size rule, and what happens where it cannot be built."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.models.common import pack16
from jaxmoe.models.experts import LayerWeights
from jaxmoe.pallas_kernels.expert_ffn import (
    Stacked,
    cpu_kernel,
    expert_ffn,
    expert_ffn_reference,
    fallback_above,
    resolve,
)
from jaxmoe.pallas_kernels.expert_ffn.panels import plain, to_panels, width_for

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")


def _layers(L, E, D, F, dtype, seed):
    kg, ku, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    s = 1 / np.sqrt(D)
    return {
        "w_gate": (jax.random.normal(kg, (L, E, D, F)) * s).astype(dtype),
        "w_up": (jax.random.normal(ku, (L, E, D, F)) * s).astype(dtype),
        "w_down": (jax.random.normal(kd, (L, E, F, D)) * s).astype(dtype),
    }


def _routing(T, K, E, seed, dtype):
    kx, ki, kw = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    ids = jnp.argsort(jax.random.uniform(ki, (T, E)), axis=1)[:, :K].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(kw, (T, K)), -1).astype(dtype)
    return ids, weights, kx


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reads_one_layer_of_a_stack_in_place(dtype):
    seed = int.from_bytes(os.urandom(3), "little")
    L, E, D, F, T, K = 3, 8, 64, 96, 12, 2
    p = _layers(L, E, D, F, dtype, seed)
    ids, weights, kx = _routing(T, K, E, seed, dtype)
    x = jax.random.normal(kx, (T, D)).astype(dtype)
    packed = {k: pack16(v) for k, v in p.items()}  # how the monolithic executor stores 16-bit weights
    for layer in range(L):
        experts = LayerWeights(packed, jnp.int32(layer))
        assert cpu_kernel.supports(x, ids, experts)
        got = jax.jit(lambda x, i, w, layer: expert_ffn(x, i, w, LayerWeights(packed, layer), impl="cpu_kernel"))(
            x, ids, weights, jnp.int32(layer)
        )
        want = expert_ffn_reference(x, ids, weights, Stacked(*(p[k][layer] for k in ("w_gate", "w_up", "w_down"))))
        want = np.asarray(want, np.float32)
        tol = 2e-5 if dtype == jnp.float32 else 3e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"seed={seed}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, pairs", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)], ids=["f32", "bf16", "pairs"]
)
@pytest.mark.parametrize("D, F, width", [(64, 192, 64), (96, 160, 32), (48, 80, 16)])
@pytest.mark.parametrize("T", [1, 3, 9, 40])
def test_reads_weights_stored_as_panels(dtype, pairs, D, F, width, T):
    """The layout the monolithic executor stores for this kernel (``panels.py``): every panel width
    it has tiles for, bfloat16 also in pairs of rows (the bf16 dot where the CPU has one, widened
    where not), experts with 1 to 20 rows on average (more than 8: several passes over a panel;
    a prefill-sized batch, which the kernel takes on panels), in place at each layer of a stack,
    against the reference on the plain weights; and the slices ``bucketed_loop`` takes of panels
    (``LayerWeights.expert``) are the plain matrices."""
    seed = int.from_bytes(os.urandom(3), "little")
    L, E, K = 2, 4, 2
    p = _layers(L, E, D, F, dtype, seed)
    ids, weights, kx = _routing(T, K, E, seed, dtype)
    x = jax.random.normal(kx, (T, D)).astype(dtype)
    assert width_for(D, F) == width
    stored = {k: to_panels(pack16(v), width, pairs) for k, v in p.items()}
    assert all(stored[k].shape == pack16(p[k]).shape for k in stored)
    for layer in range(L):
        experts = LayerWeights(stored, jnp.int32(layer))
        assert cpu_kernel.supports(x, ids, experts)
        got = jax.jit(lambda x, i, w, layer: expert_ffn(x, i, w, LayerWeights(stored, layer), impl="cpu_kernel"))(
            x, ids, weights, jnp.int32(layer)
        )
        plain_weights = Stacked(*(p[k][layer] for k in ("w_gate", "w_up", "w_down")))
        want = np.asarray(expert_ffn_reference(x, ids, weights, plain_weights), np.float32)
        tol = 2e-5 if dtype == jnp.float32 else 3e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"seed={seed}"
        )
        for mine, theirs in zip(experts.expert(jnp.int32(E - 1), dtype), plain_weights.expert(E - 1, dtype)):
            np.testing.assert_array_equal(np.asarray(mine, np.float32), np.asarray(theirs, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 9])
def test_pairs_keep_the_hidden_activation_in_fp32(T):
    """bfloat16 weights in pairs of rows (the AVX512-BF16 dot) with activations that are bfloat16 values:
    the result matches float32 math on those values to 1e-5 of its size, so the hidden activation
    into the down projection was not rounded to bfloat16 (that alone is ~1e-3 of it)."""
    seed = int.from_bytes(os.urandom(3), "little")
    L, E, K, D, F = 1, 4, 2, 64, 128
    p = _layers(L, E, D, F, jnp.bfloat16, seed)
    ids, weights, kx = _routing(T, K, E, seed, jnp.float32)
    x = jax.random.normal(kx, (T, D)).astype(jnp.bfloat16).astype(jnp.float32)  # exact in the pairs
    stored = {k: to_panels(v, width_for(D, F), pairs=True) for k, v in p.items()}
    got = np.asarray(expert_ffn(x, ids, weights, LayerWeights(stored, jnp.int32(0)), impl="cpu_kernel"))
    fp32 = Stacked(*(p[k][0].astype(jnp.float32) for k in ("w_gate", "w_up", "w_down")))
    want = np.asarray(expert_ffn_reference(x, ids, weights, fp32))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"seed={seed}")


@pytest.mark.slow
def test_panels_round_trip_and_refuse_widths_that_do_not_divide():
    a = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 32, 96))
    for width in (16, 32):
        stored = to_panels(a, width)
        assert stored.data.shape == (2, 3, 96 // width, 32, width) and stored.shape == a.shape
        np.testing.assert_array_equal(np.asarray(plain(stored)), np.asarray(a))
        paired = to_panels(a, width, pairs=True)
        assert paired.data.shape == (2, 3, 96 // width, 16, 2 * width) and paired.shape == a.shape
        np.testing.assert_array_equal(np.asarray(plain(paired)), np.asarray(a))
        # column j of panel n, pair row i: rows 2 i and 2 i + 1 side by side
        np.testing.assert_array_equal(np.asarray(paired.data[1, 2, 1, 5, 6:8]), np.asarray(a[1, 2, 10:12, width + 3]))
    with pytest.raises(ValueError, match="cannot be stored in pairs"):
        to_panels(a[..., :31, :], 16, pairs=True)
    assert width_for(32, 96) == 32 and width_for(64, 128) == 64 and width_for(24, 64) is None
    with pytest.raises(ValueError, match="not a multiple of the panel width 64"):
        to_panels(a, 64)


@pytest.mark.slow
def test_an_expert_chosen_twice_by_one_token_counts_twice():
    seed = int.from_bytes(os.urandom(3), "little")
    p = _layers(1, 4, 32, 64, jnp.float32, seed)
    experts = Stacked(*(p[k][0] for k in ("w_gate", "w_up", "w_down")))
    ids, weights, kx = _routing(9, 2, 4, seed, jnp.float32)
    ids = ids.at[:, 1].set(ids[:, 0])
    x = jax.random.normal(kx, (9, 32))
    got = expert_ffn(x, ids, weights, experts, impl="cpu_kernel")
    want = expert_ffn_reference(x, ids, weights, experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed={seed}")


@pytest.mark.slow
def test_prefill_sized_batches_and_odd_shapes_run_the_fallback():
    p = _layers(1, 4, 32, 64, jnp.float32, 0)
    experts = Stacked(*(p[k][0] for k in ("w_gate", "w_up", "w_down")))
    ids, weights, kx = _routing(17, 2, 4, 0, jnp.float32)
    x = jax.random.normal(kx, (17, 32))
    assert not cpu_kernel.supports(x, ids, experts)  # 34 rows > 8 per expert on average
    assert cpu_kernel.supports(x[:16], ids[:16], experts)
    assert fallback_above("cpu_kernel", 4, 2) == 16  # what the scaling model prices as the fallback
    assert fallback_above("bucketed_loop", 4, 2) is None
    odd = Stacked(*(jnp.ones((4, 24, 64)), jnp.ones((4, 24, 64)), jnp.ones((4, 64, 24))))
    assert not cpu_kernel.supports(jnp.ones((2, 24)), ids[:2], odd)  # D = 24: not a multiple of 16
    calls = []
    fallback = lambda *a: calls.append(1) or expert_ffn_reference(*a)  # noqa: E731
    cpu_kernel.cpu_kernel(x, ids, weights, experts, fallback)
    assert calls == [1]


@pytest.mark.slow
def test_turned_off_auto_falls_back_and_explicit_use_names_the_reason(monkeypatch):
    monkeypatch.setenv("JAXMOE_CPU_KERNEL", "0")
    assert not cpu_kernel.available()
    assert resolve("auto", {"cpu": "cpu_kernel", "other": "dense"}) in ("bucketed_loop", "dense")
    p = _layers(1, 4, 32, 64, jnp.float32, 0)
    experts = Stacked(*(p[k][0] for k in ("w_gate", "w_up", "w_down")))
    ids, weights, kx = _routing(2, 2, 4, 0, jnp.float32)
    with pytest.raises(cpu_kernel.KernelUnavailable, match="JAXMOE_CPU_KERNEL=0"):
        expert_ffn(jax.random.normal(kx, (2, 32)), ids, weights, experts, impl="cpu_kernel")


@pytest.mark.slow
def test_same_inputs_same_bits_whichever_thread_runs_an_item():
    """Items run on whichever pool thread claims them; the sum over them runs in a fixed order, so a
    repeated request gets the same logprobs to the last bit (the serving tests compare them)."""
    p = _layers(1, 8, 64, 256, jnp.float32, 3)
    experts = Stacked(*(p[k][0] for k in ("w_gate", "w_up", "w_down")))
    ids, weights, kx = _routing(16, 2, 8, 3, jnp.float32)
    x = jax.random.normal(kx, (16, 64))
    run = jax.jit(lambda x: expert_ffn(x, ids, weights, experts, impl="cpu_kernel"))
    first = np.asarray(run(x))
    for _ in range(30):
        np.testing.assert_array_equal(np.asarray(run(x)), first)


@pytest.mark.slow
@pytest.mark.parametrize("width", [0, 32], ids=["plain", "panels"])
def test_invariant_form_gives_a_token_the_same_bits_in_any_batch(width):
    """``cpu_kernel_invariant`` (deterministic mode): a token's output is bit-identical alone, in a
    decode-sized batch and in a prefill-sized one (plain weights too: no fallback), at any row; it is
    the reference's result. ``pool_threads`` chunks: the default form's work split changes with the
    number of routed experts when there are more threads than a token's experts."""
    E, D, F, K = 8, 64, 128, 2
    p = _layers(1, E, D, F, jnp.float32, 5)
    weights3 = tuple(p[k][0] for k in ("w_gate", "w_up", "w_down"))
    experts = LayerWeights({k: to_panels(v, width) if width else v for k, v in p.items()}, jnp.int32(0))
    ids, weights, kx = _routing(70, K, E, 5, jnp.float32)
    x = jax.random.normal(kx, (70, D))
    run = jax.jit(lambda x, i, w: expert_ffn(x, i, w, experts, impl="cpu_kernel_invariant"))
    alone = np.asarray(run(x[:1], ids[:1], weights[:1]))
    want = np.asarray(expert_ffn_reference(x[:1], ids[:1], weights[:1], Stacked(*weights3)))
    np.testing.assert_allclose(alone, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for n, at in ((5, 3), (70, 41)):  # token 0 moved to row ``at`` of a batch of n
        order = np.r_[1 : at + 1, 0, at + 1 : n]
        got = np.asarray(run(x[order], ids[order], weights[order]))
        np.testing.assert_array_equal(got[at], alone[0])
    with pytest.raises(ValueError, match="cpu_kernel_invariant"):  # no silent fallback: odd shapes refused
        odd = Stacked(*(w[:, :40, :] if i < 2 else w[:, :, :40] for i, w in enumerate(weights3)))
        expert_ffn(x[:2, :40], ids[:2], weights[:2], odd, impl="cpu_kernel_invariant")


@pytest.mark.slow
def test_invariant_matmul_gives_a_row_the_same_bits_at_any_row_count():
    """``invariant_matmul`` (deterministic mode's dense matrices, N padded to whole vectors): a row's
    result does not depend on the row count or its position, where XLA's dot changes algorithm with
    the row count (docs/serving.md); it is the product."""
    from jaxmoe.models.layer_matrix import LayerMatrix

    kw, kx = jax.random.split(jax.random.PRNGKey(7))
    stack = jax.random.normal(kw, (2, 64, 40)) / 8  # N = 40: padded to 48 and cut back
    x = jax.random.normal(kx, (300, 64))
    run = jax.jit(lambda x: x @ LayerMatrix(stack, jnp.int32(1), jnp.float32, invariant=True))
    alone = np.asarray(run(x[:1]))
    np.testing.assert_allclose(alone, np.asarray(x[:1] @ stack[1]), rtol=2e-5, atol=2e-5)
    for n, at in ((7, 3), (300, 211)):
        order = np.r_[1 : at + 1, 0, at + 1 : n]
        np.testing.assert_array_equal(np.asarray(run(x[order]))[at], alone[0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 32, 33])
def test_layer_matrix_reads_one_layer_in_place(dtype, rows):
    """``x @ LayerMatrix`` (the model's attention projections in the monolithic scan): the kernel's
    matmul for the few rows where it is faster (``MATMUL_MAX_ROWS``), the slice and ``@`` beyond,
    the same numbers either way."""
    from jaxmoe.models.layer_matrix import LayerMatrix

    seed = int.from_bytes(os.urandom(3), "little")
    kw, kx = jax.random.split(jax.random.PRNGKey(seed))
    stack = (jax.random.normal(kw, (3, 64, 80)) / 8).astype(dtype)
    x = jax.random.normal(kx, (rows, 1, 64)).astype(dtype)
    in_place = rows <= cpu_kernel.MATMUL_MAX_ROWS[jnp.dtype(dtype).name]
    assert cpu_kernel.matmul_supports(x, pack16(stack)) == in_place
    for layer in range(3):
        got = jax.jit(lambda x, i: x @ LayerMatrix(pack16(stack), i, dtype))(x, jnp.int32(layer))
        want = np.asarray(jnp.einsum("btk,kn->btn", x.astype(jnp.float32), stack[layer].astype(jnp.float32)))
        assert got.shape == (rows, 1, 80) and got.dtype == dtype
        tol = 2e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"seed={seed}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("width", [0, 32], ids=["plain", "panels"])
def test_reads_int8_weights_with_column_scales_in_place(dtype, T, width):
    """int8 expert weights (``jaxmoe.quantization.quantize_int8``: per output column scales), plain or
    as panels, read in place at each layer of a stack and scaled in the tile, equal the reference on
    the dequantized weights; ``bucketed_loop`` (the fallback) gives the same on them."""
    from jaxmoe.quantization import Quantized, quantize_int8

    seed = int.from_bytes(os.urandom(3), "little")
    L, E, D, F, K = 2, 8, 64, 96, 2
    q = {k: quantize_int8(v) for k, v in _layers(L, E, D, F, jnp.float32, seed).items()}
    if width:
        q = {k: Quantized(to_panels(v.q, width), v.scale) for k, v in q.items()}
    ids, weights, kx = _routing(T, K, E, seed, dtype)
    x = jax.random.normal(kx, (T, D)).astype(dtype)
    for layer in range(L):
        experts = LayerWeights(q, jnp.int32(layer))
        assert cpu_kernel.supports(x, ids, experts)
        run = jax.jit(
            lambda x, i, w, layer, impl: expert_ffn(x, i, w, LayerWeights(q, layer), impl=impl), static_argnums=4
        )
        got = run(x, ids, weights, jnp.int32(layer), "cpu_kernel")
        assert cpu_kernel.INT8_TARGET in run.lower(x, ids, weights, jnp.int32(layer), "cpu_kernel").as_text()
        plain_w = Stacked(*(q[k].at(layer).dequantize(jnp.float32) for k in ("w_gate", "w_up", "w_down")))
        want = np.asarray(expert_ffn_reference(x.astype(jnp.float32), ids, weights, plain_w), np.float32)
        tol = 2e-5 if dtype == jnp.float32 else 3e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"seed={seed}"
        )
        loop = np.asarray(run(x, ids, weights, jnp.int32(layer), "bucketed_loop"), np.float32)
        np.testing.assert_allclose(loop, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"seed={seed}")


# rows per expert: every register tile of 1 to 8 rows (on AVX2 in groups of up to 4: 7 = 4 + 3) and more
# than a tile (13 = 8 + 5)
ROWS_PER_EXPERT = (1, 2, 3, 4, 5, 6, 7, 8, 13)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["f32", "bf16", "pairs", "int8"])
@pytest.mark.parametrize("width", [16, 64])
def test_every_row_count_of_a_panel_tile(form, width):
    """Each expert gets a different number of rows (``ROWS_PER_EXPERT``), so every row count of the
    panel tiles runs (``panel_tile_avx512``, ``panel_tile_avx2`` and its groups of rows, ``pair_tile``,
    whichever this CPU builds): float32, bfloat16 (widened or in pairs) and int8 panels against the
    reference on the same values in float32."""
    from jaxmoe.quantization import Quantized, quantize_int8

    seed = int.from_bytes(os.urandom(3), "little")
    E, D, F = len(ROWS_PER_EXPERT), 128, 192
    p = _layers(1, E, D, F, jnp.float32, seed)
    ids = jnp.asarray(
        np.repeat(np.arange(E), ROWS_PER_EXPERT)[np.random.default_rng(seed).permutation(sum(ROWS_PER_EXPERT))]
    )
    ids = ids.astype(jnp.int32)[:, None]
    T = ids.shape[0]
    kx, kw = jax.random.split(jax.random.PRNGKey(seed + 1))
    weights = jax.random.uniform(kw, (T, 1), minval=0.5, maxval=1.5)
    x = jax.random.normal(kx, (T, D)).astype(jnp.bfloat16).astype(jnp.float32)  # exact in bfloat16 pairs
    if form == "int8":
        q = {k: quantize_int8(v) for k, v in p.items()}
        stored = {k: Quantized(to_panels(v.q, width), v.scale) for k, v in q.items()}
        values = {k: v.at(0).dequantize(jnp.float32) for k, v in q.items()}
    else:
        dtype = jnp.float32 if form == "f32" else jnp.bfloat16
        stored = {k: to_panels(v.astype(dtype), width, pairs=form == "pairs") for k, v in p.items()}
        values = {k: v[0].astype(dtype).astype(jnp.float32) for k, v in p.items()}
    got = np.asarray(expert_ffn(x, ids, weights, LayerWeights(stored, jnp.int32(0)), impl="cpu_kernel"))
    want = np.asarray(
        expert_ffn_reference(x, ids, weights, Stacked(*(values[k] for k in ("w_gate", "w_up", "w_down"))))
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"seed={seed}")
