"""Multi-host serving on one machine: ``jaxmoe serve`` as 2 JAX processes x 4 CPU devices against 1
process with the same 8 devices, the same mesh file (meshes/cpu-2x4.yaml) and the same load.

Each server is started as a subprocess (warm-up on: no compile while measuring), then a closed loop of
``--concurrency`` clients sends ``--requests`` streamed greedy completions (HTTP, fixed prompt,
``--max-tokens`` tokens each). Reported: requests/s over the run, TTFT (first streamed token) and ITL
(mean gap between the following tokens) P50 / P90 at the client.

    python bench/multihost_serve.py --out bench/results/$(date +%F)-multihost-serve.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["--num-blocks", "64", "--block-size", "8", "--max-num-seqs", "2", "--max-prefill-chunk", "16"]
ENGINE += ["--max-batch-tokens", "32"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(processes: int, model: str, log_dir: Path) -> tuple[list[subprocess.Popen], int]:
    http, coordinator = _port(), _port()
    devices = 8 // processes
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "jaxmoe.cli", "serve", "--model", model, "--dtype", "float32"]
        cmd += ["--mesh", str(ROOT / "meshes" / "cpu-2x4.yaml"), "--http-port", str(http), "--grpc-port", "0"]
        cmd += [*ENGINE, "--quiet"]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", str(processes)]
            cmd += ["--process-id", str(i)]
        log = open(log_dir / f"bench-serve-{processes}p-{i}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        if "http listening" in (log_dir / f"bench-serve-{processes}p-0.log").read_text(errors="replace"):
            return procs, http
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(1)
    stop(procs)
    raise SystemExit(f"server with {processes} process(es) did not start; logs in {log_dir}")


def stop(procs) -> None:
    procs[0].send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def one(port: int, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times[0] - t0, (times[-1] - times[0]) / max(1, len(times) - 1)


def load(port: int, args) -> dict:
    ttft, itl, lock, todo = [], [], threading.Lock(), list(range(args.requests))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            a, b = one(port, args.prompt, args.max_tokens)
            with lock:
                ttft.append(a)
                itl.append(b)

    one(port, args.prompt, args.max_tokens)  # one request first (connections, tokenizer)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def pct(xs, q):
        return statistics.quantiles(xs, n=10)[q // 10 - 1] if len(xs) > 1 else xs[0]

    return {
        "req_s": args.requests / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * pct(ttft, 90),
        "itl_p50_ms": 1e3 * statistics.median(itl),
        "itl_p90_ms": 1e3 * pct(itl, 90),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt", default="The mixture of experts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    rows = []
    for processes in (1, 2):
        procs, port = start(processes, args.model, log_dir)
        try:
            r = load(port, args)
        finally:
            stop(procs)
        rows.append((processes, r))
        print(processes, json.dumps(r), flush=True)
    table = [
        "| server | requests/s | TTFT P50 / P90 (ms) | ITL P50 / P90 (ms) |",
        "|---|---|---|---|",
    ]
    for processes, r in rows:
        what = "1 process x 8 CPU devices" if processes == 1 else "2 processes x 4 CPU devices (jax.distributed)"
        table.append(
            f"| {what} | {r['req_s']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} |"
        )
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(
            f"# multi-host serving, {time.strftime('%Y-%m-%d')}\n\n"
            f"`python bench/multihost_serve.py {' '.join(argv or sys.argv[1:])}` (model {args.model}, "
            f"meshes/cpu-2x4.yaml, {args.requests} requests, concurrency {args.concurrency}, "
            f"{args.max_tokens} tokens each)\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
