"""``HttpServer``: uvicorn serving an ASGI app on the caller's event loop (a task, no threads, no
signal handlers: ``jaxmoe serve`` owns SIGTERM / SIGINT and stops it through ``JaxmoeServer``).

Overload is answered by the application, as JSON: a request that arrives while more than
``max_connections`` connections are open (or requests in flight) gets a 429 with ``Retry-After``
(``ConnectionLimit``; uvicorn's own ``limit_concurrency`` would answer a plain-text 503, to
``/health`` too). ``/health`` has its own reserve: it is served whatever the load, by the listening socket's own
thread (``server/http_acceptor.py``: every connection is accepted there, a ``GET /health`` answered
there without the event loop, every other connection handed to the loop, its bytes unread), or,
on a connection the loop already serves, by the connection as its request head arrives
(``HttpServer(health=...)``: no ASGI task, so it does not queue behind the tasks of the requests
that arrived before it); and ``health_reserve`` connections past the limit stay open for it; past
those, a new connection closes the longest-held one waiting for its first request in the
acceptor, or on the loop the longest-idle kept-alive one (or, if every connection has a request
running, itself), so the process never runs out of file descriptors. New requests are taken up at most
``starts_per_tick`` per event-loop iteration (``_Pacer``; connections handed over likewise), so that a
burst does not make one iteration everything else waits behind. uvicorn's options set the rest:
``timeout_keep_alive`` (an idle kept-alive connection is closed), ``h11_max_incomplete_event_size``
(the largest request head), ``timeout_graceful_shutdown``. uvicorn has no timeout for a new
connection's request head, so the h11 protocol here adds one (``header_timeout_s``): a connection
that has not sent a complete request head by then (after it opened, or after its previous
response) is closed (slowloris); and its answer to a request that is not valid HTTP is the
OpenAI-style JSON error every other refusal has (uvicorn's own is plain text).

Large bodies are served apart: a connection whose first request head declares a body of
``large_body_bytes`` or more (or a chunked one) is handed by the acceptor to a second uvicorn server
on its own event loop and thread (``jaxmoe-http-large``), which serves the same app: its megabytes
are read from the socket, parsed by h11, guarded, validated and refused (or admitted: the engine
streams to whichever loop admitted a request) there, so the loop that runs the other streams, gRPC
and the rest of HTTP moves none of its bytes. The connection stays on that loop for its later
requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


from jaxmoe.server.http_acceptor import Acceptor, health_head
from jaxmoe.server.http_errors import ApiError, send_error

HEALTH_PATHS = ("/health",)  # served whatever the load


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 4096  # open connections or in-flight requests; a request beyond: JSON 429 (not /health)
    health_reserve: int = 256  # connections past max_connections kept for /health; past those an idle one closes
    keep_alive_timeout_s: int = 5  # uvicorn timeout_keep_alive
    header_timeout_s: float = 10.0  # a new connection's request head must arrive within this
    max_header_bytes: int = 64 << 10  # uvicorn h11_max_incomplete_event_size (the request head)
    shutdown_timeout_s: int = 5  # uvicorn timeout_graceful_shutdown, after the engine drained
    starts_per_tick: int | None = 8  # requests (and connections) taken up per event-loop iteration (None: all)
    listen_backlog: int = 2048  # connections the kernel queues before they are accepted
    large_body_bytes: int | None = 64 << 10  # a first request body this large: served by the second loop (None: not)


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol plus a request-head timeout: a connection whose next request head is
    not complete ``header_timeout_s`` after it opened, or after its previous response, is closed.

    ``/health`` is answered as its request head arrives, by ``health(headers)`` ((status, JSON
    body), or None to leave the request to the app): no ASGI task is made for it, so it does not
    wait for the loop to run the tasks of every request that arrived before it."""

    header_timeout_s = 10.0
    max_open = None  # connections at most (max_connections + health_reserve); None: no bound
    health = None  # headers -> (status, body bytes) | None
    pacer = None  # _Pacer: new requests per event-loop iteration (None: no bound)
    _waiting = False  # a request head that waits for its turn (pacer)

    def data_received(self, data: bytes) -> None:
        if self._idle() and self.conn.their_state is h11.IDLE:  # the start of a request
            if self.health is not None:
                headers = health_head(data)
                answer = headers is not None and self.health(headers)
                if answer and self._answer_at_once(data, *answer):
                    return
            if self.pacer is not None and not self.pacer.take():  # its turn comes in a later iteration
                self.transport.pause_reading()
                self._waiting = True  # its head has arrived: the head timer does not close it
                self.pacer.defer(lambda: self._resume(data))
                return
        super().data_received(data)

    def _resume(self, data: bytes) -> None:
        self._waiting = False
        if self.transport.is_closing():
            return
        self.transport.resume_reading()
        super().data_received(data)

    def _answer_at_once(self, data: bytes, status: int, body: bytes) -> bool:
        self._unset_keepalive_if_required()
        self.conn.receive_data(data)
        try:
            request, end = self.conn.next_event(), self.conn.next_event()
        except h11.RemoteProtocolError as e:  # e.g. HTTP/1.1 without a Host header
            self.send_400_response(f"Invalid HTTP request received: {e}")
            return True
        if not isinstance(request, h11.Request) or not isinstance(end, h11.EndOfMessage):
            self.transport.close()  # cannot happen for a head health_head took
            return True
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        if self.conn.our_state is h11.MUST_CLOSE:
            self.transport.close()
            return True
        self.on_response_complete()  # the next request on this connection, timed as any
        return True

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()
        self._opened = self.loop.time()
        if self.max_open is not None and len(self.connections) > self.max_open:
            self._make_room()

    def _idle(self) -> bool:
        """No request in progress: waiting for (the next) request head."""
        return self.cycle is None or self.cycle.response_complete

    def _make_room(self) -> None:
        """Past the hard bound: close the longest-idle other connection, or this one if none is idle."""
        idle = [c for c in self.connections if c is not self and c._idle() and not c.transport.is_closing()]
        victim = min(idle, key=lambda c: c._opened) if idle else self
        victim.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_cycle = self.cycle  # a new request head replaces it
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        waiting = self.cycle is self._head_cycle and (self.cycle is None or self.cycle.response_complete)
        if waiting and not self._waiting and not self.transport.is_closing():  # no new complete request head in time
            self.transport.close()

    def on_response_complete(self) -> None:
        self._head_timer.cancel()
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: the next request head is timed too
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request that is not valid HTTP (or whose head outgrew the limit): a JSON 400, then close."""
        error = {"message": msg, "type": "invalid_request_error", "param": None, "code": "invalid_http"}
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class _Pacer:
    """At most ``per_tick`` new requests start per event-loop iteration, in arrival order.

    asyncio runs, in one iteration, every callback that was ready when it began: the heads of a
    burst of N requests that arrive together would be parsed, and N handler tasks made (whose first
    steps -- parse, validate, route -- all run in the next iteration), while anything that becomes
    ready meanwhile -- a health probe, a stream's next token -- waits for all of them. A connection
    whose request head arrives when this iteration's ``per_tick`` turns are taken (or others
    wait) pauses reading and keeps the bytes; ``_tick`` hands them on, ``per_tick`` connections
    per iteration."""

    def __init__(self, per_tick: int):
        self.per_tick = per_tick
        self.used = 0  # turns taken in this iteration
        self._waiting: collections.deque = collections.deque()
        self._ticking = False

    def take(self) -> bool:
        """A turn now (True), or False: ``defer`` the work."""
        if self._waiting or self.used >= self.per_tick:
            return False
        self.used += 1
        self._schedule()
        return True

    def defer(self, fn) -> None:
        self._waiting.append(fn)
        self._schedule()

    def _schedule(self) -> None:
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_soon(self._tick)  # runs in the next iteration

    def _tick(self) -> None:
        self._ticking = False
        self.used = 0
        while self._waiting and self.used < self.per_tick:
            self.used += 1
            self._waiting.popleft()()
        if self._waiting or self.used:
            self._schedule()


class ConnectionLimit:
    """ASGI middleware: a request that arrives while ``load()`` (open connections or requests in
    flight) exceeds ``limit`` is answered with a JSON 429 and ``Retry-After``, counted by
    ``on_refuse()``; ``HEALTH_PATHS`` are always served."""

    def __init__(self, app, limit: int, load, on_refuse=None, retry_after_s: int = 1):
        self.app, self.limit, self.load, self.on_refuse, self.retry_after_s = app, limit, load, on_refuse, retry_after_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            return await self.app(scope, receive, send)
        if self.load() > self.limit:
            if self.on_refuse is not None:
                self.on_refuse()
            error = ApiError(
                429,
                f"server overloaded: more than {self.limit} HTTP connections or requests in flight; retry later",
                "rate_limit_error",
                "overloaded",
            )
            return await send_error(send, error, {"Retry-After": str(self.retry_after_s)})
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn's server, with connections accepted by an ``Acceptor`` thread (which answers
    ``/health`` itself) instead of ``loop.create_server`` (its own, or, for the second loop's server,
    the first one's: ``_hand_off``); the loop takes up at most ``per_tick`` handed-off connections
    per iteration."""

    acceptor_of = None  # hand_off -> Acceptor (HttpServer sets it); None: connections come from another's
    per_tick: int | None = None
    acceptor = None

    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the CLI owns SIGINT / SIGTERM

    async def startup(self, sockets=None) -> None:
        await self.lifespan.startup()
        loop = asyncio.get_running_loop()
        config = self.config

        def create_protocol():
            return config.http_protocol_class(
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop
            )

        self.servers = []  # nothing for uvicorn's shutdown to close: the acceptor owns the socket
        self._loop, self._create_protocol = loop, create_protocol
        self._handed: collections.deque = collections.deque()
        self._handed_lock = threading.Lock()
        self._draining = False
        if self.acceptor_of is not None:
            self.acceptor = self.acceptor_of(self._hand_off)
            self.acceptor.start()
        self.started = True

    def _hand_off(self, sock: socket.socket) -> None:
        """(the acceptor's thread) A connection for the loop, its bytes unread."""
        with self._handed_lock:
            self._handed.append(sock)
            if self._draining:
                return
            self._draining = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            sock.close()

    def _drain(self) -> None:
        with self._handed_lock:
            n = len(self._handed) if self.per_tick is None else min(self.per_tick, len(self._handed))
            socks = [self._handed.popleft() for _ in range(n)]
            more = bool(self._handed)
            self._draining = more
        for sock in socks:
            if self.should_exit:
                sock.close()
            else:
                asyncio.ensure_future(self._adopt(sock))
        if more:
            self._loop.call_soon(self._drain)  # the rest in the next iteration

    async def _adopt(self, sock: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._create_protocol, sock)
        except OSError:
            sock.close()

    async def shutdown(self, sockets=None) -> None:
        if self.acceptor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.acceptor.stop)
        with self._handed_lock:
            while self._handed:
                self._handed.popleft().close()
        await super().shutdown(sockets)


