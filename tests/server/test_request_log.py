"""One log line per request (logger ``jaxmoe.requests``): id, route, prompt / output tokens, TTFT and
status, for HTTP (plain and streamed, refused) and gRPC; ``jaxmoe serve --no-log-requests`` /
``--quiet`` turn them off."""

from __future__ import annotations

import http.client
import json
import logging
import re

import pytest

from jaxmoe import LLM
from jaxmoe.cli import build_parser
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny-random", num_blocks=64, block_size=8, max_num_seqs=2)
    st = ServerThread(llm.engine, ServeOptions(model_name="tiny", warmup_shapes=((1, 1), (1, 16))))
    yield st.start()
    st.stop(abort_inflight=True)


def _post(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "jaxmoe.requests"]


@pytest.mark.slow
def test_each_request_logs_one_line(server, caplog):
    caplog.set_level(logging.INFO, logger="jaxmoe.requests")
    assert _post(server, {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}) == 200
    assert _post(server, {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True, "stream": True}) == 200
    assert _post(server, {"prompt": "Hello", "max_tokens": 2, "temperature": -1}) == 400
    with JaxmoeClient(server.grpc_target) as c:
        list(c.generate("Hi", max_tokens=2, ignore_eos=True, timeout=60))
    lines = _lines(caplog)
    assert len(lines) == 4, lines
    plain, streamed, refused, grpc_line = lines
    assert re.fullmatch(
        r"cmpl-\w+ /v1/completions status=200 prompt_tokens=6 output_tokens=3 ttft=\d+\.\d{3}s finish=length", plain
    )
    assert re.fullmatch(r"cmpl-\w+ /v1/completions \(stream\) status=200 prompt_tokens=6 output_tokens=2 .*", streamed)
    assert refused == "- /v1/completions status=400 prompt_tokens=0 output_tokens=0 ttft=- finish=-"
    assert re.fullmatch(
        r"grpc-\w+ grpc Generate status=OK prompt_tokens=3 output_tokens=2 ttft=\S+ finish=length", grpc_line
    )


@pytest.mark.slow
def test_serve_flags():
    p = build_parser()
    assert p.parse_args(["serve"]).log_requests is True and not p.parse_args(["serve"]).quiet
    assert p.parse_args(["serve", "--no-log-requests"]).log_requests is False
    assert p.parse_args(["serve", "--quiet"]).quiet
