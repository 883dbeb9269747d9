"""The OpenAI-compatible HTTP server, live on an ephemeral loopback port: the official `openai`
client (completions, chat, streaming) against the standalone LLM, OpenAI-style errors (400 / 429),
priority extension, client disconnect, /v1/models, /health and the Prometheus /metrics."""

from __future__ import annotations

import concurrent.futures
import http.client
import json

import openai
import pytest

from jaxmoe.sampling import SamplingParams
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.testing import (
    WARMUP,
    burst_into_full_queue,
    engine_idle_and_free,
    failing_steps,
    shared_demo_llm,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": "Hello"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm():
    return shared_demo_llm()


@pytest.fixture(scope="module")
def reference(llm):
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    return {"completion": llm.generate(PROMPT, sp)[0], "chat": llm.chat(MESSAGES, sp)}


@pytest.fixture(scope="module")
def server(llm, reference):
    st = ServerThread(llm.engine, ServeOptions(model_name="demo-moe", **WARMUP))
    yield st.start()
    st.stop(abort_inflight=True)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, path, body, headers=None):
    """(status, parsed JSON or SSE events) with the standard library."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if raw.startswith("{") else raw)


def _get(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


@pytest.mark.slow
def test_completion_matches_standalone(oai, reference):
    r = oai.completions.create(model="demo-moe", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    ref = reference["completion"]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.object == "text_completion" and r.model == "demo-moe"


def test_completion_from_token_ids(oai, reference):
    ref = reference["completion"]
    r = oai.completions.create(model="demo-moe", prompt=ref.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref.text


def test_completion_stream(oai, reference):
    chunks = list(
        oai.completions.create(
            model="demo-moe",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["completion"].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_matches_standalone(oai, reference):
    r = oai.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference["chat"].text


def test_chat_stream_with_priority_and_logprobs(oai, reference):
    stream = oai.chat.completions.create(
        model="demo-moe",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body={"priority": "ls"},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference["chat"].text
    lps = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(lps) == MAX_TOKENS and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_ends_with_done(server):
    status, raw = _post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True, "temperature": 0}
    )
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": [1, 2, 999]}, "outside the vocabulary"),
    ({"prompt": "x" * 300}, "context"),
    ({"prompt": "hi", "priority": "urgent"}, "unknown priority"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": ["a", 5]}, "prompt"),
    # each of these once passed validation and broke the step of every co-batched request
    ({"prompt": "hi", "seed": "1"}, "seed"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "top_k": 2**31}, "top_k"),
    ({"prompt": "hi", "top_k": float("inf")}, "top_k"),
    ({"prompt": "hi", "logprobs": 2.5}, "logprobs"),
    ({"prompt": "hi", "stop": ["ok", 1]}, "stop"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    # and these were silently coerced
    ({"prompt": "hi", "ignore_eos": "false"}, "ignore_eos"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "stream": "false"}, "stream"),
    ({"prompt": "hi\ud800"}, "surrogate"),
]


@pytest.mark.parametrize("body, match", BAD, ids=[m + str(i) for i, (_, m) in enumerate(BAD)])
def test_invalid_request_is_400(server, body, match):
    status, err = _post(server, "/v1/completions", body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error" and match in err["error"]["message"]
    assert err["error"]["code"] == "invalid_argument"
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_other_400s(server, oai):
    assert _post(server, "/v1/completions", b"{not json")[0] == 400
    assert _post(server, "/v1/chat/completions", {"messages": []})[0] == 400
    assert _post(server, "/v1/completions", {"prompt": "hi"}, {"X-Priority": "urgent"})[0] == 400
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="demo-moe", prompt="hi", max_tokens=-1)
    # still serving
    assert oai.completions.create(model="demo-moe", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_overload_is_429(server):
    results = burst_into_full_queue(
        server.async_engine, lambda i: _post(server, "/v1/completions", {"prompt": f"req {i}", "max_tokens": 8})
    )
    statuses = [s for s, _ in results]
    assert statuses.count(429) == 10 and statuses.count(200) == 2, statuses
    err = next(body for s, body in results if s == 429)["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"


def test_engine_failure_is_500(server):
    with failing_steps(server.async_engine, "injected failure"):
        status, err = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        s_status, events = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True})
    assert status == 500 and err["error"]["code"] == "internal_error" and "injected" in err["error"]["message"]
    assert s_status == 200 and '"internal_error"' in events and events.rstrip().endswith("data: [DONE]")
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_client_disconnect_aborts(server):
    ae = server.async_engine
    aborted = ae.call(lambda e: e.scheduler.num_aborted)
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = {"prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read(6) == b"data: "
    conn.sock.close()  # hang up mid-stream
    conn.close()
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=15)
    assert engine_idle_and_free(ae)
    assert ae.call(lambda e: e.scheduler.num_aborted) == aborted + 1


def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == ["demo-moe"]
    status, body = _get(server, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_metrics(server, oai):
    executor = server.async_engine.engine.executor
    executor.expert_activation_counts = lambda: [[1, 2, 3], [4, 5, 6]]  # the lead's hook, faked
    try:
        oai.completions.create(model="demo-moe", prompt="hi", max_tokens=3, extra_headers={"X-Priority": "ls"})
        status, text = _get(server, "/metrics")
    finally:
        del executor.expert_activation_counts
    assert status == 200
    for needle in [
        'jaxmoe_time_to_first_token_seconds_count{priority="ls"}',
        'jaxmoe_time_per_output_token_seconds_count{priority="ls"}',
        'jaxmoe_queue_length{queue="ls_prefill"}',
        'jaxmoe_queue_length{queue="be_decode"}',
        "jaxmoe_running_batch_size",
        "jaxmoe_kv_block_utilization",
        'jaxmoe_preemptions_total{kind="keep_kv",level="step",priority="be"}',
        'jaxmoe_preemptions_total{kind="recompute",level="step",priority="ls"}',
        'jaxmoe_preemptions_total{kind="pause",level="layer",priority="be"}',
        "jaxmoe_policy_errors_total 0.0",
        'jaxmoe_expert_activations_total{expert="2",layer="1"} 6.0',
        'jaxmoe_requests_rejected_total{reason="invalid"}',
        'jaxmoe_requests_finished_total{finish_reason="length",priority="ls"}',
    ]:
        assert needle in text, needle


def _alone(server, prompts, sampling):
    """Each prompt's final output through the running engine (the engine belongs to the loop thread)."""
    outs = []
    for p in prompts:
        *_, last = list(server.async_engine.add(p, sampling))
        outs.append(last)
    return outs


