"""``jaxmoe serve`` on several processes (``jax.distributed``): which cluster to join (flags or the
environment), the checks before the model loads, and a follower's loop.

Process 0 serves HTTP and gRPC; every other process builds the same engine and runs the steps
process 0 broadcasts (``jaxmoe.engine.replication``), with no front end. docs/multi_host.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from jaxmoe.server.serve_options import MAX_PORT, ServeOptionError

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 10  # jax's coordination service declares a silent process dead after this
WATCH_INTERVAL_S = 1.0  # process 0 asks the coordination service which processes live this often
SHUTDOWN_TIMEOUT_S = 30  # jax.distributed.shutdown's barrier waits at most this
FAILED_LINGER_S = 5.0  # after a process is gone, process 0 answers 503 this long, then exits 1
STEP_TIMEOUT_S = 300.0  # --step-timeout's default: process 0 waits this long in one step or broadcast


def distributed_args(args, environ=os.environ) -> dict | None:
    """``jax.distributed.initialize``'s keyword arguments from ``--coordinator``, ``--num-processes``,
    ``--process-id`` and ``--distributed``; ``{}`` (jax reads the environment) with none of the three
    under SLURM or Open MPI with several tasks, with ``$JAX_COORDINATOR_ADDRESS``, or with
    ``--distributed`` (e.g. Cloud TPU); None: one process. ``ServeOptionError`` naming the flag."""
    coordinator = getattr(args, "coordinator", None)
    num, pid = getattr(args, "num_processes", None), getattr(args, "process_id", None)
    if coordinator is None and num is None and pid is None:
        tasks = (
            environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or environ.get("OMPI_COMM_WORLD_SIZE")
        )
        several = tasks is not None and tasks.isdigit() and int(tasks) > 1
        if getattr(args, "distributed", False) or several or environ.get("JAX_COORDINATOR_ADDRESS"):
            return {}
        return None
    if num is None or pid is None:
        missing = "--num-processes" if num is None else "--process-id"
        raise ServeOptionError(f"{missing}: give --num-processes and --process-id together (with --coordinator)")
    if coordinator is None and not environ.get("JAX_COORDINATOR_ADDRESS"):
        raise ServeOptionError("--coordinator: give HOST:PORT of process 0 (or set $JAX_COORDINATOR_ADDRESS)")
    if num < 1:
        raise ServeOptionError(f"--num-processes: must be an integer >= 1, got {num}")
    if not 0 <= pid < num:
        raise ServeOptionError(f"--process-id: must be an integer in 0..{num - 1} (--num-processes {num}), got {pid}")
    out = dict(num_processes=num, process_id=pid)
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
            raise ServeOptionError(f"--coordinator: must be HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}")
        out["coordinator_address"] = coordinator
    return out


def join(kwargs: dict) -> None:
    """``jax.distributed.initialize(**kwargs)`` (CPU collectives: gloo); blocks until every process
    has joined."""
    import jax

    if "jax_cpu_collectives_implementation" in jax.config.values:  # the default on jax 0.10
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "jax_enable_recoverability" in jax.config.values:
        # a dead process is reported (``get_live_nodes``) instead of terminating every other one, so
        # that process 0 can answer 503 and end its requests with an error before it exits
        jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        **kwargs,
        initialization_timeout=int(os.environ.get("JAXMOE_JOIN_TIMEOUT", "300")),
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )


def check_multihost(args, spec) -> None:
    """On a cluster of several processes (after ``join``): a mesh file that matches it, and no
    option whose decisions depend on one process's clock or on arrivals inside a step."""
    import jax

    from jaxmoe.mesh import check_cluster

    if spec is None:
        raise ServeOptionError(
            f"--mesh: serving on {jax.process_count()} processes needs a mesh file whose nodes are the processes "
            "(e.g. meshes/cpu-2x4.yaml, meshes/h100-2x8.yaml)"
        )
    check_cluster(spec, jax.process_count(), jax.local_device_count(), jax.devices()[0].platform)
    for flag, on in (
        ("--layer-preemption", getattr(args, "layer_preemption", False)),
        ("--autoscale", getattr(args, "autoscale", False)),
    ):
        if on:
            raise ServeOptionError(f"{flag}: not available when serving on several processes")


