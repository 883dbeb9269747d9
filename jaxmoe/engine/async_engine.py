"""``AsyncEngine``: one background thread runs the ``LLMEngine`` step loop; any thread submits.

The loop thread is the only one that touches the engine. Other threads talk to it through a
command queue that the loop drains between steps:

* ``add(...)`` (blocking, for thread pools such as gRPC's) or ``await add_async(...)`` (asyncio)
  admits a request and returns a :class:`RequestStream` of ``RequestOutput`` objects, one per step
  that touched the request, the last with ``finished=True``. Admission errors are raised to the
  caller: ``ValueError`` (bad input), ``OverloadedError`` (waiting queue full),
  ``EngineClosedError`` (shutting down). An accepted request always ends its stream: finished,
  aborted (``finish_reason="abort"``) or with an :class:`EngineStepError`.
* ``abort(request_id)`` (any thread, done before the next step) frees the KV blocks and ends the
  stream with ``finish_reason="abort"``.
* An exception inside ``step()`` fails the requests of that step only (``EngineStepError``); the
  loop keeps serving the others (re-allocating the KV cache if the failed program took it).
* ``shutdown(abort_inflight)``; ``snapshot()``: statistics published after every step (metrics);
  ``call(fn)`` runs ``fn(engine)`` on the loop.
* Multi-host (``leader``: a ``replication.Leader``, process 0 of a ``jax.distributed`` cluster): the
  requests admitted and aborted, each step and each ``call(..., replicate=fn)`` reach the other
  processes before they run here (``engine/replication.py``); when a process is gone every request
  ends with ``ClusterFailedError``, the loop stops and ``on_cluster_failure(reason)`` is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable

from jaxmoe.compilation import compile_events
from jaxmoe.engine.engine import LLMEngine
from jaxmoe.engine.outputs import RequestOutput, StepFailedError
from jaxmoe.engine.replication import STEP, CALL, ClusterFailedError, Leader
from jaxmoe.engine.request_stream import (  # noqa: F401  (re-exported: the errors are part of this API)
    END,
    EngineClosedError,
    EngineStepError,
    RequestStream,
    RequestTimeoutError,
)
from jaxmoe.engine.stats import EngineStats
from jaxmoe.engine.warmup import WarmupCancelled, warm_up  # noqa: F401  (WarmupCancelled: re-exported)
from jaxmoe.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Add:
    prompt: Any
    sampling: SamplingParams | None
    priority: Any
    request_id: str | None
    stream_loop: asyncio.AbstractEventLoop | None
    future: concurrent.futures.Future
    cache_salt: str | None = None


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_finish: Callable[[RequestOutput], None] | None = None,
        idle_poll_s: float = 0.5,
        counts_every_s: float = 1.0,
        request_timeout_s: float | None = None,
        leader: Leader | None = None,
        on_cluster_failure: Callable[[str], None] | None = None,
    ):
        """``request_timeout_s``: a request still running that long after admission is ended
        with ``RequestTimeoutError`` (None: no deadline). ``leader``: multi-host serving, this is
        process 0 (see the module docstring)."""
        self.engine = engine
        self.leader = leader
        self.on_cluster_failure = on_cluster_failure
        self._failure_reported = False
        self._failure_lock = threading.Lock()
        self.request_timeout_s = request_timeout_s
        self._deferred: list = []  # commands that arrived while a step was paused between layers
        engine.poll = self._admit_arrivals
        engine.emit = self._deliver_all
        self._admitted: dict[str, float] = {}  # request id -> admission time (for the deadline)
        self.on_finish = on_finish  # called on the loop thread with each final output (metrics)
        self._idle_poll_s = idle_poll_s
        self._stats = EngineStats(counts_every_s)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._last: dict[str, RequestOutput] = {}
        self._closing = False
        self._stop: tuple[bool, float] | None = None  # (abort_inflight, deadline)
        self._thread: threading.Thread | None = None
        self._snapshot: dict[str, Any] = {}
        self.step_errors = 0
        self.num_steps = 0
        self._compiles_at_ready: int | None = None
        # multi-host: since when the loop waits in a broadcast or a step (which other processes must
        # join); None otherwise. A watchdog reads it (a process that stopped stepping without dying)
        self.cluster_wait_since: float | None = None
        compile_events()  # start counting

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._publish()
            self._thread = threading.Thread(target=self._run, name="jaxmoe-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, abort_inflight: bool = True, timeout: float = 30.0) -> None:
        """Stop admission; abort the in-flight requests (``finish_reason="abort"``) or let them
        finish, aborting whatever is left after ``timeout`` seconds. Returns when the loop exited."""
        self._closing = True
        if self._thread is None:
            return
        self._commands.put(("stop", abort_inflight, time.monotonic() + timeout))
        self._thread.join(timeout + 10)

    # -- submission (any thread) ----------------------------------------------------------------
    def add(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        priority: Any = "be",
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit a request (blocks until the loop has taken it, at most one step). Raises ValueError,
        OverloadedError or EngineClosedError; returns a stream for ``for`` loops. ``cache_salt``:
        see ``LLMEngine.add_request``."""
        return self._submit(prompt, sampling, priority, request_id, None, cache_salt).result()

    async def add_async(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        priority: Any = "be",
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Like ``add`` for asyncio code; the stream is iterated with ``async for``."""
        loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._submit(prompt, sampling, priority, request_id, loop, cache_salt))

    def _submit(self, prompt, sampling, priority, request_id, loop, cache_salt=None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.leader is not None and self.leader.failed is not None:
            future.set_exception(EngineClosedError(f"the serving cluster stopped: {self.leader.failed}"))
        elif self._closing or not self.running:
            future.set_exception(EngineClosedError("the engine is not running (shutting down?)"))
        else:
            self._commands.put(("add", _Add(prompt, sampling, priority, request_id, loop, future, cache_salt)))
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); processed before the next step."""
        self._commands.put(("abort", request_id))

    def call(
        self, fn: Callable[[LLMEngine], Any], timeout: float | None = 60.0, replicate: Callable | None = None
    ) -> Any:
        """Run ``fn(engine)`` on the loop thread between steps and return its result. Multi-host:
        ``replicate`` (picklable, e.g. a ``functools.partial`` of a module function) runs on every
        other process at the same point; give it for anything that runs programs or changes the
        engine (a ``fn`` without it runs here only)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.running:
            if self.leader is not None and replicate is not None:
                self.leader.sync((CALL, replicate))
            return fn(self.engine)  # no loop: the caller is the only user of the engine
        self._commands.put(("call", fn, future, replicate))
        return future.result(timeout)

    def snapshot(self) -> dict[str, Any]:
        """Latest statistics published by the loop (scheduler stats, KV blocks, expert counts)."""
        return self._snapshot

    def warmup(
        self,
        shapes: list[tuple[int, int]] | None = None,
        progress: bool | None = None,
        cancel: threading.Event | None = None,
        scoring: bool = False,
    ) -> float:
        """Compile the step program of every shape serving can meet (``runner.plan.shapes()``:
        (rows per attention instance, tokens per row)), by running each once on padding rows that
        write no KV. Returns the seconds spent. ``progress``: on stderr, a tqdm bar on a terminal
        and lines otherwise (``jaxmoe.progress``; False: none). ``cancel``: set it to stop between two shapes (``WarmupCancelled``).
        Afterwards ``compiles_after_warmup`` counts programs compiled while serving."""

        replicate = None
        if self.leader is not None:  # every process compiles the same shapes; no cancel half-way
            cancel = None
            replicate = functools.partial(warm_up, shapes=shapes, progress=False, scoring=scoring)

        def run(engine: LLMEngine) -> float:
            seconds = warm_up(engine, shapes, progress, cancel, scoring=scoring)
            self._compiles_at_ready = compile_events()["programs"]
            return seconds

        return self.call(run, timeout=None, replicate=replicate)

    @property
    def compiles_after_warmup(self) -> int | None:
        """XLA programs compiled (or loaded from the persistent cache) in this process since warm-up
        ended (None: no warm-up ran)."""
        if self._compiles_at_ready is None:
            return None
        return compile_events()["programs"] - self._compiles_at_ready

    # -- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._drain_commands(block=not self.engine.has_work())
                self._expire()
                if self._stop is not None:
                    abort_inflight, deadline = self._stop
                    if abort_inflight or time.monotonic() > deadline:
                        self._abort_all()
                    if not self.engine.has_work():
                        break
                if self.engine.has_work():
                    self._step()
                elif self.leader is not None:
                    self._sync()  # idle: the journal so far, and a heartbeat
            if self.leader is not None:
                self.leader.stop()
        except ClusterFailedError as e:
            self._cluster_failed(str(e))
        except BaseException:  # a bug in the loop itself: fail everyone rather than hang them
            log.exception("jaxmoe engine loop crashed")
            self._fail(list(self._streams), "the engine loop crashed")
            raise
        finally:
            self._closing = True
            self._reject_pending()
            self._publish()

    def _admit_arrivals(self) -> None:
        """Between the layers of a paused step: admit new requests (layer-level preemption may run
        them now); every other command waits for the step's end."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._handle(cmd)
            else:
                self._deferred.append(cmd)

    def _drain_commands(self, block: bool) -> None:
        for cmd in self._deferred:
            self._handle(cmd)
        self._deferred = []
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish()

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            self._admit(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            fn, future, replicate = cmd[1], cmd[2], cmd[3]
            if future.set_running_or_notify_cancel():
                try:
                    if self.leader is not None and replicate is not None:
                        self._sync((CALL, replicate))  # ClusterFailedError ends the loop
                    future.set_result(fn(self.engine))
                except ClusterFailedError as e:
                    future.set_exception(e)
                    raise
                except BaseException as e:
                    future.set_exception(e)
        elif kind == "stop":
            self._closing = True
            self._stop = (cmd[1], cmd[2])

    def _admit(self, req: _Add) -> None:
        if not req.future.set_running_or_notify_cancel():
            return
        if self._stop is not None:
            req.future.set_exception(EngineClosedError("the engine is shutting down"))
            return
        try:
            rid = self.engine.add_request(
                req.prompt, req.sampling, req.priority, req.request_id, cache_salt=req.cache_salt
            )
        except Exception as e:  # ValueError, OverloadedError: the caller gets it, nothing queued
            req.future.set_exception(e)
            return
        if self.leader is not None:
            self.leader.added(self.engine, rid)
        stream = RequestStream(rid, req.stream_loop)
        self._streams[rid] = stream
        self._admitted[rid] = time.monotonic()
        req.future.set_result(stream)

    def _abort(self, rid: str) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        seq = self.engine.sequence(rid)
        self._engine_abort(rid)
        last = self._last.get(rid)
        if seq is not None:
            out = RequestOutput(
                request_id=rid,
                prompt_token_ids=seq.prompt_ids,
                token_ids=list(seq.output_ids),
                text=last.text if last else "",
                delta_token_ids=[],
                delta_text="",
                logprobs=last.logprobs if last else None,
                finished=True,
                finish_reason="abort",
                priority=seq.priority.value,
                ttft=seq.ttft,
                tpot=seq.tpot,
            )
            self._deliver(out)
        else:  # already finished and delivered
            self._close(rid)

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self._abort(rid)

    def _engine_abort(self, rid: str) -> None:
        self.engine.abort(rid)
        if self.leader is not None:
            self.leader.aborted(rid)

    def fail_cluster(self, reason: str) -> None:
        """(any thread; multi-host) A process is gone, seen from outside the loop (jax's coordination
        service): new requests are refused and the ones in flight end with ``ClusterFailedError`` now,
        even while the loop is busy (compiling); the loop itself stops at its next broadcast."""
        if self.leader is None or self.leader.failed is not None:
            return
        self.leader.fail(reason)
        for stream in dict(self._streams).values():  # a copy: the loop thread may change the dict
            stream.put(ClusterFailedError(reason))  # thread-safe; a stream ends at its first error
        self._report_failure(reason)

    def _report_failure(self, reason: str) -> None:
        with self._failure_lock:
            if self._failure_reported:
                return
            self._failure_reported = True
        if self.on_cluster_failure is not None:
            try:
                self.on_cluster_failure(reason)
            except Exception:
                log.exception("on_cluster_failure hook failed")

    def _cluster_failed(self, reason: str) -> None:
        """A process of the cluster is gone: end every request with the reason, take no more."""
        self._closing = True
        if self.leader is not None:
            self.leader.fail(reason)
        for rid in list(self._streams):
            self._admitted.pop(rid, None)
            self._last.pop(rid, None)
            self._streams.pop(rid).put(ClusterFailedError(reason))
        self._report_failure(reason)

    def _sync(self, *ops: tuple) -> None:
        """``leader.sync`` (the journal and ``ops`` to every process), watched (``cluster_wait_since``)."""
        self.cluster_wait_since = time.monotonic()
        try:
            self.leader.sync(*ops)
        finally:
            self.cluster_wait_since = None

    def _step(self) -> None:
        self.engine.step_request_ids = []
        if self.leader is not None:
            self.cluster_wait_since = time.monotonic()  # the broadcast and the step's collectives
            self.leader.sync((STEP,))  # ClusterFailedError ends the loop
        try:
            outputs = self.engine.step()
        except Exception as e:
            if self.leader is not None:  # a collective failed: the processes cannot agree any more
                self.leader.fail(f"a step failed across processes: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                raise ClusterFailedError(self.leader.failed) from e
            self._step_failed(e)
            return
        finally:
            self.cluster_wait_since = None
        if self.leader is not None:
            self.leader.stepped(self.engine.step_request_ids)
        self.num_steps += 1
        self._deliver_all(outputs)
        self._publish()

    def _step_failed(self, e: Exception) -> None:
        self.step_errors += 1
        log.error("engine step failed", exc_info=e)
        if isinstance(e, StepFailedError):  # the model run failed and took the KV cache: fail that step
            self._fail(e.request_ids, str(e))
        else:  # scheduling / bookkeeping failed: the step's requests, by id
            self._fail(self.engine.step_request_ids, f"engine step failed: {type(e).__name__}: {e}")
        self._after_failure()

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """The outputs of a step (also of one run inside a paused step: ``engine.emit``) to their streams."""
        for out in outputs:
            if out.error is not None:
                self.step_errors += 1
                log.error("request %s failed in the engine: %s", out.request_id, out.error)
            self._deliver(out)

    def _after_failure(self) -> None:
        """No stream may wait forever: fail every stream whose request the engine no longer holds."""
        orphans = [rid for rid in self._streams if self.engine.sequence(rid) is None]
        self._fail(orphans, "the request was lost by a failed engine step")
        self._publish()

    def _expire(self) -> None:
        """End the requests older than the request deadline (``RequestTimeoutError``)."""
        if self.request_timeout_s is None or not self._admitted:
            return
        limit = time.monotonic() - self.request_timeout_s
        late = [rid for rid, t in self._admitted.items() if t < limit]
        if late:
            message = f"the request did not finish within the server's deadline of {self.request_timeout_s:g} s"
            log.warning("%d request(s) passed the request deadline; ending them", len(late))
            self._fail(late, message, RequestTimeoutError)
            self._publish()

    def _fail(self, rids: list[str], message: str, error: type[EngineStepError] = EngineStepError) -> None:
        for rid in rids:
            try:
                self._engine_abort(rid)
            except Exception:  # keep failing the others
                log.exception("abort of %s failed", rid)
            stream = self._streams.pop(rid, None)
            self._last.pop(rid, None)
            self._admitted.pop(rid, None)
            if stream is not None:
                stream.put(error(message))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:  # a request added through call() (warm-up)
            return
        if out.error is not None:
            self._fail([out.request_id], out.error)
            return
        stream.put(out)
        if out.finished:
            self._close(out.request_id)
            if self.on_finish is not None:
                try:
                    self.on_finish(out)
                except Exception:
                    log.exception("on_finish hook failed")
        else:
            self._last[out.request_id] = out

    def _close(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        self._last.pop(rid, None)
        self._admitted.pop(rid, None)
        if stream is not None:
            stream.put(END)

    def _reject_pending(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add" and cmd[1].future.set_running_or_notify_cancel():
                cmd[1].future.set_exception(EngineClosedError("the engine stopped"))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(EngineClosedError("the engine stopped"))

    def _publish(self) -> None:
        """Publish statistics for other threads (a new dict each time: readers never see it change)."""
        self._snapshot = self._stats.snapshot(self.engine, len(self._streams), self.step_errors)
