"""Offline greedy decode: jaxmoe vs vLLM (CPU build) vs transformers on one checkpoint, fp32 and bf16.

The setting of an outside measurement of the 107 M checkpoint, on one command:

* checkpoint: Mixtral architecture, hidden 512, 8 layers, 8 heads / 2 KV heads, 8 experts top-2,
  expert width 1024, vocab 1024, untied head, 107 M parameters, random weights written by
  transformers and stored bf16 (``bench/startup.py``'s ``bench-107m``; fp32 runs upcast on load);
* prompts: 32 random token ids each (seed 0), sent as token ids to every engine;
* exactly 128 new tokens (EOS ignored), greedy, batch 1 and 16; one warm-up generation per batch
  size, then the median of ``--repeats`` (3) timed generations; tok/s = batch x 128 / wall time of
  one whole generation (prefill included);
* every engine on both CPU cores, one engine process at a time (the others are not running);
  ``--rounds`` (2) rounds, the engine order reversed in every other round, so load from other jobs
  on the machine hits every engine alike; the table gives every round and the ratios per round.

Engines (each in its own process):

* jaxmoe: ``LLM(ckpt, dtype=...).generate(prompt_ids, SamplingParams(max_tokens=128,
  ignore_eos=True))`` with this interpreter (the project venv);
* vLLM: ``vllm.LLM(ckpt, dtype=..., skip_tokenizer_init=True, enable_prefix_caching=False,
  max_num_seqs=16, max_model_len=512)`` with ``--vllm-python`` (its own venv; see BENCHMARKS.md
  "How vLLM was installed"), ``VLLM_CPU_OMP_THREADS_BIND`` = both cores, ``VLLM_CPU_KVCACHE_SPACE=1``,
  and tcmalloc + the venv's Intel OpenMP preloaded when present (vLLM's CPU guide);
* transformers: ``generate(do_sample=False, min_new_tokens=128)`` with sdpa attention and the
  fastest of its expert implementations (``eager``, ``grouped_mm``; each timed, best reported),
  ``torch.set_num_threads(2)``.

Also reported: greedy agreement of every engine with jaxmoe (rows whose 128 tokens are all equal),
the machine's read bandwidth (a jitted sum over 400 MB, both threads) and the share of the
weight-read roofline that batch 16 reaches (every expert is hit at batch 16, so a decode step reads
all non-embedding weights once), and each engine's "start": process start to the end of its first
(warm-up) generation, compiles included (jaxmoe: persistent compilation cache as configured).

    python bench/vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python
    python bench/vs_vllm.py ... --dtypes float32 --batches 16 --rounds 1      # a quick look
    python bench/vs_vllm.py ... --benchmarks BENCHMARKS.md                    # write the table there
    python bench/vs_vllm.py ... --engines jaxmoe,baseline,vllm --baseline ../jaxmoe-old   # before/after
    python bench/vs_vllm.py ... --ckpt-dir /tmp/mixtral-3b --engines jaxmoe,vllm --dtypes bfloat16 \
        --new-tokens 32 --repeats 2 --ttft-len 128 --vocab 32000          # a big checkpoint (bench/big_checkpoint.py)

Per engine process it also records: ``load_s`` (the engine constructor's wall time: weights, KV cache,
and whatever the engine compiles there), the peak resident memory of the engine's whole process tree
(sampled every 50 ms from the driver, so vLLM's engine-core process counts) against the checkpoint's
bytes, the time to first token of one ``--ttft-len``-token prompt (``max_tokens=1``, best of 3) and a
decode-only rate per batch (``batch x (new_tokens - 1)`` / (a whole generation - a ``max_tokens=1``
generation of the same prompts), which takes the prefill out). For jaxmoe, the roofline is also given
as ``bench/device_check.py`` defines it: bytes a step must read (``_model_bytes``) / its copy bandwidth.

``--baseline DIR`` adds the engine ``baseline``: jaxmoe from another checkout (an older commit, with its
own ``.venv``), run by that checkout's interpreter and its own copy of this file, in the same rounds, so
a change's speed is compared with the code before it in one run (table "jaxmoe now / baseline").

Imports here are the standard library only: vLLM's interpreter runs this file as its worker
(``--worker vllm``) without the project installed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import threading
import time

T0 = time.perf_counter()
ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINES = ("jaxmoe", "vllm", "transformers", "baseline")
MARK_BEGIN, MARK_END = "<!-- bench/vs_vllm.py: begin -->", "<!-- bench/vs_vllm.py: end -->"


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def timed(run, batches, args, run_first=None) -> dict:
    """Per batch: warm-up, then the median of ``args.repeats`` runs. ``run(ids) -> token lists``;
    ``run_first(ids)``: the same with one new token (decode-only rates and TTFT)."""
    out, start_s = {}, None
    for b in batches:
        ids = prompts(b, args.prompt_len, args.vocab)
        run(ids)
        if start_s is None:
            start_s = time.perf_counter() - T0
        times, tokens = [], None
        for _ in range(args.repeats):
            t = time.perf_counter()
            tokens = run(ids)
            times.append(time.perf_counter() - t)
        if any(len(t) != args.new_tokens for t in tokens):
            raise SystemExit(f"an engine stopped early: lengths {[len(t) for t in tokens]}")
        out[str(b)] = {"tok_s": b * args.new_tokens / statistics.median(times), "times": times, "tokens": tokens}
        if args.decode_only and run_first:  # the same prompts, one token: the prefill and the first token alone
            first = min(_wall(run_first, ids) for _ in range(2))
            out[str(b)]["first_s"] = first
            out[str(b)]["decode_tok_s"] = b * (args.new_tokens - 1) / (statistics.median(times) - first)
    result = {"batches": out, "start_s": start_s}
    if args.ttft_len and run_first:
        ids = prompts(1, args.ttft_len, args.vocab)
        run_first(ids)
        result["ttft_s"] = min(_wall(run_first, ids) for _ in range(3))
    return result


def _wall(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def worker_jaxmoe(args) -> dict:
    sys.path.insert(0, str(ROOT))
    from jaxmoe import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(args.ckpt, dtype=args.dtype)
    load_s = time.perf_counter() - t
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    result = timed(
        lambda ids: [list(o.token_ids) for o in llm.generate(ids, sp)],
        args.batches,
        args,
        lambda ids: llm.generate(ids, one),
    )
    result["load_s"] = load_s
    llm = None  # free the weights before the bandwidth arrays
    result["bandwidth_gbs"] = read_bandwidth()
    result.update(copy_roofline(args))
    return result


def copy_roofline(args) -> dict:
    """``bench/device_check.py``'s roofline terms: its copy bandwidth (GB/s, read + write of a 1 GiB bf16
    array) and the bytes a decode step of each batch size must read (``_model_bytes``, bf16)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from device_check import _model_bytes, copy_gbs

    from jaxmoe.config import load_config

    cfg = load_config(args.ckpt)
    scale = {"float32": 2, "bfloat16": 1}[args.dtype]
    return {
        "copy_gbs": copy_gbs(),
        "step_bytes": {str(b): scale * _model_bytes(cfg, b)[1] for b in args.batches},
    }


