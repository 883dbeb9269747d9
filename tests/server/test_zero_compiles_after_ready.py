"""Warm-up covers every program serving runs: after ready, plain, sampled, logprobs, echo (with
prompt logprobs, any prompt length), penalties, min-p, n > 1 and structured-output requests compile
nothing, as ``/metrics`` shows (``jaxmoe_compiles_after_warmup``). With the engine's defaults, so with
QLLM's layer preemption on: best-effort steps run layer by layer (their programs warmed too)."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from jaxmoe import LLM
from jaxmoe.server.app import ServeOptions, ServerThread

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
LAYER_PREEMPTION_DEFAULT = True  # the real default (tests/conftest.py): layer preemption on

CASES = [
    {"prompt": "Hello there", "max_tokens": 4},
    {"prompt": "Hello there", "max_tokens": 4, "temperature": 1.0, "top_p": 0.9, "top_k": 5},
    {"prompt": "Hello there", "max_tokens": 4, "logprobs": 3},
    {"prompt": "Hello there", "max_tokens": 4, "echo": True},
    {"prompt": "Hello there", "max_tokens": 4, "echo": True, "logprobs": 2},
    {"prompt": "a longer prompt of some forty bytes, or so", "max_tokens": 2, "echo": True, "logprobs": 5},
    {"prompt": "Hello", "max_tokens": 4, "frequency_penalty": 1.0, "logit_bias": {"65": 3}},
    {"prompt": "Hello", "max_tokens": 4, "min_p": 0.1, "temperature": 1.0, "repetition_penalty": 1.2},
    {"prompt": "Hello", "max_tokens": 4, "n": 3, "temperature": 1.0},
    {"prompt": "Hello", "max_tokens": 4, "response_format": {"type": "json_object"}},
    {"prompt": "Hello", "max_tokens": 4, "guided_choice": ["yes", "no"], "temperature": 1.0, "frequency_penalty": 1.0},
]


def _call(server, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=300)
    conn.request(
        method, path, None if body is None else json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, raw


@pytest.mark.slow
def test_no_program_compiles_after_ready():
    llm = LLM("tiny-random", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=32, max_batch_tokens=64)
    st = ServerThread(llm.engine, ServeOptions(model_name="t", warmup_progress=False))
    server = st.start()
    try:
        for body in CASES:
            status, raw = _call(server, "POST", "/v1/completions", body)
            assert status == 200, (body, raw)
        _, metrics = _call(server, "GET", "/metrics")
        late = re.search(r"^jaxmoe_compiles_after_warmup(?:_total)? (\S+)$", metrics, re.M)
        assert late is not None and float(late.group(1)) == 0, metrics[:2000]
        # the defaults' layer preemption: the best-effort steps ran layer by layer (pausable)
        assert llm.engine.layer_hook is not None and llm.engine.runner.pausable_state_bytes > 0
    finally:
        st.stop(abort_inflight=True)
