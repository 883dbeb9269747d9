"""The executor's op implementations, as a client sees them: gRPC ModelInfo and the
``jaxmoe_op_impl{op, impl} 1`` info metric on /metrics."""

from __future__ import annotations

import http.client

import pytest

from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient
from jaxmoe.server.testing import shared_demo_llm

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_model_info_and_metrics_name_each_op_implementation():
    engine = shared_demo_llm().engine
    expected = engine.runner.executor.op_impls()
    st = ServerThread(engine, ServeOptions(model_name="demo-moe", warmup=False))
    server = st.start()
    try:
        with JaxmoeClient(server.grpc_target) as client:
            assert dict(client.model_info().op_impls) == expected
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        st.stop(abort_inflight=True)
    assert {"expert_ffn", "paged_attention", "layer_matmul"} <= set(expected)
    for op, impl in expected.items():
        assert f'jaxmoe_op_impl{{impl="{impl}",op="{op}"}} 1.0' in text
