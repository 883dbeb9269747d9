"""The monolithic executor stores the routed experts' weights as column panels when it runs the CPU
kernel (``pallas_kernels/expert_ffn/panels.py``): the kernel reads them, every other reader gets the
plain matrices back, and generation gives the tokens of the XLA implementation on plain weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.expert_ffn.panels import Panels, is_panels

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")

ROUTED = ("w_gate", "w_up", "w_down")


def _moe_groups(llm):
    return [g["moe"] for g in llm.executor.stacked["groups"] if "moe" in g]


@pytest.mark.slow
def test_stored_as_panels_read_back_plain_and_same_tokens():
    prompts = [[5, 9, 2, 7, 11, 3], [8, 1], list(range(3, 40))]  # decode rows and a prefill-sized chunk
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kernel = LLM("tiny-random", dtype="float32", num_blocks=64, block_size=8, expert_impl="cpu_kernel")
    xla = LLM("tiny-random", dtype="float32", num_blocks=64, block_size=8, expert_impl="bucketed_loop")
    assert kernel.executor.expert_impl == "cpu_kernel" and xla.executor.expert_impl == "bucketed_loop"
    for moe in _moe_groups(kernel):
        assert all(isinstance(moe[k], Panels) and moe[k].width == 64 for k in ROUTED)
    for moe in _moe_groups(xla):
        assert not any(isinstance(moe[k], Panels) for k in ROUTED)
    # executor.params (what rescaling and llm.params read) are the plain per-layer weights
    for mine, theirs in zip(kernel.params["layers"], xla.params["layers"]):
        for k in ROUTED:
            assert mine["moe"][k].shape == theirs["moe"][k].shape
            np.testing.assert_array_equal(np.asarray(mine["moe"][k]), np.asarray(theirs["moe"][k]))
    got = [o.token_ids for o in kernel.generate(prompts, sp)]
    want = [o.token_ids for o in xla.generate(prompts, sp)]
    assert got == want


def test_plain_executor_when_the_kernel_is_not_the_implementation():
    llm = LLM("tiny-random", dtype="float32", num_blocks=32, block_size=8, expert_impl="dense")
    leaves = jax.tree.leaves(_moe_groups(llm), is_leaf=is_panels)
    assert leaves and not any(isinstance(a, Panels) for a in leaves)


@pytest.mark.slow
@pytest.mark.parametrize("bf16_dot", [True, False], ids=["bf16-dot", "no-bf16-dot"])
def test_bfloat16_panels_in_pairs_where_the_cpu_has_a_bf16_dot(monkeypatch, bf16_dot):
    """bfloat16 experts are stored in pairs of rows exactly where the CPU has AVX512-BF16 (the layout
    of its dot instruction; float32 never); either way the plain weights read back bit for bit, the
    first greedy token of a prompt (decode and a prefill-sized chunk) is the float32 model's, and its
    logprob is the XLA form's within 0.05 nats.

    The oracle for the token is float32, not XLA's bf16 form: on a CPU with AVX512-BF16, XLA's bf16
    experts pick another token for the 37-token prompt (64 at -3.80 against 146 at -3.86), while the
    kernel (float32 accumulation) keeps float32's 146."""
    monkeypatch.setattr(cpu_kernel, "has_bf16_dot", lambda: bf16_dot)
    kw = dict(dtype="bfloat16", num_blocks=64, block_size=8)
    kernel = LLM("tiny-random", expert_impl="cpu_kernel", **kw)
    xla = LLM("tiny-random", expert_impl="bucketed_loop", **kw)
    for moe in _moe_groups(kernel):
        assert all(isinstance(moe[k], Panels) and moe[k].pairs == bf16_dot for k in ROUTED)
    for mine, theirs in zip(kernel.params["layers"], xla.params["layers"]):
        for k in ROUTED:
            np.testing.assert_array_equal(np.asarray(mine["moe"][k]), np.asarray(theirs["moe"][k]))
    prompts = [[5, 9, 2, 7, 11, 3], list(range(3, 40))]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=4)
    exact = LLM("tiny-random", dtype="float32", num_blocks=64, block_size=8)
    got, theirs, want = kernel.generate(prompts, sp), xla.generate(prompts, sp), exact.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for mine, other in zip(got, theirs):
        token = mine.outputs[0].token_ids[0]
        logprobs = other.outputs[0].logprobs[0]
        assert token in logprobs and abs(mine.outputs[0].logprobs[0][token].logprob - logprobs[token].logprob) < 0.05


@pytest.mark.parametrize("as_panels,bf16_dot", [(True, True), (True, False), (False, False)])
def test_stacked_layer_by_layer_as_whole_groups_and_the_loaded_layers_let_go(monkeypatch, as_panels, bf16_dot):
    """Start-up stacks one parameter at a time (a big checkpoint is never held twice): the stacked
    arrays are bit for bit those of stacking whole groups, and every per-layer array given up is freed."""
    import gc
    import weakref

    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.models.transformer import stack_layer_by_layer, stack_layers, store_as_panels

    monkeypatch.setattr(cpu_kernel, "has_bf16_dot", lambda: bf16_dot)
    _, params, _ = load_model("tiny-random", "bfloat16")
    want = stack_layers(params)
    want = store_as_panels(want) if as_panels else want
    refs = [weakref.ref(a) for a in jax.tree.leaves(params["layers"])]
    got = stack_layer_by_layer(params, as_panels, release=(params["layers"],))
    gc.collect()
    assert refs and all(r() is None for r in refs) and params["layers"] == [None] * len(params["layers"])
    assert jax.tree.structure(got, is_leaf=is_panels) == jax.tree.structure(want, is_leaf=is_panels)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if as_panels:
        assert all(
            isinstance(g["moe"][k], Panels) and g["moe"][k].pairs == bf16_dot for g in got["groups"] for k in ROUTED
        )
