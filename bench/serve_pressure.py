"""Serving under pressure, against a ``jaxmoe serve`` subprocess on default flags (loopback):

1. huge prompts: a 2,000,000-character prompt over HTTP (completions and chat) and gRPC while a
   stream runs and ``/health`` is probed every 20 ms: the refusal times, the largest ``/health``
   latency, the stream's largest gap between tokens against its median gap (and, as the noise
   floor of the machine, the same stream's gaps run alone just before);
2. with ``--gap-pairs N``, the stream's pace fairly: N pairs of the same stream, alone and while
   huge prompts are refused one after another for the whole stream (HTTP completions, chat, gRPC
   in turn), in alternating order in the same window: each stream's largest gap over its median
   gap, the distribution of both;
3. a burst of N simultaneous HTTP requests (every connection opened before any request is sent,
   from a child process, so that its event loop does not hold this process's GIL while the
   ``/health`` probe here waits to read its answer): how many got 200, JSON 429, anything else.

    python bench/serve_pressure.py --model demo --burst 1200 [--gap-pairs 20] [--out bench/results/DATE-serving-pressure.md]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import multiprocessing
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc

from jaxmoe.server.client import make_request
from jaxmoe.server.testing import http_burst

HUGE = 2_000_000


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, int, int]:
    cmd = [sys.executable, "-m", "jaxmoe.cli", "serve", "--model", model, "--http-port", "0", "--grpc-port", "0"]
    proc = subprocess.Popen(
        [*cmd, *extra],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ports = {}
    deadline = time.monotonic() + 1200
    while len(ports) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("the server exited during start")
        m = re.search(r"(grpc|http) listening on [^:]+:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    return proc, ports["http"], ports["grpc"]


def probe_health(port: int, stop: threading.Event, out: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        t0 = time.monotonic()
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        out.append((resp.status, time.monotonic() - t0))
        time.sleep(0.02)
    conn.close()


def post(port: int, path: str, data: bytes) -> tuple[int, dict, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.monotonic()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data, time.monotonic() - t0


def stream(port: int, max_tokens: int, times: list) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, logprobs=0)  # a chunk for every token
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    for line in conn.getresponse():
        if line.startswith(b"data: {"):
            times.append(time.monotonic())
    conn.close()


def gaps_of(times: list) -> list:
    return sorted(b - a for a, b in zip(times, times[1:]))


def huge_prompts(http_port: int, grpc_port: int, max_tokens: int) -> dict:
    # encoded before the stream starts: this process's own json.dumps of 2 MB would hold its GIL
    # while the stream's reader thread waits to timestamp a chunk
    huge = "x" * HUGE
    completion = json.dumps({"prompt": huge, "max_tokens": 4}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": huge}], "max_tokens": 4}).encode()
    rpc = make_request(huge, max_tokens=4).SerializeToString()
    control: list = []  # the same stream alone first: the gaps this machine makes with no huge prompt
    stream(http_port, max_tokens, control)
    stop, health, times = threading.Event(), [], []
    prober = threading.Thread(target=probe_health, args=(http_port, stop, health))
    streamer = threading.Thread(target=stream, args=(http_port, max_tokens, times))
    prober.start()
    streamer.start()
    while len(times) < 10 and streamer.is_alive():
        time.sleep(0.01)
    refusals = {}
    window_start = time.monotonic()
    status, body, took = post(http_port, "/v1/completions", completion)
    refusals["http completions"] = (status, took, body["error"]["message"])
    status, body, took = post(http_port, "/v1/chat/completions", chat)
    refusals["http chat"] = (status, took, body["error"]["message"])
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        t0 = time.monotonic()
        try:
            list(ch.unary_stream("/jaxmoe.v1.Jaxmoe/Generate")(rpc, timeout=300))  # bytes as they are
            refusals["grpc"] = ("OK", time.monotonic() - t0, "")
        except grpc.RpcError as e:
            refusals["grpc"] = (e.code().name, time.monotonic() - t0, e.details())
    window_end = time.monotonic()
    streamer.join(600)
    stop.set()
    prober.join(60)
    gaps, alone = gaps_of(times), gaps_of(control)
    during = [b - a for a, b in zip(times, times[1:]) if b > window_start and a < window_end]
    return {
        "alone_median_gap_s": statistics.median(alone),
        "alone_max_gap_s": alone[-1],
        "refusals": refusals,
        "health_max_s": max(lat for _, lat in health),
        "health_non_200": sum(s != 200 for s, _ in health),
        "health_probes": len(health),
        "stream_tokens": len(times),
        "stream_median_gap_s": statistics.median(gaps),
        "stream_max_gap_s": gaps[-1],
        "huge_window_s": window_end - window_start,
        "during_max_gap_s": max(during, default=0.0),  # a gap that overlaps the refusals
    }


def huge_bodies() -> tuple[list, bytes]:
    """The huge prompts, encoded once: (HTTP path and body) x 2, the gRPC request's bytes."""
    huge = "x" * HUGE
    bodies = [
        ("/v1/completions", json.dumps({"prompt": huge, "max_tokens": 4}).encode()),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": huge}], "max_tokens": 4}).encode(),
        ),
    ]
    return bodies, make_request(huge, max_tokens=4).SerializeToString()


