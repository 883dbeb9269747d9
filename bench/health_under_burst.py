"""Where a ``/health`` answer's time goes during a burst of simultaneous HTTP requests.

A server (``ServerThread`` on ``LLM("demo")``, default ``ServeOptions``) in this process; in spawned
child processes a ``/health`` prober (every 20 ms, one kept-alive connection), the burst
(``server.testing.http_burst``) and a sampler that reads, every ``--sample-ms``, the state of the
HTTP listener's thread (the one that answers ``/health``) and of the prober's from ``/proc``:
``schedstat`` (time on a core, time runnable but waiting for one), ``stat`` (R / S) and ``wchan``
(where a sleeping thread waits: ``futex`` = a lock, for a Python thread the GIL; ``ep_poll`` /
``do_select`` = waiting for bytes). Each slow probe's latency is split by what the listener
thread was doing meanwhile.

    nice -n 10 python bench/health_under_burst.py --burst 1200 [--switch-interval-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import os
import statistics
import sys
import threading
import time


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def sampler(pid: int, tids: dict, interval: float, stop, out) -> None:
    rows = []
    while not stop.is_set():
        t = time.monotonic()
        for name, (p, tid) in tids.items():
            base = f"/proc/{p}/task/{tid}"
            stat = _read(f"{base}/stat")
            state = stat.rpartition(")")[2].split()[0] if stat else "?"
            run, wait, _ = (_read(f"{base}/schedstat").split() + ["0", "0", "0"])[:3]
            rows.append((t, name, state, _read(f"{base}/wchan"), int(run), int(wait)))
        time.sleep(interval)
    out.put(rows)


def prober(port: int, stop, out) -> None:
    out.put(("tid", threading.get_native_id(), os.getpid()))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    probes = []
    while not stop.is_set():
        t0 = time.monotonic()
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        probes.append((t0, time.monotonic(), resp.status))
        time.sleep(0.02)
    out.put(("probes", probes))


def burster(port: int, n: int) -> list:
    from jaxmoe.server.testing import http_burst

    results = asyncio.run(http_burst(port, n, {"prompt": "burst", "max_tokens": 1, "temperature": 0}, timeout=1800))
    return [status for status, _, _ in results]


def split(rows, name: str, t0: float, t1: float) -> dict:
    """Seconds of [t0, t1] the thread ``name`` spent: on a core, runnable waiting for one, waiting for
    a lock (futex: the GIL), waiting for bytes (poll), other."""
    mine = [r for r in rows if r[1] == name]
    out = {"cpu": 0.0, "runqueue": 0.0, "lock (GIL)": 0.0, "poll": 0.0, "other": 0.0}
    for a, b in zip(mine, mine[1:]):
        lo, hi = max(a[0], t0), min(b[0], t1)
        if hi <= lo:
            continue
        span = b[0] - a[0]
        share = (hi - lo) / span
        cpu, rq = (b[4] - a[4]) / 1e9, (b[5] - a[5]) / 1e9
        out["cpu"] += cpu * share
        out["runqueue"] += rq * share
        asleep = max(0.0, span - cpu - rq) * share
        w = a[3] + b[3]
        key = "lock (GIL)" if "futex" in w else "poll" if ("poll" in w or "select" in w) else "other"
        out[key] += asleep
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=1200)
    ap.add_argument("--sample-ms", type=float, default=2.0)
    ap.add_argument("--slow-ms", type=float, default=50.0, help="probes slower than this are split")
    ap.add_argument("--switch-interval-ms", type=float, default=None, help="the server's GIL switch interval")
    args = ap.parse_args()
    from jaxmoe.llm import LLM
    from jaxmoe.server import serving_process
    from jaxmoe.server.app import ServeOptions, ServerThread

    if args.switch_interval_ms is not None:
        serving_process.SWITCH_INTERVAL_S = args.switch_interval_ms / 1e3
    llm = LLM("demo")
    st = ServerThread(llm.engine, ServeOptions(model_name="demo", warmup_progress=False))
    server = st.start()
    print(f"switch interval {sys.getswitchinterval() * 1e3:.2f} ms", flush=True)
    accept = next(t for t in threading.enumerate() if t.name == "jaxmoe-http-accept")
    loop = next(t for t in threading.enumerate() if t.name == "jaxmoe-server")
    ctx = multiprocessing.get_context("spawn")
    stop, q_probe, q_rows = ctx.Event(), ctx.Queue(), ctx.Queue()
    probe = ctx.Process(target=prober, args=(server.http_port, stop, q_probe))
    probe.start()
    _, probe_tid, probe_pid = q_probe.get(timeout=120)
    tids = {
        "listener": (os.getpid(), accept.native_id),
        "loop": (os.getpid(), loop.native_id),
        "prober": (probe_pid, probe_tid),
    }
    samp = ctx.Process(target=sampler, args=(os.getpid(), tids, args.sample_ms / 1e3, stop, q_rows))
    samp.start()
    time.sleep(1.0)
    load0 = os.getloadavg()[0]
    with ctx.Pool(1) as pool:
        statuses = pool.apply(burster, (server.http_port, args.burst))
    time.sleep(0.5)
    stop.set()
    probes = q_probe.get(timeout=120)[1]
    rows = q_rows.get(timeout=120)
    probe.join(30)
    samp.join(30)
    st.stop()
    lat = sorted((b - a) * 1e3 for a, b, _ in probes)
    print(
        f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}; burst: {statuses.count(200)} x 200, "
        f"{statuses.count(429)} x 429, {len(statuses) - statuses.count(200) - statuses.count(429)} other"
    )
    q = statistics.quantiles(lat, n=100)
    print(f"/health: {len(lat)} probes, p50 {q[49]:.1f} / p99 {q[98]:.1f} / max {lat[-1]:.1f} ms")
    slow = sorted(((b - a, a, b) for a, b, _ in probes if (b - a) * 1e3 > args.slow_ms), reverse=True)
    total = {}
    for took, a, b in slow[:10]:
        parts = {n: split(rows, n, a, b) for n in ("listener", "prober")}
        for n, p in parts.items():
            for k, v in p.items():
                total[(n, k)] = total.get((n, k), 0.0) + v
        desc = "; ".join(
            n + ": " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p.items() if v >= 5e-4) for n, p in parts.items()
        )
        print(f"  probe {took * 1e3:.1f} ms -> {desc} (ms)")
    if slow:
        print(
            f"the {min(10, len(slow))} slowest probes > {args.slow_ms:g} ms, summed (ms): "
            + ", ".join(f"{n} {k} {v * 1e3:.0f}" for (n, k), v in total.items() if v >= 5e-4)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
