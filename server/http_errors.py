"""OpenAI-style JSON errors for the HTTP front end: ``{"error": {"message", "type", "param",
"code"}}`` for every 4xx / 5xx, whether it comes from a handler (``ApiError``), from the request
body's pydantic validation (``param`` names the offending field), from routing (404 / 405) or from
an ASGI guard that answers before the app (``send_error``)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from jaxmoe.server import openai_protocol as protocol


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_argument", param)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    """Every error answer (the OpenAI API's shape)."""

    error: ErrorDetail


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


async def send_error(send, e: ApiError, headers: dict | None = None) -> None:
    """Answer with ``e`` from raw ASGI (a guard in front of the app)."""
    await error_response(e, headers)({"type": "http"}, None, send)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def validation_error(errors) -> ApiError:
    """The first pydantic error of a request body as a 400 naming its field."""
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        return bad("the body is not valid JSON")
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("model_attributes_type", "dict_type"):
        return bad("the body must be a JSON object sent as Content-Type: application/json")
    err = protocol.request_error([dict(first, loc=tuple(first.get("loc", ()))[1:])])  # drop "body"
    return bad(str(err), err.param)


def install_error_handlers(app: FastAPI, on_invalid=lambda: None) -> None:
    """JSON errors for everything the app can refuse; ``on_invalid()`` counts refused bodies."""

    @app.exception_handler(ApiError)
    async def _api(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        on_invalid()
        return error_response(validation_error(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = _HTTP_CODES.get(e.status_code, "invalid_argument" if e.status_code == 400 else "http_error")
        return error_response(ApiError(e.status_code, str(e.detail), kind, code), getattr(e, "headers", None))
