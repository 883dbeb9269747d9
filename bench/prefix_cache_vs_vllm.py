"""Prefix caching served over HTTP: ``jaxmoe serve`` against vLLM's OpenAI server, both with automatic
prefix caching on, on the shared-system-prompt workload of ``bench/prefix_cache.py``, in one run.

Workload (seeded, identical for both servers): a shared ``--system-tokens`` (1024) token system prompt
+ a ``--question-tokens`` (64) token question per request, ``--max-tokens`` (128) new tokens, greedy,
``ignore_eos`` (and ``min_tokens`` for vLLM), ``--requests`` requests arriving every ``--gap`` seconds
(open loop), sent as token-id lists to ``POST /v1/completions`` (streaming) so both servers see the
same prompt tokens. Each server first gets an unmeasured warm-up run of the same shape with another
system prompt (compiles, oneDNN kernels), so the measured run's first request computes the shared
prefix and the later ones can read it from the cache.

Servers (one at a time, the other stopped): started by ``bench/serve_vs_vllm.py``'s launchers with
the same settings (``--max-num-seqs``, ``--max-batch-tokens``, ``--max-model-len``, ``--dtype``;
vLLM: tcmalloc + Intel OpenMP preloaded, every core bound, its prefix caching on). jaxmoe's prefix
caching is on by default. Model: the built-in ``demo`` checkpoint (``jaxmoe/assets/demo``: a
10 M-parameter Mixtral in Hugging Face form, which vLLM loads too) unless ``--model`` names another.

Reported per server: TTFT P50 / P90, output tokens/s over the run (first send to last response),
errors, the load average before and after; then jaxmoe / vLLM ratios of output tokens/s and of TTFT
P50 (vLLM's over jaxmoe's: above 1 means jaxmoe's first tokens come sooner). After the measured run,
``--cold`` (5) cold prompts of the same length (fresh random tokens, so nothing is cached; one at a
time, one new token each): the TTFT of a whole prompt's prefill alone, median (min-max).

Run (from the repository root; vLLM's CPU build in /tmp/vllm-venv, see bench/serve_vs_vllm.py):
  .venv/bin/python bench/prefix_cache_vs_vllm.py --out /tmp/prefix-vs-vllm.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_vs_vllm as sv  # noqa: E402  (the launchers, the HTTP driver and its summary)

DEMO = pathlib.Path(__file__).resolve().parent.parent / "jaxmoe" / "assets" / "demo"


def workload(a, seed: int, vocab: int) -> list[sv.Req]:
    """``--requests`` requests sharing one system prompt, ``--gap`` s apart."""
    rng = np.random.default_rng(seed)
    system = rng.integers(10, vocab, a.system_tokens).tolist()
    return [
        sv.Req(i * a.gap, system + rng.integers(10, vocab, a.question_tokens).tolist(), a.max_tokens)
        for i in range(a.requests)
    ]


def vocab_size(model: pathlib.Path) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def bench(a, name: str, model: pathlib.Path, log_dir: pathlib.Path, vocab: int) -> dict:
    start = sv.start_jaxmoe if name == "jaxmoe" else lambda *args: sv.start_vllm(*args, prefix_caching=True)
    server = start(a, model, log_dir)
    try:
        ready = server.wait_ready(a.ready_timeout)
        print(f"[{name}] ready after {ready:.0f}s", flush=True)
        warm = workload(a, a.seed + 1, vocab)
        res, span = asyncio.run(sv.drive(server.url, "bench", warm, name == "vllm", a.request_timeout))
        s = sv.summarize(res, warm, span)
        print(f"[{name}] warm-up: {s['tok_s']:.1f} tok/s, errors {s['errors']} {s['first_error'] or ''}", flush=True)
        measured = workload(a, a.seed, vocab)
        load0 = os.getloadavg()[0]
        res, span = asyncio.run(sv.drive(server.url, "bench", measured, name == "vllm", a.request_timeout))
        s = sv.summarize(res, measured, span)
        s["load"] = (load0, os.getloadavg()[0])
        s["texts"] = [r.text for r in res]
        s["cold"] = cold_ttft(a, server.url, name == "vllm", vocab)
        print(
            f"[{name}] TTFT P50 {s['ttft'][0]:.3f}s P90 {s['ttft'][1]:.3f}s, {s['tok_s']:.1f} tok/s, "
            f"errors {s['errors']} {s['first_error'] or ''}, load {s['load'][0]:.1f}-{s['load'][1]:.1f}; "
            f"cold-prompt TTFT {_cold(s['cold'])}",
            flush=True,
        )
        return s
    finally:
        server.stop(a.stop_timeout)


def cold_ttft(a, url: str, vllm: bool, vocab: int) -> list[float]:
    """TTFT (s) of ``--cold`` prompts of the workload's length that share nothing with anything
    served before (fresh random tokens), each sent alone for one new token."""
    rng = np.random.default_rng(a.seed + 1000)
    out = []
    for _ in range(a.cold):
        prompt = rng.integers(10, vocab, a.system_tokens + a.question_tokens).tolist()
        res, _ = asyncio.run(sv.drive(url, "bench", [sv.Req(0.0, prompt, 1)], vllm, a.request_timeout))
        if res[0].error is None and res[0].first is not None:
            out.append(res[0].first - res[0].send)
    return out


def _cold(ts: list[float]) -> str:
    return f"{np.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})" if ts else "-"


def table(a, runs: dict) -> str:
    lines = [
        f"shared {a.system_tokens}-token system prompt + {a.question_tokens}-token questions, {a.max_tokens} new "
        f"tokens, {a.requests} requests {a.gap} s apart; {a.dtype}; max_num_seqs {a.max_num_seqs}",
        "",
        "| server (prefix caching on) | TTFT P50 (s) | TTFT P90 (s) | output tok/s | errors | load average "
        f"| cold {a.system_tokens + a.question_tokens}-token prompt TTFT (s), median (min-max) of {a.cold} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        lines.append(
            f"| {name} | {s['ttft'][0]:.3f} | {s['ttft'][1]:.3f} | {s['tok_s']:.1f} | {s['errors']} | "
            f"{s['load'][0]:.1f}-{s['load'][1]:.1f} | {_cold(s['cold'])} |"
        )
    if {"jaxmoe", "vllm"} <= runs.keys():
        j, v = runs["jaxmoe"], runs["vllm"]
        same = sum(x == y for x, y in zip(j["texts"], v["texts"]))
        lines += [
            "",
            f"jaxmoe / vLLM output tok/s: **{j['tok_s'] / v['tok_s']:.2f}x**; "
            f"TTFT P50 vLLM / jaxmoe: **{v['ttft'][0] / j['ttft'][0]:.2f}x** (above 1: jaxmoe's first token sooner); "
            + (
                f"cold-prompt TTFT median vLLM / jaxmoe: **{np.median(v['cold']) / np.median(j['cold']):.2f}x**; "
                if j["cold"] and v["cold"]
                else ""
            )
            + f"greedy texts equal in {same} of {len(j['texts'])} requests",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEMO), help="a Hugging Face checkpoint both servers load")
    p.add_argument("--servers", default="jaxmoe,vllm", help="which servers, in this order")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--gap", type=float, default=1.5, help="seconds between arrivals")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold", type=int, default=5, help="cold prompts (nothing cached) timed alone after the run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-kvcache-gib", type=int, default=1)
    p.add_argument("--vllm-threads-bind", default=None)
    p.add_argument("--vllm-ld-preload", default="auto")
    p.add_argument("--vllm-arg", action="append", default=[])
    p.add_argument("--jaxmoe-arg", action="append", default=[])
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--stop-timeout", type=float, default=30)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    model = pathlib.Path(a.model)
    log_dir = pathlib.Path(a.log_dir or tempfile.mkdtemp(prefix="prefix-vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size(model)
    t0 = time.time()
    runs = {name: bench(a, name, model, log_dir, vocab) for name in a.servers.split(",")}
    text = table(a, runs)
    text += f"\n\nrun {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, {os.cpu_count()} CPUs; logs {log_dir}"
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
