"""One server, one checkpoint, a few requests: time to ready, peak memory and TTFT of ``jaxmoe serve``
(or vLLM's OpenAI server) on a big checkpoint, where a full load test would not fit.

The server is started as ``bench/serve_vs_vllm.py`` starts it (same settings, same environment; its
``--max-num-seqs`` etc.), waited for (``GET /health`` == 200), then sent ``--requests`` streamed
``POST /v1/completions`` one after another, each a prompt of ``--prompt-len`` random token ids (seed
0) and exactly ``--max-tokens`` greedy tokens. Reported: seconds from process start to ready, each
request's TTFT (first streamed chunk) and total time, the completion tokens, and the peak resident
memory of the server's whole process tree (sampled every 0.2 s from start to stop) / the
checkpoint's bytes.

    python bench/serve_once.py --model /tmp/mixtral-3b --dtype bfloat16 --out /tmp/serve.json
    python bench/serve_once.py --model /tmp/mixtral-3b --dtype bfloat16 --server vllm
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serve_vs_vllm import start_jaxmoe, start_vllm  # noqa: E402
from vs_vllm import tree_rss  # noqa: E402


def stream(url: str, prompt: list[int], max_tokens: int, timeout: float, vllm: bool) -> dict:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **({"min_tokens": max_tokens} if vllm else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0, first, usage = time.monotonic(), None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices"):  # a token's chunk (its text may be empty)
                first = time.monotonic() - t0
            usage = chunk.get("usage") or usage
    return {
        "ttft_s": first,
        "total_s": time.monotonic() - t0,
        "completion_tokens": (usage or {}).get("completion_tokens"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=pathlib.Path)
    p.add_argument("--server", default="jaxmoe", choices=["jaxmoe", "vllm"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-kvcache-gib", type=int, default=1)
    p.add_argument("--vllm-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every core here)")
    p.add_argument("--vllm-ld-preload", default="auto")
    p.add_argument("--vllm-arg", action="append", default=[])
    p.add_argument("--jaxmoe-arg", action="append", default=[])
    p.add_argument("--ready-timeout", type=float, default=1500)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", type=pathlib.Path)
    a = p.parse_args(argv)
    a.stop_timeout = 30
    log_dir = pathlib.Path(a.log_dir or tempfile.mkdtemp(prefix="serve_once_"))
    ckpt_bytes = sum(f.stat().st_size for f in a.model.glob("*.safetensors"))
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    server = (start_jaxmoe if a.server == "jaxmoe" else start_vllm)(a, a.model, log_dir)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(server.proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = {"server": a.server, "model": str(a.model), "dtype": a.dtype, "load_start": os.getloadavg()}
    try:
        out["ready_s"] = round(server.wait_ready(a.ready_timeout), 1)
        out["peak_at_ready_x_ckpt"] = round(peak[0] / ckpt_bytes, 3)
        out["requests"] = [
            stream(server.url, pr, a.max_tokens, a.request_timeout, a.server == "vllm") for pr in prompts
        ]
    finally:
        done.set()
        sampler.join()
        server.stop(a.stop_timeout)
    out["peak_rss_x_ckpt"] = round(peak[0] / ckpt_bytes, 3)
    out["load_end"] = os.getloadavg()
    out["log"] = str(server.log_path)
    print(json.dumps(out))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
