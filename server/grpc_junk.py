"""``UndecodableInterceptor``: request bytes that do not decode get INVALID_ARGUMENT from every gRPC
method, the standard health service and server reflection included.

grpcio answers a request whose deserializer raises with UNKNOWN (or INTERNAL). This interceptor
wraps every method's deserializer so that it never raises (it returns an ``_Undecodable`` marker)
and the method's behavior so that a marker, for a unary request or any message of a request
stream, ends the call with INVALID_ARGUMENT naming the decoding error.

It also keeps large messages off the event loop both front ends share: grpcio decodes a request on
that loop, so a message of ``OFF_LOOP_BYTES`` or more is only marked there (``_Deferred``) and
decoded in a worker thread before the method sees it; ``large_request()`` tells the method so (it
then reads the message's large fields off the loop too: the message keeps its bytes and makes a
new Python string at each access, 2 MB of text at a time).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect

import grpc

OFF_LOOP_BYTES = 64 << 10  # a request message this large is decoded in a worker thread
_LARGE = contextvars.ContextVar("jaxmoe_large_grpc_request", default=False)


def large_request() -> bool:
    """Whether the request of the method running now (its task) was ``OFF_LOOP_BYTES`` or more."""
    return _LARGE.get()


class _Undecodable:
    def __init__(self, error: Exception):
        self.error = f"{type(error).__name__}: {error}"


class _Deferred:
    """A large request's bytes, decoded later in a worker thread (``_decoded``)."""

    def __init__(self, data: bytes, deserialize):
        self.data, self.deserialize = data, deserialize


def _parse(deserialize, data: bytes):
    try:
        return deserialize(data)
    except Exception as e:
        return _Undecodable(e)


def _lenient(deserialize):
    def parse_or_mark(data: bytes):
        if data is not None and len(data) >= OFF_LOOP_BYTES:
            return _Deferred(data, deserialize)
        return _parse(deserialize, data)

    return parse_or_mark


async def _decoded(request):
    _LARGE.set(isinstance(request, _Deferred))
    if isinstance(request, _Deferred):
        return await asyncio.to_thread(_parse, request.deserialize, request.data)
    return request


async def _refuse(context, method: str, junk: _Undecodable):
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message for {method} ({junk.error})"
    )


class UndecodableInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        wrapped = {"request_deserializer": _lenient(handler.request_deserializer)}
        if handler.unary_unary is not None:
            wrapped["unary_unary"] = _unary_unary(handler.unary_unary, method)
        if handler.unary_stream is not None:
            wrapped["unary_stream"] = _unary_stream(handler.unary_stream, method)
        if handler.stream_unary is not None:
            wrapped["stream_unary"] = _stream_unary(handler.stream_unary, method)
        if handler.stream_stream is not None:
            wrapped["stream_stream"] = _stream_stream(handler.stream_stream, method)
        return handler._replace(**wrapped)


def _unary_unary(behavior, method):
    async def call(request, context):
        request = await _decoded(request)
        if isinstance(request, _Undecodable):
            await _refuse(context, method, request)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


async def _responses(result):
    """A streaming behavior's result: an async generator's items, or nothing (it wrote them itself)."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    elif inspect.isawaitable(result):
        await result
    else:  # a plain iterator
        for response in result:
            yield response


def _unary_stream(behavior, method):
    async def call(request, context):
        request = await _decoded(request)
        if isinstance(request, _Undecodable):
            await _refuse(context, method, request)
        async for response in _responses(behavior(request, context)):
            yield response

    return call


async def _checked(requests, context, method):
    async for request in requests:
        request = await _decoded(request)
        if isinstance(request, _Undecodable):
            await _refuse(context, method, request)
        yield request


def _stream_unary(behavior, method):
    async def call(requests, context):
        return await behavior(_checked(requests, context, method), context)

    return call


def _stream_stream(behavior, method):
    async def call(requests, context):
        async for response in _responses(behavior(_checked(requests, context, method), context)):
            yield response

    return call