class HttpServer:
    def __init__(self, app, host: str, port: int, limits: HttpLimits = HttpLimits(), on_refuse=None, health=None):
        """``on_refuse()``: called for each request refused by the connection limit (metrics).
        ``health(headers)``: (status, JSON body) of a ``GET /health``, answered as it arrives, or
        None to leave it to the app (its answer must equal the app's)."""
        self._backlog = limits.listen_backlog
        app = ConnectionLimit(app, limits.max_connections, self._load, on_refuse)
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._sock = socket.socket(family, kind, proto)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(addr)
        except OSError as e:
            self._sock.close()
            raise OSError(f"--http-port: cannot listen on {host}:{port}: {e.strerror}") from None
        self.port = self._sock.getsockname()[1]
        self._server = _Server(_config(app, limits, health, paced=True))
        self._server.per_tick = limits.starts_per_tick
        # the connections whose first request has a large body: a second server, on its own loop
        self._large = _Server(_config(app, limits, health, paced=False)) if limits.large_body_bytes else None
        self._large_thread: threading.Thread | None = None
        self._server.acceptor_of = lambda hand_off: Acceptor(
            self._sock,
            health if health is not None else lambda headers: None,
            hand_off,
            self._loop_connections,
            limits.header_timeout_s,
            limits.keep_alive_timeout_s,
            limits.max_connections + limits.health_reserve,
            hand_off_large=self._large._hand_off if self._large is not None else None,
            large_body_bytes=limits.large_body_bytes,
        )
        self._task: asyncio.Task | None = None

    def _servers(self) -> list:
        return [s for s in (self._server, self._large) if s is not None and s.started]

    def _loop_connections(self) -> int:
        return sum(len(s.server_state.connections) for s in self._servers())

    def _load(self) -> int:
        held = self._server.acceptor.holding if self._server.started else 0  # not yet handed to a loop
        tasks = sum(len(s.server_state.tasks) for s in self._servers())
        return max(self._loop_connections() + held, tasks)

    @property
    def health_answered_apart(self) -> int:
        """``/health`` requests answered by the acceptor thread (not on the event loop)."""
        return self._server.acceptor.answered if self._server.started else 0

    @property
    def large_bodies_apart(self) -> int:
        """Connections handed to the second loop because their first request's body is large."""
        return self._server.acceptor.large if self._server.started else 0

    async def start(self) -> None:
        if self._large is not None:  # before any connection can be handed to it
            self._large_thread = threading.Thread(
                target=asyncio.run, args=(self._large.serve(),), name="jaxmoe-http-large", daemon=True
            )
            self._large_thread.start()
            while not self._large.started:
                if not self._large_thread.is_alive():
                    raise RuntimeError("the HTTP server for large bodies stopped during startup")
                await asyncio.sleep(0.01)
        self._sock.listen(self._backlog)  # the kernel's queue of connections not yet accepted
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise it
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop listening, let open responses finish (up to ``shutdown_timeout_s``), close."""
        if self._large is not None:  # both shut down together (a late hand-off to it is closed)
            self._large.should_exit = True
        if self._task is None:
            self._sock.close()
        else:
            self._server.should_exit = True
            await self._task
        if self._large_thread is not None:
            await asyncio.to_thread(self._large_thread.join, 30)


def _config(app, limits: HttpLimits, health, paced: bool) -> uvicorn.Config:
    """uvicorn's configuration of one of the two servers (each loop its own protocol class: the
    pacer works on the loop it runs on)."""
    protocol = type(
        "H11",
        (_HeaderTimeoutH11,),
        {
            "header_timeout_s": limits.header_timeout_s,
            "max_open": limits.max_connections + limits.health_reserve,
            "health": staticmethod(health) if health is not None else None,
            "pacer": _Pacer(limits.starts_per_tick) if paced and limits.starts_per_tick else None,
        },
    )
    return uvicorn.Config(
        app,
        http=protocol,
        lifespan="off",
        log_config=None,
        access_log=False,
        limit_concurrency=None,  # ConnectionLimit answers overload (JSON 429, /health served)
        timeout_keep_alive=limits.keep_alive_timeout_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_graceful_shutdown=limits.shutdown_timeout_s,
        backlog=limits.listen_backlog,
    )
