"""Generation through the public API on the built-in demo model: sampling controls, seeds, stop
conditions, logprobs, batching of prompts of different lengths, input validation, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import Row


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", num_blocks=256, block_size=8, max_num_seqs=16)


PROMPTS = ["Hello, MoE world", "a", "The quick brown fox jumps over the lazy dog"]


@pytest.mark.slow
def test_same_seed_same_tokens_and_seeds_differ(llm):
    s = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7)
    a = llm.generate(PROMPTS, s)
    b = llm.generate(PROMPTS[::-1], s)  # batch composition and order do not matter
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]]
    c = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=8))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


@pytest.mark.slow
def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    topk1 = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=2.0, top_k=1, seed=1, ignore_eos=True))
    topp = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=2.0, top_p=1e-6, seed=1, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1] == [o.token_ids for o in topp]


@pytest.mark.slow
def test_batched_prompts_equal_individual_generation(llm):
    s = SamplingParams(max_tokens=16, ignore_eos=True)
    together = llm.generate(PROMPTS, s)
    alone = [llm.generate(p, s)[0] for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in together)


@pytest.mark.slow
def test_mixed_step_runs_decodes_and_prefills_as_separate_batches(llm):
    """A prompt arriving while others decode: that step runs [B, 1] decodes and the [b, T] prefill
    as two batches (no decode row padded to the chunk's length), and every request still gets
    the tokens it gets alone."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = {p: llm.generate(p, greedy)[0].token_ids for p in PROMPTS}
    engine, ex = llm.engine, llm.executor
    shapes, real = [], ex.forward
    ex.forward = lambda tokens, *a, **k: (shapes.append(np.shape(tokens)), real(tokens, *a, **k))[1]
    try:
        first = [engine.add_request(p, greedy) for p in PROMPTS[:2]]
        engine.step(), engine.step()  # both decoding now
        shapes.clear()
        engine.block_manager.reset_prefix_cache()  # the late prompt is computed whole, not read from the cache
        late = engine.add_request(PROMPTS[2], greedy)
        engine.step()
        mixed_step = list(shapes)
        final = engine.run_until_done(timeout=120)
    finally:
        ex.forward = real
    assert [s[1] for s in mixed_step] == [1, 64] and mixed_step[0][0] == 2
    assert [final[r].token_ids for r in first + [late]] == [alone[p] for p in PROMPTS]


def test_logprobs_are_the_model_distribution(llm):
    prompt = llm.tokenizer.encode("logprobs please")
    out = llm.generate([prompt], SamplingParams(max_tokens=3, logprobs=5, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    # Recompute the first step's distribution directly from the runner.
    table = list(range(8))
    logits = np.asarray(llm.engine.runner.forward([Row(prompt, 0, table)]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits))
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(np.argmax(logp))
    np.testing.assert_allclose(first.logprob, logp[first.token_id], rtol=1e-5, atol=1e-5)
    top_ids = [t for t, _ in first.top]
    assert top_ids == list(np.argsort(-logp)[:5])
    np.testing.assert_allclose([lp for _, lp in first.top], np.sort(logp)[::-1][:5], rtol=1e-5, atol=1e-5)


def test_stop_strings_stop_tokens_and_eos(llm):
    base = llm.generate(["stop here"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = base.text[5:8]
    assert stop and stop in base.text
    cut = llm.generate(["stop here"], SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.find(stop)]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    by_id = llm.generate(["stop here"], SamplingParams(max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[: first + 1]
    llm.engine.eos_ids.add(stop_id)  # the same token acting as EOS
    try:
        eos = llm.generate(["stop here"], SamplingParams(max_tokens=24))[0]
        assert eos.finish_reason == "stop" and eos.token_ids == base.token_ids[: first + 1]
    finally:
        llm.engine.eos_ids.discard(stop_id)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(logprobs=99)],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_lose_nothing(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 99999]])
    with pytest.raises(ValueError, match="does not fit the context"):
        llm.generate([[1] * 5000])
    assert not llm.engine.has_work()
    assert llm.engine.block_manager.num_free == 256
    assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].finish_reason == "length"


@pytest.mark.slow
def test_cli_generate_runs_the_demo():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxmoe.cli",
            "generate",
            "--model",
            "tiny-random",
            "--prompt",
            "hi",
            "--max-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "5 tokens, finish_reason=length" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", "generate", "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "neither a built-in name" in bad.stderr
