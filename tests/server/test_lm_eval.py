"""lm-evaluation-harness against ``jaxmoe serve``: its ``local-completions`` model (the class
``lm_eval --model local-completions`` runs) scores loglikelihood requests through
``/v1/completions`` (echo + logprobs, the token ids lm-eval's tokenizer gives), and every item's
loglikelihood and is-greedy flag equal what ``LLM``'s prompt logprobs give for the same checkpoint
and the same token ids. lm-eval comes with the ``[test]`` extra; no data set is downloaded: the
requests are built here."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from jaxmoe.llm import LLM
from jaxmoe.sampling import SamplingParams
from jaxmoe.server.app import ServeOptions, ServerThread

pytestmark = pytest.mark.timeout(600)

PAIRS = [("The cat", " sat on the mat"), ("Hello", " world"), ("abc", "d"), ("Mixture of", " experts")]


@pytest.mark.slow
def test_lm_eval_loglikelihood_equals_llm_prompt_logprobs(checkpoint_dir):
    path = checkpoint_dir("mixtral")
    llm = LLM(path, dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4)
    lm = LocalCompletionsAPI(
        base_url="http://unused",  # set below, once the server listens
        model="tiny",
        tokenizer_backend="huggingface",
        tokenizer=str(path),
        tokenized_requests=True,
        max_retries=1,
    )
    want = []
    for context, continuation in PAIRS:
        ctx, cont = lm._encode_pair(context, continuation)  # what lm-eval sends: ctx + cont token ids
        assert ctx and cont
        out = llm.generate(ctx + cont, SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
        scored = out.prompt_logprobs[len(ctx) :]
        want.append(
            (
                sum(lp.logprob for lp in scored),
                all(lp.token_id == max(lp.top, key=lambda t: t[1])[0] for lp in scored),
            )
        )
    with ServerThread(llm.engine, ServeOptions(model_name="tiny", warmup=False)) as server:
        lm.base_url = server.http_url + "/v1/completions"
        requests = [
            Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)
        ]
        got = lm.loglikelihood(requests)
    assert len(got) == len(PAIRS)
    for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want):
        assert g_ll == pytest.approx(w_ll, abs=1e-4) and g_greedy == w_greedy
