"""vLLM habits through ``LLM``: ``outputs[i]`` completions, ``n`` / ``best_of``, logprobs with token
text and rank, the adjusted sampler (logit bias, presence / frequency / repetition penalties,
min-p) checked against a numpy reference, and ``LLM.chat`` over several conversations."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.outputs import CompletionOutput, Logprob
from jaxmoe.sampling import SamplingParamsError, adjust_logits, sample


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", num_blocks=128, block_size=8, max_num_seqs=8)


@pytest.mark.slow
def test_outputs_are_completion_outputs_with_text_ids_and_logprobs(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2))[0]
    assert out.prompt == "Hello"
    (c,) = out.outputs
    assert isinstance(c, CompletionOutput) and c.index == 0
    assert c.text == out.text and c.token_ids == out.token_ids and len(c.token_ids) == 5
    assert c.finish_reason == "length" == out.finish_reason
    assert len(c.logprobs) == 5
    for token, lps in zip(c.token_ids, c.logprobs):
        chosen = lps[token]
        assert isinstance(chosen, Logprob) and chosen.decoded_token == llm.tokenizer.decode([token])
        assert chosen.rank == 1  # greedy: the most likely token
        assert all(isinstance(v.decoded_token, str) for v in lps.values())
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    # the engine's own form still works (token_id, logprob, top tuples) and carries the text too
    first = out.logprobs[0]
    assert first.token_id == c.token_ids[0] and len(first.top) == 2 and first.decoded_token is not None


@pytest.mark.slow
def test_n_returns_n_seeded_completions_and_best_of_keeps_the_most_likely(llm):
    s = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    out = llm.generate(["abc", "xyz"], s)
    assert len(out) == 2 and all(len(o.outputs) == 3 for o in out)
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    texts = [tuple(c.token_ids) for c in out[0].outputs]
    assert len(set(texts)) > 1  # seeds differ per completion
    again = llm.generate("abc", s)[0]
    assert [c.token_ids for c in again.outputs] == [list(t) for t in texts]  # reproducible
    # completion 0 of n=3 is what n=1 with the same seed gives
    assert llm.generate("abc", SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))[
        0
    ].token_ids == list(texts[0])
    best = llm.generate("abc", SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2, best_of=5, ignore_eos=True))
    cum = [c.cumulative_logprob for c in best[0].outputs]
    assert len(cum) == 2 and cum[0] >= cum[1]
    every = llm.generate("abc", SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=5, ignore_eos=True))[0]
    assert sorted((c.cumulative_logprob for c in every.outputs), reverse=True)[:2] == pytest.approx(cum)


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {5: 101.0}}, "logit_bias[5]"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias['5']"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
def test_new_fields_are_validated_naming_the_field(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_logit_bias_forces_a_token_and_is_checked_against_the_vocabulary(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=4, logit_bias={ord("z"): 100.0}, ignore_eos=True))[0]
    assert out.text == "zzzz"
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))


@pytest.mark.slow
def test_repetition_penalties_change_greedy_output_and_plain_requests_are_unchanged(llm):
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    base = llm.generate("aaaa", plain)[0].token_ids
    rep = llm.generate("aaaa", SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0))[0].token_ids
    assert len(set(rep)) > len(set(base))  # a strong frequency penalty spreads the tokens out
    # a penalised request in the same batch does not change a plain one
    mixed = llm.generate(
        ["aaaa", "aaaa"], [plain, SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=2.0)]
    )
    assert mixed[0].token_ids == base


def _reference(logits, history, num_prompt, presence, frequency, repetition, bias):
    out = logits.astype(np.float64).copy()
    for t, b in bias.items():
        out[t] += b
    seen = set(history)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(history[num_prompt:]):
        c = history[num_prompt:].count(t)
        out[t] -= frequency * c + presence
    return out


@pytest.mark.slow
def test_adjusted_logits_match_a_numpy_reference_and_logprobs_stay_raw():
    rng = np.random.default_rng(0)
    B, V, W, K = 4, 50, 16, 8
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    zeros, ones = np.zeros(B, np.float32), np.ones(B, np.float32)
    greedy = (zeros, np.zeros(B, np.int32), ones, zeros, np.zeros(B, np.uint32), np.zeros(B, np.int32))
    history = np.full((B, W), -1, np.int32)
    num_prompt = np.array([3, 2, 0, 4], np.int32)
    seqs = [[int(logits[0].argmax())] * 2 + [1, 2, 2], [7, 8, 9], [], [5, 5, 5, 5, 6, 6]]
    for i, h in enumerate(seqs):
        history[i, : len(h)] = h
    presence = np.array([0.0, 1.0, 0.5, -1.0], np.float32)
    frequency = np.array([1.5, 0.0, 0.0, 0.7], np.float32)
    repetition = np.array([2.0, 1.0, 1.3, 0.8], np.float32)
    bias_ids = np.full((B, K), -1, np.int32)
    bias_values = np.zeros((B, K), np.float32)
    bias = [{}, {3: 5.0}, {4: -100.0, 10: 2.0}, {}]
    for i, d in enumerate(bias):
        bias_ids[i, : len(d)], bias_values[i, : len(d)] = list(d), list(d.values())
    adjusted = adjust_logits(logits, presence, frequency, repetition, history, num_prompt, bias_ids, bias_values)
    tokens, chosen, rank, _, _ = sample(adjusted, logits, *greedy, np.bool_(True))
    for i in range(B):
        ref = _reference(logits[i], seqs[i], int(num_prompt[i]), presence[i], frequency[i], repetition[i], bias[i])
        np.testing.assert_allclose(np.asarray(adjusted[i]), ref, rtol=1e-5, atol=1e-5)
        assert int(tokens[i]) == int(ref.argmax())
        raw = logits[i] - np.log(np.exp(logits[i].astype(np.float64)).sum())
        assert float(chosen[i]) == pytest.approx(raw[int(tokens[i])], abs=1e-4)  # the model's own logprob
        assert int(rank[i]) == 1 + int((logits[i] > logits[i][int(tokens[i])]).sum())
    # no adjustment at all: the logits unchanged
    none = adjust_logits(logits, zeros, zeros, ones, history * 0 - 1, num_prompt * 0, bias_ids * 0 - 1, bias_values * 0)
    np.testing.assert_array_equal(np.asarray(none), logits)


@pytest.mark.slow
def test_min_p_keeps_only_tokens_near_the_most_likely():
    B = 2
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]] * B, np.float32))
    ones = np.ones(B, np.float32)
    hits = set()
    for seed in range(40):
        args = (ones, np.zeros(B, np.int32), ones, np.full(B, 0.5, np.float32), np.full(B, seed, np.uint32))
        tokens = sample(logits, logits, *args, np.arange(B, dtype=np.int32), np.bool_(False))[0]
        hits.update(int(t) for t in tokens)
    assert hits == {0, 1}  # 0.3 >= 0.5 * 0.5 survives, 0.1 does not


@pytest.mark.slow
def test_chat_takes_one_conversation_or_a_list(llm):
    convo = [{"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]
    s = SamplingParams(max_tokens=3, ignore_eos=True)
    one = llm.chat(convo, s)
    many = llm.chat([convo, other], s)
    assert isinstance(many, list) and len(many) == 2
    assert many[0].token_ids == one.token_ids
    assert many[1].prompt_token_ids != one.prompt_token_ids
