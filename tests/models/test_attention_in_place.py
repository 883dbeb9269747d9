"""With the CPU kernels (the CPU default), the monolithic decode step reads the stacked KV cache in
place with the paged-attention kernel (``pallas_kernels/paged_attention``) instead of XLA's chunked
gather, and prefill chunks run XLA's form (faster there), except in deterministic mode, where every
step runs the kernel: generation gives the tokens and logprobs of XLA's form, for decodes after
prompts that span several chunks of keys (bfloat16: the first token and the prompt's logprobs)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import Row
from jaxmoe.pallas_kernels.paged_attention import cpu_kernel as attention_kernel

pytestmark = pytest.mark.skipif(not attention_kernel.available(), reason=f"{attention_kernel.unavailable_reason()}")

PROMPTS = [[5, 9, 2, 7, 11, 3], [8, 1], list(range(3, 40)), [(i * 7) % 250 + 3 for i in range(150)]]


def _llm(dtype):
    return LLM("tiny-random", dtype=dtype, num_blocks=96, block_size=8, expert_impl="cpu_kernel")


def _step_hlo(llm, tokens: int = 1) -> str:
    """The step program of one row of ``tokens`` tokens (1: a decode step; more: a prefill chunk)."""
    runner = llm.engine.runner
    rows = [Row([3] * tokens, 5, [0, 1, 2], SamplingParams())]
    tokens, batch, last, _ = runner.prepare(rows)
    (lowered,), _ = llm.executor.lower(tokens, batch, last)
    return lowered.as_text()


def _generate(llm, dtype):
    """Greedy tokens and their logprobs; in bfloat16 (where a rounding apart flips near-ties of the
    random model, and the tokens then part) the first token and the prompt's logprobs instead."""
    if dtype == "float32":
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1))
        return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1))
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.prompt_logprobs[1:]] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_in_place_attention_gives_the_tokens_of_xlas_form(monkeypatch, dtype):
    kernel = _llm(dtype)
    assert attention_kernel.TARGET in _step_hlo(kernel)
    assert attention_kernel.TARGET not in _step_hlo(kernel, tokens=16)  # a prefill chunk: XLA's form
    tokens, logprobs = _generate(kernel, dtype)
    with monkeypatch.context() as m:  # the same engine, attention traced through XLA's chunked form
        m.setattr(attention_kernel, "supports", lambda *a: False)
        xla = _llm(dtype)
        assert attention_kernel.TARGET not in _step_hlo(xla)
        want_tokens, want_logprobs = _generate(xla, dtype)
    assert tokens == want_tokens
    if dtype == "float32":
        for got, want in zip(logprobs, want_logprobs):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        return
    # bfloat16: both forms round the probabilities to bf16, but sum them in another order (and XLA's
    # order depends on the CPU's vector width); a one-ulp flip in a long prompt's hidden state moves
    # a later logprob by up to a few tenths. Nearly all agree to 5e-2; none is far off.
    diff = np.abs(np.concatenate(logprobs) - np.concatenate(want_logprobs))
    assert np.median(diff) < 1e-2 and (diff > 5e-2).mean() <= 0.02 and diff.max() < 0.5, diff


@pytest.mark.slow
def test_xla_form_where_the_kernels_are_not_the_implementation():
    llm = LLM("tiny-random", dtype="float32", num_blocks=32, block_size=8, expert_impl="bucketed_loop")
    assert attention_kernel.TARGET not in _step_hlo(llm)


@pytest.mark.slow
def test_deterministic_mode_runs_the_kernel_for_prefill_chunks_too():
    """Batch invariance needs one summation order per token however its prompt is chunked: there
    prefill chunks read the cache through the kernel as decodes do."""
    llm = LLM("tiny-random", dtype="float32", num_blocks=32, block_size=8, deterministic=True)
    assert attention_kernel.TARGET in _step_hlo(llm, tokens=16)
