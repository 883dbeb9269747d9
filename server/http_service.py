"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions`` (one prompt or a list of them, one choice each) and
``POST /v1/chat/completions`` (both with ``"stream": true`` as server-sent events ending in
``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, vLLM's
``POST /tokenize`` / ``POST /detokenize`` / ``GET /version``, the Prometheus
``GET /metrics`` and the OpenAPI schema ``GET /openapi.json`` (generated from the request models).
Request bodies are validated by strict pydantic models (``jaxmoe.server.openai_protocol``).
Structured output (``response_format``, vLLM's ``guided_*``) and chat's ``tools`` / ``tool_choice``:
``openai_protocol`` and ``tool_calls``.
Extension: ``"priority": "ls" | "be"`` in the body, or an ``X-Priority`` header (the body wins);
``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``cache_salt`` (requests share cached prefix KV only
with requests of the same salt) as in vLLM; ``usage.prompt_tokens_details.cached_tokens`` counts the
prompt tokens read from the prefix cache.

Every error is OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``
(``jaxmoe.server.http_errors``): 400 bad input (``param`` names the field), 404 unknown model
(``model_not_found``) or path, 408 / 413 / 415 from the body guard (``jaxmoe.server.http_body``),
429 waiting queue full, 503 shutting down, 504 the server's request deadline passed, 500 engine
failure. A client that disconnects mid-request has its request aborted in the engine.

A route is one method registered in ``OpenAIServer.app``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.middleware import Middleware

from jaxmoe.engine.async_engine import EngineClosedError, EngineStepError, RequestTimeoutError
from jaxmoe.engine.outputs import RequestOutput
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.engine.sequence import Priority
from jaxmoe.sampling import SamplingParamsError
from jaxmoe.server import admin
from jaxmoe.server import openai_protocol as protocol
from jaxmoe.server.http_body import BodyGuard
from jaxmoe.server.http_errors import ApiError, ErrorResponse, bad, error_response, install_error_handlers
from jaxmoe.server.http_parse import OFF_LOOP_BYTES, OffLoopBodyRoute
from jaxmoe.server.layout import current_layout
from jaxmoe.server.prompts import PromptPreparer, PromptTooLong, ToolsNotRendered
from jaxmoe.server.openai_format import ChatFormat, CompletionFormat, merge_final, total_usage
from jaxmoe.server.request_log import log_request

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # the Retry-After of a 429 (the waiting queue is full)

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 408, 413, 415, 421, 429, 500, 503, 504)}
STREAMED = {**ERRORS, 200: {"content": {"application/json": {}, "text/event-stream": {}}}}


def _priority(request: Request, body_priority: str | None) -> Priority:
    value = body_priority if body_priority is not None else request.headers.get("X-Priority", "be")
    try:
        return Priority.parse(value)
    except ValueError as e:
        raise bad(str(e), "priority") from None


