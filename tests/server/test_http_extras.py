"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version``, and OpenAI fields the server does not
implement (legacy ``functions``, audio, ``suffix``) refused with a 400 naming the field instead of
ignored (structured output and tools: test_structured_output_http.py)."""

from __future__ import annotations

import http.client
import json

import pytest

from jaxmoe import LLM
from jaxmoe.server.app import ServeOptions, ServerThread

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny-random", num_blocks=32, block_size=8, max_num_seqs=2)
    st = ServerThread(llm.engine, ServeOptions(model_name="tiny", warmup=False))
    yield st.start()
    st.stop(abort_inflight=True)


def _call(server, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, json.loads(raw)


def test_tokenize_detokenize_version(server):
    status, r = _call(server, "POST", "/tokenize", {"prompt": "héllo"})
    assert status == 200 and r["count"] == len(r["tokens"]) == 7 and r["tokens"][0] == 256  # BOS + 6 bytes
    assert r["max_model_len"] > 0
    _, no_special = _call(server, "POST", "/tokenize", {"prompt": "héllo", "add_special_tokens": False})
    assert no_special["tokens"] == r["tokens"][1:]
    status, d = _call(server, "POST", "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and d["prompt"] == "héllo"
    status, chat = _call(server, "POST", "/tokenize", {"messages": CHAT})
    assert status == 200 and chat["count"] > 3
    status, err = _call(server, "POST", "/detokenize", {"tokens": [1, 99999]})
    assert status == 400 and err["error"]["param"] == "tokens.1"
    status, err = _call(server, "POST", "/tokenize", {"prompt": "a", "messages": CHAT})
    assert status == 400 and err["error"]["param"] == "prompt"
    status, v = _call(server, "GET", "/version")
    assert status == 200 and isinstance(v["version"], str) and v["version"]


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(server, path, extra, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    status, err = _call(server, "POST", path, {**base, "max_tokens": 2, **extra})
    assert status == 400 and err["error"]["param"] == param, err


@pytest.mark.slow
def test_their_no_op_values_are_accepted(server):
    body = {"messages": CHAT, "max_tokens": 2, "response_format": {"type": "text"}, "tool_choice": "none"}
    status, r = _call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["finish_reason"] in ("length", "stop")
