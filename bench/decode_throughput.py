"""Benchmark: greedy decode throughput of jaxmoe vs transformers ``generate`` on one checkpoint.

What it measures: output tokens/s = batch x new tokens / wall time of one whole greedy generation
(prefill of the prompts + ``--new-tokens`` decode steps, 128 by default), at batch 1 and 16, for

* jaxmoe: ``LLM(path, dtype="float32").generate(prompts, SamplingParams(max_tokens=128,
  ignore_eos=True))`` -- the public API: scheduler + model runner + one jitted program per step
  (forward over all layers + sampler, paged KV cache donated in place);
* transformers: ``model.generate(input_ids, max_new_tokens=128, min_new_tokens=128,
  do_sample=False, use_cache=True)`` under ``torch.inference_mode()``, fp32, dynamic KV cache,
  ``attn_implementation="eager"`` and ``experts_implementation="eager"`` by default.  On a quiet
  2-core CPU eager/sdpa x eager/grouped_mm are within ~15% of each other and batched_mm is ~35x
  slower; ``--hf-sweep`` times all six combinations first and then uses the fastest.

Both run in one process on the same checkpoint and the same cores: ``--threads`` (default: every
core this process may use) is ``torch.set_num_threads`` and, when it is fewer than those cores,
the process is pinned to that many cores (``sched_setaffinity``) so XLA's CPU client gets the same
number.  Each side first does one identical warm-up generation per batch size (for jaxmoe that
run compiles every program the timed runs use; the XLA compile time and count of that run are
read from ``jax.monitoring`` and reported separately), then jaxmoe and transformers runs alternate
``--repeats`` times and the median of each is reported, so that load from other jobs on the
machine hits both sides alike (the load average is printed before and after).  Greedy tokens of
both are compared for every prompt ("equal" = all new tokens equal).

The checkpoint: a Mixtral-style random model written with ``MixtralForCausalLM.save_pretrained``
(fp32; weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), routers x2, norms ~ 1 + 0.1 N(0, 1), so
routing and greedy choices have clear margins): hidden 512, 8 layers, 8 heads / 2 KV heads
(head_dim 64), 8 experts top-2 with intermediate 768, vocab 32000, untied LM head, rope theta 1e6:
113,549,824 parameters (454 MB).  It is written into ``--ckpt-dir`` (default: a temp dir removed
at the end) and reused when that directory already holds it.  Prompts: random token ids
(seed 0), ``--prompt-len`` (32) each; batch b uses the first b of them.

Run (from the repository root):
  .venv/bin/python bench/decode_throughput.py                          # batch 1 and 16, 128 tokens
  .venv/bin/python bench/decode_throughput.py --ckpt-dir /tmp/moe100m  # keep / reuse the checkpoint
  .venv/bin/python bench/decode_throughput.py --threads 1              # one core each
  .venv/bin/python bench/decode_throughput.py --hf-sweep               # pick transformers' fastest impls
  .venv/bin/python bench/decode_throughput.py --batches 16 --repeats 1 --new-tokens 32  # quick look
  .venv/bin/python bench/decode_throughput.py --out /tmp/decode.md     # also write the markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    router_jitter_noise=0.0,
)
HF_ATTN = ("eager", "sdpa")
HF_EXPERTS = ("eager", "batched_mm", "grouped_mm")


def _randomize(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * z)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(z)
            else:  # [out, in] linears, [E, out, in] fused experts, [V, D] lm_head
                scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0  # routers: wider logit spread
                p.copy_(z * scale / math.sqrt(p.shape[-1]))


def make_checkpoint(path: pathlib.Path, seed: int = 0) -> int:
    """Write the benchmark checkpoint into ``path`` (unless it is already there); returns #params."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    marker = path / "bench_config.json"
    if marker.exists() and json.loads(marker.read_text()) == dict(CONFIG, seed=seed):
        return json.loads((path / "bench_params.json").read_text())["num_params"]
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**CONFIG)).to(torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    (path / "bench_params.json").write_text(json.dumps({"num_params": n}))
    marker.write_text(json.dumps(dict(CONFIG, seed=seed)))
    return n


def load_hf(path, attn: str, experts: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn, experts_implementation=experts
    )
    model.generation_config.eos_token_id = None  # never stop early: exactly new_tokens tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_generate(model, prompts, new_tokens: int):
    """(seconds, new tokens [B, new_tokens]) of one greedy ``generate``."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
        )
        dt = time.perf_counter() - t0
    return dt, out[:, prompts.shape[1] :].numpy()


def jax_generate(llm, prompts, new_tokens: int):
    """(seconds, new tokens [B, new_tokens]) of one greedy ``LLM.generate``."""
    import numpy as np

    from jaxmoe import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    lists = [list(map(int, p)) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(lists, sp)
    dt = time.perf_counter() - t0
    return dt, np.asarray([o.token_ids for o in outs])


class CompileLog:
    """Counts XLA backend compilations and their seconds (``jax.monitoring`` duration events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.seconds, self.count = 0.0, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, seconds: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += seconds


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", default=None, help="create / reuse the checkpoint here (default: temp dir)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch (median)")
    p.add_argument("--threads", type=int, default=None, help="cores for both sides (default: all)")
    p.add_argument("--hf-attn", default="eager", choices=HF_ATTN, help="transformers attn_implementation")
    p.add_argument(
        "--hf-experts",
        default="eager",
        choices=HF_EXPERTS,
        help="transformers experts_implementation (its own default is grouped_mm)",
    )
    p.add_argument(
        "--hf-sweep",
        action="store_true",
        help="first time every attn x experts combination (batch max, 16 tokens), use the fastest",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    threads = a.threads or len(cores)
    if threads < len(cores):  # before jax / torch start their thread pools
        os.sched_setaffinity(0, set(cores[:threads]))
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    import jax

    from jaxmoe import LLM

    load_before = loadavg()
    tmp = None
    if a.ckpt_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="jaxmoe-bench-")
        ckpt = pathlib.Path(tmp.name)
    else:
        ckpt = pathlib.Path(a.ckpt_dir)
    t0 = time.perf_counter()
    n_params = make_checkpoint(ckpt)
    print(f"checkpoint {ckpt}: {n_params:,} parameters ({time.perf_counter() - t0:.1f}s)", flush=True)

    rng = np.random.default_rng(0)
    all_prompts = rng.integers(3, CONFIG["vocab_size"], (max(batches), a.prompt_len))

    # -- transformers: which implementation --------------------------------------------------------
    hf, attn, experts, sweep = None, a.hf_attn, a.hf_experts, []
    if not a.skip_hf and a.hf_sweep:
        sweep_b, sweep_tokens = max(batches), min(16, a.new_tokens)
        for at in HF_ATTN:
            for ex in HF_EXPERTS:
                m = load_hf(ckpt, at, ex)
                hf_generate(m, all_prompts[:sweep_b], 2)
                dt = hf_generate(m, all_prompts[:sweep_b], sweep_tokens)[0]
                sweep.append((sweep_b * sweep_tokens / dt, at, ex))
                print(
                    f"  transformers attn={at:5s} experts={ex:10s} batch {sweep_b}, {sweep_tokens} tokens: "
                    f"{sweep[-1][0]:7.1f} tok/s",
                    flush=True,
                )
                del m
        _, attn, experts = max(sweep)
    if not a.skip_hf:
        hf = load_hf(ckpt, attn, experts)
        print(
            f"transformers {__import__('transformers').__version__}: attn_implementation={attn} "
            f"experts_implementation={experts}, torch {torch.__version__}, {torch.get_num_threads()} threads",
            flush=True,
        )

    # -- jaxmoe ----------------------------------------------------------------------------------
    max_b = max(batches)
    blocks_per_seq = -(-(a.prompt_len + a.new_tokens) // 16)
    t0 = time.perf_counter()
    llm = LLM(ckpt, dtype="float32", num_blocks=max_b * blocks_per_seq + 16, block_size=16, max_num_seqs=max_b)
    print(
        f"jaxmoe: jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} device), "
        f"load {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    compile_log = CompileLog()

    rows = []
    for b in batches:
        prompts = all_prompts[:b]
        compile_log.seconds, compile_log.count = 0.0, 0
        warm_jax, jax_tokens = jax_generate(llm, prompts, a.new_tokens)  # compiles
        row = dict(batch=b, jax_warm=warm_jax, compile_s=compile_log.seconds, compiles=compile_log.count)
        if hf is not None:
            row["hf_warm"], hf_tokens = hf_generate(hf, prompts, a.new_tokens)
        jt, ht = [], []
        for _ in range(a.repeats):
            dt, toks = jax_generate(llm, prompts, a.new_tokens)
            assert np.array_equal(toks, jax_tokens), "jaxmoe greedy output changed between runs"
            jt.append(dt)
            if hf is not None:
                ht.append(hf_generate(hf, prompts, a.new_tokens)[0])
        row.update(jax_tps=b * a.new_tokens / statistics.median(jt), jax_times=jt)
        msg = (
            f"batch {b:3d}: jaxmoe {row['jax_tps']:7.1f} tok/s (runs {', '.join(f'{t:.2f}' for t in jt)} s; "
            f"warm-up run {warm_jax:.1f}s, {row['compiles']} XLA compiles {row['compile_s']:.1f}s)"
        )
        if hf is not None:
            same = [bool(np.array_equal(x, y)) for x, y in zip(jax_tokens, hf_tokens)]
            row.update(
                hf_tps=b * a.new_tokens / statistics.median(ht),
                hf_times=ht,
                match=sum(same),
                first_diff=[int(np.argmax(x != y)) for x, y, s in zip(jax_tokens, hf_tokens, same) if not s],
            )
            msg += (
                f" | transformers {row['hf_tps']:7.1f} tok/s (runs {', '.join(f'{t:.2f}' for t in ht)} s)"
                f" | ratio {row['jax_tps'] / row['hf_tps']:.2f}x | greedy tokens equal for {row['match']}/{b} prompts"
            )
            if row["first_diff"]:
                msg += f" (first differing position of the others: {row['first_diff']})"
        rows.append(row)
        print(msg, flush=True)

    lines = [
        f"- CPU: {cpu_model()}, {threads} thread(s) per side (of {len(cores)} usable cores); "
        f"load average before {load_before}, after {loadavg()}",
        f"- jax {jax.__version__}, torch {torch.__version__}, transformers {__import__('transformers').__version__} "
        f"(attn_implementation={attn}, experts_implementation={experts})",
        f"- model: Mixtral-style, {n_params:,} parameters, fp32; prompts {a.prompt_len} tokens, greedy, "
        f"{a.new_tokens} new tokens; tok/s = batch x {a.new_tokens} / wall time of the whole generate "
        f"(prefill included), median of {a.repeats} alternating runs",
    ]
    if sweep:
        lines.append(
            "- transformers sweep (batch %d, 16 tokens, tok/s): " % max(batches)
            + ", ".join(f"{at}/{ex} {tps:.1f}" for tps, at, ex in sweep)
        )
    lines += [
        "",
        "| batch | jaxmoe tok/s | transformers tok/s | jaxmoe / transformers | greedy tokens equal "
        "| jaxmoe warm-up run (s) | XLA compiles (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hf_cols = (
            f"{r['hf_tps']:.1f} | {r['jax_tps'] / r['hf_tps']:.2f}x | {r['match']}/{r['batch']}"
            if "hf_tps" in r
            else "- | - | -"
        )
        lines.append(
            f"| {r['batch']} | {r['jax_tps']:.1f} | {hf_cols} | {r['jax_warm']:.1f} "
            f"| {r['compiles']} ({r['compile_s']:.1f}) |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if a.out:
        pathlib.Path(a.out).write_text(table + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
