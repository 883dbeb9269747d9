"""The OpenAI-compatible HTTP front end (aiohttp).

Endpoints: ``POST /v1/completions`` (one prompt or a list of them, one choice each) and
``POST /v1/chat/completions`` (both with ``"stream": true`` as server-sent events ending in
``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` and the Prometheus
``GET /metrics``. Request bodies are validated by strict pydantic models
(``jaxmoe.server.openai_protocol``). Extension: ``"priority": "ls" | "be"`` in the body, or an
``X-Priority`` header (the body wins); ``top_k``, ``stop_token_ids`` and ``ignore_eos`` as in vLLM.

Every error is OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 bad input
(``param`` names the field), 404 unknown model (``model_not_found``) or path, 413 body too large,
415 unknown Content-Encoding, 429 waiting queue full, 503 shutting down, 504 the server's request
deadline passed, 500 engine failure. A client that disconnects mid-request has its request
aborted in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from aiohttp import web
from jinja2 import TemplateError

from jaxmoe.engine.async_engine import EngineClosedError, EngineStepError, RequestTimeoutError
from jaxmoe.engine.outputs import RequestOutput
from jaxmoe.sampling import SamplingParamsError
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.engine.sequence import Priority
from jaxmoe.server import openai_protocol as protocol
from jaxmoe.server.openai_format import ChatFormat, CompletionFormat, merge_final, total_usage

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_argument", param)


def error_response(e: ApiError) -> web.Response:
    return web.json_response(
        {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}, status=e.status
    )


_HTTP_ERRORS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error answer is an OpenAI-style JSON object, never aiohttp's plain text."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return error_response(
            ApiError(
                e.status,
                e.reason if not e.text or e.text.startswith(str(e.status)) else e.text,
                kind,
                _HTTP_ERRORS.get(e.status, "http_error"),
            )
        )


def _priority(request: web.Request, body_priority: str | None) -> Priority:
    value = body_priority if body_priority is not None else request.headers.get("X-Priority", "be")
    try:
        return Priority.parse(value)
    except ValueError as e:
        raise _bad(str(e), "priority") from None


async def _read_json(request: web.Request):
    """The body as JSON, or a 4xx ApiError: bad encoding, bad compression, not JSON, too deep."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate", "br", ""):
        raise ApiError(
            415,
            f"Content-Encoding {encoding!r} is not supported",
            "invalid_request_error",
            "unsupported_media_type",
            "Content-Encoding",
        )
    timeout = request.app["body_read_timeout_s"]
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:  # a slow client must not hold the connection and its handler forever
        raise ApiError(
            408, f"the request body did not arrive within {timeout:g} s", "invalid_request_error", "request_timeout"
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413,
            f"request body larger than {request.app['max_body_bytes']} bytes",
            "invalid_request_error",
            "request_too_large",
        ) from None
    except Exception as e:  # undecodable compressed body (zlib / brotli errors)
        raise _bad(f"the body could not be decoded ({encoding}): {type(e).__name__}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _bad("the body is not valid JSON") from None
    except RecursionError:
        raise _bad("the body is nested too deeply") from None


class OpenAIServer:
    def __init__(
        self,
        async_engine,
        model_name: str,
        metrics=None,
        ready=lambda: True,
        max_body_bytes: int = 4 << 20,
        body_read_timeout_s: float = 30.0,
    ):
        self.engine = async_engine
        self.model_name = model_name
        self.metrics = metrics
        self.ready = ready  # False until warmed up and while shutting down
        self.tokenizer = async_engine.engine.tokenizer
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s

    def app(self, *guards) -> web.Application:
        """The aiohttp app; ``guards`` are middlewares run before everything (``jaxmoe.server.security``)."""
        app = web.Application(middlewares=[*guards, json_errors], client_max_size=self.max_body_bytes)
        app["max_body_bytes"] = self.max_body_bytes
        app["body_read_timeout_s"] = self.body_read_timeout_s
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # -- simple endpoints ------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxmoe",
            "max_model_len": self.engine.engine.max_model_len,
        }

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        self._check_model(request.match_info["model_id"])
        return web.json_response(self._model_card())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"The model {name!r} does not exist (this server serves {self.model_name!r})",
                "invalid_request_error",
                "model_not_found",
                "model",
            )

    async def health(self, request):
        ok = self.ready() and self.engine.running
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def prometheus(self, request):
        if self.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request):
        return await self._generate(request, chat=True)

    def _parse(self, body, chat: bool):
        """(request model, prompts, SamplingParams); raises ApiError (400 naming the field, 404 model)."""
        try:
            if chat:
                req = protocol.parse(protocol.ChatCompletionRequest, body)
                self._check_model(req.model)
                sampling = req.to_sampling(self.engine.engine.max_model_len)
                text = self.tokenizer.apply_chat_template(req.conversation(), add_generation_prompt=True)
                prompts = [self.tokenizer.encode(text)]
            else:
                req = protocol.parse(protocol.CompletionRequest, body)
                self._check_model(req.model)
                sampling = req.to_sampling()
                prompts = req.prompts()
        except protocol.RequestError as e:
            raise _bad(str(e), e.param) from None
        except SamplingParamsError as e:
            raise _bad(str(e), e.param) from None
        except (ValueError, TemplateError) as e:  # chat template errors
            raise _bad(str(e), "messages") from None
        return req, prompts, sampling

    async def _admit(self, prompts, sampling, priority, prefix: str) -> list:
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                rid = prefix + uuid.uuid4().hex
                try:
                    streams.append(await self.engine.add_async(prompt, sampling, priority, rid))
                except ValueError as e:
                    raise _bad(str(e), "prompt" if len(prompts) == 1 else f"prompt.{i}") from None
                except OverloadedError as e:
                    raise ApiError(429, f"server overloaded: {e}", "rate_limit_error", "overloaded") from None
                except EngineClosedError as e:
                    raise ApiError(503, str(e), "server_error", "unavailable") from None
        except ApiError:
            for st in streams:  # all or nothing
                self.engine.abort(st.request_id)
            raise
        return streams

    async def _generate(self, request: web.Request, chat: bool):
        try:
            body = await _read_json(request)
            req, prompts, sampling = self._parse(body, chat)
            priority = _priority(request, req.priority)
            streams = await self._admit(prompts, sampling, priority, "chatcmpl-" if chat else "cmpl-")
        except ApiError as e:
            if self.metrics is not None:
                self.metrics.reject({400: "invalid", 429: "overloaded"}.get(e.status, "unavailable"))
            return error_response(e)
        rid = streams[0].request_id
        fmts = [
            ChatFormat(self, rid, i) if chat else CompletionFormat(self, rid, i, echo=req.echo)
            for i in range(len(streams))
        ]
        finished = False
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                resp = await self._stream(request, streams, fmts, include_usage)
            else:
                finals = await asyncio.gather(*(_last(st) for st in streams))
                resp = web.json_response(merge_final(fmts, finals))
            finished = True
            return resp
        except EngineStepError as e:
            finished = True
            timeout = isinstance(e, RequestTimeoutError)
            return error_response(
                ApiError(504 if timeout else 500, str(e), "server_error", "timeout" if timeout else "internal_error")
            )
        finally:
            if not finished:  # client went away (handler cancelled, write failed): free the slots
                for st in streams:
                    self.engine.abort(st.request_id)

    async def _stream(self, request, streams, fmts, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._stream_events(resp, streams, fmts, include_usage)
        except ConnectionResetError:  # the client went away: stop generating for it
            log.info("client disconnected from %s; aborting it", streams[0].request_id)
            for st in streams:
                self.engine.abort(st.request_id)
        return resp

    async def _stream_events(self, resp, streams, fmts, include_usage: bool) -> None:
        last: dict[int, RequestOutput] = {}
        try:
            for chunk in fmts[0].first_chunks():
                await _sse(resp, chunk)
            async for i, out in _merged(streams):
                last[i] = out
                if out.delta_text or out.finished or (out.logprobs and out.delta_token_ids):
                    await _sse(resp, fmts[i].chunk(out))
        except EngineStepError as e:
            code = "timeout" if isinstance(e, RequestTimeoutError) else "internal_error"
            await _sse(resp, {"error": {"message": str(e), "type": "server_error", "param": None, "code": code}})
        else:
            if include_usage and last:
                await _sse(resp, fmts[0].usage_chunk(total_usage(last.values())))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


async def _last(stream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise EngineStepError("the request ended without output")
    return last


async def _merged(streams):
    """(index, output) from several request streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, st):
        try:
            async for out in st:
                await queue.put((i, out, None))
        except EngineStepError as e:
            await queue.put((i, None, e))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                done += 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _sse(resp: web.StreamResponse, obj) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
