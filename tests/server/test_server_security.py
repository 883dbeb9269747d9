"""Security options of `jaxmoe serve`: API key on HTTP and gRPC, Host header check, cross-origin
requests refused unless allowed; /health stays open."""

from __future__ import annotations

import contextlib
import http.client
import json
import time

import grpc
import pytest

from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient
from jaxmoe.server.http_server import HttpLimits
from jaxmoe.server.security import SecurityOptions
from jaxmoe.server.testing import WARMUP, shared_demo_llm, wait_until

pytestmark = pytest.mark.timeout(180)
KEY = "s3cret-key"
ALLOWED = "https://app.example"


@pytest.fixture(scope="module")
def server():
    llm = shared_demo_llm()
    opts = ServeOptions(model_name="m", security=SecurityOptions(api_key=KEY, allowed_origins=(ALLOWED,)), **WARMUP)
    st = ServerThread(llm.engine, opts)
    yield st.start()
    st.stop(abort_inflight=True)


def _request(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if raw.startswith("{") else raw), resp.headers


BODY = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.slow
def test_api_key_on_http(server):
    admitted = server.async_engine.call(lambda e: e.scheduler.stats()["admitted"])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, err, _ = _request(server, "POST", "/v1/completions", BODY, headers)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", headers
    assert server.async_engine.call(lambda e: e.scheduler.stats()["admitted"]) == admitted  # nothing ran
    assert _request(server, "POST", "/v1/completions", BODY, AUTH)[0] == 200
    assert _request(server, "GET", "/v1/models")[0] == 401
    assert _request(server, "GET", "/health")[0] == 200 and _request(server, "GET", "/metrics")[0] == 200


def test_host_header_must_name_the_server(server):
    status, err, _ = _request(server, "POST", "/v1/completions", BODY, {**AUTH, "Host": "evil.example"})
    assert status == 421 and err["error"]["code"] == "misdirected_request"
    assert (
        _request(server, "POST", "/v1/completions", BODY, {**AUTH, "Host": f"localhost:{server.http_port}"})[0] == 200
    )


def test_cross_origin_requests_refused_unless_allowed(server):
    admitted = server.async_engine.call(lambda e: e.scheduler.stats()["admitted"])
    # the simple request a web page can send without a preflight: text/plain, cross-origin
    status, err, _ = _request(
        server,
        "POST",
        "/v1/completions",
        BODY,
        {**AUTH, "Origin": "https://evil.example", "Content-Type": "text/plain"},
    )
    assert status == 403 and err["error"]["code"] == "origin_not_allowed"
    assert server.async_engine.call(lambda e: e.scheduler.stats()["admitted"]) == admitted
    status, _, headers = _request(server, "POST", "/v1/completions", BODY, {**AUTH, "Origin": ALLOWED})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED


def test_api_key_on_grpc(server):
    with JaxmoeClient(server.grpc_target) as anonymous, JaxmoeClient(server.grpc_target, api_key=KEY) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(anonymous.generate("hi", max_tokens=2, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            anonymous.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.health() == "SERVING"  # health stays open
        chunks = list(client.generate("hi", max_tokens=2, temperature=0, timeout=30))
        assert chunks[-1].finish_reason and client.model_info().model == "m"


@pytest.mark.slow
def test_slow_body_is_refused_with_408():
    """A client that sends headers and then trickles (or never sends) its body gets 408 and frees the
    connection, instead of holding a handler forever."""
    import socket

    llm = shared_demo_llm()
    limits = HttpLimits(header_timeout_s=0.5, max_connections=4, max_header_bytes=4096)
    st = ServerThread(llm.engine, ServeOptions(model_name="m", body_read_timeout_s=0.5, http_limits=limits, **WARMUP))
    server = st.start()
    admitted = server.async_engine.call(lambda e: e.scheduler.stats()["admitted"])
    try:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": '
            )  # 89 bytes never come
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert server.async_engine.call(lambda e: e.scheduler.stats()["admitted"]) == admitted  # nothing ran
        status, out, _ = _request(server, "POST", "/v1/completions", BODY)  # a normal request still works
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        # a connection that sends nothing is closed after the head timeout (held by the listener's thread)
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            t0 = time.monotonic()
            assert sock.recv(4096) == b"" and time.monotonic() - t0 < 5
        # a connection that never finishes its request head is closed (slowloris), with no answer
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            t0 = time.monotonic()
            assert sock.recv(4096) == b"" and time.monotonic() - t0 < 5
        # the same for the next request head on a kept-alive connection (a trickle keeps no connection)
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read() and conn.sock is not None  # kept alive
        conn.sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        closed = False
        for _ in range(40):  # a header line every 0.1 s, each before the keep-alive timeout, for up to 4 s
            time.sleep(0.1)
            try:
                conn.sock.sendall(b"X-Slow: 1\r\n")
            except OSError:  # the server closed the connection
                closed = True
                break
        if not closed:
            with contextlib.suppress(ConnectionResetError):
                closed = conn.sock.recv(4096) == b""
        assert closed and time.monotonic() - t0 < 4, time.monotonic() - t0
        conn.close()
        # a request head still incomplete past max_header_bytes: a JSON 400, closed
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 8000)
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"
        # not HTTP at all: a JSON 400 too
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(b"\x16\x03\x01 this is not http\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["type"] == "invalid_request_error"
        # beyond the connection limit a request gets a JSON 429 with Retry-After; /health is still served
        idle = [socket.create_connection(("127.0.0.1", server.http_port), timeout=30) for _ in range(4)]
        try:
            status, out, headers = _request(server, "GET", "/v1/models")
            assert status == 429 and out["error"]["code"] == "overloaded" and headers["Retry-After"] == "1"
            assert _request(server, "GET", "/health")[0] == 200
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: _request(server, "GET", "/v1/models")[0] == 200, timeout=5)
    finally:
        st.stop(abort_inflight=True)
