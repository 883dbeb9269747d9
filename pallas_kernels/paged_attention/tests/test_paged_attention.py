"""Paged attention: every implementation against the plain jnp reference on fresh random caches,
block tables and positions (decode and prefill-sized, GQA groups 1-8, float32 and bfloat16 caches,
packed or not); then the model's attention with the kernel against its XLA form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.pallas_kernels.paged_attention import IMPLS, cpu_kernel, paged_attention, paged_attention_reference

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")


def _problem(seed, B, T, H, KVH, hd, block_size, NB, dtype, packed=False, L=3):
    """Random caches, a random block table per row (distinct blocks), positions ending anywhere."""
    rng = np.random.default_rng(seed)
    S = B * NB * block_size + 2 * block_size
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(kk, (L, S, KVH, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (L, S, KVH, hd), jnp.float32).astype(dtype)
    if packed:
        k, v = jax.lax.bitcast_convert_type(k, jnp.uint16), jax.lax.bitcast_convert_type(v, jnp.uint16)
    q = jax.random.normal(kq, (B, T, H, hd), jnp.float32)
    tables = rng.permutation(S // block_size)[: B * NB].reshape(B, NB).astype(np.int32)
    last = rng.integers(T - 1, NB * block_size, size=B)  # each row's last position
    positions = (last[:, None] - np.arange(T)[::-1][None, :]).astype(np.int32)
    return q, k, v, int(rng.integers(L)), jnp.asarray(tables), jnp.asarray(positions)


CASES = [  # B, T, H, KVH, hd, block_size, NB
    (1, 1, 8, 2, 64, 16, 4),
    (5, 1, 4, 4, 32, 8, 7),
    (16, 1, 16, 2, 64, 16, 3),
    (3, 1, 8, 1, 128, 4, 9),
    (2, 37, 8, 2, 64, 16, 5),
    (1, 64, 4, 2, 16, 16, 8),
]


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_T{}_H{}_KVH{}_hd{}_bs{}_NB{}".format(*c))
@pytest.mark.parametrize("dtype,packed", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)])
def test_cpu_kernel_matches_the_reference(case, dtype, packed):
    B, T, H, KVH, hd, bs, NB = case
    q, k, v, layer, tables, positions = _problem(sum(case), B, T, H, KVH, hd, bs, NB, dtype, packed)
    kw = dict(block_size=bs, scale=hd**-0.5, dtype=dtype)
    want = paged_attention_reference(q, k, v, layer, tables, positions, **kw)
    got = jax.jit(lambda *a: paged_attention(*a, **kw, impl="cpu_kernel"))(q, k, v, layer, tables, positions)
    assert got.shape == (B, T, H, hd) and got.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.slow
@needs_kernel
def test_padding_rows_and_positions_past_the_table_stay_finite():
    """Padding rows (position 0, the table of the first block) see key 0 only; a position past the
    table's last key sees every key of the table, as the reference's mask does."""
    q, k, v, layer, tables, _ = _problem(7, 3, 1, 8, 2, 64, 16, 2, jnp.float32)
    positions = jnp.asarray([[0], [31], [500]], jnp.int32)
    kw = dict(block_size=16, scale=0.125, dtype=jnp.float32)
    got = paged_attention(q, k, v, layer, tables, positions, **kw, impl="cpu_kernel")
    want = paged_attention_reference(q, k, v, layer, tables, positions, **kw)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    slot = int(tables[0, 0]) * 16  # row 0 attends to key 0 alone: its value
    np.testing.assert_allclose(np.asarray(got[0, 0, :4]), np.asarray(v[layer, slot, 0])[None].repeat(4, 0), rtol=1e-6)


@pytest.mark.slow
@needs_kernel
def test_same_inputs_same_bits():
    q, k, v, layer, tables, positions = _problem(11, 8, 20, 8, 2, 64, 16, 4, jnp.float32)
    run = jax.jit(lambda *a: paged_attention(*a, block_size=16, scale=0.125, dtype=jnp.float32, impl="cpu_kernel"))
    first = np.asarray(run(q, k, v, layer, tables, positions))
    for _ in range(3):
        assert np.array_equal(np.asarray(run(q, k, v, layer, tables, positions)), first)


@pytest.mark.slow
def test_unknown_impl_names_the_choices():
    with pytest.raises(ValueError, match="reference"):
        paged_attention(
            *_problem(0, 1, 1, 2, 1, 16, 4, 1, jnp.float32), block_size=4, scale=1.0, dtype=jnp.float32, impl="x"
        )
    assert set(IMPLS) == {"reference", "cpu_kernel"}


def test_supports_refuses_what_the_kernel_does_not_take():
    q = jnp.zeros((1, 1, 8, 64))
    assert not cpu_kernel.supports(jnp.zeros((1, 1, 8, 40)), jnp.zeros((2, 16, 2, 40)), jnp.float32)  # hd % 16
    assert not cpu_kernel.supports(q, jnp.zeros((2, 16, 3, 64)), jnp.float32)  # H % KVH
    assert not cpu_kernel.supports(q, jnp.zeros((2, 16, 2, 64), jnp.uint16), jnp.float16)  # fp16 bits
    assert not cpu_kernel.supports(q, jnp.zeros((2, 16, 2, 64), jnp.bfloat16), jnp.float32)
    assert cpu_kernel.supports(q, jnp.zeros((2, 16, 2, 64)), jnp.float32) == cpu_kernel.available()
