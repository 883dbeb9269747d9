"""Serving: ``jaxmoe serve`` vs vLLM's OpenAI server, both driven by guidellm (the 107 M checkpoint's serving setting).

The serving rows of an outside measurement of the 107 M checkpoint, on one command:

* checkpoint: ``bench/startup.py``'s ``bench-107m`` (Mixtral architecture, hidden 512, 8 layers,
  8 / 2 heads, 8 experts top-2, expert width 1024, vocab 1024, untied head, 107 M parameters,
  random weights stored bf16; fp32 runs upcast on load) plus a byte-level BPE tokenizer with exactly
  1024 entries (``tokenizers``, trained on this Python's standard-library sources; ids 0-2 are
  ``<unk>``, ``<s>``, ``</s>`` as in the model config), saved as ``tokenizer.json`` +
  ``tokenizer_config.json`` in the checkpoint directory, so both servers and guidellm
  (its scenario's ``tokenizer``: ``huggingface_auto`` on the checkpoint directory) tokenize alike;
* servers, one at a time on a free 127.0.0.1 port (the other is not running), same checkpoint and
  ``--dtype`` (``--dtypes``: float32 and bfloat16), ``--max-num-seqs`` 16, ``--max-model-len`` 512:

  - ``jaxmoe serve`` (the ``jaxmoe`` script next to this interpreter, else ``python -m jaxmoe.cli``);
    its own defaults otherwise (warm-up compiles before /health answers 200);
  - ``python -m vllm.entrypoints.openai.api_server`` with ``--vllm-python`` and its best CPU settings:
    ``VLLM_CPU_OMP_THREADS_BIND`` = every core this process may use, ``VLLM_CPU_KVCACHE_SPACE=1``,
    ``LD_PRELOAD`` of tcmalloc and the venv's Intel OpenMP (``libiomp5.so``), and
    ``--no-enable-prefix-caching`` (guidellm's synthetic prompts are all different anyway);

* load: guidellm (``--guidellm``, 0.8.1) against ``/v1/completions``, streaming, synthetic text of
  ``--prompt-tokens`` 256 prompt tokens and ``--output-tokens`` 128 output tokens per request
  (guidellm sends ``max_tokens`` = 128 and ``ignore_eos: true``; both servers honour it, and the
  table reports the completion tokens the servers actually returned):

  - throughput: guidellm's ``throughput`` profile with ``max_concurrency`` = ``--concurrency`` (16),
    ``--throughput-requests`` requests (64) -> output tokens/s;
  - constant rate: ``--rate`` (1) request/s for ``--rate-seconds`` (60) s -> inter-token latency
    P50 and TTFT P50 / P90;

* start-up: process start to the first ``GET /health`` = 200 (polled every 0.5 s);
* ``--rounds`` (1) rounds; the server order is reversed in every other round, so load from other
  jobs on this shared machine hits both alike. Ratios are jaxmoe / vLLM within one round.

jaxmoe's compiles after ready (``jaxmoe_compiles_after_warmup`` from ``/metrics``) are reported
too: non-zero means serving traffic waited for XLA compiles.

The constant-rate phase sends ``--rate`` x ``--rate-seconds`` requests (60) and measures every one of
them (guidellm ``max_requests``; bounded by ``--rate-drain-seconds`` after sending). With
``--rate-window duration`` it is guidellm's time box instead: requests still running when
``--rate-seconds`` ends are "incomplete" and not in the ITL / TTFT statistics, which favours the
early requests of a server that falls behind. No unmeasured warm-up load by default (``--warmup-requests``
adds one): like the outside measurement, the first measured requests pay what each server did not
prepare before /health answered 200.

Run from the repository root (the project venv's interpreter; about 10-12 minutes per dtype and
round on 2 busy cores: jaxmoe starts in ~250-320 s, vLLM in ~80 s, then 64 requests and 60 s each)::

    python bench/serve_guidellm.py --out /tmp/serve_guidellm.md
    python bench/serve_guidellm.py --dtypes bfloat16 --rounds 2 --out /tmp/serve_guidellm.md
    # a smoke run: one dtype, 4 requests at 16 concurrent, 5 requests at 1 req/s
    python bench/serve_guidellm.py --dtypes float32 --throughput-requests 4 --rate-seconds 5

Smoke runs (2026-11-25, 2-core AMD EPYC shared with other jobs, load average 10-17) went through end
to end for float32 and bfloat16, both servers: every request had 256 prompt tokens and exactly 128
completion tokens on both. Their numbers (2-4 requests per phase) say nothing about the servers:
vLLM's first requests after /health 200 are several times slower than its later ones (ITL ~50 ms
for the first 2 requests, 5.9 ms at 1 req/s right after), and OpenMP threads pinned to both cores
suffer most from other jobs on the machine. Compare only full-size runs on a quiet machine.

Needs: vLLM's CPU build in its own venv (``--vllm-python``, default /tmp/vllm-venv/bin/python; see
``bench/serve_vs_vllm.py`` for how it was installed) and guidellm 0.8.1 in another
(``--guidellm``, default /tmp/guidellm-venv/bin/guidellm; ``pip install guidellm==0.8.1`` with torch
pinned to the CPU wheel).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_vs_vllm import Server, cpu_list, free_port  # noqa: E402 (the same server harness)

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 = the checkpoint's (unk), bos_token_id, eos_token_id
SERVERS = ("jaxmoe", "vllm")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


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
        yield from text.splitlines(keepends=True)
        budget -= len(text)
        if budget <= 0:
            return


def make_tokenizer(vocab_size: int, corpus_mb: float):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(corpus_mb), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, not {vocab_size}: raise --tokenizer-corpus-mb")
    return tok


def make_checkpoint(path: pathlib.Path, corpus_mb: float) -> dict:
    """``bench-107m`` (written once) plus its tokenizer in ``path``; the model config."""
    from startup import SHAPES, write_checkpoint

    if not (path / "config.json").exists():
        t0 = time.monotonic()
        write_checkpoint(path, **SHAPES["bench-107m"])
        print(f"checkpoint written to {path} in {time.monotonic() - t0:.1f}s", flush=True)
    config = json.loads((path / "config.json").read_text())
    marker = path / "bench_tokenizer.json"
    want = {"kind": "byte-level BPE", "vocab_size": config["vocab_size"], "corpus_mb": corpus_mb, "specials": SPECIALS}
    if not (marker.exists() and json.loads(marker.read_text()) == want and (path / "tokenizer.json").exists()):
        from transformers import PreTrainedTokenizerFast

        t0 = time.monotonic()
        tok = make_tokenizer(config["vocab_size"], corpus_mb)
        for name, tid in (("<s>", config["bos_token_id"]), ("</s>", config["eos_token_id"])):
            if tok.token_to_id(name) != tid:
                raise SystemExit(f"tokenizer: {name} is id {tok.token_to_id(name)}, the config says {tid}")
        PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            model_max_length=config["max_position_embeddings"],
        ).save_pretrained(path)
        marker.write_text(json.dumps(want))
        print(f"tokenizer ({config['vocab_size']} entries) trained in {time.monotonic() - t0:.1f}s", flush=True)
    return config


# --------------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------------
def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except Exception:  # noqa: BLE001 - not up yet / gone: the caller polls or reports
        return 0, ""


def vllm_ld_preload(vllm_python: str) -> str:
    """tcmalloc and the venv's Intel OpenMP, as vLLM's CPU install guide recommends (those present)."""
    iomp = pathlib.Path(vllm_python).parent.parent / "lib" / "libiomp5.so"  # pip's intel-openmp
    return ":".join(str(p) for p in (pathlib.Path(TCMALLOC), iomp) if p.exists())


def start_server(a, name: str, dtype: str, ckpt: pathlib.Path, workdir: pathlib.Path) -> Server:
    port = free_port()
    common = ["--dtype", dtype, "--host", "127.0.0.1", "--served-model-name", "bench"]
    common += ["--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len)]
    if name == "jaxmoe":
        exe = pathlib.Path(sys.executable).with_name("jaxmoe")
        base = [str(exe)] if exe.exists() else [sys.executable, "-m", "jaxmoe.cli"]
        cmd = base + ["serve", "--model", str(ckpt), "--http-port", str(port), "--grpc-port", "0", *common]
        cmd += [*a.jaxmoe_arg]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("JAX_PLATFORMS", "cpu")
        if a.cold_cache:
            env["JAXMOE_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="xla-", dir=workdir)
    else:
        cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--port", str(port)]
        cmd += [*common, "--no-enable-prefix-caching", "--seed", "0", "--generation-config", "vllm", *a.vllm_arg]
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kvcache_gib))
        env["VLLM_CPU_OMP_THREADS_BIND"] = a.vllm_threads_bind or cpu_list()
        for k in ("VIRTUAL_ENV", "PYTHONPATH", "JAX_PLATFORMS"):
            env.pop(k, None)
        if preload := vllm_ld_preload(a.vllm_python):
            env["LD_PRELOAD"] = preload
        if a.cold_cache:
            env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-", dir=workdir)
        env["PATH"] = str(pathlib.Path(a.vllm_python).parent) + os.pathsep + env.get("PATH", "")
    return Server(name, cmd, env, port, workdir / f"{name}.log")


def jaxmoe_metric(url: str, name: str) -> float | None:
    """One sample of the Prometheus text at ``url``/metrics (None when absent)."""
    for line in _get(url + "/metrics")[1].splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


# --------------------------------------------------------------------------------------------------
# guidellm
# --------------------------------------------------------------------------------------------------
def scenario(a, url: str, ckpt: pathlib.Path, phase: str, out_json: pathlib.Path) -> dict:
    """guidellm's scenario ("spec") for one phase: ``warmup``, ``throughput`` or ``rate``."""
    if phase in ("warmup", "throughput"):
        profile = {"kind": "throughput", "max_concurrency": a.concurrency}
        constraints = [
            {"kind": "max_requests", "count": a.warmup_requests if phase == "warmup" else a.throughput_requests},
            {"kind": "max_duration", "seconds": a.throughput_max_seconds},
        ]
    else:
        profile = {"kind": "constant", "rate": [a.rate]}
        if a.rate_window == "duration":  # guidellm's time box: requests still running are "incomplete"
            constraints = [{"kind": "max_duration", "seconds": a.rate_seconds}]
        else:  # send for rate_seconds, then let every sent request finish (bounded)
            constraints = [
                {"kind": "max_requests", "count": rate_requests(a)},
                {"kind": "max_duration", "seconds": a.rate_seconds + a.rate_drain_seconds},
            ]
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": "bench",
                "request_format": "/v1/completions",
                "timeout": a.request_timeout,
            },
            "profile": profile,
            "constraints": constraints,
            "data": [{"kind": "synthetic_text", "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(ckpt)},
            "outputs": [{"kind": "json", "path": str(out_json)}],
        }
    }


