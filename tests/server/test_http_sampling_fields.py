"""The OpenAI sampling fields over HTTP: ``n`` choices (streamed and not), ``best_of``, penalties,
``logit_bias`` (string token-id keys), vLLM's ``min_p`` / ``repetition_penalty``; each bad value is
a 400 naming its field."""

from __future__ import annotations

import http.client
import json

import pytest

from jaxmoe import LLM
from jaxmoe.server.app import ServeOptions, ServerThread

pytestmark = pytest.mark.timeout(300)

SHAPES = dict(warmup_shapes=((1, 1), (2, 1), (4, 1), (1, 16), (2, 16), (4, 16)))


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny-random", num_blocks=128, block_size=8, max_num_seqs=4)
    st = ServerThread(llm.engine, ServeOptions(model_name="tiny", **SHAPES))
    yield st.start()
    st.stop(abort_inflight=True)


def _post(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if raw.startswith("{") else raw)


@pytest.mark.slow
def test_n_choices_and_usage_counts_the_prompt_once(server):
    body = {"prompt": "Hello", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    status, r = _post(server, "/v1/completions", body)
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in r["choices"]}) > 1
    assert r["usage"]["prompt_tokens"] == len("Hello") + 1 and r["usage"]["completion_tokens"] == 12
    status, again = _post(server, "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]]


def test_n_streamed_for_chat(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True, "seed": 1}
    status, raw = _post(server, "/v1/chat/completions", body)
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1}


def test_best_of_returns_the_most_likely(server):
    body = {"prompt": "abc", "max_tokens": 4, "n": 1, "best_of": 4, "temperature": 1.0, "seed": 3, "logprobs": 0}
    status, r = _post(server, "/v1/completions", body)
    assert status == 200 and len(r["choices"]) == 1, r
    best = sum(r["choices"][0]["logprobs"]["token_logprobs"])
    status, every = _post(server, "/v1/completions", {**body, "n": 4, "best_of": None})
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
    assert best == pytest.approx(max(sums), abs=1e-4)


def test_logit_bias_and_penalties_are_applied(server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logit_bias": {str(ord("q")): 100}}
    status, r = _post(server, "/v1/completions", body)
    assert status == 200 and r["choices"][0]["text"] == "qqq", r
    plain = {"prompt": "aaaa", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, base = _post(server, "/v1/completions", plain)
    _, pen = _post(server, "/v1/completions", {**plain, "frequency_penalty": 2.0, "repetition_penalty": 1.5})
    assert len(set(pen["choices"][0]["text"])) > len(set(base["choices"][0]["text"]))
    status, _ = _post(server, "/v1/completions", {**plain, "min_p": 0.2, "presence_penalty": 0.5})
    assert status == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
    ],
)
def test_bad_values_name_the_field(server, extra, param):
    status, r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
    assert status == 400, r
    assert r["error"]["param"].startswith(param), r