def test_errors_name_the_field(server):
    cases = [
        ("/v1/completions", {"prompt": "hi", "seed": "1"}, "seed"),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", 1]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2.5}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
    ]
    for path, body, param in cases:
        status, err = _post(server, path, body)
        assert status == 400 and err["error"]["param"].startswith(param), (body, err)


def test_unparseable_bodies_are_json_4xx(server):
    gz = {"Content-Encoding": "gzip"}
    cases = [
        (b"[" * 100_000, {}, 400),  # deeply nested JSON
        (json.dumps({"messages": [{"content": "x"}]}).encode(), {}, 400),
        (b"\x1f\x8b not gzip at all", gz, 400),
        (b"{}", {"Content-Encoding": "zstd-nonsense"}, 415),
        (b'{"prompt": "' + b"x" * (5 << 20) + b'"}', {}, 413),
    ]
    for body, headers, want in cases:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, err = _post(server, path, body, headers)
        assert status == want and set(err["error"]) == {"message", "type", "param", "code"}, (body[:40], status)
    status, body = _get(server, "/no/such/path")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_body_must_be_a_json_object(server):
    for body, headers in [
        (b"[1, 2]", {}),
        (b'{"prompt": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"}),
    ]:
        status, err = _post(server, "/v1/completions", body, headers)
        assert status == 400 and "JSON object" in err["error"]["message"], err


def test_unknown_model_is_404(server, oai):
    status, err = _post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-9")
    assert oai.models.retrieve("demo-moe").id == "demo-moe"


def test_openai_compatibility(server, oai, llm):
    greedy = dict(max_tokens=5, temperature=0)
    alone = _alone(server, ["one", "two"], SamplingParams(max_tokens=5))
    want = [o.text for o in alone]
    r = oai.completions.create(model="demo-moe", prompt=["one", "two"], **greedy)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == want
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in alone)
    plain = oai.chat.completions.create(model="demo-moe", messages=MESSAGES, **greedy)
    parts = oai.chat.completions.create(
        model="demo-moe",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
        **greedy,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content and plain.usage.total_tokens
    capped = oai.chat.completions.create(model="demo-moe", messages=MESSAGES, max_completion_tokens=2, temperature=0)
    assert capped.usage.completion_tokens == 2
    chunks = list(
        oai.completions.create(
            model="demo-moe", prompt=["one", "two"], stream=True, stream_options={"include_usage": True}, **greedy
        )
    )
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == want


def test_a_failing_request_fails_alone(server, llm):
    """A request whose rows break the model run fails by itself (the step is re-run without it);
    the requests batched with it get exactly their standalone tokens and the KV cache survives."""
    ae = server.async_engine
    runner = ae.engine.runner
    real_run, POISON = runner.run, 299

    def run(rows, between_layers=None):
        if any(POISON in r.token_ids for r in rows):
            raise RuntimeError("injected per-request failure")
        return real_run(rows, between_layers)

    prompts = ["good one", "another good", "third"]
    want = [o.token_ids for o in _alone(server, prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    ae.call(lambda e: setattr(runner, "run", run))
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            bad = pool.submit(_post, server, "/v1/completions", {"prompt": [5, 6, POISON], "max_tokens": 8})
            good = [
                pool.submit(
                    _post,
                    server,
                    "/v1/completions",
                    {"prompt": p, "max_tokens": 8, "ignore_eos": True, "temperature": 0},
                )
                for p in prompts
            ]
            status, err = bad.result(60)
            results = [f.result(60) for f in good]
    finally:
        ae.call(lambda e: setattr(runner, "run", real_run))
    assert status == 500 and "injected per-request failure" in err["error"]["message"]
    tok = ae.engine.tokenizer
    assert [s for s, _ in results] == [200] * 3
    assert [r["choices"][0]["text"] for _, r in results] == [tok.decode(w) for w in want]
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=10) and engine_idle_and_free(ae)


def test_failure_after_a_request_finished_does_not_hang(server):
    """A step that raises after its requests finished (here: a failing step hook) still ends
    every one of them: an error, never a stream that waits forever."""
    ae = server.async_engine

    class Failing:
        def before_step(self, engine):
            pass

        def after_step(self, engine, outputs):
            engine.hooks.remove(self)
            raise RuntimeError("injected bookkeeping failure")

    ae.call(lambda e: e.add_hook(Failing()))
    status, err = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 500 and "bookkeeping" in err["error"]["message"]
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=10) and engine_idle_and_free(ae)


def test_request_deadline(server):
    ae = server.async_engine
    old = ae.request_timeout_s
    ae.request_timeout_s = 0.05  # 1000 tokens take far longer, even on a quiet machine (~1.5 ms per step)
    try:
        status, err = _post(server, "/v1/completions", {"prompt": "slow", "max_tokens": 1000, "ignore_eos": True})
    finally:
        ae.request_timeout_s = old
    assert status == 504 and err["error"]["code"] == "timeout" and "deadline" in err["error"]["message"]
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=10) and engine_idle_and_free(ae)


