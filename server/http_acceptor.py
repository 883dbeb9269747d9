"""``Acceptor``: the HTTP listening socket's own thread, which answers ``GET /health`` itself.

The event loop serves every request of both front ends; in a burst of a thousand connections one
of its iterations can take hundreds of milliseconds (the callbacks of every connection that became
ready, each waiting for the GIL behind the engine and tokenizer threads), and a ``/health`` answered
on the loop waits for it. This thread accepts every connection and waits for its first bytes
(``select``: no GIL held); a connection whose first bytes are exactly one complete ``GET /health``
request head (``health(headers)`` returns an answer) is answered here, and kept here while it only
asks for ``/health`` (a load balancer's kept-alive probe); any other connection goes to the event
loop with its bytes unread (``MSG_PEEK``), where uvicorn serves it as if it had accepted it. A thread
blocked in ``select`` needs the GIL only for the few hundred microseconds of an answer: on a loaded
2-core machine it woke within 92 ms during a 1,200-request burst while the loop lagged 460 ms.

The thread asks for a larger share of a core than the process's other threads (its niceness
``LISTENER_NICE`` below theirs, Linux: per thread) where the process may raise its priority (root or
``CAP_SYS_NICE``; elsewhere it stays as it is): on a loaded machine most of a slow ``/health`` was
this thread, woken, waiting for a core.

Connections held here that send nothing are closed after ``header_timeout_s`` (after
``keep_alive_timeout_s`` once answered), and at most ``max_open`` connections are open in all (held
here or on the loop): past that a new connection closes the longest-held one here.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time

import h11

HEAD_LIMIT = 8192  # bytes peeked: a /health request head is far shorter
ACCEPT_RETRY_S = 1.0  # out of file descriptors: accepting pauses this long (as asyncio's own server does)
LISTENER_NICE = -5  # this thread's niceness, relative to the process's, where it may raise its priority
log = logging.getLogger(__name__)


def health_head(data: bytes) -> dict[str, str] | None:
    """The headers of ``data`` when it is exactly one complete ``GET /health`` request head with no
    body (lower-case names); None for anything else."""
    if not data.startswith(b"GET /health HTTP/1.") or not data.endswith(b"\r\n\r\n") or len(data) > HEAD_LIMIT:
        return None
    lines = data[:-4].split(b"\r\n")
    if lines[0] not in (b"GET /health HTTP/1.1", b"GET /health HTTP/1.0"):
        return None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.decode("latin-1").lower()] = value.strip().decode("latin-1")
    if "content-length" in headers or "transfer-encoding" in headers or "upgrade" in headers:
        return None
    return headers


def large_body(data: bytes, threshold: int) -> bool:
    """Whether ``data`` starts with a complete request head (within ``HEAD_LIMIT``) whose body is
    ``threshold`` bytes or more by its ``Content-Length``, or of a length it does not declare (a
    ``Transfer-Encoding``). A head that is not complete, or not readable, is not large: the event
    loop answers it as it would."""
    end = data.find(b"\r\n\r\n", 0, HEAD_LIMIT)
    if end < 0:
        return False
    for line in data[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            value = value.strip()
            return value.isdigit() and int(value) >= threshold
    return False


def _raise_priority() -> int | None:
    """This thread ``LISTENER_NICE`` below the niceness it started with, if the process may raise its
    priority; returns the thread's niceness (None where niceness is not per thread or not known)."""
    try:
        tid = threading.get_native_id()
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + LISTENER_NICE)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (AttributeError, OSError):
        return None


class _Held:
    __slots__ = ("deadline",)

    def __init__(self, deadline: float):
        self.deadline = deadline  # closed then unless a request head arrives


