"""The gRPC API takes the penalties, min-p and logit bias too (SamplingParams fields 10-14), checked
by the same validator as HTTP and the Python API."""

from __future__ import annotations

import grpc
import pytest

from jaxmoe import LLM
from jaxmoe.server.app import ServeOptions, ServerThread
from jaxmoe.server.client import JaxmoeClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client():
    llm = LLM("tiny-random", num_blocks=32, block_size=8, max_num_seqs=2)
    st = ServerThread(llm.engine, ServeOptions(model_name="tiny", warmup=False))
    server = st.start()
    with JaxmoeClient(server.grpc_target) as c:
        yield c
    st.stop(abort_inflight=True)


@pytest.mark.slow
def test_logit_bias_and_penalties_over_grpc(client):
    out = client.complete("Hello", max_tokens=3, temperature=0.0, logit_bias={ord("q"): 100.0}, timeout=120)
    assert out["text"] == "qqq"
    plain = client.complete("aaaa", max_tokens=12, temperature=0.0, ignore_eos=True, timeout=120)
    penalised = client.complete(
        "aaaa",
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        frequency_penalty=2.0,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        min_p=0.05,
        timeout=120,
    )
    assert len(set(penalised["text"])) > len(set(plain["text"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw, name",
    [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"min_p": 2.0}, "min_p"),
        ({"logit_bias": {5: 500.0}}, "logit_bias"),
    ],
)
def test_bad_values_are_invalid_argument_naming_the_field(client, kw, name):
    with pytest.raises(grpc.RpcError) as e:
        client.complete("hi", max_tokens=2, timeout=60, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in e.value.details()
