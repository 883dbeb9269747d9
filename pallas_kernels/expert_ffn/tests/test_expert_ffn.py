"""The shared test base of the expert-FFN op: every implementation in ``IMPLS`` against the plain jnp
reference on fresh random inputs (the seed is in the failure message), and the reference against a
numpy reading of the formula.

Cases cover batch-1 decode, prefill-sized batches, unrouted slots (id -1), experts no token chose,
every token on one expert, fp32 and bf16.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.pallas_kernels.expert_ffn import IMPLS, Stacked, cpu_kernel, expert_ffn, expert_ffn_reference, resolve

CASES = {  # tokens, top_k, experts, hidden, ffn, how ids are drawn
    "decode_b1": (1, 2, 8, 32, 64, "random"),
    "decode_b16": (16, 2, 8, 32, 64, "random"),
    "prefill": (53, 3, 6, 32, 48, "random"),
    "unrouted_slots": (13, 3, 5, 32, 64, "with_minus_one"),
    "one_hot_expert": (20, 1, 4, 32, 64, "all_expert_2"),
}


def _inputs(case: str, dtype, seed: int):
    t, k, e, d, f, how = CASES[case]
    kx, ki, kw, kg, ku, kd = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(kx, (t, d)).astype(dtype)
    if how == "all_expert_2":
        ids = jnp.full((t, k), 2, jnp.int32)
    else:  # k distinct experts per token, as a router picks them
        ids = jnp.argsort(jax.random.uniform(ki, (t, e)), axis=1)[:, :k].astype(jnp.int32)
        if how == "with_minus_one":
            ids = ids.at[3, 1].set(-1).at[0].set(-1)
    weights = jax.nn.softmax(jax.random.normal(kw, (t, k)), -1).astype(dtype)
    s = 1.0 / np.sqrt(d)
    experts = Stacked(
        *(
            (jax.random.normal(key, shape) * s).astype(dtype)
            for key, shape in ((kg, (e, d, f)), (ku, (e, d, f)), (kd, (e, f, d)))
        )
    )
    return x, ids, weights, experts


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _tolerance(dtype, want):
    scale = float(np.abs(want).max()) + 1e-6
    return dict(rtol=2e-5, atol=2e-5 * scale) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_implementation_matches_reference(impl, case, dtype):
    if impl.startswith("cpu_kernel") and not cpu_kernel.available():
        pytest.skip(f"cpu_kernel: {cpu_kernel.unavailable_reason()}")
    if impl == "cpu_kernel_invariant" and case != "prefill":  # cpu_kernel's cases; test_cpu_kernel.py has its own
        pytest.skip("cpu_kernel_invariant: the prefill case (plain weights, no fallback) is the one cpu_kernel lacks")
    seed = int.from_bytes(os.urandom(3), "little")
    x, ids, weights, experts = _inputs(case, dtype, seed)
    want = _f32(expert_ffn_reference(x, ids, weights, experts))
    got = jax.jit(functools.partial(expert_ffn, impl=impl))(x, ids, weights, experts)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(_f32(got), want, err_msg=f"{impl} {case} seed={seed}", **_tolerance(dtype, want))


class _LayerView:
    """``ExpertWeights`` of layer ``index`` of weights stacked over layers [L, E, ...] (as the model's
    ``LayerWeights``), bf16 kept as its uint16 bits (``models.common.pack16``)."""

    def __init__(self, stacks, index, dtype):
        self.stacks, self.index, self.dtype = stacks, index, dtype
        self.num_experts = stacks[0].shape[1]

    def _layer(self, w):
        w = jax.lax.dynamic_index_in_dim(w, self.index, keepdims=False)
        return jax.lax.bitcast_convert_type(w, self.dtype) if w.dtype == jnp.uint16 else w

    def stacked(self, dtype):
        return tuple(self._layer(w).astype(dtype) for w in self.stacks)

    def expert(self, e, dtype):
        return tuple(jax.lax.dynamic_index_in_dim(w, e, keepdims=False) for w in self.stacked(dtype))

    def layered(self):
        return self.stacks, self.index


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_reads_one_layer_of_a_layer_stack_in_place(dtype):
    """The Pallas form on a layer view reads the layer's experts out of the whole stack by group index
    (``xla.layer_stack``): the same output as the reference on that layer's weights, and the program
    slices no weight (a slice feeding a custom call is a copy of the layer's whole expert stack)."""
    seed = int.from_bytes(os.urandom(3), "little")
    layers = [_inputs("decode_b16", dtype, seed + i) for i in range(3)]
    x, ids, weights, _ = layers[0]
    pack = (lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)) if dtype == jnp.bfloat16 else (lambda a: a)
    stacks = tuple(pack(jnp.stack([layer[3][j] for layer in layers])) for j in range(3))

    def run(index, stacks):
        return expert_ffn(x, ids, weights, _LayerView(stacks, index, dtype), impl="pallas")

    for index in (1, 2):
        want = _f32(expert_ffn_reference(x, ids, weights, layers[index][3]))
        got = jax.jit(run)(jnp.int32(index), stacks)
        np.testing.assert_allclose(_f32(got), want, err_msg=f"layer {index} seed={seed}", **_tolerance(dtype, want))
    program = str(jax.make_jaxpr(run)(jnp.int32(1), stacks))
    assert "dynamic_slice" not in program and "pallas_call" in program


def test_reference_is_the_formula():
    seed = int.from_bytes(os.urandom(3), "little")
    x, ids, weights, experts = _inputs("unrouted_slots", jnp.float32, seed)
    x_, w_, (wg, wu, wd) = np.asarray(x), np.asarray(weights), (np.asarray(a) for a in experts)
    want = np.zeros_like(x_)
    for t, row in enumerate(np.asarray(ids)):
        for j, e in enumerate(row):
            if e >= 0:
                g, u = x_[t] @ wg[e], x_[t] @ wu[e]
                want[t] += w_[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    got = expert_ffn_reference(x, ids, weights, experts)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")


def test_names_are_checked():
    x, ids, weights, experts = _inputs("decode_b1", jnp.float32, 0)
    with pytest.raises(ValueError, match="'fastest'"):
        expert_ffn(x, ids, weights, experts, impl="fastest")
    with pytest.raises(ValueError, match="expert_impl.*'nope'"):
        resolve("nope", {"other": "dense"})
    assert resolve("auto", {"cpu": "bucketed_loop", "other": "dense"}) in ("bucketed_loop", "dense")
    assert resolve("grouped", {"other": "dense"}) == "grouped"
