"""The OpenAI-compatible HTTP front end (aiohttp).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true``
as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and the
Prometheus ``GET /metrics``. Extension: ``"priority": "ls" | "be"`` in the body, or an
``X-Priority`` header (the body wins); ``top_k`` and ``ignore_eos`` are accepted too.

Errors are OpenAI-style ``{"error": {"message", "type", "code"}}``: 400 bad input, 429 waiting
queue full, 503 shutting down, 500 engine failure. A client that disconnects mid-request has its
request aborted in the engine.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from aiohttp import web

from jaxmoe.engine.async_engine import EngineClosedError, EngineStepError
from jaxmoe.engine.engine import RequestOutput
from jaxmoe.engine.sampler import SamplingParams
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.engine.sequence import Priority

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_argument")


def error_response(e: ApiError) -> web.Response:
    return web.json_response({"error": {"message": e.message, "type": e.type, "code": e.code}},
                             status=e.status)


def _sampling(body: dict, chat: bool) -> SamplingParams:
    if body.get("n", 1) != 1 or body.get("best_of", 1) not in (1, None):
        raise _bad("only n=1 is supported")
    if body.get("echo"):
        raise _bad("echo is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise _bad(f"{name} is not supported")
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens", 16)
    logprobs = None
    if chat:
        if body.get("logprobs"):
            logprobs = body.get("top_logprobs") or 0
    elif body.get("logprobs") is not None:
        logprobs = body["logprobs"]
    stop = body.get("stop") or ()
    kw = dict(max_tokens=max_tokens, temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
              top_k=body.get("top_k", 0), seed=body.get("seed"), stop=(stop,) if isinstance(stop, str) else stop,
              ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs)
    for name in ("temperature", "top_p"):
        if kw[name] is None:
            kw[name] = 1.0
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise _bad(str(e)) from None


def _priority(request: web.Request, body: dict) -> Priority:
    value = body.get("priority", request.headers.get("X-Priority", "be"))
    if not isinstance(value, str):
        raise _bad(f"priority must be 'ls' or 'be', got {value!r}")
    try:
        return Priority.parse(value)
    except ValueError as e:
        raise _bad(str(e)) from None


class OpenAIServer:
    def __init__(self, async_engine, model_name: str, metrics=None, ready=lambda: True):
        self.engine = async_engine
        self.model_name = model_name
        self.metrics = metrics
        self.ready = ready  # False until warmed up and while shutting down
        self.tokenizer = async_engine.engine.tokenizer

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # -- simple endpoints ------------------------------------------------------------------------
    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jaxmoe",
             "max_model_len": self.engine.engine.max_model_len}]})

    async def health(self, request):
        ok = self.ready() and self.engine.running
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def prometheus(self, request):
        if self.metrics is None:
            return web.Response(status=404)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request):
        return await self._generate(request, chat=True)

    async def _parse(self, request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _bad("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise _bad("messages must be a non-empty list of {role, content} objects with text content")
            prompt = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise _bad("prompt must be a string or a list of token ids (batches are not supported)")
            if not isinstance(prompt, (str, list)) or not prompt:
                raise _bad("prompt must be a non-empty string or list of token ids")
        return body, prompt, _sampling(body, chat), _priority(request, body)

    async def _generate(self, request: web.Request, chat: bool):
        try:
            body, prompt, sampling, priority = await self._parse(request, chat)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            try:
                stream = await self.engine.add_async(prompt, sampling, priority, rid)
            except ValueError as e:
                raise _bad(str(e)) from None
            except OverloadedError as e:
                raise ApiError(429, f"server overloaded: {e}", "rate_limit_error", "overloaded") from None
            except EngineClosedError as e:
                raise ApiError(503, str(e), "server_error", "unavailable") from None
        except ApiError as e:
            if self.metrics is not None:
                self.metrics.reject({400: "invalid", 429: "overloaded"}.get(e.status, "unavailable"))
            return error_response(e)
        fmt = _ChatFormat(self, rid, body) if chat else _CompletionFormat(self, rid, body)
        finished = False
        try:
            if body.get("stream"):
                resp = await self._stream(request, stream, fmt, body)
            else:
                last = None
                async for out in stream:
                    last = out
                if last is None:
                    raise EngineStepError("the request ended without output")
                resp = web.json_response(fmt.final(last))
            finished = True
            return resp
        except EngineStepError as e:
            finished = True
            return error_response(ApiError(500, str(e), "server_error", "internal_error"))
        finally:
            if not finished:  # client went away (handler cancelled, write failed): free the slot
                self.engine.abort(rid)

    async def _stream(self, request, stream, fmt, body) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            await self._stream_events(resp, stream, fmt, include_usage)
        except ConnectionResetError:  # the client went away: stop generating for it
            log.info("client disconnected from %s; aborting it", stream.request_id)
            self.engine.abort(stream.request_id)
        return resp

    async def _stream_events(self, resp, stream, fmt, include_usage: bool) -> None:
        last = None
        try:
            for chunk in fmt.first_chunks():
                await _sse(resp, chunk)
            async for out in stream:
                last = out
                if out.delta_text or out.finished or (out.logprobs and out.delta_token_ids):
                    await _sse(resp, fmt.chunk(out))
        except EngineStepError as e:
            await _sse(resp, {"error": {"message": str(e), "type": "server_error", "code": "internal_error"}})
        else:
            if include_usage and last is not None:
                await _sse(resp, fmt.usage_chunk(last))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


async def _sse(resp: web.StreamResponse, obj) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


class _CompletionFormat:
    """``text_completion`` objects."""

    def __init__(self, server: OpenAIServer, rid: str, body: dict):
        self.server, self.rid, self.created = server, rid, int(time.time())
        self.tok = server.tokenizer
        self.offset = 0

    def _base(self, choices, usage=None):
        obj = {"id": self.rid, "object": "text_completion", "created": self.created,
               "model": self.server.model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj

    def _logprobs(self, out: RequestOutput, new: bool):
        if out.logprobs is None:
            return None
        items = out.logprobs[len(out.token_ids) - len(out.delta_token_ids):] if new else out.logprobs
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in items:
            d["tokens"].append(self.tok.decode([lp.token_id]))
            d["token_logprobs"].append(lp.logprob)
            d["top_logprobs"].append({self.tok.decode([t]): v for t, v in lp.top})
            d["text_offset"].append(self.offset)
            self.offset += len(d["tokens"][-1])
        return d

    def first_chunks(self):
        return []

    def chunk(self, out: RequestOutput):
        return self._base([{"index": 0, "text": out.delta_text, "logprobs": self._logprobs(out, True),
                            "finish_reason": out.finish_reason if out.finished else None}])

    def usage_chunk(self, out: RequestOutput):
        return self._base([], out.usage)

    def final(self, out: RequestOutput):
        return self._base([{"index": 0, "text": out.text, "logprobs": self._logprobs(out, False),
                            "finish_reason": out.finish_reason}], out.usage)


class _ChatFormat:
    """``chat.completion`` / ``chat.completion.chunk`` objects."""

    def __init__(self, server: OpenAIServer, rid: str, body: dict):
        self.server, self.rid, self.created = server, rid, int(time.time())
        self.tok = server.tokenizer

    def _base(self, obj_type, choices, usage=None):
        obj = {"id": self.rid, "object": obj_type, "created": self.created,
               "model": self.server.model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj

    def _entry(self, token_id: int, logprob: float):
        text = self.tok.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, out: RequestOutput, new: bool):
        if out.logprobs is None:
            return None
        items = out.logprobs[len(out.token_ids) - len(out.delta_token_ids):] if new else out.logprobs
        return {"content": [dict(self._entry(lp.token_id, lp.logprob),
                                 top_logprobs=[self._entry(t, v) for t, v in lp.top]) for lp in items]}

    def first_chunks(self):
        return [self._base("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])]

    def chunk(self, out: RequestOutput):
        delta = {"content": out.delta_text} if out.delta_text else {}
        return self._base("chat.completion.chunk", [
            {"index": 0, "delta": delta, "logprobs": self._logprobs(out, True),
             "finish_reason": out.finish_reason if out.finished else None}])

    def usage_chunk(self, out: RequestOutput):
        return self._base("chat.completion.chunk", [], out.usage)

    def final(self, out: RequestOutput):
        return self._base("chat.completion", [
            {"index": 0, "message": {"role": "assistant", "content": out.text},
             "logprobs": self._logprobs(out, False), "finish_reason": out.finish_reason}], out.usage)