def watch_steps(async_engine, stop: threading.Event, step_timeout_s: float = STEP_TIMEOUT_S) -> threading.Thread:
    """Process 0: a thread that fails the cluster (``AsyncEngine.fail_cluster``) when the engine loop has
    waited more than ``step_timeout_s`` in one broadcast or step (``AsyncEngine.cluster_wait_since``)
    with no program compiled meanwhile (a step may compile): a process that lives but stopped stepping
    (hung; its heartbeats go on, so ``watch_processes`` does not see it) leaves process 0 waiting
    there, in a collective it cannot time out."""
    import time

    from jaxmoe.compilation import compile_events

    def run() -> None:
        programs, progress = compile_events()["programs"], time.monotonic()
        while not stop.wait(WATCH_INTERVAL_S):
            now, since, compiled = time.monotonic(), async_engine.cluster_wait_since, compile_events()["programs"]
            if compiled != programs:  # compiling is progress, not a hang
                programs, progress = compiled, now
            if since is not None and now - max(since, progress) > step_timeout_s:
                async_engine.fail_cluster(
                    f"process 0 waited {now - since:.0f} s in one step for the other processes (--step-timeout "
                    f"{step_timeout_s:g}): a process of the cluster stopped stepping without dying (hung)"
                )
                return

    thread = threading.Thread(target=run, name="jaxmoe-watch-steps", daemon=True)
    thread.start()
    return thread


def watch_processes(async_engine, stop: threading.Event) -> threading.Thread:
    """Process 0: a thread asking jax's coordination service which processes live (every
    ``WATCH_INTERVAL_S``; ``get_live_nodes`` may block while all of them live: with jax 0.10.2 on CPU
    a check placed after it in this loop never ran, hence ``watch_steps``' own thread); one missing
    fails the cluster (``AsyncEngine.fail_cluster``) even while the engine loop is busy compiling or idle."""
    import jax
    from jax._src import distributed  # the client jax.distributed.initialize made (no public handle)

    n = jax.process_count()

    def run() -> None:
        client = distributed.global_state.client
        while client is not None and not stop.wait(WATCH_INTERVAL_S):
            try:
                live = client.get_live_nodes(list(range(n)))
            except Exception as e:  # noqa: BLE001 - the service itself is in this process: keep asking
                log.warning("get_live_nodes failed: %s", e)
                continue
            gone = sorted(set(range(n)) - set(live))
            if gone:
                async_engine.fail_cluster(
                    f"a process of the cluster is gone: process {', '.join(map(str, gone))} stopped sending "
                    "heartbeats to jax's coordination service"
                )
                return

    thread = threading.Thread(target=run, name="jaxmoe-watch-processes", daemon=True)
    thread.start()
    return thread


def refuse(message: str) -> None:
    """After joining: print the one-line refusal and leave at once (status 2), once every process has
    printed its own (they meet at a barrier, then process 0, which holds jax's coordination service,
    leaves last: a process still connected when it goes is aborted by jax)."""
    import time

    import jax
    from jax._src import distributed

    print(f"jaxmoe: {message}", file=sys.stderr, flush=True)
    try:
        distributed.global_state.client.wait_at_barrier("jaxmoe_refused", 10_000)
        if jax.process_index() == 0:
            time.sleep(1.0)
    except Exception:  # noqa: BLE001 - another process did not refuse: leave anyway
        pass
    os._exit(2)


def follow(engine) -> int:
    """A follower's life: run process 0's steps until it stops (0) or is gone (1)."""
    import jax

    from jaxmoe.engine.replication import follow as follow_steps

    print(f"jaxmoe: process {jax.process_index()} of {jax.process_count()}: following process 0", flush=True)
    try:
        follow_steps(engine)
    except Exception as e:  # noqa: BLE001 - the leader (or another process) is gone: exit non-zero
        print(f"jaxmoe: stopping: {type(e).__name__}: {str(e).splitlines()[0][:300]}", file=sys.stderr, flush=True)
        return 1
    print("jaxmoe: process 0 stopped the cluster", flush=True)
    shutdown()
    return 0


def shutdown() -> None:
    """Leave the cluster cleanly (every process calls it after a normal stop)."""
    import jax

    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 - exiting anyway
        print(f"jaxmoe: jax.distributed.shutdown: {e}", file=sys.stderr, flush=True)
