"""Start-up of ``jaxmoe serve``: time to /health 200 (cold and warm compilation cache), programs
compiled, the process's memory mappings after warm-up, compiles after ready, and SIGTERM stop time.

Checkpoints (random Mixtral weights written by transformers, bf16 on disk):

* ``depth-N``: hidden 256, 8 experts top-2, expert width 512, vocab 384, N layers -- the shape of the
  model that could not start with 16 layers (XLA's JIT exhausted vm.max_map_count).
* ``bench-107m``: hidden 512, 8 layers, 8 / 2 heads, 8 experts top-2, expert width 1024, vocab 1024,
  untied head (107 M parameters), the checkpoint of the vLLM comparison.

Each server runs with a fresh compilation-cache directory (cold), then again with the same one
(warm). A few requests run after ready; ``jaxmoe_compiles_after_warmup`` must stay 0.

vLLM side by side (``--vllm-python``, default /tmp/vllm-venv/bin/python when present): ``vllm serve``
of the 107M checkpoint, process start to /health 200, with the settings of bench/serve_vs_vllm.py
(``VLLM_CPU_OMP_THREADS_BIND`` = this process's cores, ``VLLM_CPU_KVCACHE_SPACE=1``, tcmalloc and the
venv's libiomp5 preloaded, prefix caching off, ``--skip-tokenizer-init``: the checkpoint has no
tokenizer, jaxmoe uses its byte tokenizer); "cold": fresh ``VLLM_CACHE_ROOT`` and
``TORCHINDUCTOR_CACHE_DIR`` (no torch.compile cache), "warm": the second start with them.
Each row records the 1-minute load average at its start (the machine may be shared).

    python bench/startup.py [--depths 4,16,32] [--no-107m] [--out DIR] [--dtype float32] [--vllm-python PY]
    python bench/startup.py --depths "" --out /tmp/startup-ckpt   # the 107M rows and vLLM's only
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

MIXTRAL = dict(
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SHAPES = {
    "depth": dict(hidden_size=256, intermediate_size=512, vocab_size=384),
    "bench-107m": dict(hidden_size=512, intermediate_size=1024, vocab_size=1024, num_hidden_layers=8),
}


def write_checkpoint(path: pathlib.Path, **shape) -> pathlib.Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**MIXTRAL, **shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except Exception:
        return 0, b""


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def serve_once(model: pathlib.Path, cache: pathlib.Path, port: int, dtype: str | None, timeout: float = 900.0) -> dict:
    env = dict(os.environ, JAXMOE_COMPILATION_CACHE=str(cache), JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        "-m",
        "jaxmoe.cli",
        "serve",
        "--model",
        str(model),
        "--http-port",
        str(port),
        "--grpc-port",
        "0",
        "--max-model-len",
        "1024",
        *(["--dtype", dtype] if dtype else []),
    ]
    proc, out = _start(cmd, env, port, timeout)
    url = f"http://127.0.0.1:{port}"
    ready = out["ready_s"]
    if ready is not None:
        body = json.dumps(
            {"model": str(model), "prompt": [1, 5, 9, 13] * 8, "max_tokens": 16, "temperature": 0}
        ).encode()
        for _ in range(3):
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()
        metrics = _get(url + "/metrics")[1].decode()
        out["compiles"] = _metric(metrics, "jaxmoe_xla_compiles_total")
        out["compile_s"] = _metric(metrics, "jaxmoe_xla_compile_seconds_total")
        out["compiles_after_ready"] = _metric(metrics, "jaxmoe_compiles_after_warmup")
        out["maps"] = sum(1 for _ in open(f"/proc/{proc.pid}/maps"))
    return _stop(proc, out)


def _start(cmd: list[str], env: dict, port: int, timeout: float) -> tuple[subprocess.Popen, dict]:
    """Start the server; wait for /health 200 (``ready_s``: seconds from process start, None: it
    exited or timed out first)."""
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = None
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
            ready = time.monotonic() - t0
            break
        time.sleep(0.25)
    return proc, {"ready_s": ready, "exit_before_ready": proc.poll(), "load": load}


def _stop(proc: subprocess.Popen, out: dict) -> dict:
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    out["stop_s"] = time.monotonic() - t1
    out["log_tail"] = proc.stdout.read()[-400:] if out["ready_s"] is None else ""
    return out


def vllm_once(python: str, model: pathlib.Path, cache: pathlib.Path, port: int, dtype: str | None) -> dict:
    """``vllm serve`` of ``model``: process start to /health 200, with ``cache`` as its
    torch.compile caches' root."""
    from types import SimpleNamespace

    from bench.serve_vs_vllm import cpu_list, vllm_ld_preload

    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "64"]
    cmd += ["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--seed", "0", "--skip-tokenizer-init"]
    cmd += ["--dtype", dtype] if dtype else []
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(),
        VLLM_CACHE_ROOT=str(cache / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        PATH=str(pathlib.Path(python).parent) + os.pathsep + os.environ.get("PATH", ""),
    )
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "JAX_PLATFORMS"):
        env.pop(k, None)
    preload = vllm_ld_preload(SimpleNamespace(vllm_ld_preload="auto", vllm_python=python))
    if preload:
        env["LD_PRELOAD"] = preload
    proc, out = _start(cmd, env, port, 900.0)
    return _stop(proc, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,16,32")
    ap.add_argument("--no-107m", action="store_true")
    ap.add_argument("--out", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--dtype", default="float32", help="--dtype of every server ('' = the checkpoint's, bf16)")
    default_vllm = "/tmp/vllm-venv/bin/python"
    ap.add_argument(
        "--vllm-python",
        default=default_vllm if os.path.exists(default_vllm) else "",
        help="python of a vLLM CPU venv: vLLM's start on the 107M checkpoint ('' = skip)",
    )
    args = ap.parse_args(argv)
    root = pathlib.Path(args.out or tempfile.mkdtemp(prefix="jaxmoe-startup-"))
    depths = [int(n) for n in args.depths.split(",") if n.strip()]
    models = [(f"depth-{n}", dict(SHAPES["depth"], num_hidden_layers=n)) for n in depths]
    if not args.no_107m:
        models.append(("bench-107m", SHAPES["bench-107m"]))
    import jax

    print(
        f"# {platform.node()} {os.cpu_count()} cores, jax {jax.__version__}, "
        f"vm.max_map_count {pathlib.Path('/proc/sys/vm/max_map_count').read_text().strip()}, "
        f"dtype {args.dtype or 'checkpoint'}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(
        "| server | model | cache | ready (s) | programs compiled | compile s | mappings | compiles after ready "
        "| stop (s) | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, shape in models:
        path = write_checkpoint(root / name, **shape)
        cache = pathlib.Path(tempfile.mkdtemp(prefix="jaxmoe-xla-"))
        for label in ("cold", "warm"):
            r = serve_once(path, cache, args.port, args.dtype)
            if r["ready_s"] is None:
                print(f"| jaxmoe | {name} | {label} | FAILED (exit {r['exit_before_ready']}): {r['log_tail']!r} |")
                continue
            print(
                f"| jaxmoe | {name} | {label} | {r['ready_s']:.1f} | {r['compiles']:.0f} | {r['compile_s']:.1f} | "
                f"{r['maps']} | {r['compiles_after_ready']:.0f} | {r['stop_s']:.1f} | {r['load']:.1f} |",
                flush=True,
            )
        if name == "bench-107m" and args.vllm_python:
            cache = pathlib.Path(tempfile.mkdtemp(prefix="vllm-cache-"))
            for label in ("cold", "warm"):
                r = vllm_once(args.vllm_python, path, cache, args.port, args.dtype)
                ready = "FAILED: " + repr(r["log_tail"]) if r["ready_s"] is None else f"{r['ready_s']:.1f}"
                print(f"| vLLM | {name} | {label} | {ready} | - | - | - | - | {r['stop_s']:.1f} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
