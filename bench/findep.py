"""FinDEP on the disaggregated runtime: step time of r1 micro-batches (ASAS / AASS) vs no pipelining,
measured side by side, beside the solver's prediction from a profile measured on the same mesh.

    python bench/findep.py [--model DIR] [--mesh meshes/cpu-8.yaml] [--rows 8] [--context 128] [--steps 20]

Without --model a random DeepSeek-V2-style checkpoint with shared experts is written with
transformers (hidden 512, 4 layers, 16 routed experts top-4, 2 shared). Each configuration runs
``--steps`` decode steps on synthetic rows (``planning.measure.synthetic_batch``) after one warm-up
step; the table gives the median step time. On the CPU test mesh the 8 "devices" share the
machine's cores, so overlap between the sub-meshes cannot shorten a step there: the point of the
CPU run is the cost of the extra dispatches; the speed-up needs real parallel devices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def write_checkpoint(path: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: F401

    cfg = DeepseekV2Config(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=2,
        first_k_dense_replace=0,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=2048,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--mesh", default="meshes/cpu-8.yaml")
    ap.add_argument("--rows", type=int, default=8, help="sequences per attention instance")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)

    import jax

    from jaxmoe.llm import load_model
    from jaxmoe.planning import BatchShape, solve
    from jaxmoe.planning.measure import Sweep, profile_executor, synthetic_batch
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor
    from jaxmoe.runtime.pipeline import Pipeline

    model = Path(args.model) if args.model else write_checkpoint(Path(tempfile.mkdtemp()) / "dsv2")
    cfg, params, _ = load_model(model, "float32")
    block = 16
    probe = DisaggregatedExecutor(cfg, params, 1, block, args.mesh)
    ag = probe.num_attention
    slots = ag * -(-args.context // block) * block
    configs = [Pipeline(1, "ASAS"), Pipeline(2, "ASAS"), Pipeline(2, "AASS"), Pipeline(4, "ASAS"), Pipeline(4, "AASS")]
    executors = {p: DisaggregatedExecutor(cfg, params, slots, block, probe.sub, pipeline=p) for p in configs}
    batch = synthetic_batch(executors[configs[0]], args.rows, args.context)
    times: dict = {p: [] for p in configs}
    for p, ex in executors.items():
        jax.block_until_ready(ex.forward(*batch))  # compile
    for _ in range(args.steps):  # interleaved rounds: machine noise hits every configuration alike
        for p, ex in executors.items():
            t0 = time.perf_counter()
            jax.block_until_ready(ex.forward(*batch))
            times[p].append(time.perf_counter() - t0)
    profile = profile_executor(executors[configs[0]], Sweep(rows=(1, 2, 4, 8), contexts=(args.context,), repeats=3))
    shape = BatchShape(batch=args.rows, tokens=1, context=args.context)
    print(
        f"# {cfg.family} L{cfg.num_layers} D{cfg.hidden_size} E{cfg.moe.num_experts} k{cfg.moe.top_k}, "
        f"mesh {args.mesh} ({ag} attention instances), {args.rows} rows/instance, context {args.context}, "
        f"{args.steps} steps, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}"
    )
    print("| pipeline | measured step (ms, median) | vs r1=1 | predicted by the solver's model (ms) |")
    print("|---|---|---|---|")
    base = statistics.median(times[configs[0]])
    for p in configs:
        med = statistics.median(times[p])
        try:
            pred = solve(profile, shape, orders=(p.order,), r1=p.r1, r2=1).time_s * 1e3
            pred_s = f"{pred:.2f}"
        except ValueError as e:
            pred_s = f"- ({e})"
        print(f"| r1={p.r1} {p.order} | {med * 1e3:.2f} | {base / med:.2f}x | {pred_s} |")
    best = solve(profile, shape)
    print(
        f"\nsolver's choice for this profile: {best.order} r1={best.r1} r2={best.r2}, "
        f"predicted {best.time_s * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
