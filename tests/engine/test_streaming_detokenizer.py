"""Streaming detokenization is incremental (``tokenizers.decoders.DecodeStream``): a 4,000-token
stream decodes each token once (no whole-output re-decode per step; the time per token stays flat),
split UTF-8 characters appear whole, and the engine's streamed deltas add up to the final text with
stop strings still honoured."""

from __future__ import annotations

import time

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.tokenizer import ByteTokenizer, Detokenizer, load_tokenizer

N = 4000


class _Counting:
    """A tokenizer whose ``decode`` counts the token ids it is given."""

    def __init__(self, tok):
        self._tok, self.decoded_ids = tok, 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self._tok.decode(ids)

    def decode_stream(self):
        return self._tok.decode_stream()


def _ids(tok, n: int) -> list[int]:
    words = "the expert router sends each token to two of eight experts; naïve 東京 ünïcödé 🙂 "
    ids = []
    while len(ids) < n:
        ids += tok.encode(words, add_special_tokens=False)
    return ids[:n]


@pytest.mark.parametrize("kind", ["hf", "bytes"])
def test_a_4000_token_stream_costs_linear_time(checkpoint_dir, kind):
    tok = load_tokenizer(checkpoint_dir("mixtral")) if kind == "hf" else ByteTokenizer()
    ids = _ids(tok, N)
    counting = _Counting(tok)
    detok = Detokenizer(counting)
    quarter = N // 4
    times, pieces = [], []
    for q in range(4):
        t0 = time.perf_counter()
        for t in ids[q * quarter : (q + 1) * quarter]:
            pieces.append(detok.add(t))
            _ = detok.text  # what the engine reads every step
        times.append(time.perf_counter() - t0)
    assert counting.decoded_ids == 0  # nothing re-decoded while streaming
    final = detok.finish(ids)
    assert counting.decoded_ids == N  # one full decode at the end
    assert final == tok.decode(ids) and "".join(pieces) == final[: len("".join(pieces))]
    assert "\ufffd" not in "".join(pieces)  # split characters appear whole
    # the last quarter costs about what the first did (a quadratic re-decode would be ~7x)
    assert times[3] < 3 * times[0] + 0.05, times


@pytest.mark.slow
def test_engine_deltas_add_up_and_stop_strings_still_cut(checkpoint_dir):
    llm = LLM(checkpoint_dir("mixtral"), num_blocks=64, block_size=8, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    full = llm.generate("hello", greedy)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    engine = llm.engine
    stop = full.text[5:8]
    rid = engine.add_request("hello", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    deltas, last = [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.delta_text)
                last = out
    assert last.finished and last.finish_reason == "stop"
    assert "".join(deltas) == last.text == full.text[: full.text.index(stop)]