@pytest.mark.slow
def test_echo_with_prompt_logprobs_as_lm_eval_sends_it(server, llm):
    """lm-evaluation-harness `local-completions` loglikelihood: echo + logprobs, max_tokens 0 or 1;
    the prompt's token logprobs equal the engine's prompt logprobs."""
    ctx, cont = [5, 17, 33, 2, 9], [40, 41, 7]
    want = _alone(server, [ctx + cont], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    for max_tokens in (0, 1):
        status, r = _post(
            server,
            "/v1/completions",
            {
                "model": "demo-moe",
                "prompt": [ctx + cont],
                "echo": True,
                "max_tokens": max_tokens,
                "logprobs": 1,
                "temperature": 0,
            },
        )
        assert status == 200, r
        lp = r["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 8 + max_tokens and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:8] == pytest.approx([w.logprob for w in want[1:]], abs=1e-5)
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        assert r["usage"]["completion_tokens"] == max_tokens
    status, r = _post(server, "/v1/completions", {"prompt": "Hello", "echo": True, "max_tokens": 2, "temperature": 0})
    assert status == 200 and r["choices"][0]["text"].startswith("Hello")
    status, err = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 0})
    assert status == 400 and err["error"]["param"] == "max_tokens"


def test_echo_with_stream(server):
    """``echo`` with ``stream``: the first chunk starts with the prompt's text and its logprobs (the
    first prompt token has none), then the generated tokens; the same as the non-streamed answer."""
    body = {"prompt": [5, 17, 33, 2], "echo": True, "max_tokens": 3, "logprobs": 1, "temperature": 0}
    status, whole = _post(server, "/v1/completions", body)
    s_status, raw = _post(server, "/v1/completions", dict(body, stream=True))
    assert status == 200 and s_status == 200
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events]
    first = choices[0]["logprobs"]
    assert len(first["tokens"]) >= 4 and first["token_logprobs"][0] is None
    streamed = {k: [v for c in choices if c["logprobs"] for v in c["logprobs"][k]] for k in first}
    assert streamed == whole["choices"][0]["logprobs"]
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    # echo without logprobs: the prompt's text first, no logprobs
    status, raw = _post(server, "/v1/completions", {"prompt": "Hello", "echo": True, "max_tokens": 2, "stream": True})
    first = json.loads(next(line[6:] for line in raw.splitlines() if line.startswith("data: {")))
    assert first["choices"][0]["text"].startswith("Hello") and first["choices"][0]["logprobs"] is None


def test_openapi_schema_is_served(server):
    status, raw = _get(server, "/openapi.json")
    schema = json.loads(raw)
    assert status == 200 and {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}"} <= set(
        schema["paths"]
    )
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "logprobs", "echo", "stream", "priority"} <= set(props)
    assert "400" in schema["paths"]["/v1/completions"]["post"]["responses"]


@pytest.mark.slow
def test_every_block_free_at_the_end(server):
    ae = server.async_engine
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=10)
    assert engine_idle_and_free(ae)
