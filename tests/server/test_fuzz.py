"""Fuzzing both front ends while good requests stream beside them.

Hypothesis generates over a thousand bad requests (wrong types, out-of-range values, malformed JSON,
undecodable gRPC bytes) against the OpenAI HTTP API and the gRPC service while greedy requests
stream concurrently. Afterwards: no response was a 5xx / INTERNAL, every good request got exactly
the tokens it gets alone, every KV block is free and nothing is in flight.
"""

from __future__ import annotations

import http.client
import json
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmoe.sampling import SamplingParams
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient
from jaxmoe.server.proto import jaxmoe_pb2 as pb
from jaxmoe.server.testing import WARMUP, engine_idle_and_free, shared_demo_llm, wait_until

pytestmark = pytest.mark.timeout(400)

GOOD_PROMPTS = ["The quick brown fox", "Mixture of experts", "def f(x):", "Hello"]
GOOD_TOKENS = 8
FUZZ = settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def llm():
    return shared_demo_llm()


@pytest.fixture(scope="module")
def server(llm):
    st_ = ServerThread(llm.engine, ServeOptions(model_name="m", **WARMUP))
    yield st_.start()
    st_.stop(abort_inflight=True)


@pytest.fixture(scope="module")
def background(server, llm):
    """Good greedy requests streaming (HTTP and gRPC alternately) for as long as the module runs."""
    want = {}
    for p in GOOD_PROMPTS:  # alone, through the running engine (its loop thread owns it)
        *_, last = list(server.async_engine.add(p, SamplingParams(max_tokens=GOOD_TOKENS, ignore_eos=True)))
        want[p] = last.token_ids
    stop, results, errors = threading.Event(), [], []

    def http_one(prompt):
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
        body = {
            "prompt": prompt,
            "max_tokens": GOOD_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "logprobs": 0,
            "stream": True,
        }
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        conn.close()
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        return resp.status, [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])], raw

    def worker(i):
        client = JaxmoeClient(server.grpc_target)
        tok = server.async_engine.engine.tokenizer
        n = 0
        while not stop.is_set():
            prompt = GOOD_PROMPTS[(i + n) % len(GOOD_PROMPTS)]
            try:
                if n % 2:
                    chunks = list(
                        client.generate(prompt, max_tokens=GOOD_TOKENS, ignore_eos=True, temperature=0, timeout=120)
                    )
                    ids = [t for c in chunks for t in c.delta_token_ids]
                    results.append((prompt, ids == want[prompt], "grpc"))
                else:
                    status, pieces, raw = http_one(prompt)
                    ok = status == 200 and pieces == [tok.decode([t]) for t in want[prompt]]
                    results.append((prompt, ok, raw[-300:] if not ok else "http"))
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                errors.append(repr(e))
            n += 1
        client.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()

    def finish():
        stop.set()
        for t in threads:
            t.join(120)

    yield results, errors, finish
    finish()


# -- bad values ------------------------------------------------------------------------------------

BAD_SCALARS = st.one_of(
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "ignore_eos",
    "stream",
    "n",
    "stop_token_ids",
    "priority",
    "model",
    "stream_options",
    "echo",
    "messages",
]
JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


@st.composite
def bad_http(draw):
    """(path, raw body bytes): a valid request with one or two fields made bad, or junk."""
    kind = draw(st.sampled_from(["field", "field", "field", "json", "bytes", "chat"]))
    if kind == "bytes":
        return "/v1/completions", draw(st.binary(max_size=64))
    if kind == "json":
        return draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"])), json.dumps(draw(JSON)).encode()
    if kind == "chat":
        msgs = draw(
            st.lists(st.one_of(JSON, st.fixed_dictionaries({"role": BAD_SCALARS, "content": BAD_SCALARS})), max_size=3)
        )
        return "/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 2}).encode()
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True)):
        body[field] = draw(BAD_SCALARS)
    text = json.dumps(body, allow_nan=True)
    return "/v1/completions", text.encode()


def _post_raw(server, path, data: bytes):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, raw


HTTP_SEEN: list[int] = []


@pytest.mark.slow
@FUZZ
@given(req=bad_http())
def test_fuzz_http(server, background, req):
    path, data = req
    status, raw = _post_raw(server, path, data)
    HTTP_SEEN.append(status)
    assert status < 500, (path, data[:200], raw[:300])
    if status >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
    elif b'"stream": true' not in data:
        json.loads(raw)  # an accepted request (the mutation happened to be valid) answers JSON


F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def bad_grpc(draw):
    """Raw bytes on the wire: a GenerateRequest with out-of-range values, or undecodable junk."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=48))
    s = pb.SamplingParams(
        top_k=draw(st.integers(-(2**31), 2**31 - 1)),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(st.text(max_size=300), max_size=20)),
    )
    for name, strategy in (
        ("max_tokens", st.integers(-(2**31), 2**31 - 1)),
        ("temperature", F32),
        ("top_p", F32),
        ("logprobs", st.integers(-(2**31), 2**31 - 1)),
    ):
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    req = pb.GenerateRequest(sampling=s, priority=draw(st.sampled_from(["ls", "be", "", "urgent", "x" * 40])))
    if draw(st.booleans()):
        req.token_ids.ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6)))
    else:
        req.text = draw(st.text(max_size=20))
    return req.SerializeToString()


GRPC_SEEN: list[str] = []


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.mark.slow
@settings(FUZZ, max_examples=450)
@given(data=bad_grpc())
def test_fuzz_grpc(server, background, channel, data):
    call = channel.unary_stream("/jaxmoe.v1.Jaxmoe/Generate", request_serializer=None, response_deserializer=None)
    try:
        for _ in call(data, timeout=60):
            pass
        GRPC_SEEN.append("OK")
    except grpc.RpcError as e:
        GRPC_SEEN.append(e.code().name)
        assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
            e.code(),
            e.details(),
            data[:100],
        )


@pytest.mark.slow
def test_good_requests_were_untouched_and_everything_is_free(server, background):
    results, errors, finish = background
    finish()  # stop the good traffic, wait for its last requests
    ae = server.async_engine
    assert len(HTTP_SEEN) + len(GRPC_SEEN) >= 1000, (len(HTTP_SEEN), len(GRPC_SEEN))
    assert HTTP_SEEN.count(400) > 400 and GRPC_SEEN.count("INVALID_ARGUMENT") > 250, (HTTP_SEEN, GRPC_SEEN)
    assert not errors, errors[:3]
    assert len(results) >= 6 and all(ok for _, ok, _ in results), [r for r in results if not r[1]][:3]
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=30)
    assert engine_idle_and_free(ae)
