"""The gRPC server, live on ephemeral loopback ports: streaming vs the standalone LLM, mixed
priorities, cancel, invalid arguments, overload, health/reflection; and one `jaxmoe serve`
subprocess that must exit cleanly within 3 s of SIGTERM, its gRPC and HTTP streams in flight ended
with ``finish_reason="abort"``."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxmoe.sampling import SamplingParams
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient, make_request
from jaxmoe.server.testing import (
    WARMUP,
    burst_into_full_queue,
    engine_idle_and_free,
    failing_steps,
    shared_demo_llm,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PROMPTS = [f"Client {i} says hi" for i in range(8)]
MAX_TOKENS = 12
SENT = {"accepted": 0}  # requests the server accepted in this module (for the no-loss check)


@pytest.fixture(scope="module")
def llm():
    return shared_demo_llm()


@pytest.fixture(scope="module")
def reference(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    return {p: (o.token_ids, o.text) for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def server(llm, reference):
    st = ServerThread(llm.engine, ServeOptions(**WARMUP))
    srv = st.start()
    srv.finished_before = srv.async_engine.call(lambda e: e.scheduler.num_finished)  # incl. warm-up
    yield srv
    st.stop(abort_inflight=True)


@pytest.fixture(scope="module")
def client(server):
    with JaxmoeClient(server.grpc_target) as c:
        yield c


def _collect(call):
    chunks = list(call)
    SENT["accepted"] += 1
    assert chunks and chunks[-1].finish_reason and not any(c.finish_reason for c in chunks[:-1])
    ids = [t for c in chunks for t in c.delta_token_ids]
    return chunks, ids, "".join(c.delta_text for c in chunks)


@pytest.mark.slow
def test_model_info_health_and_reflection(server, client):
    info = client.model_info()
    assert (info.model, info.family, info.vocab_size, info.max_context) == ("demo", "mixtral", 320, 256)
    assert (info.num_layers, info.num_experts, info.experts_per_token) == (4, 8, 2)
    assert "monolithic" in info.mesh and info.policy == "qllm"
    assert client.health() == "SERVING" and client.health("jaxmoe.v1.Jaxmoe") == "SERVING"
    services = ProtoReflectionDescriptorDatabase(client.channel).get_services()
    assert {"jaxmoe.v1.Jaxmoe", "grpc.health.v1.Health"} <= set(services)


def test_concurrent_mixed_priority_clients_match_standalone(client, reference):
    def one(i):
        prio = "ls" if i % 4 == 0 else "be"  # 2 of 8 latency-sensitive
        chunks, ids, text = _collect(
            client.generate(
                PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0, priority=prio, request_id=f"mix-{i}", timeout=90
            )
        )
        last = chunks[-1]
        assert last.request_id == f"mix-{i}" and last.priority == prio
        assert last.usage.completion_tokens == len(ids) and last.HasField("ttft_s")
        return PROMPTS[i], ids, text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8), timeout=120))
    for prompt, ids, text in results:
        assert (ids, text) == reference[prompt], prompt


def test_logprobs(client):
    chunks, ids, _ = _collect(client.generate(PROMPTS[0], max_tokens=4, logprobs=3, temperature=0))
    lps = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
        assert abs(lp.top[0].logprob - lp.logprob) < 1e-5 and lp.top[0].logprob >= lp.top[1].logprob


def test_cancel_mid_stream_frees_kv_blocks(server, client):
    aborted = server.async_engine.call(lambda e: e.scheduler.num_aborted)
    call = client.generate("Tell me a long story", max_tokens=200, ignore_eos=True, request_id="to-cancel")
    first = next(call)
    assert first.request_id == "to-cancel" and not first.finish_reason
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    SENT["accepted"] += 1
    assert wait_until(lambda: server.async_engine.snapshot()["in_flight"] == 0, timeout=10)
    assert engine_idle_and_free(server.async_engine)
    assert server.async_engine.call(lambda e: e.scheduler.num_aborted) == aborted + 1


BAD = [
    (dict(prompt=""), "empty prompt"),
    (dict(prompt=[]), "empty prompt"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(prompt="hi", logprobs=99), "logprobs"),
    (dict(prompt=[1, 2, 320]), "outside the vocabulary"),
    (dict(prompt=[-1]), "outside the vocabulary"),
    (dict(prompt="x" * 300), "context"),
    (dict(prompt="hi", priority="urgent"), "unknown priority"),
]


@pytest.mark.parametrize("kwargs, match", BAD, ids=[m + str(i) for i, (_, m) in enumerate(BAD)])
def test_invalid_arguments(client, kwargs, match):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(prompt, timeout=30, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()


def test_still_serving_after_bad_requests(client, reference):
    _, ids, _ = _collect(client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0))
    assert ids == reference[PROMPTS[1]][0]


def test_engine_failure_is_internal_and_server_survives(server, client, reference):
    with failing_steps(server.async_engine, "injected failure"), pytest.raises(grpc.RpcError) as err:
        list(client.generate(PROMPTS[2], max_tokens=4, timeout=30))
    SENT["accepted"] += 1  # accepted, then failed (and aborted in the engine)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "injected failure" in err.value.details()
    _, ids, _ = _collect(client.generate(PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0))
    assert ids == reference[PROMPTS[2]][0]


def test_overload_is_resource_exhausted(server, client):
    def one(i):
        try:
            _collect(client.generate(PROMPTS[i % 8], max_tokens=8, timeout=60))
            return "ok"
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "overloaded" in e.details()
            return "exhausted"

    codes = burst_into_full_queue(server.async_engine, one)
    assert codes.count("exhausted") == 10 and codes.count("ok") == 2, codes


def test_no_request_lost_and_every_block_free(server):
    ae = server.async_engine
    assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=10)
    assert engine_idle_and_free(ae)
    finished = ae.call(lambda e: e.scheduler.num_finished) - server.finished_before
    assert finished == SENT["accepted"]  # every accepted request ended (finished or aborted)


def _jaxmoe_command() -> list[str]:
    script = shutil.which("jaxmoe", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "jaxmoe.cli"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_jaxmoe_serve_subprocess_exits_cleanly_on_sigterm():
    cmd = _jaxmoe_command() + [
        "serve",
        "--model",
        "tiny-random",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--block-size",
        "128",
        "--num-blocks",
        "8",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "2",
        "--max-batch-tokens",
        "32",
        "--no-layer-preemption",  # fused steps only: QLLM's layer preemption is not the subject here
    ]
    # default warm-up grid: decodes of 1 and 2 rows, prefills of 16 and 32 tokens
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    ports, lines = {}, []
    try:
        deadline = time.monotonic() + 180
        while len(ports) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.match(r"jaxmoe: (grpc|http) listening on (\S+):(\d+)$", line.strip())
            if m:
                assert m.group(2) == "127.0.0.1"
                ports[m.group(1)] = int(m.group(3))
        assert len(ports) == 2, "".join(lines)
        sse = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=60)
        body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": 0}
        sse.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        events = sse.getresponse()
        assert events.status == 200 and events.readline().startswith(b"data: {")  # the SSE stream runs
        with JaxmoeClient(f"127.0.0.1:{ports['grpc']}") as c:
            assert c.health() == "SERVING"
            call = c.generate("Hello there", max_tokens=200, ignore_eos=True, timeout=60)
            first = next(call)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # both streams in flight are aborted at once (vLLM's way)
            chunks = [first] + list(call)
        reasons = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in events if line[:7] == b"data: {"]
        sse.close()
        assert proc.wait(timeout=60) == 0
        took = time.monotonic() - t0
        assert chunks[-1].finish_reason == "abort" and len(chunks) < 200, chunks[-1]
        assert reasons and reasons[-1] == "abort" and len(reasons) < 200, reasons[-3:]
        assert took < 3.0, took
        out = proc.stdout.read()
        assert "jaxmoe: stopped" in out, "".join(lines) + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_request_proto_roundtrip():
    req = make_request([1, 2, 3], max_tokens=5, seed=7, stop=["x"], priority="ls")
    assert req.WhichOneof("prompt") == "token_ids" and req.sampling.HasField("seed")
    assert not req.sampling.HasField("temperature")