def rate_requests(a) -> int:
    return max(1, round(a.rate * a.rate_seconds))


def _stat(metrics: dict, key: str, field: str = "p50") -> float | None:
    s = (metrics.get(key) or {}).get("successful")
    if not s or not s.get("count"):
        return None
    return s["mean"] if field == "mean" else s["total_sum"] if field == "sum" else s["percentiles"][field]


def summarize(report: dict) -> dict:
    """The numbers of guidellm's JSON report (its one benchmark) the table needs."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]
    out_tokens = _stat(m, "output_token_count", "sum") or 0.0
    return {
        "requests": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "duration_s": bench["duration"],
        "output_tok_s": _stat(m, "output_tokens_per_second", "mean"),  # guidellm's "Output Tokens Per Sec"
        "output_tokens": out_tokens,
        "completion_tokens_mean": _stat(m, "output_token_count", "mean"),
        "completion_tokens_min": (m["output_token_count"].get("successful") or {}).get("min"),
        "prompt_tokens_mean": _stat(m, "prompt_token_count", "mean"),
        "ttft_ms": (_stat(m, "time_to_first_token_ms", "p50"), _stat(m, "time_to_first_token_ms", "p90")),
        "itl_ms": (_stat(m, "inter_token_latency_ms", "p50"), _stat(m, "inter_token_latency_ms", "p90")),
        "tpot_ms_p50": _stat(m, "time_per_output_token_ms", "p50"),
        "first_error": next((r.get("info", {}).get("error") for r in bench["requests"].get("errored") or []), None),
    }


def run_guidellm(a, url: str, ckpt: pathlib.Path, phase: str, workdir: pathlib.Path, tag: str) -> dict:
    out_json = workdir / f"{tag}-{phase}.json"
    spec = workdir / f"{tag}-{phase}-scenario.json"
    spec.write_text(json.dumps(scenario(a, url, ckpt, phase, out_json), indent=1))
    env = dict(os.environ)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "JAX_PLATFORMS"):
        env.pop(k, None)
    if a.guidellm_workers:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(a.guidellm_workers)
    cmd = [a.guidellm, "run", "--scenario", str(spec), "--disable-progress"]
    with open(workdir / f"{tag}-{phase}-guidellm.log", "wb") as log:
        # guidellm writes guidellm.log into its working directory: run it in workdir
        proc = subprocess.run(
            cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.guidellm_timeout
        )
    if proc.returncode != 0 or not out_json.exists():
        tail = (workdir / f"{tag}-{phase}-guidellm.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"guidellm {phase} exited with {proc.returncode}:\n" + "\n".join(tail))
    return summarize(json.loads(out_json.read_text()))


def bench_server(a, name: str, dtype: str, ckpt: pathlib.Path, workdir: pathlib.Path, tag: str) -> dict:
    """Start ``name`` on ``dtype``, time it to /health 200, run both guidellm phases, stop it."""
    info: dict = {"server": name, "dtype": dtype}
    server = start_server(a, name, dtype, ckpt, workdir)
    try:
        info["ready_s"] = server.wait_ready(a.ready_timeout)
        print(f"[{name} {dtype}] /health 200 after {info['ready_s']:.1f}s", flush=True)
        for phase in ("warmup", "throughput", "rate") if a.warmup_requests else ("throughput", "rate"):
            s = run_guidellm(a, server.url, ckpt, phase, workdir, tag)
            info[phase] = s
            ttft, itl = s["ttft_ms"], s["itl_ms"]
            print(
                f"[{name} {dtype}] {phase}: {s['requests']} ok / {s['errored']} errored / {s['incomplete']} "
                f"incomplete in {s['duration_s']:.1f}s, {_f(s['output_tok_s'])} output tok/s, completion tokens "
                f"mean {_f(s['completion_tokens_mean'])} (min {_f(s['completion_tokens_min'], '.0f')}), prompt "
                f"tokens mean {_f(s['prompt_tokens_mean'])}, TTFT P50/P90 {_f(ttft[0], '.0f')}/{_f(ttft[1], '.0f')} "
                f"ms, ITL P50 {_f(itl[0])} ms" + (f"; first error: {s['first_error']}" if s["first_error"] else ""),
                flush=True,
            )
        if name == "jaxmoe":
            info["compiles_after_ready"] = jaxmoe_metric(server.url, "jaxmoe_compiles_after_warmup")
            info["compiles"] = jaxmoe_metric(server.url, "jaxmoe_xla_compiles_total")
    except Exception as e:  # noqa: BLE001 - reported in the table; the other runs go on
        info["error"] = str(e)
        print(f"[{name} {dtype}] FAILED: {e}", flush=True)
    finally:
        info["load"] = os.getloadavg()[0]
        server.stop(30.0)
    return info


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(x, y) -> str:
    return "-" if x is None or not y else f"{x / y:.2f}x"


def _get_path(info: dict, *keys):
    for k in keys:
        if isinstance(info, dict):
            info = info.get(k)
        elif isinstance(info, (list, tuple)) and isinstance(k, int) and k < len(info):
            info = info[k]
        else:
            return None
    return info


def render(a, results: list[dict], versions: dict, total_s: float) -> str:
    lines = [
        f"guidellm against /v1/completions (streaming), synthetic text {a.prompt_tokens} prompt / "
        f"{a.output_tokens} output tokens (max_tokens {a.output_tokens}, ignore_eos); throughput profile "
        f"max_concurrency {a.concurrency}, {a.throughput_requests} requests; constant {a.rate:g} req/s for "
        f"{a.rate_seconds:g} s ("
        + (
            f"{rate_requests(a)} requests, all measured"
            if a.rate_window == "requests"
            else "time box: requests still running at the end are not measured"
        )
        + f"). Both servers: --max-num-seqs {a.max_num_seqs}, --max-model-len {a.max_model_len}, "
        f"one at a time; compilation caches: {'fresh per start' if a.cold_cache else 'each server default'}; "
        f"unmeasured warm-up after /health 200: "
        f"{f'{a.warmup_requests} requests (throughput profile)' if a.warmup_requests else 'none'}. "
        f"{os.cpu_count()} CPUs ({cpu_model()}), {time.strftime('%Y-%m-%d')}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f". Total {total_s / 60:.0f} min.",
        "",
        f"| round | dtype | server | start to /health 200 (s) | output tok/s @{a.concurrency} | completion tokens "
        f"(mean, min) @{a.concurrency} | ok / err / incomplete @{a.concurrency} | ITL P50 @{a.rate:g}/s (ms) "
        f"| TTFT P50 / P90 @{a.rate:g}/s (ms) | ok / err / incomplete @{a.rate:g}/s | jaxmoe compiles after ready "
        "| load avg at end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, c = r.get("throughput") or {}, r.get("rate") or {}
        err = f" FAILED: {r['error'].splitlines()[0][:120]}" if "error" in r else ""
        lines.append(
            f"| {r['round']} | {r['dtype']} | {r['server']}{err} | {_f(r.get('ready_s'))} | {_f(t.get('output_tok_s'))} "
            f"| {_f(t.get('completion_tokens_mean'))}, {_f(t.get('completion_tokens_min'), '.0f')} "
            f"| {t.get('requests', '-')} / {t.get('errored', '-')} / {t.get('incomplete', '-')} "
            f"| {_f(_get_path(c, 'itl_ms', 0))} | {_f(_get_path(c, 'ttft_ms', 0), '.0f')} / "
            f"{_f(_get_path(c, 'ttft_ms', 1), '.0f')} | {c.get('requests', '-')} / {c.get('errored', '-')} / "
            f"{c.get('incomplete', '-')} | {_f(r.get('compiles_after_ready'), '.0f') if r['server'] == 'jaxmoe' else ''} "
            f"| {_f(r.get('load'))} |"
        )
    lines += [
        "",
        f"| round | dtype | output tok/s @{a.concurrency}: jaxmoe / vLLM | ITL P50 @{a.rate:g}/s: jaxmoe / vLLM "
        f"| TTFT P50 @{a.rate:g}/s: jaxmoe / vLLM | start to /health 200: jaxmoe / vLLM |",
        "|---|---|---|---|---|---|",
    ]
    pairs = {}
    for r in results:
        pairs.setdefault((r["round"], r["dtype"]), {})[r["server"]] = r
    for (rnd, dtype), p in pairs.items():
        j, v = p.get("jaxmoe", {}), p.get("vllm", {})
        lines.append(
            f"| {rnd} | {dtype} "
            f"| {_ratio(_get_path(j, 'throughput', 'output_tok_s'), _get_path(v, 'throughput', 'output_tok_s'))} "
            f"| {_ratio(_get_path(j, 'rate', 'itl_ms', 0), _get_path(v, 'rate', 'itl_ms', 0))} "
            f"| {_ratio(_get_path(j, 'rate', 'ttft_ms', 0), _get_path(v, 'rate', 'ttft_ms', 0))} "
            f"| {_ratio(j.get('ready_s'), v.get('ready_s'))} |"
        )
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def versions(a) -> dict:
    import jax

    v = {"jax": jax.__version__}
    probes = {"vllm": [a.vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]}
    probes["guidellm"] = [a.guidellm, "--version"]
    for name, cmd in probes.items():
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            out = []
        if name == "vllm":
            v.update(vllm=out[0] if out else "?", torch=out[1] if len(out) > 1 else "?")
        else:
            v[name] = out[-1] if out else "?"
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", default="/tmp/jaxmoe-guidellm-ckpt", help="written on first use, reused after")
    p.add_argument("--tokenizer-corpus-mb", type=float, default=4.0)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--servers", default="jaxmoe,vllm", help="order of the first round (reversed every other round)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=16, help="throughput profile's max_concurrency")
    p.add_argument("--throughput-requests", type=int, default=64)
    p.add_argument("--throughput-max-seconds", type=float, default=900, help="bound on the throughput phase")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="unmeasured requests (throughput profile) after /health 200, before measuring (default 0: none)",
    )
    p.add_argument("--rate", type=float, default=1.0, help="constant profile's requests/s")
    p.add_argument("--rate-seconds", type=float, default=60, help="seconds of sending at --rate")
    p.add_argument(
        "--rate-window",
        choices=["requests", "duration"],
        default="requests",
        help="requests: send rate x seconds requests and measure them all (default); duration: stop at "
        "--rate-seconds, requests still running are incomplete and not measured",
    )
    p.add_argument(
        "--rate-drain-seconds", type=float, default=600, help="--rate-window requests: bound on the wait after sending"
    )
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--cold-cache", action="store_true", help="a fresh compilation cache dir for every server start")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all our cores)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    p.add_argument("--jaxmoe-arg", action="append", default=[], help="extra jaxmoe serve argument (repeatable)")
    p.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm")
    p.add_argument("--guidellm-workers", type=int, default=None, help="GUIDELLM__MAX_WORKER_PROCESSES (default 10)")
    p.add_argument("--guidellm-timeout", type=float, default=1800)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--work-dir", default=None, help="server logs, guidellm scenarios and reports (default: temp)")
    p.add_argument("--out", default=None, help="write the markdown table here (and the raw numbers to OUT.json)")
    a = p.parse_args(argv)

    servers = a.servers.split(",")
    if not set(servers) <= set(SERVERS) or not servers:
        raise SystemExit(f"--servers: {a.servers!r}; expected names from {SERVERS}")
    dtypes = a.dtypes.split(",")
    if not set(dtypes) <= {"float32", "bfloat16"}:
        raise SystemExit(f"--dtypes: {a.dtypes!r}; expected float32 and/or bfloat16")
    t0 = time.monotonic()
    ckpt = pathlib.Path(a.ckpt_dir)
    make_checkpoint(ckpt, a.tokenizer_corpus_mb)
    workdir = pathlib.Path(a.work_dir or tempfile.mkdtemp(prefix="serve_guidellm_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    vers = versions(a)
    print(f"checkpoint {ckpt}; {vers}; logs and guidellm reports in {workdir}; load {os.getloadavg()}", flush=True)

    results = []
    for rnd in range(1, a.rounds + 1):
        order = servers if rnd % 2 else servers[::-1]
        for dtype in dtypes:
            for name in order:
                info = bench_server(a, name, dtype, ckpt, workdir, f"r{rnd}-{dtype}-{name}")
                info["round"] = rnd
                results.append(info)
    table = render(a, results, vers, time.monotonic() - t0)
    print("\n" + table, flush=True)
    if a.out:
        pathlib.Path(a.out).write_text(table)
        pathlib.Path(a.out + ".json").write_text(json.dumps({"versions": vers, "results": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