class OpenAIServer:
    def __init__(
        self,
        async_engine,
        model_name: str,
        metrics=None,
        ready=lambda: True,
        max_body_bytes: int = 4 << 20,
        body_read_timeout_s: float = 30.0,
        prompts: PromptPreparer | None = None,
    ):
        self.engine = async_engine
        self.prompts = prompts or PromptPreparer(async_engine.engine)  # tokenization off the loop
        self.model_name = model_name
        self.metrics = metrics
        self.ready = ready  # False until warmed up and while shutting down
        self.tokenizer = async_engine.engine.tokenizer
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s

    def app(self, *guards: Middleware) -> FastAPI:
        """The ASGI app; ``guards`` run before everything (``jaxmoe.server.security.HttpGuard``),
        then the body guard, then the routes."""
        body = Middleware(BodyGuard, max_body_bytes=self.max_body_bytes, body_read_timeout_s=self.body_read_timeout_s)
        app = FastAPI(
            title="jaxmoe OpenAI-compatible API",
            version="1",
            docs_url=None,
            redoc_url=None,
            middleware=[*guards, body],
        )
        app.router.route_class = OffLoopBodyRoute  # large bodies are parsed and validated off the loop
        install_error_handlers(app, on_invalid=lambda: self._reject(400))
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], responses=STREAMED)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], responses=STREAMED)
        app.add_api_route("/v1/models", self.models, methods=["GET"], responses=ERRORS)
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"], responses=ERRORS)
        app.add_api_route("/health", self.health, methods=["GET"], responses=ERRORS)
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"], responses=ERRORS)
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"], responses=ERRORS)
        app.add_api_route("/version", self.version, methods=["GET"], responses=ERRORS)
        app.add_api_route("/admin/rescale", self.admin_rescale, methods=["POST"], responses=ERRORS)
        app.add_api_route("/admin/united_experts", self.admin_united_experts, methods=["POST"], responses=ERRORS)
        app.add_api_route(
            "/metrics", self.prometheus, methods=["GET"], responses={**ERRORS, 200: {"content": {"text/plain": {}}}}
        )
        return app

    # -- simple endpoints ------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxmoe",
            "max_model_len": self.engine.engine.max_model_len,
            **_layout_fields(self.engine.engine),
        }

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self._model_card()

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"The model {name!r} does not exist (this server serves {self.model_name!r})",
                "invalid_request_error",
                "model_not_found",
                "model",
            )

    def health_answer(self) -> tuple[int, dict]:
        ok = self.ready() and self.engine.running
        return (200, {"status": "ok"}) if ok else (503, {"status": "unavailable"})

    async def health(self) -> JSONResponse:
        status, body = self.health_answer()
        return JSONResponse(body, status_code=status)

    async def tokenize(self, body: protocol.TokenizeRequest) -> dict:
        """Token ids of a prompt, or of chat messages through the chat template (vLLM's ``/tokenize``);
        text longer than any prompt may be is refused by its length, the rest tokenized off the loop."""
        self._check_model(body.model)
        if body.messages is not None:
            messages = [
                {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
            ]
            chars, param = sum(len(m["content"]) for m in messages), "messages"
        else:
            chars, param = len(body.prompt), "prompt"
        try:
            self.prompts.check_chars(chars, param)
        except PromptTooLong as e:
            raise bad(str(e), e.param) from None

        def tokenize() -> list[int]:
            text = body.prompt
            if body.messages is not None:
                try:
                    text = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=body.add_generation_prompt
                    )
                except (ValueError, TemplateError) as e:
                    raise bad(str(e), "messages") from None
            return self.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

        tokens = await self.prompts.run(tokenize)
        return {"count": len(tokens), "max_model_len": self.engine.engine.max_model_len, "tokens": tokens}

    async def detokenize(self, body: protocol.DetokenizeRequest) -> dict:
        """The text of token ids (vLLM's ``/detokenize``, decoded off the loop); 400 naming an id
        outside the vocabulary."""
        self._check_model(body.model)
        vocab = self.engine.engine.cfg.vocab_size
        for i, t in enumerate(body.tokens):
            if t >= vocab:
                raise bad(f"tokens.{i}: token id {t} is outside the vocabulary [0, {vocab})", f"tokens.{i}")
        return {"prompt": await self.prompts.run(self.tokenizer.decode, body.tokens)}

    async def version(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"version": version("jaxmoe")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    async def admin_rescale(self, body: admin.RescaleRequest) -> dict:
        """Live re-scaling (``server.admin.rescale``): answers once the new layout serves, with the
        stall it caused; behind the API key like every route."""
        try:
            return await asyncio.to_thread(admin.rescale, self.engine, body.model_dump(exclude_none=True))
        except admin.AdminError as e:
            kind = "invalid_request_error" if e.http_status < 500 else "server_error"
            code = {409: "rescale_in_progress", 503: "unavailable", 504: "timeout"}.get(
                e.http_status, "invalid_argument"
            )
            raise ApiError(e.http_status, str(e), kind, code) from None

    async def admin_united_experts(self, body: admin.UnitedExpertsRequest) -> dict:
        """BrownoutServe's Experts Loader (``server.admin.load_united_experts``): answers once the new
        united experts serve; behind the API key like every route."""
        try:
            return await asyncio.to_thread(admin.load_united_experts, self.engine, body.model_dump())
        except admin.AdminError as e:
            kind = "invalid_request_error" if e.http_status < 500 else "server_error"
            code = "timeout" if e.http_status == 504 else "invalid_argument"
            raise ApiError(e.http_status, str(e), kind, code) from None

    async def prometheus(self) -> Response:
        if self.metrics is None:
            raise ApiError(404, "metrics are off", "invalid_request_error", "not_found")
        return Response(self.metrics.render(), media_type="text/plain; charset=utf-8")

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, body: protocol.CompletionRequest, request: Request) -> Response:
        return await self._generate(request, body, chat=False)

    async def chat_completions(self, body: protocol.ChatCompletionRequest, request: Request) -> Response:
        return await self._generate(request, body, chat=True)

    def _reject(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.reject({400: "invalid", 429: "overloaded"}.get(status, "unavailable"))

    async def _prepare(self, req, chat: bool, big: bool = False):
        """(prompts as token ids, SamplingParams); raises ApiError (400 naming the field, 404 model).
        Prompts are checked by length first, then tokenized off the event loop (``PromptPreparer``);
        the rest of a ``big`` request's checks (and any request's grammar check: structured output,
        tools) run in a worker thread too."""
        self._check_model(req.model)
        try:
            if big or req.structured() is not None or (chat and req.tool_mode is not None):
                sampling, inputs, tools, auto = await asyncio.to_thread(self._checked, req, chat)
            else:
                sampling, inputs, tools, auto = self._checked(req, chat)
            if chat:
                prompts = [await self.prompts.chat_ids(inputs, tools=tools, tools_must_show=auto)]
            else:
                prompts = [await self.prompts.prompt_ids(p, _prompt_param(inputs, i)) for i, p in enumerate(inputs)]
        except PromptTooLong as e:
            raise bad(str(e), e.param) from None
        except ToolsNotRendered as e:
            raise bad(str(e), "tool_choice") from None
        except SamplingParamsError as e:
            raise bad(str(e), e.param) from None
        except (ValueError, TemplateError) as e:  # chat template errors
            raise bad(str(e), "messages") from None
        return prompts, sampling

    def _checked(self, req, chat: bool):
        """(SamplingParams, the conversation or the prompts, rendered tools, whether they must show):
        every check that needs no tokenizer, prompts refused by length before any is tokenized."""
        engine = self.engine.engine
        if chat:
            sampling = req.to_sampling(engine.max_model_len, engine.sampling_defaults)
            mode = req.tool_mode
            conversation = req.conversation()
            self.prompts.check_chars(sum(len(m["content"]) for m in conversation), "messages")
            tools = mode.rendered() if mode is not None else None
            return sampling, conversation, tools, mode is not None and not mode.forced
        sampling = req.to_sampling(engine.sampling_defaults)
        texts = req.prompts()
        for i, p in enumerate(texts):
            if isinstance(p, str):
                self.prompts.check_chars(len(p), _prompt_param(texts, i))
        return sampling, texts, None, False

    async def _admit(self, prompts, sampling, priority, prefix: str, cache_salt: str | None = None) -> list:
        """One stream per prompt and completion (``sampling.num_sequences`` per prompt, prompt-major)."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                try:
                    for j in range(sampling.num_sequences):
                        rid = prefix + uuid.uuid4().hex
                        streams.append(
                            await self.engine.add_async(prompt, sampling.for_index(j), priority, rid, cache_salt)
                        )
                except SamplingParamsError as e:
                    raise bad(str(e), e.param) from None
                except ValueError as e:
                    raise bad(str(e), "prompt" if len(prompts) == 1 else f"prompt.{i}") from None
                except OverloadedError as e:
                    raise ApiError(429, f"server overloaded: {e}", "rate_limit_error", "overloaded") from None
                except EngineClosedError as e:
                    raise ApiError(503, str(e), "server_error", "unavailable") from None
        except ApiError:
            for st in streams:  # all or nothing
                self.engine.abort(st.request_id)
            raise
        return streams

    def _abort(self, streams) -> None:
        for st in streams:
            self.engine.abort(st.request_id)

    async def _generate(self, request: Request, req, chat: bool) -> Response:
        route = request.url.path
        try:
            big = int(request.headers.get("content-length") or 0) >= OFF_LOOP_BYTES
            prompts, sampling = await self._prepare(req, chat, big)
            priority = _priority(request, req.priority)
            streams = await self._admit(prompts, sampling, priority, "chatcmpl-" if chat else "cmpl-", req.cache_salt)
        except ApiError as e:
            self._reject(e.status)
            log_request(route, "-", e.status)
            return error_response(e, {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None)
        rid = streams[0].request_id
        fmts = [
            ChatFormat(self, rid, i, req.tool_mode) if chat else CompletionFormat(self, rid, i, echo=req.echo)
            for i in range(len(streams))
        ]
        per_prompt = sampling.num_sequences
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._events(streams, fmts, include_usage, per_prompt, route),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        finals = asyncio.ensure_future(asyncio.gather(*(_last(st) for st in streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({finals, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not finals.done():  # the client went away (or this handler was cancelled): free the slots
                finals.cancel()
                self._abort(streams)
        if not finals.done() or finals.cancelled():
            log.info("client disconnected from %s; aborted it", rid)
            log_request(route, rid, 499)
            return Response(status_code=499)
        try:
            body = merge_final(fmts, finals.result(), per_prompt, sampling.n)
            log_request(route, rid, 200, finals.result(), per_prompt)
            return JSONResponse(body)
        except EngineStepError as e:
            timeout = isinstance(e, RequestTimeoutError)
            log_request(route, rid, 504 if timeout else 500)
            return error_response(
                ApiError(504 if timeout else 500, str(e), "server_error", "timeout" if timeout else "internal_error")
            )

    async def _events(self, streams, fmts, include_usage: bool, per_prompt: int = 1, route: str = ""):
        """The SSE body; if it stops early (the client went away) the requests are aborted."""
        last: dict[int, RequestOutput] = {}
        done, status = False, 200
        try:
            try:
                for chunk in fmts[0].first_chunks():
                    yield _sse(chunk)
                async for i, out in _merged(streams):
                    last[i] = out
                    if (
                        out.delta_text
                        or out.finished
                        or (out.logprobs and out.delta_token_ids)
                        or _echo_ready(fmts[i], out)
                    ):
                        chunk = fmts[i].chunk(out)
                        if chunk is not None:  # None: held back (a tool call is sent whole at the end)
                            yield _sse(chunk)
            except EngineStepError as e:
                code = "timeout" if isinstance(e, RequestTimeoutError) else "internal_error"
                status = 504 if code == "timeout" else 500
                yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": code}})
            else:
                if include_usage and last:
                    yield _sse(fmts[0].usage_chunk(total_usage([last[i] for i in sorted(last)], per_prompt)))
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                log.info("client disconnected from %s; aborting it", streams[0].request_id)
                self._abort(streams)
                status = 499
            outs = [last.get(i) for i in range(len(streams))]
            log_request(route + " (stream)", streams[0].request_id, status, outs, per_prompt)


def _layout_fields(engine) -> dict:
    """The layout serving now (after a live rescale, the new one): attention / expert instances."""
    layout = current_layout(engine)
    if layout is None:
        return {}
    return {"attention_instances": layout[1], "expert_instances": layout[2], "layout": f"{layout[1]}a{layout[2]}e"}


def _prompt_param(prompts: list, i: int) -> str:
    return "prompt" if len(prompts) == 1 else f"prompt.{i}"


def _echo_ready(fmt, out: RequestOutput) -> bool:
    """A streamed echo waits for the first output that has tokens (and the prompt's logprobs)."""
    return fmt.pending and (out.prompt_logprobs is not None or bool(out.token_ids))


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body was read already: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
