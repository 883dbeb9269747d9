"""schemathesis against the OpenAPI schema the HTTP app serves (``/openapi.json``), while good greedy
requests stream beside it: no 5xx, every response conforms to the schema (status code, content
type, body), every good request gets exactly the tokens it gets alone, and afterwards every KV
block is free and the in-flight gauge is back to 0."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from jaxmoe.sampling import SamplingParams
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.testing import WARMUP, engine_idle_and_free, shared_demo_llm, wait_until

pytestmark = pytest.mark.timeout(600)

GOOD_PROMPTS = ["The quick brown fox", "Mixture of experts", "Hello"]
GOOD_TOKENS = 6
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
SEEN: list[int] = []
EXAMPLES = 60  # per operation and mode


@pytest.fixture(scope="module")
def server():
    st = ServerThread(shared_demo_llm().engine, ServeOptions(model_name="m", **WARMUP))
    yield st.start()
    st.stop(abort_inflight=True)


@pytest.fixture(scope="module")
def background(server):
    """Greedy streamed completions in a loop for as long as the module runs; (results, finish)."""
    want = {}
    for p in GOOD_PROMPTS:
        *_, last = list(server.async_engine.add(p, SamplingParams(max_tokens=GOOD_TOKENS, ignore_eos=True)))
        want[p] = last.text
    stop, results = threading.Event(), []

    def loop():
        n = 0
        while not stop.is_set():
            prompt = GOOD_PROMPTS[n % len(GOOD_PROMPTS)]
            body = {"prompt": prompt, "max_tokens": GOOD_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
            try:
                conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
                conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read().decode()
                conn.close()
                events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
                text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
                results.append((resp.status == 200 and text == want[prompt], raw[-300:]))
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                results.append((False, repr(e)))
            n += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def finish():
        stop.set()
        thread.join(120)

    yield results, finish
    finish()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_openapi_schema_holds(server, background, mode):
    schema = schemathesis.openapi.from_url(server.http_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}"}
    covered = set()
    for op in operations:

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        def run(case):
            response = case.call(timeout=120)
            SEEN.append(response.status_code)
            case.validate_response(response, checks=CHECKS)

        try:
            run()
            covered.add(op.path)
        except Unsatisfiable:  # nothing of this operation can be made invalid (no body, free-form strings)
            assert mode is GenerationMode.NEGATIVE and op.method.upper() == "GET", op.path
    assert {"/v1/completions", "/v1/chat/completions"} <= covered


@pytest.mark.slow
def test_good_requests_untouched_and_everything_free(server, background):
    results, finish = background
    finish()
    assert len(SEEN) >= 300 and SEEN.count(400) > 50, (len(SEEN), sorted(set(SEEN)))
    assert len(results) >= 3 and all(ok for ok, _ in results), [r for r in results if not r[0]][:3]
    ae = server.async_engine
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=30)
    assert engine_idle_and_free(ae)
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", "/metrics")
    assert "jaxmoe_inflight_requests 0.0" in conn.getresponse().read().decode()
