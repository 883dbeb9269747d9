"""``OffLoopBodyRoute``: FastAPI routes whose large JSON bodies are parsed and validated in a worker
thread, so that the event loop both front ends share only moves their bytes.

FastAPI parses (``json.loads``) and validates (pydantic) a route's body on the event loop: for a
body of megabytes that is tens of milliseconds in which no other request, stream or health check
is served. A body of ``OFF_LOOP_BYTES`` or more is parsed and validated here in a thread instead;
and parsed by pydantic-core's JSON parser (jiter) rather than ``json.loads``: a thread does not
free the loop from a parse that holds the GIL throughout, and ``json.loads`` holds it for tens of
milliseconds over a 2 MB string where jiter takes well under one (a body jiter refuses is parsed
again by ``json.loads``, so that values and errors stay exactly the standard library's);
FastAPI then gets the validated model, which it takes as it is (a model instance validates in
constant time), so the route, its OpenAPI schema and its error answers stay FastAPI's. Smaller
bodies take FastAPI's own path (a thread hop would cost more than the parse). The thread is one of
the loop's long-lived default executor's (``asyncio.to_thread``), not anyio's: anyio starts a worker
that ends with the request's task, so every large body started a thread, and the loop waits until a
new thread runs (1-2 ms of the loop per 2 MB refusal on the loaded 2-core machine, more under load).
"""

from __future__ import annotations

import asyncio
import json

import pydantic_core
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 64 << 10  # a body this large (bytes, decoded) is parsed and validated off the loop


def _json_content(content_type: str | None) -> bool:
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def parse_body(field, body: bytes):
    """The body as ``field``'s model; raises ``RequestValidationError`` as FastAPI would."""
    try:
        data = pydantic_core.from_json(body)
    except ValueError:  # not JSON as jiter reads it (or a lone surrogate, a BOM): json.loads's answer
        data = _stdlib_loads(body)
    value, errors = field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=data)
    return value


def _stdlib_loads(body: bytes):
    """``json.loads(body)``, its errors as FastAPI answers them."""
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([dict(error, ctx={"error": e.msg})], body=e.doc) from None
    except UnicodeDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.start), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([dict(error, ctx={"error": str(e)})]) from None
    except Exception:  # e.g. RecursionError (JSON nested too deep): FastAPI's own answer
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from None


class OffLoopBodyRoute(APIRoute):
    """An ``APIRoute`` (``FastAPI(route_class=...)``) that parses large JSON bodies in a thread."""

    def get_route_handler(self):
        on_loop = super().get_route_handler()
        field = self.body_field
        if field is None:
            return on_loop

        async def handler(request):
            body = await request.body()
            if len(body) >= OFF_LOOP_BYTES and _json_content(request.headers.get("content-type")):
                # FastAPI reads the parsed body from here (Request.json's cache)
                request._json = await asyncio.to_thread(parse_body, field, body)
            return await on_loop(request)

        return handler