class Acceptor:
    def __init__(
        self,
        sock: socket.socket,
        health,
        hand_off,
        loop_connections,
        header_timeout_s: float,
        keep_alive_timeout_s: float,
        max_open: int,
        hand_off_large=None,
        large_body_bytes: int | None = None,
    ):
        """``sock``: the listening socket. ``health(headers)``: (status, JSON body bytes) or None (the
        loop answers it). ``hand_off(sock)``: give a connection to the event loop (called on this
        thread); ``hand_off_large(sock)``: likewise, a connection whose first request has a body of
        ``large_body_bytes`` or more (None: every connection to ``hand_off``).
        ``loop_connections()``: how many connections the loops have open."""
        self.sock, self.health, self.hand_off, self.loop_connections = sock, health, hand_off, loop_connections
        self.hand_off_large = hand_off_large if large_body_bytes is not None else None
        self.large_body_bytes = large_body_bytes
        self.header_timeout_s, self.keep_alive_timeout_s, self.max_open = (
            header_timeout_s,
            keep_alive_timeout_s,
            max_open,
        )
        self.answered = 0  # /health requests answered here
        self.large = 0  # connections given to hand_off_large
        self.niceness: int | None = None  # this thread's, once it runs (None: not known on this system)
        self._held: collections.OrderedDict[socket.socket, _Held] = collections.OrderedDict()  # oldest first
        self._deadlines: list = []  # heap of (deadline, n, connection); stale entries skipped
        self._n = itertools.count()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._accept_paused_until: float | None = None
        self._thread = threading.Thread(target=self._run, name="jaxmoe-http-accept", daemon=True)

    @property
    def holding(self) -> int:
        """Connections held here (waiting for a first request head, or kept alive after /health)."""
        return len(self._held)

    def start(self) -> None:
        self.sock.setblocking(False)
        self._sel.register(self.sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting; close the listening socket and the connections held here."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10)

    def _run(self) -> None:
        self.niceness = _raise_priority()
        try:
            while not self._stopping:
                wake = [d for d in (self._deadlines[0][0] if self._deadlines else None, self._accept_paused_until) if d]
                timeout = max(0.0, min(wake) - time.monotonic()) if wake else None
                for key, _ in self._sel.select(timeout):
                    try:
                        if key.data == "listen":
                            self._accept()
                        elif key.data == "conn" and key.fileobj in self._held:
                            self._readable(key.fileobj)
                    except Exception:  # a bug here must not stop the server from accepting
                        log.exception("HTTP acceptor")
                        if key.data == "conn" and key.fileobj in self._held:
                            self._close(key.fileobj)
                now = time.monotonic()
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._sel.register(self.sock, selectors.EVENT_READ, "listen")
                while self._deadlines and self._deadlines[0][0] <= now:
                    deadline, _, conn = heapq.heappop(self._deadlines)
                    held = self._held.get(conn)
                    if held is not None and held.deadline == deadline:
                        self._close(conn)  # no (next) request head in time
        finally:
            for conn in list(self._held):
                self._close(conn)
            self._sel.close()
            self.sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(64):  # then the other ready sockets get their turn
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: the connection stays queued; retry later
                self._sel.unregister(self.sock)
                self._accept_paused_until = time.monotonic() + ACCEPT_RETRY_S
                return
            conn.setblocking(False)
            self._held[conn] = _Held(0.0)
            self._until(conn, time.monotonic() + self.header_timeout_s)
            self._sel.register(conn, selectors.EVENT_READ, "conn")
            while self._held and len(self._held) + self.loop_connections() > self.max_open:
                self._close(next(iter(self._held)))  # the longest held (perhaps this one)

    def _readable(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(HEAD_LIMIT + 1, socket.MSG_PEEK)
        except OSError:
            return self._close(conn)
        if not data:  # closed by the client
            return self._close(conn)
        headers = health_head(data)
        answer = self.health(headers) if headers is not None else None
        if not answer:  # not /health, or not answered here: a loop reads it
            large = self.hand_off_large is not None and large_body(data, self.large_body_bytes)
            return self._give(conn, large)
        parser = h11.Connection(h11.SERVER)  # one request; whether the connection stays open follows from it
        try:
            parser.receive_data(data)
            request, end = parser.next_event(), parser.next_event()
        except h11.RemoteProtocolError:  # e.g. HTTP/1.1 without a Host header: the loop answers it
            return self._give(conn)
        if not isinstance(request, h11.Request) or not isinstance(end, h11.EndOfMessage):
            return self._give(conn)
        status, body = answer
        headers_out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        events = (h11.Response(status_code=status, headers=headers_out), h11.Data(data=body), h11.EndOfMessage())
        out = b"".join(parser.send(event) for event in events)
        try:
            conn.recv(len(data))  # the head peeked above
            sent = conn.send(out)
        except OSError:
            sent = -1
        self.answered += 1
        if sent != len(out) or parser.our_state is h11.MUST_CLOSE:
            return self._close(conn)
        self._until(conn, time.monotonic() + self.keep_alive_timeout_s)

    def _until(self, conn: socket.socket, deadline: float) -> None:
        self._held[conn].deadline = deadline
        heapq.heappush(self._deadlines, (deadline, next(self._n), conn))

    def _give(self, conn: socket.socket, large: bool = False) -> None:
        self._sel.unregister(conn)
        del self._held[conn]
        if large:
            self.large += 1
            self.hand_off_large(conn)
        else:
            self.hand_off(conn)

    def _close(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        del self._held[conn]
        conn.close()