def refuse_until(
    http_port: int, grpc_port: int, encoded, stop: threading.Event, answers: list, sink=None, start=None, once=False
) -> None:
    """Huge prompts refused one after another (HTTP completions, chat, gRPC in turn) until ``stop``
    (``once``: the three, then stop), from when ``start()`` is true; with ``sink`` (a port), the same
    bytes go over HTTP to that sink process instead."""
    bodies, rpc = encoded
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        generate = ch.unary_stream("/jaxmoe.v1.Jaxmoe/Generate")
        while start is not None and not start() and not stop.is_set():
            time.sleep(0.001)
        i = 0
        while not stop.is_set() and not (once and i == 3):
            if sink is not None:
                status, _, took = post(sink, "/", bodies[i % 2][1] if i % 3 < 2 else rpc)
                answers.append((f"sink {status}", took))
            elif i % 3 < 2:
                status, _, took = post(http_port, *bodies[i % 3])
                answers.append((status, took))
            else:
                t0 = time.monotonic()
                try:
                    list(generate(rpc, timeout=300))
                    answers.append(("OK", time.monotonic() - t0))
                except grpc.RpcError as e:
                    answers.append((e.code().name, time.monotonic() - t0))
            i += 1


def _sink(port_out) -> None:
    """A loopback HTTP sink (another process): reads each request's body, answers 400 ``{}``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.put(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as f:
            length = 0
            for line in iter(f.readline, b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            f.read(length)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")


def gap_pairs(http_port: int, grpc_port: int, pairs: int, max_tokens: int, once: bool = False) -> dict:
    """Largest gap / median gap of the same stream: alone, while huge prompts are refused, and while
    the same bytes go to a sink process instead (the client's and the kernel's share of the CPU),
    in rotating order. ``once``: the three huge prompts once, after the stream's 10th token; else one
    after another for the whole stream."""
    runs: dict = {"alone": [], "refusing": [], "sink": []}
    medians: dict = {k: [] for k in runs}
    answers: list = []
    encoded = huge_bodies()  # before any stream: this process's json.dumps of 2 MB holds its GIL
    ctx = multiprocessing.get_context("spawn")
    port_q = ctx.Queue()
    sink = ctx.Process(target=_sink, args=(port_q,), daemon=True)
    sink.start()
    sink_port = port_q.get(timeout=60)
    order = list(runs)
    try:
        for i in range(pairs):
            for kind in order[i % 3 :] + order[: i % 3]:
                times: list = []
                stop = threading.Event()
                args = (http_port, grpc_port, encoded, stop, answers, sink_port if kind == "sink" else None)
                args += ((lambda t=times: len(t) >= 10) if once else None, once)
                refuser = threading.Thread(target=refuse_until, args=args)
                if kind != "alone":
                    refuser.start()
                stream(http_port, max_tokens, times)
                stop.set()
                if kind != "alone":
                    refuser.join(300)
                gaps = gaps_of(times)
                runs[kind].append(gaps[-1] / statistics.median(gaps))
                medians[kind].append(statistics.median(gaps))
    finally:
        sink.kill()
    return {"ratios": {k: sorted(v) for k, v in runs.items()}, "medians": medians, "answers": answers}


def _dist(ratios: list) -> str:
    q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    return f"median {statistics.median(ratios):.2f}x, p10 {q[0]:.2f}x, p90 {q[-1]:.2f}x, max {max(ratios):.2f}x"


def burst(http_port: int, n: int, max_tokens: int) -> dict:
    stop, health = threading.Event(), []
    prober = threading.Thread(target=probe_health, args=(http_port, stop, health))
    prober.start()
    t0 = time.monotonic()
    body = {"prompt": "burst", "max_tokens": max_tokens, "temperature": 0}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.submit(_burst_client, http_port, n, body).result()
    took = time.monotonic() - t0
    stop.set()
    prober.join(60)
    statuses = [s for s, _, _ in results]
    json_429 = sum(1 for s, b, h in results if s == 429 and b and "error" in b and "retry-after" in h)
    return {
        "n": n,
        "served_200": statuses.count(200),
        "json_429": json_429,
        "other": len(statuses) - statuses.count(200) - json_429,
        "seconds": took,
        "health_max_s": max(lat for _, lat in health),
        "health_non_200": sum(s != 200 for s, _ in health),
        "health_probes": len(health),
    }


def _burst_client(port: int, n: int, body: dict) -> list:
    return asyncio.run(http_burst(port, n, body, timeout=1800))


def metrics_rejected(http_port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {
        m[1]: float(m[2]) for m in re.finditer(r'^jaxmoe_requests_rejected_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--burst", type=int, default=1200)
    ap.add_argument("--burst-max-tokens", type=int, default=1)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--gap-pairs", type=int, default=0, help="rounds of streams alone / refusing / sink (0: none)")
    ap.add_argument(
        "--refusals",
        choices=["once", "continuous"],
        default="once",
        help="--gap-pairs: the three huge prompts once per stream (after its 10th token) or one after another",
    )
    ap.add_argument("--skip-burst", action="store_true", help="no burst (with --gap-pairs: the pace alone)")
    ap.add_argument("--out", default=None, help="append a markdown section here")
    ap.add_argument("serve_args", nargs="*", help="more `jaxmoe serve` flags (after --)")
    args = ap.parse_args()
    proc, http_port, grpc_port = start_server(args.model, args.serve_args)
    try:
        load_start = os.getloadavg()[0]
        huge = huge_prompts(http_port, grpc_port, args.stream_tokens)
        pace = None
        if args.gap_pairs:
            pace = gap_pairs(http_port, grpc_port, args.gap_pairs, args.stream_tokens, args.refusals == "once")
        load_pace = os.getloadavg()[0]
        b = None if args.skip_burst else burst(http_port, args.burst, args.burst_max_tokens)
        rejected = metrics_rejected(http_port)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [
        f"## jaxmoe serve --model {args.model} (default flags) {' '.join(args.serve_args)}",
        "",
        f"Huge prompts ({HUGE:,} characters) while a {args.stream_tokens}-token stream runs and /health is probed:",
        "",
        "| request | answer | seconds |",
        "| --- | --- | --- |",
        *[f"| {k} | {v[0]} | {v[1]:.3f} |" for k, v in huge["refusals"].items()],
        "",
        f"- /health: {huge['health_probes']} probes, largest latency {huge['health_max_s'] * 1e3:.1f} ms, "
        f"{huge['health_non_200']} not 200",
        f"- stream: {huge['stream_tokens']} chunks, median gap {huge['stream_median_gap_s'] * 1e3:.1f} ms, "
        f"largest gap {huge['stream_max_gap_s'] * 1e3:.1f} ms "
        f"({huge['stream_max_gap_s'] / huge['stream_median_gap_s']:.2f}x the median); the same stream alone just "
        f"before: median gap {huge['alone_median_gap_s'] * 1e3:.1f} ms, largest {huge['alone_max_gap_s'] * 1e3:.1f} ms "
        f"({huge['alone_max_gap_s'] / huge['alone_median_gap_s']:.2f}x); largest gap overlapping the "
        f"{huge['huge_window_s']:.2f} s of the three refusals {huge['during_max_gap_s'] * 1e3:.1f} ms "
        f"({huge['during_max_gap_s'] / huge['stream_median_gap_s']:.2f}x the median)",
        f"- load average at the end: {os.getloadavg()[0]:.1f}",
        f"- message: {next(iter(huge['refusals'].values()))[2]}",
        "",
    ]
    if pace is not None:
        refusals = [(code, t) for code, t in pace["answers"] if not str(code).startswith("sink")]
        codes = sorted({str(code) for code, _ in refusals})
        what = {
            "alone": "alone",
            "refusing": "while the huge prompts are refused",
            "sink": "while the same bytes go to a sink process",
        }
        lines += [
            f"The stream's pace, {args.gap_pairs} rounds of {args.stream_tokens}-token streams alone / refusing / "
            f"sink in rotating order, the huge prompts {args.refusals} (load {load_start:.1f} at the start, {load_pace:.1f} at the end); largest gap / "
            "median gap of each stream:",
            "",
            *[
                f"- {what[k]}: {_dist(v)}; median gap {statistics.median(pace['medians'][k]) * 1e3:.1f} ms"
                for k, v in pace["ratios"].items()
            ],
            f"- {len(refusals)} refusals, answers {codes}, slowest {max(t for _, t in refusals):.3f} s; "
            f"{len(pace['answers']) - len(refusals)} sends to the sink",
            *[f"- every ratio, {k}: {' '.join(f'{r:.2f}' for r in v)}" for k, v in pace["ratios"].items()],
            "",
        ]
    if b is not None:
        lines += [
            f"Burst of {b['n']:,} simultaneous HTTP requests (max_tokens {args.burst_max_tokens}):",
            "",
            f"- 200: {b['served_200']:,}; JSON 429 with Retry-After: {b['json_429']:,}; anything else: {b['other']:,}"
            f" (all answered in {b['seconds']:.1f} s)",
            f"- /health during the burst: {b['health_probes']} probes, largest latency "
            f"{b['health_max_s'] * 1e3:.1f} ms, {b['health_non_200']} not 200",
            f"- jaxmoe_requests_rejected_total afterwards: {rejected}",
        ]
    lines += [f"- SIGTERM to exit (idle): {exit_s:.2f} s", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
