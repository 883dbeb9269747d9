"""What refusing huge prompts costs the event loop that runs the streams (``jaxmoe-server``).

A server (``ServerThread`` on ``LLM("demo")``, the tests' warm-up) in this process; a spawned child
process sends ``--refusals`` 2,000,000-character prompts over HTTP, one connection each, completions
and chat in turn, one after another, each answered 400. Meanwhile a 1 ms ``call_at`` heartbeat on the
event loop records how late it runs (the loop's lag: how long anything else ready on the loop, such as
a stream's next token, waited), and ``/proc/<pid>/task/<tid>/schedstat`` gives the CPU time of the
loop's thread (less what it used over as long a window right after, with nothing sent: the
heartbeat's own CPU) and of the second loop's (``jaxmoe-http-large``, where it exists); and a child
process samples every 0.5 ms whether the loop's thread sleeps on a futex (``wchan``: waiting for the
GIL), again less the same window idle.
Runs on any checkout (``PYTHONPATH`` chooses which), so the same script measures main and a branch.

    python bench/large_body_loop.py --refusals 30 [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import threading
import time

HUGE = 2_000_000


def _cpu_s(tid: int | None) -> float:
    if tid is None:
        return 0.0
    with open(f"/proc/{os.getpid()}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _tid(name: str) -> int | None:
    return next((t.native_id for t in threading.enumerate() if t.name == name), None)


def refuse(port: int, n: int, out) -> None:
    bodies = [
        json.dumps({"prompt": "x" * HUGE, "max_tokens": 4}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x" * HUGE}], "max_tokens": 4}).encode(),
    ]
    statuses = []
    for i in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        path = "/v1/completions" if i % 2 == 0 else "/v1/chat/completions"
        conn.request("POST", path, bodies[i % 2], {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        statuses.append(resp.status)
        conn.close()
    out.put(statuses)


def watch(pid: int, tid: int, stop, out) -> None:
    """(a child process: it takes no GIL of the server's) Every 0.5 ms, whether the loop's thread sleeps
    on a futex (``/proc/.../wchan``: for a Python thread, waiting for the GIL); puts (samples, futex)."""
    samples = futex = 0
    with open(f"/proc/{pid}/task/{tid}/wchan") as f:
        while not stop.is_set():
            f.seek(0)
            samples += 1
            futex += f.read().startswith("futex")
            time.sleep(0.0005)
    out.put((samples, futex))


def _gil_wait_s(ctx, tid: int, seconds_of) -> tuple[float, float]:
    """(seconds the loop's thread waited on a futex, seconds sampled) while ``seconds_of()`` runs."""
    stop, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=watch, args=(os.getpid(), tid, stop, out))
    child.start()
    time.sleep(0.5)  # the child is sampling
    took = seconds_of()
    stop.set()
    samples, futex = out.get(timeout=60)
    child.join(60)
    return took * futex / max(samples, 1), took


def one_round(server, refusals: int) -> dict:
    loop = server._loop
    lags: list[float] = []
    beating = threading.Event()
    beating.set()

    def beat(due: float) -> None:
        now = loop.time()
        lags.append(now - due)
        if beating.is_set():
            loop.call_at(now + 0.001, beat, now + 0.001)

    loop.call_soon_threadsafe(lambda: beat(loop.time()))
    tids = {name: _tid(name) for name in ("jaxmoe-server", "jaxmoe-http-large")}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=refuse, args=(server.http_port, refusals, out))
    time.sleep(0.2)
    lags.clear()
    load = os.getloadavg()[0]
    cpu: dict = {}

    def refusing() -> float:
        lags.clear()
        cpu["before"] = {name: _cpu_s(tid) for name, tid in tids.items()}
        t0 = time.monotonic()
        child.start()
        cpu["statuses"] = out.get(timeout=600)
        child.join(60)
        took = time.monotonic() - t0
        cpu["after"] = {name: _cpu_s(tid) for name, tid in tids.items()}
        cpu["busy"] = list(lags)
        return took

    gil_busy, took = _gil_wait_s(ctx, tids["jaxmoe-server"], refusing)
    before, after, statuses, busy = cpu["before"], cpu["after"], cpu["statuses"], cpu["busy"]

    def idling() -> float:  # the same window again with nothing sent: the heartbeat's own CPU, the machine's lag
        lags.clear()
        idle_before = _cpu_s(tids["jaxmoe-server"])
        time.sleep(took)
        cpu["idle"] = _cpu_s(tids["jaxmoe-server"]) - idle_before
        cpu["idle_lags"] = list(lags)
        return took

    gil_idle, _ = _gil_wait_s(ctx, tids["jaxmoe-server"], idling)
    idle_cpu, idle = cpu["idle"], cpu["idle_lags"]
    beating.clear()
    time.sleep(0.05)
    return {
        "statuses": sorted(set(statuses)),
        "load": (load, os.getloadavg()[0]),
        "seconds": took,
        "loop_cpu_ms": (after["jaxmoe-server"] - before["jaxmoe-server"] - idle_cpu) * 1e3 / refusals,
        "large_cpu_ms": (after["jaxmoe-http-large"] - before["jaxmoe-http-large"]) * 1e3 / refusals,
        "second_loop": tids["jaxmoe-http-large"] is not None,
        "gil_wait_ms": (gil_busy - gil_idle) * 1e3 / refusals,
        "lag_ms": _lag_ms(busy),
        "idle_lag_ms": _lag_ms(idle),
    }


def _lag_ms(lags: list) -> tuple[float, float]:
    """(p99, max) in milliseconds."""
    return statistics.quantiles(lags, n=100)[98] * 1e3, max(lags) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refusals", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from jaxmoe.server.app import ServeOptions, ServerThread
    from jaxmoe.server.testing import WARMUP, shared_demo_llm

    st = ServerThread(shared_demo_llm().engine, ServeOptions(model_name="m", **WARMUP))
    server = st.start()
    try:
        for i in range(args.rounds):
            r = one_round(server, args.refusals)
            print(
                f"{args.label} round {i + 1} load {r['load'][0]:.1f}-{r['load'][1]:.1f}: answers {r['statuses']}, "
                f"{args.refusals} in {r['seconds']:.2f} s; jaxmoe-server CPU {r['loop_cpu_ms']:.2f} ms per refusal "
                f"beyond idle, jaxmoe-http-large CPU {r['large_cpu_ms']:.2f} ms (second loop: {r['second_loop']}); "
                f"jaxmoe-server waiting on a futex (the GIL) {r['gil_wait_ms']:.2f} ms per refusal beyond idle; "
                "loop lag p99 / max %.1f / %.1f ms, the same window idle %.1f / %.1f ms"
                % (*r["lag_ms"], *r["idle_lag_ms"]),
                flush=True,
            )
    finally:
        st.stop(abort_inflight=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
