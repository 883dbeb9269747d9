"""Load on the gRPC front end (grpc.aio): 500 concurrent streams while a health probe runs every
100 ms. Health always answers; streams beyond the engine's waiting queue are refused with
RESOURCE_EXHAUSTED (with a retry hint) and counted; the rest complete; nothing leaks."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import make_request
from jaxmoe.server.proto import jaxmoe_pb2_grpc as pb_grpc
from jaxmoe.server.testing import WARMUP, engine_idle_and_free, shared_demo_llm, wait_until

pytestmark = pytest.mark.timeout(300)
STREAMS = 500


def _rejected(server) -> float:
    text = server.metrics.render().decode()
    m = re.search(r'^jaxmoe_requests_rejected_total\{reason="overloaded"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_500_streams_with_health_probes(tmp_path):
    llm = shared_demo_llm()
    st = ServerThread(llm.engine, ServeOptions(model_name="m", **WARMUP))
    server = st.start()
    try:
        before = _rejected(server)
        outcome = asyncio.run(_load(server.grpc_target))
        ae = server.async_engine
        assert wait_until(lambda: ae.snapshot()["in_flight"] == 0, timeout=60) and engine_idle_and_free(ae)
        after = _rejected(server)
    finally:
        st.stop(abort_inflight=True)
    codes, retry_hints, probes = outcome
    assert len(codes) == STREAMS
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, {c for c in codes if c not in ("OK", "RESOURCE_EXHAUSTED")}
    refused = codes.count("RESOURCE_EXHAUSTED")
    assert refused > 0 and codes.count("OK") > 0
    assert after - before == refused  # every refusal is counted
    assert retry_hints == refused  # and carries a retry hint
    assert len(probes) >= 5 and all(status == "SERVING" for status, _ in probes)
    assert max(latency for _, latency in probes) < 2.0, probes


async def _load(target: str):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.JaxmoeStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        done = asyncio.Event()
        probes: list[tuple[str, float]] = []

        async def probe():
            while not done.is_set():
                t0 = time.monotonic()
                resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                probes.append((health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), time.monotonic() - t0))
                await asyncio.sleep(0.1)

        async def one(i):
            call = stub.Generate(make_request(f"load {i}", max_tokens=2, temperature=0), timeout=120)
            try:
                async for _ in call:
                    pass
                return "OK", False
            except grpc.aio.AioRpcError as e:
                hint = any(k == "retry-after-ms" for k, _ in (e.trailing_metadata() or ()))
                return e.code().name, hint

        prober = asyncio.ensure_future(probe())
        results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
        await asyncio.sleep(0.3)
        done.set()
        await prober
    return [c for c, _ in results], sum(h for _, h in results), probes
