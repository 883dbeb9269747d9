"""Per-layer cost of the disaggregated data path: attention program, A2E + E2A transfers, expert
program, and the transfers per layer, for several mesh layouts against the monolithic executor.

CPU mode (default): the built-in demo model (Mixtral-style, 4 layers, D=256, 8 experts top-2)
at batch 16 decode on 8 host CPU devices (``--xla_force_host_platform_device_count=8``), layouts
cpu-8 (2A+6E), cpu-8-4a4e, cpu-8-1a7e, and the baselines: ``MonolithicExecutor`` (one jit for the
whole step) and the disaggregated executor with ``monolithic: true`` on one device and E slots
(both sub-meshes on it, no transfers: the cost of splitting the step into per-layer programs).

  .venv/bin/python bench/disaggregated_layers.py                 # prints a markdown table
  .venv/bin/python bench/disaggregated_layers.py --layouts cpu-8-4a4e.yaml cpu-8-tp2.yaml  # other layouts
  .venv/bin/python bench/disaggregated_layers.py --model /tmp/jaxmoe-bench-107m --batches 1 4 16 64 --layouts cpu-8.yaml
      # a checkpoint (here the 107 M one of the vLLM comparison) at several batch sizes, with the host's share
  .venv/bin/python bench/disaggregated_layers.py --gpu           # one DeepSeek-V2-Lite layer, 1 GPU
  .venv/bin/python bench/disaggregated_layers.py --gpu --scale 8 # the same, dims / 8 (dry run on CPU)

Timing mode (``executor.timing = True``) blocks after every phase (``jax.block_until_ready``) and
records wall times per layer; "step async" is the same step without blocking (what serving sees,
phases of different devices may overlap). Medians over ``--steps`` decode steps after warm-up.
"host us/layer": in timing mode, the CPU time of the calling thread inside the layer's program calls
(``Phases``: the host's work to dispatch them, argument checks, transfer plans, enqueueing; not the
devices' threads, nor waiting for a core, which on 2 cores with 8 host devices is most of a call's
wall time); "host CPU ms/step (async)": the calling thread's CPU time for a whole step without
blocking (``ModelRunner.forward``: the batch prepared on the host, every program dispatched, the
Python between the calls), per step.
Sequences' KV blocks are allocated from the slot range of the attention instance that serves
their row (block-to-instance affinity).

``--gpu``: one DeepSeek-V2-Lite-sized MoE layer (hidden 2048, 16 heads MLA with kv_lora 512,
64 routed experts top-6 of width 1408, 2 shared experts, vocab 102400) with random bf16 weights;
decode step monolithic vs disaggregated with both sub-meshes on the single device, grouped matmul
``ragged_dot`` and Pallas (Mosaic GPU), AEBS reference and kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--gpu" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe.engine.model_runner import ModelRunner, Row  # noqa: E402
from jaxmoe.runtime.disaggregated import DisaggregatedExecutor  # noqa: E402
from jaxmoe.runtime.monolithic import MonolithicExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU_LAYOUTS = ["cpu-8.yaml", "cpu-8-4a4e.yaml", "cpu-8-1a7e.yaml"]
WARMUP = 3


# --------------------------------------------------------------------------- workload


def blocks_per_seq(prompt_len: int, block_size: int, steps: int, warmup: int = WARMUP) -> int:
    return -(-(prompt_len + warmup + 2 * steps + 1) // block_size)


def make_rows(
    batch: int, prompt_len: int, block_size: int, num_blocks: int, attention_instances: int, steps: int, seed=0
):
    """Prompts and block tables; row r's blocks come from its attention instance's slot range."""
    rng = np.random.default_rng(seed)
    per_seq = blocks_per_seq(prompt_len, block_size, steps)
    per_instance = num_blocks // attention_instances
    rows_per_instance = -(-batch // attention_instances)
    tables = []
    for r in range(batch):
        inst, k = divmod(r, rows_per_instance)
        first = inst * per_instance + k * per_seq
        assert first + per_seq <= (inst + 1) * per_instance, "not enough KV blocks"
        tables.append(list(range(first, first + per_seq)))
    prompts = rng.integers(3, 250, (batch, prompt_len))
    return [Row(list(map(int, p)), 0, t) for p, t in zip(prompts, tables)]


def run_decode(executor, rows, block_size: int, steps: int, warmup: int = WARMUP):
    """Prefill, then decode steps alternating timing mode on / off.

    Returns (per-phase records of the timed steps, async step times, timed step times, transfer
    stats before the first measured step)."""
    runner = ModelRunner(executor, block_size, len(rows[0].block_table))
    logits = runner.forward(rows)
    pos = [len(r.token_ids) for r in rows]
    next_tokens = np.asarray(jnp.argmax(logits, -1))
    timed, async_times, host_cpu = [], [], []
    stats_before = None
    for s in range(warmup + 2 * steps):
        if s == warmup and hasattr(executor, "transfer_stats"):
            stats_before = executor.transfer_stats()  # count decode steps only from here
        mode_timed = s >= warmup and (s - warmup) % 2 == 0
        if hasattr(executor, "timing"):
            executor.timing = mode_timed
        step_rows = [Row([int(t)], p, r.block_table) for t, p, r in zip(next_tokens, pos, rows)]
        t0, cpu0 = time.perf_counter(), time.thread_time()
        logits = runner.forward(step_rows)
        returned = time.thread_time() - cpu0
        logits = jax.block_until_ready(logits)
        dt = time.perf_counter() - t0
        next_tokens = np.asarray(jnp.argmax(logits, -1))
        pos = [p + 1 for p in pos]
        if s >= warmup:
            (timed if mode_timed else async_times).append(dt)
            if not mode_timed:
                host_cpu.append(returned)
    if hasattr(executor, "timing"):
        executor.timing = False
    records = list(executor.timings)[-steps:] if hasattr(executor, "timings") else []
    return records, (async_times, host_cpu), timed, stats_before


def summarize(name, executor, records, async_times, timed_steps, stats_before):
    async_times, host_cpu = async_times
    row = {"layout": name, "step_async_ms": 1e3 * statistics.median(async_times)}
    row["host_cpu_ms"] = 1e3 * statistics.median(host_cpu)
    if not records:  # MonolithicExecutor: one program
        row.update(step_timed_ms=1e3 * statistics.median(timed_steps))
        return row

    def per_layer(phase):
        vals = [statistics.mean(r[phase].values()) for r in records if r[phase]]
        return 1e3 * statistics.median(vals) if vals else 0.0

    row.update({p + "_ms": per_layer(p) for p in ("attention", "a2e", "expert", "e2a", "host")})
    row["head_ms"] = 1e3 * statistics.median(r["head"] + r["embed"] for r in records)
    row["step_timed_ms"] = 1e3 * statistics.median(timed_steps)
    layer = min(executor.transfer_stats())
    now, before = executor.transfer_stats()[layer], stats_before[layer]
    diff = lambda *key: _get(now, key) - _get(before, key)  # noqa: E731
    steps = diff("steps")
    row["a2e_hops"] = diff("a2e_transfers") / steps
    row["e2a_hops"] = diff("e2a_transfers") / steps
    row["cross_hops"] = (diff("a2e", "cross") + diff("e2a", "cross")) / steps
    row["kib"] = (diff("a2e_bytes") + diff("e2a_bytes")) / steps / 1024
    row["strategy"] = now["strategy"]
    spec = executor.sub.spec
    row["layout"] = f"{name} ({spec.attention.count}A+{spec.experts.count}E)"
    return row


def _get(d, key):
    for k in key:
        d = d[k]
    return d


def table(rows) -> str:
    head = (
        "| layout | attention ms/layer | a2e ms/layer | expert ms/layer | e2a ms/layer | transfers/layer "
        "(a2e+e2a, cross-node) | KiB/layer | strategy | embed+head ms | step ms (timed) | step ms (async) "
        "| host us/layer | host CPU ms/step (async) |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if "attention_ms" not in r:
            lines.append(
                f"| {r['layout']} | - | - | - | - | 0 | 0 | - | - | {r['step_timed_ms']:.2f} "
                f"| {r['step_async_ms']:.2f} | - | {r['host_cpu_ms']:.2f} |"
            )
            continue
        hops = r["a2e_hops"] + r["e2a_hops"]
        lines.append(
            f"| {r['layout']} | {r['attention_ms']:.2f} | {r['a2e_ms']:.2f} | {r['expert_ms']:.2f} | {r['e2a_ms']:.2f} "
            f"| {hops:.0f} ({r['a2e_hops']:.0f}+{r['e2a_hops']:.0f}, {r['cross_hops']:.0f}) | {r['kib']:.0f} "
            f"| {r['strategy'] if hops else '- (same device)'} | {r['head_ms']:.2f} | {r['step_timed_ms']:.2f} "
            f"| {r['step_async_ms']:.2f} | {1e3 * r['host_ms']:.0f} | {r['host_cpu_ms']:.2f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- modes


def cpu_mode(args):
    from jaxmoe.checkpoint.model import load_model

    cfg, params, _ = load_model(args.model or "tiny-random", dtype=args.dtype if args.model else "float32")
    results = []
    for batch in args.batches or [args.batch]:
        results += cpu_rows(args, cfg, params, batch)
    dtype = jax.tree.leaves(params)[0].dtype
    print(
        f"{args.model or 'tiny-random'}: {cfg.num_layers} layers, D={cfg.hidden_size}, {cfg.moe.num_experts} experts "
        f"top-{cfg.moe.top_k}, F={cfg.moe.intermediate_size}; batch {args.batches or args.batch} decode, prompt "
        f"{args.prompt_len}, {dtype}, expert_impl={args.expert_impl}; {jax.device_count()} {jax.default_backend()} "
        f"devices; load {' '.join(open('/proc/loadavg').read().split()[:3])}"
    )
    print(table(results))


def cpu_rows(args, cfg, params, batch: int) -> list[dict]:
    """The monolithic executor, then each layout, at ``batch`` decode rows."""
    num_blocks, bs = args.num_blocks, args.block_size
    results = []
    rows_for = lambda m: make_rows(batch, args.prompt_len, bs, num_blocks, m, args.steps)  # noqa: E731
    prefix = f"B={batch} " if args.batches else ""
    mono = MonolithicExecutor(cfg, params, num_blocks * bs, bs)
    rec, asy, tim, before = run_decode(mono, rows_for(1), bs, args.steps)
    results.append(summarize(prefix + "monolithic executor (1 device, one jit)", mono, rec, asy, tim, before))
    del mono
    one_device = {
        "platform": "cpu",
        "nodes": 1,
        "devices_per_node": 1,
        "monolithic": True,
        "experts": {"instances": 1, "slots_per_instance": cfg.moe.num_experts},
    }
    for layout in ["1 device"] + (args.layouts or CPU_LAYOUTS):
        mesh = one_device if layout == "1 device" else str(ROOT / "meshes" / layout)
        ex = DisaggregatedExecutor(cfg, params, num_blocks * bs, bs, mesh, expert_impl=args.expert_impl)
        rec, asy, tim, before = run_decode(ex, rows_for(ex.num_attention), bs, args.steps)
        results.append(summarize(prefix + layout, ex, rec, asy, tim, before))
        print(f"done {prefix}{layout}", file=sys.stderr)
        del ex
    return results


DSV2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}


def random_params(cfg, dtype, seed=0):
    """Random weights in the checkpoint layout, drawn on the default device."""
    from jaxmoe.checkpoint.hf_names import param_plan
    from jaxmoe.checkpoint.loader import empty_tree, set_leaf

    params, key = empty_tree(cfg), jax.random.key(seed)
    for i, leaf in enumerate(param_plan(cfg)):
        shape = leaf.shape[::-1] if leaf.transpose else leaf.shape
        if leaf.stack:
            shape = (len(leaf.sources),) + shape
        if len(shape) == 1:
            value = jnp.ones(shape, dtype)
        else:
            value = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / np.sqrt(shape[-2])
            value = value.astype(dtype)
        set_leaf(params, leaf.path, value)
    return params


def gpu_mode(args):
    from jaxmoe.config import from_hf_config

    hf = dict(DSV2_LITE)
    if args.scale > 1:  # dry run: shrink every width
        for k in (
            "hidden_size",
            "moe_intermediate_size",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "qk_nope_head_dim",
        ):
            hf[k] //= args.scale
        hf["vocab_size"] //= args.scale * 4
    cfg = from_hf_config(hf)
    dtype = jnp.dtype(args.dtype)
    params = random_params(cfg, dtype)
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(jax.devices()[0].platform, jax.devices()[0].platform)
    mesh = {
        "platform": platform,
        "nodes": 1,
        "devices_per_node": 1,
        "monolithic": True,
        "experts": {"instances": 1, "slots_per_instance": cfg.moe.num_experts + args.redundant},
        "shared_experts": "attention",
    }
    num_blocks, bs = args.num_blocks, args.block_size
    results = []
    for batch in args.batches:
        rows = make_rows(batch, args.prompt_len, bs, num_blocks, 1, args.steps)
        mono = MonolithicExecutor(cfg, params, num_blocks * bs, bs)
        rec, asy, tim, before = run_decode(mono, rows, bs, args.steps)
        results.append(summarize(f"B={batch} monolithic executor", mono, rec, asy, tim, before))
        del mono
        for expert_impl, aebs_impl in (("ragged_dot", "reference"), ("pallas", "kernel"), ("pallas", "reference")):
            name = f"B={batch} disaggregated, gmm={expert_impl}, aebs={aebs_impl}"
            try:
                ex = DisaggregatedExecutor(
                    cfg, params, num_blocks * bs, bs, mesh, expert_impl=expert_impl, aebs_impl=aebs_impl
                )
                rec, asy, tim, before = run_decode(ex, rows, bs, args.steps)
                results.append(summarize(name, ex, rec, asy, tim, before))
                del ex
            except Exception as exc:  # a kernel that does not lower here: report, go on
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
                results.append(
                    {"layout": name + " (failed)", "step_async_ms": float("nan"), "step_timed_ms": float("nan")}
                )
    dev = jax.devices()[0]
    print(
        f"DeepSeek-V2-Lite-sized layer{' / ' + str(args.scale) if args.scale > 1 else ''}: D={cfg.hidden_size}, "
        f"MLA kv_lora {cfg.attn.kv_lora_rank}, {cfg.moe.num_experts} experts top-{cfg.moe.top_k} F="
        f"{cfg.moe.intermediate_size}, 2 shared, vocab {cfg.vocab_size}; {args.dtype}; prompt {args.prompt_len}; "
        f"{cfg.moe.num_experts + args.redundant} expert slots; device {dev.device_kind}"
    )
    print(table(results))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="one DeepSeek-V2-Lite-sized layer on the single device")
    ap.add_argument("--scale", type=int, default=1, help="--gpu: divide the widths by this (CPU dry run)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="batch sizes (--gpu: default 1 16 64)")
    ap.add_argument("--model", default=None, help="CPU: a checkpoint directory instead of tiny-random")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--expert-impl", default="auto")
    ap.add_argument("--layouts", nargs="*", default=None, help=f"CPU: mesh files in meshes/ (default {CPU_LAYOUTS})")
    ap.add_argument("--dtype", default=None, help="--gpu (default bfloat16) and --model (default: the checkpoint's)")
    ap.add_argument("--redundant", type=int, default=16, help="--gpu: redundant expert slots")
    args = ap.parse_args()
    if args.gpu:
        args.batches = args.batches or [1, 16, 64]
        args.dtype = args.dtype or "bfloat16"
    need = max(args.batches or [args.batch]) * blocks_per_seq(args.prompt_len, args.block_size, args.steps)
    args.num_blocks = args.num_blocks or 4 * (-(-need // 4) + 4)  # room in each of up to 4 instances' ranges
    (gpu_mode if args.gpu else cpu_mode)(args)


if __name__ == "__main__":
    main()
