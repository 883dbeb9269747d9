"""Prefix caching through the servers: ``usage.prompt_tokens_details.cached_tokens`` (completions and
chat, streamed final usage too), the per-request ``cache_salt`` (HTTP and gRPC), the prefix-cache
metrics, and outputs equal to an uncached engine's."""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient

pytestmark = pytest.mark.slow  # three engines and a server (about 3 minutes on a loaded 2-core CPU)

ENGINE = dict(block_size=16, num_blocks=32, max_num_seqs=4, max_model_len=256)
PROMPT = "The system prompt every request shares: answer briefly, politely and in English. Q: "


@pytest.fixture(scope="module")
def plain():
    """Reference outputs of an engine without prefix caching."""
    llm = LLM("tiny-random", prefix_caching=False, **ENGINE)
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    return {q: llm.generate(PROMPT + q, sp)[0] for q in ("one?", "two?")}


@pytest.fixture(scope="module")
def server(plain):
    st = ServerThread(LLM("tiny-random", **ENGINE).engine, ServeOptions(model_name="m"))
    yield st.start()
    st.stop(abort_inflight=True)


def post(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if raw.startswith("{") else raw)


def complete(server, q, **extra):
    body = {"model": "m", "prompt": PROMPT + q, "max_tokens": 5, "temperature": 0, "logprobs": 0, **extra}
    status, obj = post(server, "/v1/completions", body)
    assert status == 200, obj
    return obj


@pytest.mark.slow
def test_cached_tokens_in_usage_and_outputs_unchanged(server, plain):
    first = complete(server, "one?")
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = complete(server, "two?")  # the 5 full blocks of the shared system prompt come from the cache
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    for obj, q in ((first, "one?"), (second, "two?")):
        assert obj["choices"][0]["text"] == plain[q].text
        got = obj["choices"][0]["logprobs"]["token_logprobs"]
        assert np.allclose(got, [t.logprob for t in plain[q].logprobs], atol=1e-3)
    status, events = post(
        server,
        "/v1/completions",
        {"model": "m", "prompt": PROMPT + "one?", "max_tokens": 5, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert status == 200
    usage = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 80
    status, chat = post(
        server,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2},
    )
    assert status == 200 and "cached_tokens" in chat["usage"]["prompt_tokens_details"]


@pytest.mark.slow
def test_cache_salt_isolates_tenants(server):
    assert complete(server, "salted?", cache_salt="a")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(server, "salted!", cache_salt="b")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(server, "salted.", cache_salt="a")["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    status, err = post(server, "/v1/completions", {"model": "m", "prompt": "x", "cache_salt": ""})
    assert status == 400 and err["error"]["param"] == "cache_salt"
    status, err = post(server, "/v1/completions", {"model": "m", "prompt": "x", "cache_salt": 7})
    assert status == 400 and err["error"]["param"] == "cache_salt"
    with JaxmoeClient(server.grpc_target) as c:
        assert c.complete(PROMPT + "grpc", max_tokens=2, cache_salt="c")["usage"]["cached_tokens"] == 0
        assert c.complete(PROMPT + "grpc?", max_tokens=2, cache_salt="c")["usage"]["cached_tokens"] == 80
        assert c.complete(PROMPT + "grpc!", max_tokens=2)["usage"]["cached_tokens"] == 80


@pytest.mark.slow
def test_prefix_cache_metrics(server):
    complete(server, "metrics?")
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("jaxmoe_prefi")}
    assert values["jaxmoe_prefix_cache_hits_total"] >= 80
    assert values["jaxmoe_prefix_cache_queries_total"] > values["jaxmoe_prefix_cache_hits_total"]
    # the cached tokens were not computed again: prefill computed what the cache did not hold
    assert 0 < values["jaxmoe_prefill_tokens_total"] <= values["jaxmoe_prefix_cache_queries_total"] - 80
    assert values["jaxmoe_prefix_cache_waits_total"] >= 0
    assert values["jaxmoe_prefix_cache_blocks"] >= 5


@pytest.fixture(scope="module")
def deterministic_server():
    """``jaxmoe serve --deterministic``'s engine behind the HTTP server; ``.rows``: the rows of every
    model call it ran."""
    engine = LLM("tiny-random", deterministic=True, **ENGINE).engine
    runner, rows = engine.runner, []
    run = runner.run

    def counted(batch, *args, **kwargs):
        rows.append(len(batch))
        return run(batch, *args, **kwargs)

    runner.run = counted
    st = ServerThread(engine, ServeOptions(model_name="m", warmup=False))  # compiles only what runs
    server = st.start()
    server.rows = rows
    yield server
    st.stop(abort_inflight=True)


@pytest.mark.slow
def test_deterministic_server_answers_alike_alone_and_beside_concurrent_requests(deterministic_server):
    """The same greedy request with logprobs, alone and beside three concurrent requests of other
    lengths (other cache salts: no cached prefix either time), gets bit-identical tokens and logprobs."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(q, salt, n=8):
        obj = complete(deterministic_server, q, max_tokens=n, cache_salt=salt)
        return obj["choices"][0]["text"], obj["choices"][0]["logprobs"]["token_logprobs"]

    alone = ask("alone?", "a")
    others = ["x" * 30 + "?", "a longer question that takes a few more tokens to say?", "hm?"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, q, "b", 12) for q in others]
        futures.insert(1, pool.submit(ask, "alone?", "c"))
        batched = [f.result() for f in futures]
    assert max(deterministic_server.rows) >= 2  # it ran beside others
    assert batched[1] == alone  # the text and every logprob, exactly
