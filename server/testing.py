"""Helpers for the serving tests and benchmarks.

Compiling the demo model's programs dominates a CPU test run, and compiled programs belong to an
executor, so all serving tests of one pytest process share one ``LLM("tiny-random")`` (and its engine):
the standalone references are computed with ``llm.generate`` while no server wraps the engine,
then a server / ``AsyncEngine`` wraps that same engine. The small KV geometry (64-token blocks,
256-token context) keeps every test sequence in one block, so few bucket shapes get compiled.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time

import jax

TEST_ENGINE_KWARGS = dict(block_size=64, num_blocks=32, max_num_seqs=8, max_model_len=256, max_waiting=64)
# the shapes the server tests meet; prompt scoring (echo with logprobs) compiles when first used
WARMUP = dict(
    warmup_shapes=tuple([(b, 1) for b in (1, 2, 4, 8)] + [(b, t) for t in (16, 32) for b in (1, 2, 4)]),
    warmup_scoring=False,
)


@functools.lru_cache(maxsize=None)
def shared_demo_llm():
    from jaxmoe.llm import LLM

    return LLM("tiny-random", **TEST_ENGINE_KWARGS)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def engine_idle_and_free(async_engine) -> bool:
    """No request left in the engine and every KV block free (read on the engine thread)."""

    def check(engine):
        bm = engine.block_manager
        return not engine.has_work() and bm.num_free == bm.num_blocks

    return async_engine.call(check)


def burst_into_full_queue(async_engine, send, n: int = 12, max_waiting: int = 2) -> list:
    """Send ``n`` requests at once (``send(i)`` from n threads) while the engine loop is held
    busy (until all n are queued) and at most ``max_waiting`` requests may wait: ``max_waiting`` are admitted, the rest
    are overloaded. Returns the ``send`` results in order; restores the queue bound."""
    old = async_engine.call(lambda e: e.scheduler.max_waiting)
    async_engine.call(lambda e: setattr(e.scheduler, "max_waiting", max_waiting))
    barrier = threading.Barrier(n)

    holding = threading.Event()

    def hold(engine):  # the loop waits until all n requests are queued (prompts are tokenized first, elsewhere)
        holding.set()
        deadline = time.monotonic() + 60
        while async_engine._commands.qsize() < n and time.monotonic() < deadline:
            time.sleep(0.01)

    busy = threading.Thread(target=async_engine.call, args=(hold,), daemon=True)
    busy.start()
    holding.wait(60)  # the blocking call holds the loop first: all n requests arrive meanwhile

    def one(i):
        barrier.wait(10)
        return send(i)

    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n), timeout=120))
    finally:
        async_engine.call(lambda e: setattr(e.scheduler, "max_waiting", old))


def crashing_run(runner, message: str = "injected device failure"):
    """A stand-in for ``runner.run`` that fails like a crashed device program which had the KV
    cache donated to it: it deletes the cache arrays, then raises RuntimeError(message).
    ``.calls`` counts its calls."""

    def run(rows, between_layers=None):
        run.calls += 1
        for leaf in jax.tree.leaves(runner.executor.cache):
            leaf.delete()
        raise RuntimeError(message)

    run.calls = 0
    return run


@contextlib.contextmanager
def failing_steps(async_engine, message: str = "injected device failure"):
    """While inside, every model run of the engine is a ``crashing_run`` (yielded)."""
    runner = async_engine.engine.runner
    real_run, broken = runner.run, crashing_run(runner, message)
    async_engine.call(lambda e: setattr(runner, "run", broken))
    try:
        yield broken
    finally:
        async_engine.call(lambda e: setattr(runner, "run", real_run))


async def http_burst(port: int, n: int, body: dict, path: str = "/v1/completions", timeout: float = 300.0) -> list:
    """``n`` HTTP requests over ``n`` simultaneous loopback connections (every connection is opened
    before any request is sent). Returns one (status, parsed JSON body or None, headers) per request;
    status 0: the connection failed or was closed without an answer."""
    import asyncio
    import json

    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()

    async def connect():
        try:
            return await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        except OSError:
            return None

    async def one(conn):
        if conn is None:
            return 0, None, {}
        reader, writer = conn
        try:
            writer.write(head + data)
            await writer.drain()
            raw = await reader.read()
        except OSError:
            return 0, None, {}
        finally:
            writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        headers_raw, _, payload = rest.partition(b"\r\n\r\n")
        if not status_line.startswith(b"HTTP/1.1 "):
            return 0, None, {}
        headers = dict(line.decode("latin-1").split(": ", 1) for line in headers_raw.split(b"\r\n") if b": " in line)
        headers = {k.lower(): v for k, v in headers.items()}
        try:
            parsed = json.loads(payload) if payload.startswith(b"{") else None
        except ValueError:
            parsed = None
        return int(status_line.split()[1]), parsed, headers

    conns = await asyncio.gather(*(connect() for _ in range(n)))
    return await asyncio.wait_for(asyncio.gather(*(one(c) for c in conns)), timeout)
