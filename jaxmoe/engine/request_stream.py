"""A request's stream of outputs across threads (``RequestStream``) and the errors that end one.

The ``AsyncEngine`` loop thread puts outputs (and at the end ``END`` or an exception) into the
stream; the consumer reads them from any thread (``for``) or from an asyncio loop (``async for``).
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

from jaxmoe.engine.outputs import RequestOutput

END = object()


class EngineClosedError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in it; the request was ended."""


class RequestTimeoutError(EngineStepError):
    """The request was still running when the server's request deadline passed; it was ended."""


class RequestStream:
    """The outputs of one request. Iterate it synchronously (``for out in stream``) or, when made by
    ``add_async``, asynchronously (``async for out in stream``). Raises ``EngineStepError`` if the
    request failed inside the engine."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._queue: Any = asyncio.Queue() if loop is not None else queue.Queue()
        self.finished = False

    def put(self, item) -> None:  # called by the loop thread
        if self._loop is None:
            self._queue.put(item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                pass

    def _unwrap(self, item):
        if item is END:
            self.finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """Next output (blocking); None on timeout; StopIteration after the last one."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        return self._unwrap(item)

    def __iter__(self):
        if self._loop is not None:
            raise TypeError("a stream made by add_async is iterated with `async for`")
        while True:
            try:
                yield self.get()
            except StopIteration:
                return

    def __aiter__(self):
        if self._loop is None:
            raise TypeError("a stream made by add() is iterated with `for`")
        return self

    async def __anext__(self) -> RequestOutput:
        item = await self._queue.get()
        try:
            return self._unwrap(item)
        except StopIteration:
            raise StopAsyncIteration from None
