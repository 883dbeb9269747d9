"""``BodyGuard``: the ASGI middleware that reads an HTTP request body before the app sees it.

It refuses an unknown ``Content-Encoding`` (415), a body over the size limit (413: at once when its
``Content-Length`` says so, else counted on the bytes received and on the bytes decompressed as they arrive, so a gzip bomb is never inflated past
the limit and, once it has all arrived, is answered at once; the rest of a too-large body still
being sent is read and dropped, within the read timeout and up to ``DRAIN_FACTOR`` times the
limit, so that the client reads the answer rather than a reset), a body that does not arrive within the read timeout (408, and the connection is closed:
a slow client cannot hold a handler) and a compressed body that does not decode (400), each as an
OpenAI-style JSON error. The app then gets the decoded body in one piece; what the client sends
later (its disconnect) still reaches the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib

from jaxmoe.server.http_errors import ApiError, bad, send_error

ENCODINGS = ("identity", "gzip", "deflate")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
DRAIN_FACTOR = 4  # a too-large body is read and dropped up to this many times the limit
_NO_BODY = ("GET", "HEAD", "OPTIONS", "DELETE")


class _TooLarge(Exception):
    def __init__(self, more_body: bool):
        super().__init__()
        self.more_body = more_body  # the client is still sending


class _Gone(Exception):
    pass


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes", "invalid_request_error", "request_too_large")


class BodyGuard:
    def __init__(self, app, max_body_bytes: int, body_read_timeout_s: float):
        self.app, self.limit, self.timeout = app, max_body_bytes, body_read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in _NO_BODY:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        encoding = headers.get("content-encoding", "identity").strip().lower() or "identity"
        if encoding not in ENCODINGS:
            return await send_error(
                send,
                ApiError(
                    415,
                    f"Content-Encoding {encoding!r} is not supported (one of {', '.join(ENCODINGS)})",
                    "invalid_request_error",
                    "unsupported_media_type",
                    "Content-Encoding",
                ),
                {"Connection": "close"},
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            declared = int(headers.get("content-length", "0"))
            if declared > self.limit:  # refused unread (what is sent is dropped only up to DRAIN_FACTOR x)
                raise _TooLarge(declared <= DRAIN_FACTOR * self.limit)
            body = await asyncio.wait_for(self._read(receive, encoding), self.timeout)
        except _TooLarge as e:
            # read (and drop) what the client is still sending, so that it reads the answer instead of
            # a reset connection: bounded by the read deadline and DRAIN_FACTOR times the limit; a body
            # that has all arrived is answered at once
            if e.more_body:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._drain(receive), max(0.0, deadline - loop.time()))
            return await send_error(send, _too_large(self.limit), {"Connection": "close"})
        except TimeoutError:
            err = ApiError(
                408,
                f"the request body did not arrive within {self.timeout:g} s",
                "invalid_request_error",
                "request_timeout",
            )
            return await send_error(send, err, {"Connection": "close"})
        except ValueError:  # Content-Length not a number
            return await send_error(send, bad("Content-Length is not a number", "Content-Length"))
        except ApiError as e:
            return await send_error(send, e)
        except _Gone:
            return
        kept = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")]
        scope = dict(scope, headers=kept + [(b"content-length", str(len(body)).encode())])
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, when the client goes away

        await self.app(scope, replay, send)

    async def _drain(self, receive) -> None:
        dropped = 0
        while dropped < DRAIN_FACTOR * self.limit:
            msg = await receive()
            dropped += len(msg.get("body", b""))
            if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                return

    async def _read(self, receive, encoding: str) -> bytes:
        """The body, decoded as it arrives: both the bytes received and the decoded bytes stop at the
        limit (``_TooLarge``), so a compressed bomb is never inflated past it."""
        inflate = zlib.decompressobj(_WBITS[encoding]) if encoding != "identity" else None
        chunks, received, size = [], 0, 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Gone()
            chunk, more = msg.get("body", b""), msg.get("more_body", False)
            received += len(chunk)
            if received > self.limit:
                raise _TooLarge(more)
            if inflate is not None and chunk:
                try:
                    chunk = inflate.decompress(chunk, self.limit + 1 - size)  # at most one byte past the limit
                except zlib.error as e:
                    raise bad(f"the body could not be decoded ({encoding}): {e}") from None
                if inflate.unconsumed_tail or size + len(chunk) > self.limit:
                    raise _TooLarge(more)
            size += len(chunk)
            chunks.append(chunk)
            if not more:
                if inflate is not None and not inflate.eof:
                    raise bad(f"the body could not be decoded ({encoding}): truncated")
                return b"".join(chunks)
