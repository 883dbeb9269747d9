"""One default sampling story: a request's unset temperature / top_p / top_k come from the
checkpoint's generation_config.json (when it sets do_sample), else greedy, in ``LLM.generate``,
the HTTP request models and the gRPC request translation alike."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.checkpoint.model import generation_config
from jaxmoe.server import openai_protocol as protocol
from jaxmoe.server.grpc_service import sampling_from_proto
from jaxmoe.server.proto import jaxmoe_pb2 as pb


@pytest.fixture(scope="module")
def sampled_dir(checkpoint_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(checkpoint_dir("mixtral"), d)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.8}))
    return d


def test_generation_config_fills_every_front_end(sampled_dir, tmp_path):
    want = {"temperature": 0.6, "top_p": 0.8}
    assert generation_config(sampled_dir) == want
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_config(tmp_path) == {} == generation_config("tiny-random")

    http = protocol.CompletionRequest(prompt="hi").to_sampling(want)
    assert (http.temperature, http.top_p) == (0.6, 0.8)
    assert protocol.CompletionRequest(prompt="hi", temperature=0).to_sampling(want).temperature == 0
    chat = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling(9, want)
    assert chat.temperature == 0.6
    assert protocol.CompletionRequest(prompt="hi").to_sampling({}).temperature == 0.0  # greedy

    grpc_s = sampling_from_proto(pb.SamplingParams(), want)
    assert (grpc_s.temperature, grpc_s.top_p) == (0.6, 0.8)
    explicit = pb.SamplingParams()
    explicit.temperature = 0.0
    assert sampling_from_proto(explicit, want).temperature == 0.0
    assert sampling_from_proto(pb.SamplingParams()).temperature == 0.0


@pytest.mark.slow
def test_llm_uses_the_generation_config_when_given_no_sampling_params(sampled_dir):
    llm = LLM(sampled_dir, num_blocks=32, block_size=8, max_num_seqs=2)
    assert llm.engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.8}
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.8)
    greedy = LLM("tiny-random", num_blocks=32, block_size=8, max_num_seqs=2)
    assert greedy.get_default_sampling_params().temperature == 0.0
    out = greedy.generate("abc")[0]  # no SamplingParams: greedy, the SamplingParams default max_tokens
    assert out.token_ids == greedy.generate("abc", SamplingParams())[0].token_ids
