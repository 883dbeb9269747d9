"""``jaxmoe serve`` and ``jaxmoe client`` (registered into ``jaxmoe.cli`` by ``register``).

``jaxmoe serve`` loads the model, warms up, then prints one line per front end::

    jaxmoe: grpc listening on 127.0.0.1:50151
    jaxmoe: http listening on 127.0.0.1:8100

and serves until SIGTERM / SIGINT: it then stops taking requests, aborts the requests in flight
(their streams end with ``finish_reason="abort"``, as vLLM's do; ``--shutdown-grace N`` lets them
run up to N seconds first), cancels a live-rescale build in flight and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from jaxmoe.options import EXPERT_IMPLS
from jaxmoe.server.brownout_flags import add_brownout_args, serve_brownout


DEFAULT_HTTP_PORT = 8100  # beside a vLLM server (8000) on the same host
DEFAULT_GRPC_PORT = 50151  # beside the usual gRPC 50051


def register(sub, add_model_args) -> None:
    serve = sub.add_parser("serve", help="serve a model over gRPC and OpenAI-compatible HTTP")
    add_model_args(serve, quantization=True)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback only; 0.0.0.0 exposes the server)"
    )
    serve.add_argument(
        "--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help=f"0 = pick a free port (default {DEFAULT_GRPC_PORT})"
    )
    serve.add_argument(
        "--port",
        "--http-port",
        dest="http_port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"HTTP (OpenAI API) port; 0 = pick a free port (default {DEFAULT_HTTP_PORT}: not vLLM's 8000)",
    )
    serve.add_argument("--served-model-name", default=None, help="name in /v1/models (default: --model)")
    serve.add_argument(
        "--policy",
        default="qllm",
        help="scheduling policy: qllm, fcfs, or module:Class (a SchedulingPolicy, docs/scheduling.md)",
    )
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-batch-tokens", type=int, default=2048)
    serve.add_argument(
        "--layer-preemption",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="QLLM: latency-sensitive requests join a running best-effort step at its next layer boundary "
        "(default: on without --mesh, --deterministic and --async-scheduling, else off; on with --expert-queues; "
        "--no-layer-preemption: off)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not keep and share the KV of full prompt blocks between requests (automatic prefix caching is on "
        "by default)",
    )
    serve.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="dispatch each step before the previous step's tokens are read, overlapping stops, "
        "detokenization and streaming with the model (monolithic executor; default: off)",
    )
    serve.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant mode: a request's tokens and logprobs are bit-identical whatever it is batched "
        "with, however its prompt is chunked and whether its prefix came from the cache (costs throughput)",
    )
    serve.add_argument(
        "--expert-queues",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="QLLM per-expert queues (with layer preemption): each MoE layer's routed tokens wait in per-expert "
        "queues served in ROUNDS rounds, with pause points after attention, after routing and between rounds; "
        "latency-sensitive work arriving there jumps the queues (0: off)",
    )
    serve.add_argument(
        "--pause-every",
        type=int,
        default=None,
        metavar="LAYERS",
        help="layer preemption: layers between two pause points (1: after every layer; more: fewer programs per "
        "step, a later pause; default: measured at warm-up, the finest whose steps cost <= 2 %% more than the "
        "fused step's, else step-level preemption; 1 with --layer-preemption or --expert-queues)",
    )
    serve.add_argument(
        "--max-paused-state-bytes",
        type=int,
        default=None,
        help="layer preemption: a step whose paused state would exceed this is not paused (default: no limit)",
    )
    serve.add_argument(
        "--expert-impl",
        default="auto",
        choices=["auto", *EXPERT_IMPLS],
        help="expert-FFN implementation (auto: the fastest on this backend)",
    )
    serve.add_argument("--max-waiting", type=int, default=1024, help="waiting queue size (then 429)")
    serve.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--rebalance-every",
        type=int,
        default=0,
        help="with --mesh: re-place expert replicas from recent activations every N steps",
    )
    serve.add_argument(
        "--pipeline",
        default=None,
        help="with --mesh: the step's schedule, sequential (default) | pppipe | findep | a JSON object like "
        '\'{"order": "ASAS", "r1": 2, "r2": 4}\' (docs/findep.md)',
    )
    serve.add_argument(
        "--pipeline-profile", default=None, help="profile JSON (`jaxmoe profile`) for --pipeline pppipe/findep"
    )
    serve.add_argument(
        "--max-prefill-chunk", type=int, default=512, help="tokens of one prefill chunk (longer prompts are chunked)"
    )
    serve.add_argument(
        "--log-requests",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one log line per request: id, route, prompt / output tokens, TTFT, status (default on)",
    )
    serve.add_argument(
        "--quiet", action="store_true", help="log warnings and errors only (no request lines, no progress)"
    )
    serve.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip compiling before serving (the first requests of each shape then compile)",
    )
    serve.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        help="several processes: seconds process 0 waits in one step (or broadcast) for the others, "
        "compiling aside, before it fails every request and exits (a hung process; 0: no limit)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=0.0,
        help="seconds in-flight requests may go on after SIGTERM / SIGINT before they are aborted "
        '(default 0: aborted at once, their streams end with finish_reason "abort", as vLLM does)',
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may run before the server ends it (0: no deadline)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest HTTP request body (413 above)")
    serve.add_argument(
        "--body-read-timeout",
        type=float,
        default=30.0,
        help="seconds an HTTP request body may take to arrive (408 after; slow clients)",
    )
    serve.add_argument(
        "--http-max-connections",
        type=int,
        default=4096,
        help="HTTP connections (or in-flight requests) served; a request beyond gets a JSON 429 with Retry-After "
        "(/health is always served)",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=5,
        help="seconds an idle kept-alive HTTP connection stays open (uvicorn timeout_keep_alive)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a new HTTP connection may take to send its request head (closed after)",
    )
    serve.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 << 10,
        help="largest HTTP request head (uvicorn h11_max_incomplete_event_size; 400 above)",
    )
    add_brownout_args(serve)
    serve.add_argument(
        "--autoscale",
        action="store_true",
        help="with --mesh and --slo-tpot-ms: the JANUS scaling controller changes the attention / expert "
        "instances live (docs/scaling.md)",
    )
    serve.add_argument("--autoscale-interval", type=float, default=30.0, help="--autoscale: seconds between decisions")
    serve.add_argument(
        "--scaling-profile",
        default=None,
        help="--autoscale: the performance model fitted on this mesh, model and dtype (JSON from "
        "`jaxmoe scaling-profile --out`), or a directory searched for it; default (or none found): a host roofline",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("JAXMOE_API_KEY"),
        help="require this key (HTTP Authorization: Bearer KEY, gRPC metadata authorization) "
        "(default: $JAXMOE_API_KEY; none)",
    )
    serve.add_argument(
        "--protect-health",
        action="store_true",
        help="with --api-key: /health, /metrics and gRPC health need the key too",
    )
    serve.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins allowed to call the API ('*': any; default none)",
    )
    serve.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header values accepted ('*': any; default: the bound address)",
    )
    serve.add_argument(
        "--abort-on-shutdown",
        action="store_true",
        help="abort in-flight requests at once on SIGTERM / SIGINT, whatever --shutdown-grace says (the default "
        "with --shutdown-grace 0)",
    )
    multi = serve.add_argument_group(
        "multi-host (jax.distributed; process 0 serves HTTP and gRPC, the others follow its steps: docs/multi_host.md)"
    )
    multi.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address for jax")
    multi.add_argument("--num-processes", type=int, default=None, help="processes in the cluster (= mesh nodes)")
    multi.add_argument("--process-id", type=int, default=None, help="this process: 0 .. --num-processes - 1")
    multi.add_argument(
        "--distributed",
        action="store_true",
        help="join the cluster jax.distributed detects by itself (Cloud TPU, SLURM, Open MPI, Kubernetes); "
        "automatic under SLURM / Open MPI with several tasks or with $JAX_COORDINATOR_ADDRESS",
    )
    serve.set_defaults(func=cmd_serve)

    client = sub.add_parser("client", help="talk to a running server over gRPC")
    client.add_argument("--target", default=f"127.0.0.1:{DEFAULT_GRPC_PORT}")
    client.add_argument("--prompt", default="Hello")
    client.add_argument("--max-tokens", type=int, default=32)
    client.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy (default: the server's, see docs/serving.md)"
    )
    client.add_argument("--top-k", type=int, default=0)
    client.add_argument("--top-p", type=float, default=None)
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--stop", action="append", default=[])
    client.add_argument("--logprobs", type=int, default=None)
    client.add_argument("--priority", default="be")
    client.add_argument("--info", action="store_true", help="print ModelInfo and health, no generation")
    client.add_argument("--timeout", type=float, default=120.0)
    client.set_defaults(func=cmd_client)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def runtime_config(args):
    """(the ``RuntimeConfig``, the mesh description) ``jaxmoe serve`` runs with these parsed arguments:
    the model, the mesh file, brownout and SALC (``serve_brownout``), the pipeline and the autoscaler."""
    from jaxmoe.assembly import BrownoutSection, FinDEPConfig, JanusConfig, QLLMConfig, RuntimeConfig
    from jaxmoe.engine.config import EngineConfig
    from jaxmoe.engine.policies import make_policy

    if os.getcwd() not in sys.path:  # --policy module:Class may name a module here (as uvicorn's app dir)
        sys.path.insert(0, os.getcwd())
    policy = make_policy(args.policy)  # a bad name or module:Class fails now, before the model loads
    engine = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        max_waiting=args.max_waiting,
        max_model_len=args.max_model_len,
        max_prefill_chunk=args.max_prefill_chunk,
        policy=policy,
        pause_every=args.pause_every,
        expert_impl=args.expert_impl,
        prefix_caching=args.prefix_caching,
        deterministic=args.deterministic,
        async_scheduling=args.async_scheduling,
    )
    mesh_description = "monolithic: one device (no mesh file)"
    spec = None
    if args.mesh:
        from jaxmoe.mesh import load_mesh

        spec = load_mesh(args.mesh)
        mesh_description = spec.describe()
    settings = serve_brownout(args, spec)
    brownout = BrownoutSection(from_mesh_file=False)  # serve_brownout merged the file's section and the flags
    if settings is not None:
        brownout = BrownoutSection(settings.brownout(), settings.salc_config(), from_mesh_file=False)
    pipeline = None
    if args.pipeline is not None:
        from jaxmoe.findep.online import parse_pipeline

        pipeline = parse_pipeline(args.pipeline)
    config = RuntimeConfig(
        model=args.model,
        dtype=args.dtype,
        mesh=args.mesh,
        engine=engine,
        janus=JanusConfig(
            rebalance_every=args.rebalance_every,
            autoscale_slo_tpot_s=args.slo_tpot_ms / 1e3 if args.autoscale else None,
            autoscale_interval_s=args.autoscale_interval,
            scaling_profile=args.scaling_profile,
        ),
        findep=FinDEPConfig(pipeline, args.pipeline_profile),
        brownout=brownout,
        qllm=QLLMConfig(args.layer_preemption, args.expert_queues, args.max_paused_state_bytes),
        quantization=args.quantization,
        quantize_attention=args.quantize_attention,
    )
    return config, mesh_description


def cmd_serve(args) -> int:
    import asyncio  # here, not at the top: ``jaxmoe --help`` and ``jaxmoe client`` stay fast

    from jaxmoe.server.app import ServeOptions
    from jaxmoe.server.http_server import HttpLimits
    from jaxmoe.server.security import SecurityOptions

    from jaxmoe.server import multihost
    from jaxmoe.server.serve_options import (
        ServeOptionError,
        check_max_model_len,
        check_ports_free,
        raise_open_files_limit,
        validate_serve_args,
    )

    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.log_requests:
        logging.getLogger("jaxmoe.requests").setLevel(logging.WARNING)
    try:  # every option, and the ports, before the model loads: one line naming the option
        validate_serve_args(args)
        cluster = multihost.distributed_args(args)
        if cluster is None or args.process_id in (None, 0):
            check_ports_free(args.host, {"--grpc-port": args.grpc_port, "--http-port": args.http_port})
    except ServeOptionError as e:
        print(f"jaxmoe: {e}", file=sys.stderr)
        return 2
    processes, process_index = 1, 0
    if cluster is not None:
        try:
            multihost.join(cluster)
        except Exception as e:  # noqa: BLE001 - a coordinator that does not answer, a bad environment
            where = "--coordinator" if "coordinator_address" in cluster else "jax.distributed"
            print(f"jaxmoe: {where}: could not join the cluster: {str(e).splitlines()[0][:300]}", file=sys.stderr)
            return 2
        import jax

        processes, process_index = jax.process_count(), jax.process_index()
    raise_open_files_limit()  # thousands of HTTP connections (--http-max-connections)
    if args.autoscale and not (args.mesh and args.slo_tpot_ms):
        print("jaxmoe: --autoscale needs --mesh and --slo-tpot-ms", file=sys.stderr)
        return 2
    if args.scaling_profile and not args.autoscale:
        print("jaxmoe: --scaling-profile is the --autoscale performance model: give --autoscale too", file=sys.stderr)
        return 2
    from jaxmoe.assembly import build_engine

    config, mesh_description = runtime_config(args)
    if processes > 1:
        from jaxmoe.mesh import MeshConfigError, load_mesh

        try:
            multihost.check_multihost(args, load_mesh(args.mesh) if args.mesh else None)
            if config.brownout.salc is not None:
                raise ServeOptionError("--salc: not available when serving on several processes (--no-salc)")
        except (ServeOptionError, MeshConfigError) as e:
            multihost.refuse(str(e))
    engine = build_engine(config)
    if process_index > 0:  # a follower: the same engine, the steps process 0 broadcasts, no front end
        code = multihost.follow(engine)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        check_max_model_len(args, engine.cfg.max_position)
    except ServeOptionError as e:
        if processes > 1:
            multihost.refuse(str(e))
        print(f"jaxmoe: {e}", file=sys.stderr)
        return 2
    opts = ServeOptions(
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        model_name=args.served_model_name or str(args.model),
        mesh_description=mesh_description,
        warmup=not args.no_warmup,
        warmup_progress=False if args.quiet else None,
        request_timeout_s=args.request_timeout or None,
        max_body_bytes=args.max_body_bytes,
        body_read_timeout_s=args.body_read_timeout,
        http_limits=HttpLimits(
            max_connections=args.http_max_connections,
            keep_alive_timeout_s=args.keep_alive_timeout,
            header_timeout_s=args.header_timeout,
            max_header_bytes=args.max_header_bytes,
        ),
        security=SecurityOptions(
            api_key=args.api_key or None,
            protect_health=args.protect_health,
            allowed_origins=_names(args.allowed_origins),
            allowed_hosts=None if args.allowed_hosts is None else _names(args.allowed_hosts),
        ),
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(
            f"jaxmoe: warning: binding {args.host} without --api-key: anyone who reaches it can use it", file=sys.stderr
        )
    code = asyncio.run(
        _serve(
            engine,
            opts,
            args.abort_on_shutdown,
            args.shutdown_grace,
            multihost=processes > 1,
            step_timeout=args.step_timeout,
        )
    )
    if processes > 1 and code == 0:
        multihost.shutdown()  # the followers got STOP from the engine loop and leave too
    # Everything is stopped and drained: exit now. The interpreter's own teardown (the XLA client and
    # gRPC core freeing their thread pools, a cancelled rescale build finishing its compile) takes
    # seconds more and does nothing a server needs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(
    engine, opts, abort_on_shutdown: bool, grace: float, multihost: bool = False, step_timeout: float | None = None
) -> int:
    import asyncio

    from jaxmoe.engine.async_engine import WarmupCancelled
    from jaxmoe.engine.replication import ClusterFailedError, Leader
    from jaxmoe.server.app import JaxmoeServer
    from jaxmoe.server.multihost import FAILED_LINGER_S, watch_processes, watch_steps

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = JaxmoeServer(engine, opts, leader=Leader() if multihost else None)
    watching = threading.Event()
    if multihost:
        watch_processes(server.async_engine, watching)
        if step_timeout:
            watch_steps(server.async_engine, watching, step_timeout)
    print("jaxmoe: warming up (compiling) ..." if opts.warmup else "jaxmoe: starting ...", flush=True)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    failing = asyncio.ensure_future(server.cluster_failed.wait())
    await asyncio.wait({starting, stopping, failing}, return_when=asyncio.FIRST_COMPLETED)

    async def cluster_failed(reason) -> int:
        # a process of the cluster is gone: every request has ended with an error; answer 503 a
        # little longer (health checks, load balancers), then exit non-zero for the supervisor
        print(f"jaxmoe: error: {reason}; exiting in {FAILED_LINGER_S:g} s", file=sys.stderr, flush=True)
        await asyncio.sleep(FAILED_LINGER_S)
        await server.stop(abort_inflight=True, grace=0.0)
        return 1

    if starting.done() and isinstance(starting.exception(), ClusterFailedError):
        return await cluster_failed(starting.exception())
    if failing.done():
        return await cluster_failed(server.failure)
    if starting.done() and isinstance(starting.exception(), OSError):  # a port taken since the check
        print(f"jaxmoe: {starting.exception()}", file=sys.stderr, flush=True)
        await server.stop(abort_inflight=True, grace=0.0)
        return 1
    if not starting.done():  # a signal during warm-up: stop at the next program boundary
        server.cancel_warmup.set()
        try:
            await starting
        except WarmupCancelled:
            pass
        print("jaxmoe: stopped during warm-up", flush=True)
        await server.stop(abort_inflight=True, grace=0.0)
        return 0
    starting.result()
    print(f"jaxmoe: warm-up took {server.warmup_seconds:.1f}s", flush=True)
    print(f"jaxmoe: grpc listening on {opts.host}:{server.grpc_port}", flush=True)
    print(f"jaxmoe: http listening on {opts.host}:{server.http_port}", flush=True)
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    if failing.done():
        return await cluster_failed(server.failure)
    watching.set()  # the followers leave after the drain: not a failure
    print("jaxmoe: shutting down", flush=True)
    await server.stop(abort_inflight=abort_on_shutdown or grace == 0, grace=0.0 if abort_on_shutdown else grace)
    print("jaxmoe: stopped", flush=True)
    return 0


def cmd_client(args) -> int:
    import grpc

    from jaxmoe.server.client import JaxmoeClient

    with JaxmoeClient(args.target) as client:
        try:
            if args.info:
                print(client.model_info(timeout=args.timeout))
                print(f"health: {client.health(timeout=args.timeout)}")
                return 0
            last = None
            for chunk in client.generate(
                args.prompt,
                timeout=args.timeout,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop,
                logprobs=args.logprobs,
                priority=args.priority,
            ):
                if args.logprobs is None:
                    print(chunk.delta_text, end="", flush=True)
                for lp in chunk.logprobs:  # one line per token when logprobs are asked
                    top = " ".join(f"{t.token!r}:{t.logprob:.3f}" for t in lp.top)
                    print(f"{lp.token_id:>6} {lp.token!r:>8} {lp.logprob:8.3f}  top: {top}")
                last = chunk
            print()
            if last is not None:
                u = last.usage
                print(
                    f"--- finish_reason={last.finish_reason} prompt_tokens={u.prompt_tokens} "
                    f"completion_tokens={u.completion_tokens}",
                    file=sys.stderr,
                )
        except grpc.RpcError as e:
            print(f"jaxmoe: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
