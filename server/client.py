"""A small Python client for the jaxmoe gRPC API.

    with JaxmoeClient("127.0.0.1:50151") as c:
        for chunk in c.generate("Hello", max_tokens=16, priority="ls"):
            print(chunk.delta_text, end="")
        print(c.model_info())

``generate`` yields ``jaxmoe.v1.GenerateResponse`` messages (``delta_text``, ``delta_token_ids``,
``logprobs``, ``finish_reason`` and ``usage`` on the last one); errors are ``grpc.RpcError`` with
the server's status code. ``cancel()`` on the returned stream (or dropping it) cancels the request.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxmoe.server.proto import jaxmoe_pb2 as pb
from jaxmoe.server.proto import jaxmoe_pb2_grpc as pb_grpc


def make_request(
    prompt: str | list[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop=(),
    stop_token_ids=(),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    priority: str = "be",
    request_id: str = "",
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float | None = None,
    logit_bias: dict[int, float] | None = None,
    cache_salt: str | None = None,
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("seed", seed),
        ("logprobs", logprobs),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty),
        ("min_p", min_p),
    ):
        if value is not None:
            setattr(sampling, name, value)
    sampling.logit_bias.update(logit_bias or {})
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling, priority=priority)
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    return req


class JaxmoeClient:
    def __init__(self, target: str, channel: grpc.Channel | None = None, api_key: str | None = None):
        self.channel = channel or grpc.insecure_channel(target)
        self.stub = pb_grpc.JaxmoeStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def generate(self, prompt: str | list[int], timeout: float | None = None, **kwargs):
        """Stream of ``GenerateResponse``; keyword arguments as in ``make_request``. The returned
        object is also a ``grpc.Call``: ``.cancel()`` aborts the request on the server."""
        return self.stub.Generate(make_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    def complete(self, prompt: str | list[int], timeout: float | None = None, **kwargs) -> dict:
        """Run a request to the end: {"text", "token_ids", "finish_reason", "usage"}."""
        text, ids, last = [], [], None
        for chunk in self.generate(prompt, timeout=timeout, **kwargs):
            text.append(chunk.delta_text)
            ids.extend(chunk.delta_token_ids)
            last = chunk
        usage = {
            "prompt_tokens": last.usage.prompt_tokens,
            "completion_tokens": last.usage.completion_tokens,
            "total_tokens": last.usage.total_tokens,
            "cached_tokens": last.usage.cached_tokens,
        }
        return {"text": "".join(text), "token_ids": ids, "finish_reason": last.finish_reason, "usage": usage}

    def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def rescale(
        self, attention: int, experts: int, slots_per_instance: int | None = None, timeout: float | None = 600.0
    ) -> pb.RescaleResponse:
        """Live re-scaling (admin; the API key when the server has one): returns when the new layout serves."""
        req = pb.RescaleRequest(attention=attention, experts=experts, slots_per_instance=slots_per_instance)
        return self.stub.Rescale(req, timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        """ "SERVING" / "NOT_SERVING" (standard grpc.health.v1)."""
        resp = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "JaxmoeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
