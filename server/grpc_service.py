"""The gRPC front end (``jaxmoe.v1.Jaxmoe``): server-streaming ``Generate``, ``ModelInfo`` and the admin
``Rescale`` (live re-scaling, ``server.admin``; behind the API key like every RPC), plus
the standard health service and server reflection (so ``grpcurl`` works without the .proto).

Runs on ``grpc.aio`` (one event loop, shared with the HTTP front end); each ``Generate`` call admits
its request with ``AsyncEngine.add_async`` and streams the engine's outputs. Health and ModelInfo
answer under any load; RESOURCE_EXHAUSTED (waiting queue full) carries a ``retry-after-ms``
trailer and is counted in ``jaxmoe_requests_rejected_total``. Status codes: INVALID_ARGUMENT for bad input
(the message names the field), RESOURCE_EXHAUSTED when the waiting queue is full, UNAVAILABLE while
shutting down, DEADLINE_EXCEEDED when the server's request deadline passed, INTERNAL when the
engine failed the request. Unset sampling fields take the checkpoint's generation_config, else greedy (as over HTTP). A client cancel (or deadline) aborts
the request in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxmoe.engine.async_engine import EngineClosedError, EngineStepError, RequestTimeoutError
from jaxmoe.engine.outputs import RequestOutput
from jaxmoe.sampling import SamplingParams
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.engine.sequence import Priority
from jaxmoe.server import admin
from jaxmoe.server.proto import jaxmoe_pb2 as pb
from jaxmoe.server.proto import jaxmoe_pb2_grpc as pb_grpc
from jaxmoe.server.request_log import log_request
from jaxmoe.server.grpc_junk import UndecodableInterceptor, large_request
from jaxmoe.server.prompts import PromptPreparer
from jaxmoe.server.security import ApiKeyInterceptor, SecurityOptions

UNREQUESTED_CALL_WAIT_S = 600  # seconds a call may wait for the server to take it up
MAX_PENDING_CALLS = 16384  # calls that may wait so
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Jaxmoe"].full_name  # "jaxmoe.v1.Jaxmoe"


def sampling_from_proto(s: pb.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """The shared validator (``SamplingParams``: raises ``SamplingParamsError`` naming the field);
    unset fields take ``defaults`` (the checkpoint's generation_config: ``LLMEngine.sampling_defaults``)
    and otherwise ``SamplingParams``' own (greedy), as over HTTP."""
    kw = dict(defaults or {})
    kw.update(stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)
    if s.top_k:
        kw["top_k"] = s.top_k
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
    ):
        if s.HasField(name):
            kw[name] = getattr(s, name)
    if s.logit_bias:
        kw["logit_bias"] = dict(s.logit_bias)
    return SamplingParams(**kw)