def read_bandwidth() -> float:
    """GB/s of a jitted sum over a 400 MB float32 array (both threads), best of 10."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((100_000_000,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def worker_vllm(args) -> dict:
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(
        args.ckpt,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_seqs=16,
        max_model_len=512,
        seed=0,
    )
    load_s = time.perf_counter() - t
    sp = SamplingParams(
        max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True, temperature=0.0, detokenize=False
    )

    def run(ids):
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
    result = timed(
        run, args.batches, args, lambda ids: llm.generate([{"prompt_token_ids": p} for p in ids], one, use_tqdm=False)
    )
    result["load_s"] = load_s
    return result


def worker_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    best = None
    for experts in ("eager", "grouped_mm"):
        model = AutoModelForCausalLM.from_pretrained(
            args.ckpt, dtype=dtype, attn_implementation="sdpa", experts_implementation=experts
        ).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0

        def run(ids, model=model):
            x = torch.tensor(ids, dtype=torch.long)
            with torch.inference_mode():
                out = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                )
            return out[:, x.shape[1] :].tolist()

        result = timed(run, args.batches, args)
        result["experts_impl"] = {b: experts for b in result["batches"]}
        if best is None:
            best = result
            continue
        for b, r in result["batches"].items():  # keep the faster implementation per batch size
            if r["tok_s"] > best["batches"][b]["tok_s"]:
                best["batches"][b], best["experts_impl"][b] = r, experts
    return best


WORKERS = {"jaxmoe": worker_jaxmoe, "vllm": worker_vllm, "transformers": worker_transformers}


def baseline_rev(tree: pathlib.Path) -> str:
    """The short commit of the baseline checkout (``?`` when it is not a git checkout)."""
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


# ---------------------------------------------------------------------------------------------- driver


def write_checkpoint(path: pathlib.Path) -> pathlib.Path:
    sys.path.insert(0, str(ROOT / "bench"))
    import startup

    return startup.write_checkpoint(path, **startup.SHAPES["bench-107m"])


def weight_bytes(ckpt: pathlib.Path, dtype: str) -> int:
    """Bytes a batch-16 decode step reads: every parameter but the embedding table, in ``dtype``."""
    cfg = json.loads((ckpt / "config.json").read_text())
    D, F, E, L, V = (
        cfg[k] for k in ("hidden_size", "intermediate_size", "num_local_experts", "num_hidden_layers", "vocab_size")
    )
    hd = D // cfg["num_attention_heads"]
    attn = D * D * 2 + 2 * D * cfg["num_key_value_heads"] * hd
    per_layer = attn + E * 3 * D * F + D * E + 2 * D
    params = L * per_layer + V * D + D  # + LM head + final norm
    return params * {"float32": 4, "bfloat16": 2}[dtype]


def run_engine(engine: str, dtype: str, args) -> dict:
    cmd = [args.vllm_python if engine == "vllm" else sys.executable, str(pathlib.Path(__file__).resolve())]
    cwd = ROOT
    if engine == "baseline":  # the other checkout's interpreter and its own worker, so it imports its own jaxmoe
        cwd = args.baseline.resolve()
        cmd = [str(cwd / ".venv" / "bin" / "python"), str(cwd / "bench" / "vs_vllm.py")]
    cmd += ["--worker", "jaxmoe" if engine == "baseline" else engine, "--dtype", dtype, "--ckpt", str(args.ckpt_dir)]
    cmd += ["--batches", ",".join(map(str, args.batches)), "--repeats", str(args.repeats)]
    cmd += ["--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--vocab", str(args.vocab)]
    cmd += ["--ttft-len", str(args.ttft_len)] + (["--decode-only"] if args.decode_only else [])
    env = dict(os.environ)
    if engine == "vllm":
        cores = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}-{cores[-1]}", VLLM_CPU_KVCACHE_SPACE="1")
        preload = [
            p
            for p in (args.tcmalloc, str(pathlib.Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"))
            if p and os.path.exists(p)
        ]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    load = os.getloadavg()[0]
    result = worker_result(cmd, env, cwd, f"{engine} {dtype}", args.timeout)
    result["load"] = (load, os.getloadavg()[0])
    return result


def worker_result(cmd: list[str], env: dict, cwd, label: str, timeout: float) -> dict:
    """Run a bench worker subprocess; its last ``RESULT {json}`` line, or exit naming ``label``."""
    print(f"  {label} (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample():  # the whole process tree's resident bytes, every 50 ms
        while not done.wait(0.05):
            peak[0] = max(peak[0], tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the worker would outlive the driver otherwise
        raise SystemExit(f"{label}: no result within {timeout:.0f} s (--timeout)") from None
    finally:
        done.set()
        sampler.join()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{label} failed (exit {proc.returncode}):\n{stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["peak_rss"] = peak[0]
    return result


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc; 0 once it has exited)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def agree(a: list, b: list) -> str:
    """Rows whose tokens are all equal / rows, and the mean length of the common prefix."""
    prefix = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), len(r)) for r, s in zip(a, b)]
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)} ({sum(prefix) / len(prefix):.0f})"


def table(results: dict, args) -> str:
    """results[(round, dtype, engine)] -> markdown."""
    bw = max(r["bandwidth_gbs"] for (_, _, e), r in results.items() if e == "jaxmoe")
    rows = [
        "| dtype | batch | round | jaxmoe tok/s | vLLM tok/s | transformers tok/s | jaxmoe / vLLM | jaxmoe / transformers"
        " | greedy = jaxmoe: rows (mean common prefix), vLLM; HF | load avg (jaxmoe, vLLM, HF) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for dtype in args.dtypes:
        for b in map(str, args.batches):
            for rnd in range(args.rounds):
                r = {e: results[(rnd, dtype, e)] for e in args.engines}
                tok = {e: r[e]["batches"][b]["tok_s"] for e in args.engines}
                ref = r["jaxmoe"]["batches"][b]["tokens"]
                cell = lambda e: f"{tok[e]:.1f}" if e in tok else "-"  # noqa: E731
                ratio = lambda e: f"{tok['jaxmoe'] / tok[e]:.2f}x" if e in tok else "-"  # noqa: E731
                same = "; ".join(
                    agree(ref, r[e]["batches"][b]["tokens"]) for e in args.engines if e not in ("jaxmoe", "baseline")
                )
                loads = ", ".join(f"{r[e]['load'][0]:.1f}" for e in args.engines)
                ratios.setdefault((dtype, b), []).append(tok["jaxmoe"] / tok["vllm"] if "vllm" in tok else None)
                rows.append(
                    f"| {dtype} | {b} | {rnd + 1} | {cell('jaxmoe')} | {cell('vllm')} | {cell('transformers')} "
                    f"| {ratio('vllm')} | {ratio('transformers')} | {same} | {loads} |"
                )
    roof = ["", f"Read bandwidth (jitted sum over 400 MB, 2 threads, best of 10): **{bw:.1f} GB/s**.", ""]
    roof += [
        "| dtype | weights read per batch-16 step | floor (ms/step) | engine | ms/token-step at batch 16 (best round) | share of roofline |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes:
        nbytes = weight_bytes(args.ckpt_dir, dtype)
        floor = nbytes / (bw * 1e9) * 1e3
        for e in args.engines:
            if "16" not in map(str, args.batches):
                continue
            best = max(results[(rnd, dtype, e)]["batches"]["16"]["tok_s"] for rnd in range(args.rounds))
            step = 16 / best * 1e3
            roof.append(f"| {dtype} | {nbytes / 1e6:.0f} MB | {floor:.1f} | {e} | {step:.1f} | {floor / step:.0%} |")
    starts = ["", "Start (process start to the end of the first warm-up generation, s), per round:", ""]
    for dtype in args.dtypes:
        for e in args.engines:
            s = ", ".join(f"{results[(rnd, dtype, e)]['start_s']:.1f}" for rnd in range(args.rounds))
            starts.append(f"- {dtype} {e}: {s}")
    hf = {
        (dtype, b): results[(rnd, dtype, "transformers")]["experts_impl"][b]
        for rnd in range(args.rounds)
        for dtype in args.dtypes
        for b in map(str, args.batches)
        if "transformers" in args.engines
    }
    notes = (
        [
            "",
            "transformers' fastest expert implementation per (dtype, batch): "
            + ", ".join(f"{k[0]} b{k[1]}: {v}" for k, v in hf.items()),
        ]
        if hf
        else []
    )
    return "\n".join(rows + before_after(results, args) + roof + starts + notes + per_process(results, args)) + "\n"


def per_process(results: dict, args) -> list[str]:
    """Load time, peak memory of the process tree / checkpoint bytes, TTFT and decode-only rates per engine
    process, and jaxmoe's share of ``bench/device_check.py``'s roofline (copy bandwidth)."""
    ckpt = sum(f.stat().st_size for f in args.ckpt_dir.glob("*.safetensors"))
    bs = list(map(str, args.batches))
    rows = [
        "",
        f"Per engine process (checkpoint: {ckpt / 1e9:.2f} GB of safetensors):",
        "",
        "| dtype | engine | round | load avg at start | constructor (s) | start (s) | peak RSS of the process tree (GB)"
        " | peak RSS / checkpoint | TTFT, "
        + f"{args.ttft_len}-token prompt (s) | "
        + " | ".join(f"decode-only tok/s b{b}" for b in bs)
        + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(bs),
    ]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for dtype in args.dtypes:
        for e in args.engines:
            for rnd in range(args.rounds):
                r = results[(rnd, dtype, e)]
                dec = " | ".join(fmt(r["batches"][b].get("decode_tok_s"), ".1f") for b in bs)
                rows.append(
                    f"| {dtype} | {e} | {rnd + 1} | {r['load'][0]:.1f} | {fmt(r.get('load_s'), '.1f')} | {r['start_s']:.1f}"
                    f" | {r['peak_rss'] / 1e9:.2f} | {r['peak_rss'] / ckpt:.2f}x | {fmt(r.get('ttft_s'), '.3f')} | {dec} |"
                )
    roof = [r for r in results.items() if "copy_gbs" in r[1]]
    if roof:
        rows += [
            "",
            "jaxmoe against `bench/device_check.py`'s roofline (bytes a decode step must read, `_model_bytes`"
            " / copy bandwidth of a 1 GiB bf16 array, read + write):",
            "",
            "| dtype | round | batch | copy GB/s | bytes per step | floor (ms/step) | decode-only ms/step | share |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (rnd, dtype, _), r in sorted((k, v) for k, v in roof if k[2] == "jaxmoe"):
            for b in bs:
                rate = r["batches"][b].get("decode_tok_s") or r["batches"][b]["tok_s"]
                step, floor = int(b) / rate * 1e3, r["step_bytes"][b] / (r["copy_gbs"] * 1e9) * 1e3
                rows.append(
                    f"| {dtype} | {rnd + 1} | {b} | {r['copy_gbs']:.1f} | {r['step_bytes'][b] / 1e9:.2f} GB"
                    f" | {floor:.1f} | {step:.1f} | {floor / step:.0%} |"
                )
    return rows


def before_after(results: dict, args) -> list[str]:
    """The same rounds, jaxmoe now against the ``--baseline`` checkout (empty without one)."""
    if "baseline" not in args.engines:
        return []
    rows = [
        "",
        f"jaxmoe now against the baseline checkout ({baseline_rev(args.baseline)}), same rounds:",
        "",
        "| dtype | batch | round | jaxmoe now tok/s | baseline tok/s | now / baseline | greedy = now: rows (mean common prefix) |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes:
        for b in map(str, args.batches):
            for rnd in range(args.rounds):
                now, before = (results[(rnd, dtype, e)]["batches"][b] for e in ("jaxmoe", "baseline"))
                rows.append(
                    f"| {dtype} | {b} | {rnd + 1} | {now['tok_s']:.1f} | {before['tok_s']:.1f} "
                    f"| {now['tok_s'] / before['tok_s']:.2f}x | {agree(now['tokens'], before['tokens'])} |"
                )
    return rows


def header(args) -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    versions = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return (
        f"- **Date:** {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. **Machine:** {os.cpu_count()}-core {cpu}, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, no GPU. jax {versions}.\n"
        f"- **Command:** `python bench/vs_vllm.py --vllm-python {args.vllm_python} --engines {','.join(args.engines)}"
        f" --dtypes {','.join(args.dtypes)} --batches {','.join(map(str, args.batches))} --rounds {args.rounds}"
        + (f" --baseline {args.baseline} ({baseline_rev(args.baseline)})" if "baseline" in args.engines else "")
        + "`\n\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", type=pathlib.Path, default=pathlib.Path("/tmp/jaxmoe-bench-107m"))
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--tcmalloc", default="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--ttft-len", type=int, default=0, help="also time the first token of one prompt this long")
    p.add_argument(
        "--decode-only", action="store_true", help="also time max_tokens=1 per batch: decode rates without prefill"
    )
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--baseline", type=pathlib.Path, help="a jaxmoe checkout with its own .venv: the engine 'baseline'")
    p.add_argument("--out", type=pathlib.Path, help="also write the markdown here")
    p.add_argument(
        "--benchmarks", type=pathlib.Path, help=f"replace the text between {MARK_BEGIN!r} and {MARK_END!r} here"
    )
    args = p.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.worker:
        print("RESULT " + json.dumps(WORKERS[args.worker](args)), flush=True)
        return 0
    args.engines = args.engines.split(",")
    args.dtypes = args.dtypes.split(",")
    if args.engines[0] != "jaxmoe" or any(e not in ENGINES for e in args.engines):
        raise SystemExit(f"--engines: jaxmoe first, then any of {ENGINES}; got {args.engines}")
    if "baseline" in args.engines and not (args.baseline and (args.baseline / ".venv" / "bin" / "python").exists()):
        raise SystemExit("--baseline: the engine 'baseline' needs a checkout with its own .venv (DIR/.venv/bin/python)")
    write_checkpoint(args.ckpt_dir)
    results = {}
    for rnd in range(args.rounds):
        order = args.engines if rnd % 2 == 0 else args.engines[::-1]
        for dtype in args.dtypes:
            for engine in order:
                results[(rnd, dtype, engine)] = run_engine(engine, dtype, args)
                tok = {b: round(r["tok_s"], 1) for b, r in results[(rnd, dtype, engine)]["batches"].items()}
                print(f"round {rnd + 1} {dtype} {engine}: tok/s {tok}", file=sys.stderr, flush=True)
                # the whole record as it comes, so a run cut short keeps the engines it finished
                print(f"  {json.dumps(results[(rnd, dtype, engine)])}", file=sys.stderr, flush=True)
    md = header(args) + table(results, args)
    print(md)
    if args.out:
        args.out.write_text(md)
    if args.benchmarks:
        text = args.benchmarks.read_text()
        a, b = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
        args.benchmarks.write_text(text[:a] + "\n" + md + text[b:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
