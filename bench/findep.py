"""FinDEP (arXiv:2512.21487) on the disaggregated runtime: the shape of the paper's Tables 3-5, measured
on the CPU mesh and simulated for GPU meshes, a per-stream timeline of one layer (predicted vs
measured) and the accuracy of the performance model.

    PYTHONPATH=. python bench/findep.py [--model DIR] [--mesh meshes/cpu-8.yaml] [--rows 2]
        [--seq 256] [--seqs 256,1024,2048] [--steps 5] [--chunks 1,8] [--stat median|min] [--plot docs/findep_timeline.png]
        [--part cpu,sim]

Without --model a random DeepSeek-V2-style checkpoint with shared experts is written with
transformers (hidden 256, 4 layers, 16 routed experts top-4, 2 shared). CPU part: a profile is
measured on the mesh (``planning.measure``, prefill steps of --seq tokens), then prefill steps
(--rows sequences per attention instance of --seq tokens) run under each schedule, interleaved round
by round (machine noise hits all alike), median (--stat min: least) of --steps. Table 3: throughput vs r1 (ASAS, r2 = 1);
Table 4: vs r2 (r1 = 2); Table 5: FinDEP (the solver's choice from the measured profile) vs the best
measured PPPipe (order PP, r2 = 1, best r1), per sequence length. Simulation part: the same tables
from the event model with FinDEP's Fig. 7 parameters (8x A6000, ``paper_profile``) as a GPU-shaped
profile, for DeepSeek-V2 dimensions on an 8-GPU (3 attention + 5 expert) and a 32-GPU (8 + 24) H100
layout: the layouts are H100-sized, the numbers are the paper's A6000 fits, not H100 measurements.
On the CPU mesh the 8 "devices" share 2 cores, so sub-meshes cannot truly run in parallel.
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
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=2,
        first_k_dense_replace=0,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=8192,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    return path


def _ints(text):
    return tuple(int(v) for v in text.split(","))


def table(title, header, rows):
    print(f"\n{title}\n\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


class Runner:
    """Executors of one model on one mesh, one per pipeline, timed on the same synthetic batches."""

    def __init__(self, cfg, params, mesh, max_context, rows):
        from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

        self.cfg, self.params, block = cfg, params, 16
        self.stat = "median"
        probe = DisaggregatedExecutor(cfg, params, 1, block, mesh)
        self.ag = probe.num_attention
        slots = self.ag * rows * (-(-2 * max_context // block) * block)
        self.ex = DisaggregatedExecutor(cfg, params, slots, block, probe.sub)

    def batch(self, rows, seq):
        from jaxmoe.findep.measure import synthetic_batch

        return synthetic_batch(self.ex, rows, seq, seq)

    def time(self, pipes, rows, seq, steps):
        """Median (``stat = "min"``: least) seconds of a prefill step per pipeline (rounds interleaved)."""
        import jax

        args = self.batch(rows, seq)
        for p in pipes:
            self.ex.pipeline = p
            jax.block_until_ready(self.ex.forward(*args))  # compile
        times = {p: [] for p in pipes}
        for _ in range(steps):
            for p in pipes:
                self.ex.pipeline = p
                t0 = time.perf_counter()
                jax.block_until_ready(self.ex.forward(*args))
                times[p].append(time.perf_counter() - t0)
        agg = min if self.stat == "min" else statistics.median
        return {p: agg(v) for p, v in times.items()}


def cpu_part(args):
    import jax

    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.findep import BatchShape, solve
    from jaxmoe.findep.measure import Sweep, plot_profile, profile_executor

    model = Path(args.model) if args.model else write_checkpoint(Path(tempfile.mkdtemp()) / "dsv2")
    cfg, params, _ = load_model(model, "float32")
    seqs = _ints(args.seqs)
    run = Runner(cfg, params, args.mesh, max(seqs + (args.seq,)), max(args.rows, 4))
    run.stat = args.stat
    layers = cfg.num_layers
    print(
        f"# CPU mesh: {cfg.family} L{layers} D{cfg.hidden_size} E{cfg.moe.num_experts} k{cfg.moe.top_k} "
        f"(+shared), mesh {args.mesh} ({run.ag} attention instances), jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d')}, {args.stat} of {args.steps} interleaved prefill steps"
    )
    t0 = time.perf_counter()
    sweep = Sweep(
        rows=(1, 2, 4, 8),
        contexts=(args.seq, 2 * args.seq),
        tokens=args.seq,
        repeats=3,
        chunks=_ints(args.chunks),
        stat=args.stat,
    )
    profile = profile_executor(run.ex, sweep)
    print(f"profile measured in {time.perf_counter() - t0:.0f} s ({profile.source}); fits (R²):", end="")
    for s in ("attention", "shared", "a2e", "expert", "e2a"):
        m = getattr(profile.stages, s)
        if m is not None:
            print(f" {s} {m.r2:.3f}{' (with the x² term)' if s == 'expert' and len(m.betas) > 1 else ''}", end="")
    host = profile.host
    c = "unlimited" if host.concurrency is None else f"{host.concurrency:.2f}"
    pairs = ", ".join(f"{a * 1e3:.1f} + {b * 1e3:.1f} -> {ab * 1e3:.1f} ms" for a, b, ab in host.samples["concurrency"])
    print(
        f"\nhost: concurrency {c} (busy pairs alone + alone -> together: {pairs}), dispatch "
        f"{host.dispatch * 1e3:.3f} ms/program, asynchronous steps took {host.timing_scale:.2f} of the blocked time (stages scaled)"
    )
    print(f"load average (1, 5, 15 min) after profiling: {_load()}")
    if args.profile_plot:
        plot_profile(profile, args.profile_plot)
    tok = lambda rows, seq, t: rows * seq * run.ag / t  # noqa: E731

    paper = profile.model_copy(update={"host": None})  # the same stages, separate hardware (the paper's model)

    def predicted(p, rows, seq, prof=profile):
        shape = BatchShape(rows, seq, seq)
        return solve(prof, shape, orders=(p.order,), r1=p.r1, r2=p.r2).time_s

    predicted.paper = lambda p, rows, seq: predicted(p, rows, seq, paper)  # noqa: E731
    predicted.bound = lambda p, rows, seq: _bound(profile, p, rows, seq)  # noqa: E731

    rows, seq = args.rows * 2, args.seq
    if "cpu" in args.part.split(","):
        tables(args, run, profile, predicted, tok, layers, seqs)
    if args.plot:
        timeline(args, run, profile, rows, seq, layers)


def _load() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def _bound(profile, p, rows, seq) -> str:
    """Which term of max(event model, work / concurrency, programs x dispatch) sets the prediction."""
    from jaxmoe.findep import BatchShape
    from jaxmoe.findep.schedule import estimate, programs, work
    from jaxmoe.findep.solver import stage_times

    d, host = profile.dims, profile.host.host()
    times = stage_times(profile, BatchShape(rows, seq, seq), rows // p.r1, p.r2)
    terms = {
        "event": estimate(times, p.order, p.r1, p.r2, d.moe_layers, d.dense_layers),
        "work": work(times, p.r1, p.r2, d.moe_layers, d.dense_layers) / host.concurrency,
        "dispatch": programs(times, p.r1, p.r2, d.moe_layers, d.dense_layers) * host.dispatch,
    }
    return max(terms, key=terms.get)


def tables(args, run, profile, predicted, tok, layers, seqs):
    from jaxmoe.findep import BatchShape, solve
    from jaxmoe.runtime.pipeline import Pipeline

    accuracy = []
    # Table 3: vs r1; Table 4: vs r2
    rows, seq = args.rows * 2, args.seq
    r1s = [Pipeline(r, "ASAS", 1) for r in (1, 2, 4)]
    t = run.time(r1s, rows, seq, args.steps)
    table(
        f"Table 3 shape (CPU, measured): {rows} sequences/instance x {seq} tokens, ASAS, r2 = 1",
        ["r1", "m_a", "step ms", "tokens/s", "predicted ms"],
        [
            (
                p.r1,
                rows // p.r1,
                f"{t[p] * 1e3:.1f}",
                f"{tok(rows, seq, t[p]):.0f}",
                f"{predicted(p, rows, seq) * 1e3:.1f}",
            )
            for p in r1s
        ],
    )
    accuracy += [(p, rows, seq, t[p], predicted(p, rows, seq)) for p in r1s]
    r2s = [Pipeline(2, "ASAS", r) for r in (1, 2, 4, 8)]
    t = run.time(r2s, rows, seq, args.steps)
    table(
        f"Table 4 shape (CPU, measured): {rows} sequences/instance x {seq} tokens, ASAS, r1 = 2",
        ["r2", "step ms", "tokens/s", "predicted ms"],
        [
            (p.r2, f"{t[p] * 1e3:.1f}", f"{tok(rows, seq, t[p]):.0f}", f"{predicted(p, rows, seq) * 1e3:.1f}")
            for p in r2s
        ],
    )
    accuracy += [(p, rows, seq, t[p], predicted(p, rows, seq)) for p in r2s]

    # Table 5: FinDEP (solver) vs best measured PPPipe, per sequence length
    out = []
    for s in seqs:
        plan = solve(profile, BatchShape(args.rows, s, s))
        fin = Pipeline(plan.r1, plan.order, plan.r2).for_batch(args.rows, s)
        pps = [Pipeline(r, "PP", 1) for r in (1, 2) if args.rows % r == 0]
        pipes = list(dict.fromkeys([fin, *pps, Pipeline.sequential()]))
        t = run.time(pipes, args.rows, s, args.steps)
        best_pp = min(pps, key=lambda p: t[p])
        out.append(
            (
                s,
                f"{fin.order} r1={fin.r1} r2={fin.r2}",
                f"{tok(args.rows, s, t[fin]):.0f}",
                f"PP r1={best_pp.r1}",
                f"{tok(args.rows, s, t[best_pp]):.0f}",
                f"{t[best_pp] / t[fin]:.2f}x",
                f"{t[Pipeline.sequential()] / t[fin]:.2f}x",
            )
        )
        accuracy += [(p, args.rows, s, t[p], predicted(p, args.rows, s)) for p in (fin, best_pp)]
    table(
        f"Table 5 shape (CPU, measured): {args.rows} sequences/instance; FinDEP = solver's choice from the "
        "measured profile; PPPipe = best measured r1",
        ["seq len", "FinDEP config", "FinDEP tokens/s", "PPPipe config", "PPPipe tokens/s", "speedup", "vs sequential"],
        out,
    )
    table(
        "Model accuracy (CPU): predicted vs measured per-layer time (step / layers); predicted = "
        "max(event model, work / concurrency, programs x dispatch) with the measured host, 'bound' = the "
        "term that sets it; 'paper model' = the event model alone (separate hardware)",
        ["config", "rows x seq", "measured ms/layer", "predicted ms/layer", "error", "bound", "paper model", "error"],
        [
            (
                f"{p.order} r1={p.r1} r2={p.r2}",
                f"{r} x {s}",
                f"{m / layers * 1e3:.2f}",
                f"{q / layers * 1e3:.2f}",
                f"{(q - m) / m * 100:+.0f} %",
                predicted.bound(p, r, s),
                f"{predicted.paper(p, r, s) / layers * 1e3:.2f}",
                f"{(predicted.paper(p, r, s) - m) / m * 100:+.0f} %",
            )
            for p, r, s, m, q in accuracy
        ],
    )
    within = sum(abs(q - m) <= 0.15 * m for *_, m, q in accuracy)
    within_paper = sum(abs(predicted.paper(p, r, s) - m) <= 0.15 * m for p, r, s, m, _ in accuracy)
    print(
        f"\nwithin 15 %: {within} of {len(accuracy)} configurations (paper model alone: {within_paper}); "
        f"load average (1, 5, 15 min) at the end: {_load()}"
    )
    return accuracy


def timeline(args, run, profile, rows, seq, layers):
    """One layer's timeline: predicted (event model) vs measured (per-stream watchers)."""
    import jax

    from bench.findep_trace import StreamTracer, plot_timelines
    from jaxmoe.findep import BatchShape
    from jaxmoe.findep.schedule import simulate
    from jaxmoe.findep.solver import stage_times
    from jaxmoe.runtime.pipeline import Pipeline

    p = Pipeline(2, "ASAS", 2)
    argsb = run.batch(rows, seq)
    run.ex.pipeline = p
    jax.block_until_ready(run.ex.forward(*argsb))
    tracer = StreamTracer()
    run.ex.observer = tracer
    jax.block_until_ready(run.ex.forward(*argsb))
    run.ex.observer = None
    tasks = tracer.close()
    layer = layers // 2
    mine = [x for x in tasks if x["layer"] == layer]
    first = min(x["start"] for x in mine)
    seen: dict[str, int] = {}
    measured = []
    for x in sorted(mine, key=lambda x: x["start"]):  # micro-batch of each task, from dispatch order
        n = seen[x["phase"]] = seen.get(x["phase"], -1) + 1
        mb = n // p.r2 if x["phase"] in ("a2e", "expert", "e2a") else n
        measured.append(dict(x, start=x["start"] - first, end=x["end"] - first, micro_batch=mb))
    times = stage_times(profile, BatchShape(rows, seq, seq), rows // p.r1, p.r2)
    _, events = simulate(times, p.order, p.r1, p.r2, (True,), timeline=True)
    pred = [
        {
            "stream": "shared" if e.task == "shared" else e.resource,
            "start": e.start,
            "end": e.end,
            "micro_batch": e.micro_batch,
        }
        for e in events
    ]
    title = f"One MoE layer's tasks per stream, predicted vs measured ({p.order} r1={p.r1} r2={p.r2}, CPU mesh)"
    plot_timelines(pred, measured, args.plot, title)
    print(f"\ntimeline of layer {layer} written to {args.plot}")


def sim_part():
    from jaxmoe.findep import BatchShape, Dims, Limits, pppipe, solve
    from jaxmoe.findep.paper_profile import paper_profile

    def dims(ag, eg):  # DeepSeek-V2 (236B): 1 dense + 59 MoE layers
        return Dims(
            hidden=5120,
            heads=128,
            qk_head_dim=192,
            v_head_dim=128,
            expert_width=1536,
            shared_width=3072,
            num_experts=160,
            top_k=6,
            moe_layers=59,
            dense_layers=1,
            dtype_bytes=2,
            attention_instances=ag,
            expert_instances=eg,
        )

    limits = Limits(max_micro_batch_tokens=32768)
    print("\n# Simulation: event model, profile = FinDEP Fig. 7 parameters (8x A6000) for DeepSeek-V2 dimensions")
    for name, (ag, eg) in (("8-GPU H100 layout (3a5e)", (3, 5)), ("32-GPU H100 layout (8a24e)", (8, 24))):
        prof = paper_profile(dims(ag, eg), name, "deepseek-v2")
        rows = []
        for seq in (2048, 4096):
            cells = [seq]
            for r1 in (1, 2, 4, 8):
                cells.append(f"{solve(prof, BatchShape(r1, seq, seq), limits, mode='max', r1=r1).tokens_per_s:.0f}")
            rows.append(cells)
        table(
            f"Table 3 shape ({name}, simulated): tokens/s vs r1, m_a = 1", ["seq", "r1=1", "r1=2", "r1=4", "r1=8"], rows
        )
        rows = []
        for seq in (2048, 4096):
            cells = [seq]
            for r2 in (1, 2, 4, 8, 16):
                cells.append(
                    f"{solve(prof, BatchShape(4, seq, seq), limits, mode='max', r1=2, r2=r2).tokens_per_s:.0f}"
                )
            rows.append(cells)
        table(
            f"Table 4 shape ({name}, simulated): tokens/s vs r2, r1 = 2, m_a = 2",
            ["seq", "r2=1", "r2=2", "r2=4", "r2=8", "r2=16"],
            rows,
        )
        rows = []
        for seq in (1024, 2048, 4096, 8192):
            shape = BatchShape(max(1, 16384 // seq), seq, seq)
            f, p = solve(prof, shape, limits, mode="max"), pppipe(prof, shape, limits, mode="max")
            rows.append(
                (
                    seq,
                    shape.batch,
                    f"{f.order} r1={f.r1} m_a={f.m_a} r2={f.r2}",
                    f"{f.tokens_per_s:.0f}",
                    f"r1={p.r1} m_a={p.m_a}",
                    f"{p.tokens_per_s:.0f}",
                    f"{f.tokens_per_s / p.tokens_per_s:.2f}x",
                    f"{f.solve_ms:.2f}",
                )
            )
        table(
            f"Table 5 shape ({name}, simulated): FinDEP vs best-configured PPPipe (mode max: batch = memory limit)",
            ["seq", "max seqs/instance", "FinDEP", "tokens/s", "PPPipe", "tokens/s", "speedup", "solve ms"],
            rows,
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--mesh", default="meshes/cpu-8.yaml")
    ap.add_argument("--rows", type=int, default=2, help="sequences per attention instance (Table 5)")
    ap.add_argument("--seq", type=int, default=128, help="prefill tokens of Tables 3-4 and the profile")
    ap.add_argument("--seqs", default="256,1024,2048", help="sequence lengths of Table 5")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--chunks", default="1,8", help="expert-side chunk counts r2 the profile also measures")
    ap.add_argument(
        "--stat",
        default="median",
        choices=["median", "min"],
        help="over repeated steps, in the profile and the tables (min: noise on a shared machine only slows)",
    )
    ap.add_argument("--plot", default=None, help="PNG of one layer's timeline, predicted vs measured")
    ap.add_argument("--profile-plot", default=None, help="PNG of the measured profile against its fits")
    ap.add_argument("--part", default="cpu,sim", help="cpu (tables), sim, timeline (only the --plot)")
    args = ap.parse_args(argv)
    parts = args.part.split(",")
    if "sim" in parts:
        sim_part()
    if "cpu" in parts or "timeline" in parts:
        cpu_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
