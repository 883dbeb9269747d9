"""Who may talk to the server: an optional API key (HTTP ``Authorization: Bearer`` and gRPC
``authorization`` metadata), a Host-header check against the bound address (DNS rebinding), and
cross-origin (browser) requests refused unless their origin is allowed.

``SecurityOptions`` is what ``jaxmoe serve`` configures (``--api-key`` / ``$JAXMOE_API_KEY``,
``--allowed-origins``, ``--allowed-hosts``, ``--protect-health``); ``HttpGuard`` (ASGI middleware)
and ``ApiKeyInterceptor`` apply it to each front end.
"""

from __future__ import annotations

import dataclasses
import hmac

import grpc

from jaxmoe.server.http_errors import ApiError, send_error

OPEN_PATHS = ("/health", "/metrics")
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."


@dataclasses.dataclass(frozen=True)
class SecurityOptions:
    api_key: str | None = None  # None: no key asked
    protect_health: bool = False  # True: /health and /metrics (and gRPC health) need the key too
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed ("*": any); none by default
    allowed_hosts: tuple[str, ...] | None = None  # Host header values allowed; None: the bound address only

    def key_ok(self, presented: str | None) -> bool:
        if self.api_key is None:
            return True
        if not presented or not presented.startswith("Bearer "):
            return False
        return hmac.compare_digest(presented[len("Bearer ") :].encode(), self.api_key.encode())

    def hosts_for(self, bind_host: str, port: int) -> set[str] | None:
        """Host header values accepted for a server bound to bind_host:port (None: any)."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else {h.lower() for h in self.allowed_hosts}
        if bind_host in ("0.0.0.0", "::", ""):
            return None  # bound to every interface: the operator names hosts with --allowed-hosts
        names = {bind_host}
        if bind_host in ("127.0.0.1", "::1", "localhost"):
            names |= {"127.0.0.1", "localhost", "[::1]"}
        return {n.lower() for n in names} | {f"{n}:{port}".lower() for n in names}


def _refused(status: int, message: str, code: str) -> ApiError:
    return ApiError(status, message, "invalid_request_error", code)


class HttpGuard:
    """ASGI middleware applying ``SecurityOptions`` before the app; ``port_of()`` gives the bound
    port (known once the server listens)."""

    def __init__(self, app, opts: SecurityOptions, bind_host: str, port_of):
        self.app, self.opts, self.bind_host, self.port_of = app, opts, bind_host, port_of

    def untouched(self, path: str, headers: dict[str, str]) -> bool:
        """Whether a request to ``path`` with these (lower-case) headers passes this guard unchanged:
        its Host is served here, it has no Origin, and it needs no key (or has the right one)."""
        hosts = self.opts.hosts_for(self.bind_host, self.port_of())
        if (hosts is not None and headers.get("host", "").lower() not in hosts) or "origin" in headers:
            return False
        return (not self.opts.protect_health and path in OPEN_PATHS) or self.opts.key_ok(headers.get("authorization"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts = self.opts
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        hosts = opts.hosts_for(self.bind_host, self.port_of())
        host = headers.get("host", "").lower()
        if hosts is not None and host not in hosts:
            return await send_error(send, _refused(421, f"Host {host!r} is not served here", "misdirected_request"))
        origin = headers.get("origin")
        if origin is not None and "*" not in opts.allowed_origins and origin not in opts.allowed_origins:
            return await send_error(
                send,
                _refused(
                    403,
                    f"cross-origin requests from {origin!r} are not allowed (see --allowed-origins)",
                    "origin_not_allowed",
                ),
            )
        if (opts.protect_health or scope["path"] not in OPEN_PATHS) and not opts.key_ok(headers.get("authorization")):
            return await send_error(
                send, _refused(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")
            )
        if origin is None:
            return await self.app(scope, receive, send)

        async def tell_the_browser(message):  # allowed: say so on the response
            if message["type"] == "http.response.start":
                extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                message = dict(message, headers=list(message.get("headers", [])) + extra)
            await send(message)

        await self.app(scope, receive, tell_the_browser)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs without ``authorization: Bearer <key>`` metadata (UNAUTHENTICATED); health and
    reflection stay open unless ``protect_health``."""

    MESSAGE = "missing or wrong API key (metadata authorization: Bearer <key>)"

    def __init__(self, opts: SecurityOptions):
        self.opts = opts

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.MESSAGE)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.MESSAGE)
            yield  # an async generator, as a streaming handler must be

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        method = details.method
        open_ = not self.opts.protect_health and (
            method.startswith(OPEN_GRPC_PREFIX) or method.startswith(REFLECTION_PREFIX)
        )
        if open_ or self.opts.key_ok(dict(details.invocation_metadata or ()).get("authorization")):
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
