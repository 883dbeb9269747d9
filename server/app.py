"""``JaxmoeServer``: one engine (``AsyncEngine``) behind both front ends, gRPC and OpenAI HTTP.

Lifecycle: ``await start()`` starts the engine thread, warms up (compiles), then binds and starts
the gRPC and HTTP servers (health turns SERVING); ``await stop()`` turns health NOT_SERVING, stops
taking new RPCs, lets in-flight requests finish for ``grace`` seconds (or aborts them at once with
``abort_inflight=True``; their streams end with ``finish_reason="abort"``), then closes both.

``ServerThread`` runs a server on its own event loop in a background thread (tests, benchmarks).

While a server runs, the interpreter's GIL switch interval is at most ``SWITCH_INTERVAL_S`` (``server/serving_process.py``): the
event loop releases the GIL at every socket call (each send, accept, close, epoll change) and then
waits for it up to one interval each time, behind the engine thread and the tokenizer workers; at
Python's default (5 ms) a burst of connections cost ``/health`` about twice as long as at 1 ms.
And once warmed up, before it listens, the server moves every object then alive out of the
garbage collector's reach (``gc.freeze``; given back when the process's last server stops): the model, JAX, the
compiled programs and the libraries are hundreds of thousands of long-lived objects that each
full collection would walk, holding the GIL, so the loop too (1.4 s at a time during a burst on a
loaded 2-core machine; a collection now walks only what the requests made), and a full collection
comes after ``FULL_COLLECTION_EVERY`` young ones (Python's default: 10).

Multi-host (``leader``): this is process 0 of a ``jax.distributed`` cluster; when another process is
gone the engine loop ends every request with an error, health turns NOT_SERVING (HTTP ``/health``
503, new requests 503) and ``cluster_failed`` is set (``jaxmoe serve`` then exits non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe.engine.async_engine import AsyncEngine
from jaxmoe.engine.engine import LLMEngine
from starlette.middleware import Middleware

from jaxmoe.server.grpc_service import build_grpc_server, set_serving
from jaxmoe.server.http_server import HttpLimits, HttpServer
from jaxmoe.server.http_service import OpenAIServer
from jaxmoe.server.layout import current_layout
from jaxmoe.server.metrics import ServerMetrics
from jaxmoe.server.proto import jaxmoe_pb2 as pb
from jaxmoe.server.prompts import PromptPreparer
from jaxmoe.server.security import HttpGuard, SecurityOptions
from jaxmoe.server.serving_process import SERVING as _SERVING


@dataclasses.dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    grpc_port: int = 0  # 0: pick a free port
    http_port: int = 0
    model_name: str = "demo"
    mesh_description: str = "monolithic: one device (no mesh file)"
    warmup: bool = True
    warmup_shapes: tuple[tuple[int, int], ...] | None = None  # None: every shape of the engine's ShapePlan
    warmup_scoring: bool = True  # also the prompt-scoring programs (echo with logprobs): none compile later
    warmup_progress: bool | None = None  # tqdm bar on stderr (None: when stderr is a terminal)
    security: SecurityOptions = SecurityOptions()  # API key, allowed hosts and origins
    request_timeout_s: float | None = 600.0  # a request still running after this long is ended (None: never)
    max_body_bytes: int = 4 << 20  # HTTP request bodies larger than this are refused (413)
    body_read_timeout_s: float = 30.0  # an HTTP body not fully received in this time is refused (408)
    http_limits: HttpLimits = HttpLimits()  # connections, keep-alive, request head (uvicorn)


def model_info(engine: LLMEngine, opts: ServeOptions) -> pb.ModelInfoResponse:
    """``ModelInfo``, read when asked: after a live rescale it describes the new layout."""
    cfg, ec = engine.cfg, engine.config
    layout = current_layout(engine)
    return pb.ModelInfoResponse(
        model=opts.model_name,
        family=cfg.family,
        vocab_size=cfg.vocab_size,
        max_context=engine.max_model_len,
        num_layers=cfg.num_layers,
        num_moe_layers=cfg.num_moe_layers,
        num_experts=cfg.moe.num_experts,
        experts_per_token=cfg.moe.top_k,
        mesh=opts.mesh_description if layout is None else layout[0],
        policy=engine.scheduler.policy.name,
        max_num_seqs=ec.max_num_seqs,
        num_kv_blocks=ec.num_blocks,
        kv_block_size=ec.block_size,
        op_impls=op_impls(engine),
    )


def op_impls(engine: LLMEngine) -> dict[str, str]:
    """Op -> implementation of the executor serving now (``runtime.op_impls``; {} if it has no report)."""
    report = getattr(engine.runner.executor, "op_impls", None)
    return report() if callable(report) else {}


class JaxmoeServer:
    def __init__(self, engine: LLMEngine, opts: ServeOptions = ServeOptions(), leader=None):
        self.opts = opts
        self.metrics = ServerMetrics()
        self.async_engine = AsyncEngine(
            engine,
            on_finish=self.metrics.observe_finished,
            request_timeout_s=opts.request_timeout_s,
            leader=leader,
            on_cluster_failure=self._on_cluster_failure,
            # across processes an expert-count read is a collective the followers would not join
            counts_every_s=math.inf if leader is not None else 1.0,
        )
        self.cluster_failed = asyncio.Event()
        self.failure: str | None = None
        try:  # where the engine thread reports a cluster failure (start() sets it otherwise)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self.metrics.watch(self.async_engine)
        self.ready = False
        self.grpc_port = self.http_port = None
        self.warmup_seconds = 0.0
        self.prompts = PromptPreparer(engine)  # tokenization and chat templates, shared by both front ends
        self.cancel_warmup = threading.Event()  # set it to stop start() between two warm-up compiles
        self._grpc = self._health = self._http = None
        self._serving = False  # counted in _SERVING (start() got past the GIL settings)

    def _on_cluster_failure(self, reason: str) -> None:
        """(the engine thread, or the watchdog) A process of the cluster is gone: stop answering as healthy."""
        if self.failure is not None:
            return
        self.ready = False
        self.failure = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._failed_on_loop)

    def _failed_on_loop(self) -> None:
        self.cluster_failed.set()
        if self._health is not None:
            asyncio.ensure_future(set_serving(self._health, False))

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if not self._serving:
            self._serving = True
            _SERVING.begin()
        self.async_engine.start()
        o = self.opts
        if o.warmup:
            self.warmup_seconds = await loop.run_in_executor(
                None,
                lambda: self.async_engine.warmup(
                    o.warmup_shapes, o.warmup_progress, self.cancel_warmup, scoring=o.warmup_scoring
                ),
            )
        info = lambda: model_info(self.async_engine.engine, o)  # noqa: E731  (the layout serving now)
        self._grpc, self.grpc_port, self._health = build_grpc_server(
            self.async_engine, info, o.host, o.grpc_port, self.metrics, o.security, self.prompts
        )
        await set_serving(self._health, False)
        http = OpenAIServer(
            self.async_engine,
            o.model_name,
            self.metrics,
            ready=lambda: self.ready,
            max_body_bytes=o.max_body_bytes,
            body_read_timeout_s=o.body_read_timeout_s,
            prompts=self.prompts,
        )
        port_of = lambda: self.http_port  # noqa: E731
        guard = Middleware(HttpGuard, opts=o.security, bind_host=o.host, port_of=port_of)
        checks = HttpGuard(None, o.security, o.host, port_of)

        def health(headers: dict[str, str]):  # /health as it arrives, when the guard would let it through
            if not checks.untouched("/health", headers):
                return None
            status, body = http.health_answer()
            return status, json.dumps(body, separators=(",", ":")).encode()

        self._http = HttpServer(
            http.app(guard),
            o.host,
            o.http_port,
            o.http_limits,
            on_refuse=lambda: self.metrics.reject("connections"),
            health=health,
        )
        self.http_port = self._http.port
        _SERVING.freeze()  # the long-lived objects, warm-up's included: no collection walks them now
        await self._http.start()
        await self._grpc.start()
        if self.failure is None:
            await set_serving(self._health, True)
            self.ready = True

    async def stop(self, abort_inflight: bool = False, grace: float = 10.0) -> None:
        """Stop taking requests, finish (or abort) the in-flight ones, close both servers."""
        loop = asyncio.get_running_loop()
        self.ready = False
        rescaler = LiveRescaler.find(self.async_engine.engine)
        if rescaler is not None:  # a rescale build in flight is cancelled: its callers get UNAVAILABLE / 503
            rescaler.cancel()
        if self._health is not None:
            await set_serving(self._health, False)
        # new RPCs are refused at once; open streams end when the engine finishes or aborts them
        grpc_done = asyncio.ensure_future(self._grpc.stop(grace + 5.0)) if self._grpc is not None else None
        # aborting: HTTP stops listening now too, its open responses end as the engine aborts them
        # (a drain lets them finish first: HTTP stops after it)
        http_done = asyncio.ensure_future(self._http.stop()) if self._http is not None and abort_inflight else None
        await loop.run_in_executor(None, lambda: self.async_engine.shutdown(abort_inflight, grace))
        if grpc_done is not None:
            await grpc_done
        if http_done is not None:
            await http_done
        elif self._http is not None:
            await self._http.stop()
        self.prompts.close()
        if self._serving:
            self._serving = False
            _SERVING.end()

    @property
    def grpc_target(self) -> str:
        return f"{self.opts.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.opts.host}:{self.http_port}"


class ServerThread:
    """A ``JaxmoeServer`` on its own event loop in a daemon thread: ``start()`` returns once it
    listens; ``stop()`` shuts it down. The wrapped ``LLMEngine`` may be reused afterwards."""

    def __init__(self, engine: LLMEngine, opts: ServeOptions = ServeOptions()):
        self.server = JaxmoeServer(engine, opts)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxmoe-server", daemon=True)

    def start(self, timeout: float = 600.0) -> JaxmoeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout)
        return self.server

    def stop(self, abort_inflight: bool = True, grace: float = 5.0, timeout: float = 60.0) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(abort_inflight, grace), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._loop.close()

    def __enter__(self) -> JaxmoeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