def request_from_proto(req: pb.GenerateRequest, defaults: dict | None = None):
    """(prompt, SamplingParams, Priority); raises ValueError."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise ValueError("the request has no prompt (set text or token_ids)")
    prompt = req.text if which == "text" else list(req.token_ids.ids)
    if not prompt:
        raise ValueError("empty prompt")
    return prompt, sampling_from_proto(req.sampling, defaults), Priority.parse(req.priority or "be")


def output_to_proto(out: RequestOutput, tokenizer) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=out.request_id,
        delta_text=out.delta_text,
        delta_token_ids=out.delta_token_ids,
        finish_reason=out.finish_reason or "",
        priority=out.priority,
        usage=pb.Usage(**out.usage, cached_tokens=out.num_cached_tokens),
    )
    if out.logprobs is not None and out.delta_token_ids:
        for lp in out.logprobs[len(out.token_ids) - len(out.delta_token_ids) : len(out.token_ids)]:
            top = [pb.TopLogprob(token_id=t, token=tokenizer.decode([t]), logprob=v) for t, v in lp.top]
            resp.logprobs.append(
                pb.TokenLogprob(
                    token_id=lp.token_id, token=tokenizer.decode([lp.token_id]), logprob=lp.logprob, top=top
                )
            )
    if out.finished:
        if out.ttft is not None:
            resp.ttft_s = out.ttft
        if out.tpot is not None:
            resp.tpot_s = out.tpot
    return resp


class Undecodable:
    """A request whose bytes are not the message they should be (the servicer answers
    INVALID_ARGUMENT; grpcio would answer INTERNAL if the deserializer raised)."""

    def __init__(self, error: Exception):
        self.error = f"{type(error).__name__}: {error}"


def _lenient(parse):
    def parse_or_mark(data: bytes):
        try:
            return parse(data)
        except Exception as e:
            return Undecodable(e)

    return parse_or_mark


def add_servicer(servicer: "JaxmoeServicer", server) -> None:
    """``pb_grpc.add_JaxmoeServicer_to_server`` with deserializers that never raise."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest.FromString),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo,
            request_deserializer=_lenient(pb.ModelInfoRequest.FromString),
            response_serializer=pb.ModelInfoResponse.SerializeToString,
        ),
        "Rescale": grpc.unary_unary_rpc_method_handler(
            servicer.Rescale,
            request_deserializer=_lenient(pb.RescaleRequest.FromString),
            response_serializer=pb.RescaleResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class JaxmoeServicer(pb_grpc.JaxmoeServicer):
    """The ``jaxmoe.v1.Jaxmoe`` service on ``grpc.aio``: every RPC is a coroutine on the server's
    event loop, so health checks and ModelInfo answer under any number of open streams; how many
    streams may wait is the engine's admission (``--max-waiting``), not a thread pool's."""

    def __init__(self, async_engine, model_info, metrics=None, prompts=None):
        """``model_info``: the ``ModelInfoResponse``, or a function returning the current one."""
        self.engine = async_engine
        self.info = model_info
        self.metrics = metrics
        self.tokenizer = async_engine.engine.tokenizer
        self.prompts = prompts or PromptPreparer(async_engine.engine)  # tokenization off the loop

    async def _reject(self, context, code, reason: str, message: str, retry_after_s: float | None = None):
        if self.metrics is not None:
            self.metrics.reject(reason)
        if retry_after_s is not None:
            context.set_trailing_metadata((("retry-after-ms", str(int(retry_after_s * 1000))),))
        await context.abort(code, message)

    async def Generate(self, request, context):
        if isinstance(request, Undecodable):
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid",
                f"the request is not a GenerateRequest ({request.error})",
            )
        try:
            defaults = self.engine.engine.sampling_defaults
            if large_request():  # its prompt's text is made (2 MB: a millisecond and more) off the loop
                prompt, sampling, priority = await asyncio.to_thread(request_from_proto, request, defaults)
            else:
                prompt, sampling, priority = request_from_proto(request, defaults)
            prompt = await self.prompts.prompt_ids(prompt)  # refused by length first, then tokenized off the loop
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(e))
        rid = request.request_id or f"grpc-{uuid.uuid4().hex[:16]}"
        try:
            salt = request.cache_salt if request.HasField("cache_salt") else None
            if salt is not None and not salt:
                await self._reject(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", "cache_salt: must not be empty"
                )
            stream = await self.engine.add_async(prompt, sampling, priority, rid, salt)
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(e))
        except OverloadedError as e:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "overloaded",
                f"server overloaded: {e}; retry later",
                retry_after_s=1.0,
            )
        except EngineClosedError as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "unavailable", str(e))
        finished, last, status = False, None, "OK"
        try:
            async for out in stream:
                last = out
                yield output_to_proto(out, self.tokenizer)
            finished = True
        except RequestTimeoutError as e:
            finished, status = True, "DEADLINE_EXCEEDED"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except EngineStepError as e:
            finished, status = True, "INTERNAL"
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            if not finished:  # cancelled by the client (or its deadline): free the KV blocks
                status = "CANCELLED"
                self.engine.abort(rid)
            log_request("grpc Generate", rid, status, [last])

    async def ModelInfo(self, request, context):
        if isinstance(request, Undecodable):
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid",
                f"the request is not a ModelInfoRequest ({request.error})",
            )
        return self.info() if callable(self.info) else self.info

    async def Rescale(self, request, context):
        """Live re-scaling: answers when the new layout serves (``server.admin.rescale`` in a thread)."""
        if isinstance(request, Undecodable):
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid",
                f"the request is not a RescaleRequest ({request.error})",
            )
        payload = {"attention": request.attention, "experts": request.experts}
        if request.HasField("slots_per_instance"):
            payload["slots_per_instance"] = request.slots_per_instance
        try:
            result = await asyncio.to_thread(admin.rescale, self.engine, payload)
        except admin.AdminError as e:
            await context.abort(e.grpc_status, str(e))
        fields = pb.RescaleResponse.DESCRIPTOR.fields_by_name  # (first_step_calls, paused_s, ...: HTTP only)
        return pb.RescaleResponse(**{k: v for k, v in result.items() if v is not None and k in fields})


def build_grpc_server(
    async_engine,
    model_info,
    host: str,
    port: int,
    metrics=None,
    security: SecurityOptions | None = None,
    prompts=None,
):
    """A ``grpc.aio.Server`` bound to host:port (0 = pick), not started (``await server.start()``
    on the serving event loop). Returns (server, port, health). With an API key in ``security``,
    RPCs need ``authorization: Bearer <key>`` metadata."""
    interceptors = [ApiKeyInterceptor(security)] if security is not None and security.api_key else []
    interceptors.append(UndecodableInterceptor())  # junk bytes: INVALID_ARGUMENT from every method
    options = [
        # no SO_REUSEPORT: a port another server listens on is an error, not a silently shared port
        ("grpc.so_reuseport", 0),
        # grpc core drops calls that wait for the (busy) event loop to take them up once more than
        # max_pending_requests (default 1,000) wait, or after 30 s: in a burst of streams on one
        # channel that ended innocent calls. They wait their turn instead, and the engine's
        # admission answers them (RESOURCE_EXHAUSTED with a retry hint when the queue is full).
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_WAIT_S),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    add_servicer(JaxmoeServicer(async_engine, model_info, metrics, prompts), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        bound = server.add_insecure_port(f"{_host(host)}:{port}")
    except RuntimeError as e:  # grpcio raises RuntimeError for a port it cannot bind
        raise OSError(f"--grpc-port: cannot listen on {host}:{port}: {e}") from None
    if bound == 0:
        raise OSError(f"--grpc-port: cannot listen on {host}:{port}")
    return server, bound, health_servicer


async def set_serving(health_servicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
