"""``JaxmoeServer``: one engine (``AsyncEngine``) behind both front ends, gRPC and OpenAI HTTP.

Lifecycle: ``await start()`` starts the engine thread, warms up (compiles), then binds and starts
the gRPC and HTTP servers (health turns SERVING); ``await stop()`` turns health NOT_SERVING, stops
taking new RPCs, lets in-flight requests finish for ``grace`` seconds (or aborts them at once with
``abort_inflight=True``; their streams end with ``finish_reason="abort"``), then closes both.

``ServerThread`` runs a server on its own event loop in a background thread (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from jaxmoe.brownout.controller import BrownoutController
from jaxmoe.engine.async_engine import AsyncEngine
from jaxmoe.engine.engine import EngineConfig, LLMEngine
from starlette.middleware import Middleware

from jaxmoe.server.grpc_service import build_grpc_server, set_serving
from jaxmoe.server.http_server import HttpLimits, HttpServer
from jaxmoe.server.http_service import OpenAIServer
from jaxmoe.server.metrics import ServerMetrics
from jaxmoe.server.proto import jaxmoe_pb2 as pb
from jaxmoe.server.security import HttpGuard, SecurityOptions


@dataclasses.dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    grpc_port: int = 0  # 0: pick a free port
    http_port: int = 0
    model_name: str = "demo"
    mesh_description: str = "monolithic: one device (no mesh file)"
    warmup: bool = True
    warmup_shapes: tuple[tuple[int, int], ...] | None = None  # None: every shape of the engine's ShapePlan
    warmup_progress: bool | None = None  # tqdm bar on stderr (None: when stderr is a terminal)
    security: SecurityOptions = SecurityOptions()  # API key, allowed hosts and origins
    request_timeout_s: float | None = 600.0  # a request still running after this long is ended (None: never)
    max_body_bytes: int = 4 << 20  # HTTP request bodies larger than this are refused (413)
    body_read_timeout_s: float = 30.0  # an HTTP body not fully received in this time is refused (408)
    http_limits: HttpLimits = HttpLimits()  # connections, keep-alive, request head (uvicorn)


def load_engine(
    model: str,
    engine_config: EngineConfig,
    mesh: str | None = None,
    dtype=None,
    rebalance_every: int = 0,
    brownout=None,
    salc=None,
    *,
    pipeline=None,
    pipeline_profile=None,
    quantization=None,
    quantize_attention: bool = False,
) -> LLMEngine:
    """The engine ``jaxmoe serve`` runs; ``rebalance_every`` > 0 attaches the expert placement
    controller (a mesh file is needed); ``brownout`` (a ``BrownoutConfig``, the model directory
    holding united experts) and ``salc`` (a ``SALCConfig``: SLO-aware control of its threshold);
    ``pipeline`` / ``pipeline_profile``: the disaggregated step's schedule (``llm.build_executor``);
    ``quantization`` / ``quantize_attention``: weights quantized on load (``llm.load_model``)."""
    from jaxmoe.compilation import enable_persistent_cache
    from jaxmoe.llm import build_executor, load_model

    enable_persistent_cache()
    cfg, params, tokenizer = load_model(model, dtype, quantization, quantize_attention)
    if brownout is not None:
        from jaxmoe.brownout.united import attach
        from jaxmoe.demo import DEMO_DIR

        params = attach(params, cfg, DEMO_DIR if str(model) == "demo" else model)
    engine = LLMEngine(
        cfg,
        build_executor(
            cfg, params, engine_config, mesh, brownout=brownout, pipeline=pipeline, pipeline_profile=pipeline_profile
        ),
        tokenizer,
        engine_config,
    )
    if salc is not None:
        BrownoutController.attach(engine, salc)
    if rebalance_every:
        from jaxmoe.runtime.controller import PlacementController

        PlacementController.attach(engine, rebalance_every)
    return engine


def model_info(engine: LLMEngine, opts: ServeOptions) -> pb.ModelInfoResponse:
    cfg, ec = engine.cfg, engine.config
    return pb.ModelInfoResponse(
        model=opts.model_name,
        family=cfg.family,
        vocab_size=cfg.vocab_size,
        max_context=engine.max_model_len,
        num_layers=cfg.num_layers,
        num_moe_layers=cfg.num_moe_layers,
        num_experts=cfg.moe.num_experts,
        experts_per_token=cfg.moe.top_k,
        mesh=opts.mesh_description,
        policy=engine.scheduler.policy.name,
        max_num_seqs=ec.max_num_seqs,
        num_kv_blocks=ec.num_blocks,
        kv_block_size=ec.block_size,
    )


class JaxmoeServer:
    def __init__(self, engine: LLMEngine, opts: ServeOptions = ServeOptions()):
        self.opts = opts
        self.metrics = ServerMetrics()
        self.async_engine = AsyncEngine(
            engine, on_finish=self.metrics.observe_finished, request_timeout_s=opts.request_timeout_s
        )
        self.metrics.watch(self.async_engine)
        self.async_engine.brownout = next((h for h in engine.step_hooks if isinstance(h, BrownoutController)), None)
        self.ready = False
        self.grpc_port = self.http_port = None
        self.warmup_seconds = 0.0
        self.cancel_warmup = threading.Event()  # set it to stop start() between two warm-up compiles
        self._grpc = self._health = self._http = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.async_engine.start()
        o = self.opts
        if o.warmup:
            self.warmup_seconds = await loop.run_in_executor(
                None, lambda: self.async_engine.warmup(o.warmup_shapes, o.warmup_progress, self.cancel_warmup)
            )
        info = model_info(self.async_engine.engine, o)
        self._grpc, self.grpc_port, self._health = build_grpc_server(
            self.async_engine, info, o.host, o.grpc_port, self.metrics, o.security
        )
        await set_serving(self._health, False)
        http = OpenAIServer(
            self.async_engine,
            o.model_name,
            self.metrics,
            ready=lambda: self.ready,
            max_body_bytes=o.max_body_bytes,
            body_read_timeout_s=o.body_read_timeout_s,
        )
        guard = Middleware(HttpGuard, opts=o.security, bind_host=o.host, port_of=lambda: self.http_port)
        self._http = HttpServer(http.app(guard), o.host, o.http_port, o.http_limits)
        self.http_port = self._http.port
        await self._http.start()
        await self._grpc.start()
        await set_serving(self._health, True)
        self.ready = True

    async def stop(self, abort_inflight: bool = False, grace: float = 10.0) -> None:
        """Stop taking requests, finish (or abort) the in-flight ones, close both servers."""
        loop = asyncio.get_running_loop()
        self.ready = False
        if self._health is not None:
            await set_serving(self._health, False)
        # new RPCs are refused at once; open streams end when the engine finishes or aborts them
        grpc_done = asyncio.ensure_future(self._grpc.stop(grace + 5.0)) if self._grpc is not None else None
        await loop.run_in_executor(None, lambda: self.async_engine.shutdown(abort_inflight, grace))
        if grpc_done is not None:
            await grpc_done
        if self._http is not None:
            await self._http.stop()

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
