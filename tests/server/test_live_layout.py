"""After a live rescale, gRPC ``ModelInfo``, ``/v1/models`` and ``/metrics`` report the layout serving
now; stopping the server with a rescale build in flight cancels the build (its caller gets
503 ``unavailable``), ends the streams in flight with ``finish_reason="abort"`` and returns within 3 s;
``jaxmoe serve`` exits within 3 s of SIGTERM with a build in flight."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe import LLM
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient

pytestmark = pytest.mark.timeout(600)
ENGINE = dict(dtype="float32", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=16, max_batch_tokens=32)


def _request(srv, method, path, payload=None, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=timeout)
    body = None if payload is None else json.dumps(payload)
    conn.request(method, path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if raw.startswith("{") else raw)


def _stream(srv, chunks: list) -> None:
    """A long streamed completion; appends each chunk's finish_reason (None until the last)."""
    # 3 + 120 tokens: fits one attention instance of 4a4e (128 KV slots) and of 2a6e
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    for line in conn.getresponse():
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    conn.close()


def _gauge(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_layout_reported_after_rescale_and_shutdown_cancels_a_build(checkpoint_dir):
    llm = LLM(checkpoint_dir("mixtral"), mesh="meshes/cpu-8.yaml", **ENGINE)
    st = ServerThread(llm.engine, ServeOptions(warmup=False))
    srv = st.start()
    stopped = False
    try:
        with JaxmoeClient(srv.grpc_target) as client:
            before = client.model_info(timeout=60).mesh
        status, card = _request(srv, "GET", "/v1/models")
        assert card["data"][0]["layout"] == "2a6e"
        status, body = _request(srv, "POST", "/admin/rescale", {"attention": 4, "experts": 4})
        assert status == 200 and body["previous"] == "2a6e", body
        with JaxmoeClient(srv.grpc_target) as client:
            after = client.model_info(timeout=60).mesh
        assert after != before, after
        status, card = _request(srv, "GET", "/v1/models")
        model = card["data"][0]
        assert (model["layout"], model["attention_instances"], model["expert_instances"]) == ("4a4e", 4, 4)
        status, text = _request(srv, "GET", "/metrics")
        assert _gauge(text, "jaxmoe_attention_instances") == 4 and _gauge(text, "jaxmoe_expert_instances") == 4
        assert _gauge(text, "jaxmoe_rescales_total") == 1

        # a second rescale, stopped while it builds with a stream in flight: the build is cancelled,
        # the stream ends with finish_reason "abort", the server stops within 3 s
        chunks: list = []
        streamer = threading.Thread(target=_stream, args=(srv, chunks))
        streamer.start()
        deadline = time.monotonic() + 120
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert chunks, "the stream did not start"
        answer: dict = {}
        caller = threading.Thread(
            target=lambda: answer.update(r=_request(srv, "POST", "/admin/rescale", {"attention": 2, "experts": 6}))
        )
        caller.start()
        rescaler = LiveRescaler.of(llm.engine)
        deadline = time.monotonic() + 120
        while rescaler.job is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rescaler.job is not None and not rescaler.job.ready()
        job = rescaler.job
        t0 = time.monotonic()
        st.stop(abort_inflight=True, grace=0.0)
        stopped = True
        took = time.monotonic() - t0
        caller.join(30)
        streamer.join(30)
        assert took < 3.0, took
        assert chunks[-1] == "abort", chunks[-3:]  # the in-flight stream was ended, and told so
        status, body = answer["r"]
        assert status == 503 and body["error"]["code"] == "unavailable" and "cancelled" in body["error"]["message"]
        assert llm.engine.runner.executor.num_attention == 4  # the old layout stayed
        # the cancelled build stops before its next compile; wait for it, so that no thread is inside
        # an XLA compile when the interpreter exits (that aborts the process)
        job.thread.join(300)
        assert not job.thread.is_alive()
    finally:
        if not stopped:
            st.stop(abort_inflight=True)


@pytest.mark.slow
def test_cli_sigterm_cancels_a_build_and_exits_within_3s(checkpoint_dir):
    """``jaxmoe serve`` with a mesh, SIGTERM while a live rescale builds: the caller gets 503
    ``unavailable`` (cancelled) and the process exits 0 within 3 s."""
    cmd = [sys.executable, "-m", "jaxmoe.cli", "serve", "--model", str(checkpoint_dir("mixtral"))]
    cmd += ["--mesh", "meshes/cpu-8.yaml", "--no-warmup", "--http-port", "0", "--grpc-port", "0"]
    cmd += ["--dtype", "float32", "--num-blocks", "64", "--block-size", "8", "--max-num-seqs", "4"]
    # no persistent compilation cache: the build compiles, so it is still in flight at the signal
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAXMOE_COMPILATION_CACHE="off")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port, seen, deadline = None, "", time.monotonic() + 180
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen += line
            m = re.search(r"http listening on [^:]+:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port is not None, seen
        srv = types.SimpleNamespace(http_port=port)
        answer: dict = {}
        change = {"attention": 4, "experts": 4}
        caller = threading.Thread(target=lambda: answer.update(r=_request(srv, "POST", "/admin/rescale", change)))
        caller.start()
        building, deadline = False, time.monotonic() + 60
        while not building and caller.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # a second rescale is refused (409) while the first one builds
            status, body = _request(srv, "POST", "/admin/rescale", change)
            building = status == 409 and body["error"]["code"] == "rescale_in_progress"
        assert building, answer
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
        caller.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == 0 and took < 3.0, (code, took)
    status, body = answer["r"]
    assert status == 503 and body["error"]["code"] == "unavailable" and "cancelled" in body["error"]["message"]
