"""QLLM (arXiv:2503.09304) on the CPU: latency-sensitive TTFT and best-effort throughput under FCFS,
step-level preemption (QLLM's batches, preemption at step boundaries) and layer-level preemption
(latency-sensitive work that arrives during a best-effort step is merged into it at the next layer
boundary, the paper's Fig. 1b: ``layer-level``; or runs as a nested step while the best-effort step
waits: ``layer-nested``).

The engine runs in this process as the serving loop runs it (``AsyncEngine``: admit what arrived
between steps and, with layer-level preemption, between layers; deliver the tokens of a step run
inside a paused one at once). Requests follow one Poisson trace per rate (same seed for every
mode), 20 % latency-sensitive. TTFT is measured from the trace's arrival time to the moment the
first token is handed out. The model is a random Mixtral-shaped MoE (hidden 256 or ``--hidden``, intermediate
twice it, 8 experts top-2, byte vocabulary) with ``--layers`` layers, so one step is long enough
for the difference to show.

Rates are multiples of the measured capacity (best-effort requests per second when all arrive at
once). Also measured: the cost of pausable steps when nothing preempts, as a same-engine A/B
(``paired_cost``: the same 16 best-effort decodes on one engine, fused steps and each pausable form
alternating round by round; the median per-round ratio).

    python bench/qllm.py [--layers 16] [--requests 60] [--loads 0.4,0.7,0.9] [--modes ...] [--json out.json]
    python bench/qllm.py --layers 8 --loads "" --modes layer-level,expert-queues --rounds 20   # the cost only
    python bench/qllm.py --layers 8 --hidden 1024 --loads "" --modes layer-level --rounds 12   # ... bigger layers
    python bench/qllm.py --layers 8 --loads "" --modes layer-level,default --rounds 16   # ... the default's choice

``default`` is layer preemption's default: its pause granularity measured at warm-up (``qllm.granularity``),
step-level preemption (fused steps) where no granularity costs within 2 %.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

from jaxmoe.config import from_hf_config
from jaxmoe.demo import DEMO_HF_CONFIG, demo_params
from jaxmoe.engine.engine import EngineConfig, LLMEngine
from jaxmoe.engine.warmup import warm_up
from jaxmoe.assembly import QLLMConfig, RuntimeConfig, attach_features, build_executor
from jaxmoe.qllm import granularity
from jaxmoe.sampling import SamplingParams
from jaxmoe.tokenizer import ByteTokenizer

MODES = {  # name: (policy, layer_preemption, expert_queues, pause_every, ls_merge)
    "fcfs": ("fcfs", False, 0),
    "step-level": ("qllm", False, 0),
    "layer-level": ("qllm", True, 0),  # pause points after every layer; LS work merges into the BE step (cost model)
    "layer-nested": ("qllm", True, 0, 1, False),  # the same pause points; LS work runs as a nested step
    "every-4-layers": ("qllm", True, 0, 4),  # pause points after every 4 layers
    "expert-queues": ("qllm", True, 4),  # every layer + per-expert queues served in 4 rounds per MoE layer
    # layer preemption's default: the pause granularity measured at warm-up (step-level where none is within 2 %)
    "default": ("qllm", None, 0, None),
}
LS = dict(prompt=48, tokens=8)
BE = dict(prompt=192, tokens=32)


def build_engine(
    layers: int,
    policy: str,
    layer_preemption: bool,
    expert_queues: int = 0,
    pause_every: int | None = 1,
    ls_merge: bool = True,
    warm: bool = True,
    hidden: int = DEMO_HF_CONFIG["hidden_size"],
) -> LLMEngine:
    sizes = {"hidden_size": hidden, "intermediate_size": 2 * hidden}  # the demo's ratio
    cfg = from_hf_config({**DEMO_HF_CONFIG, "num_hidden_layers": layers, **sizes})
    config = RuntimeConfig(
        engine=EngineConfig(
            num_blocks=512,
            block_size=16,
            max_num_seqs=16,
            max_batch_tokens=512,
            max_prefill_chunk=256,
            policy=policy,
            pause_every=pause_every,
        ),
        qllm=QLLMConfig(layer_preemption, expert_queues, ls_merge=ls_merge),
    )
    executor = build_executor(cfg, demo_params(cfg), config)
    engine = attach_features(LLMEngine(cfg, executor, ByteTokenizer(), config.engine), config)
    if warm:  # every shape a trace may need (the cost's A/B compiles its few shapes as it runs them)
        engine.poll = (lambda: None) if engine.layer_hook is not None else None  # as ``AsyncEngine`` does
        warm_up(engine, progress=False)  # (the default measures its pause granularity here)
        engine.poll = None
    return engine


def make_trace(n: int, rate: float, ls_share: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    t, trace = 0.0, []
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        kind = "ls" if rng.random() < ls_share else "be"
        shape = LS if kind == "ls" else BE
        prompt = rng.integers(0, 256, shape["prompt"]).tolist()
        trace.append(dict(id=f"{kind}-{i}", t=t, kind=kind, prompt=prompt, tokens=shape["tokens"]))
    return trace


def serve(engine: LLMEngine, trace: list[dict]) -> dict:
    """Serve the trace in real time; per request: arrival, first-token and finish wall times."""
    pending = list(trace)
    ids, first, done = {}, {}, {}
    t0 = time.monotonic()

    def admit():
        now = time.monotonic() - t0
        while pending and pending[0]["t"] <= now:
            r = pending.pop(0)
            sp = SamplingParams(max_tokens=r["tokens"], ignore_eos=True)
            ids[engine.add_request(r["prompt"], sp, r["kind"], request_id=r["id"])] = r

    def record(outputs):
        now = time.monotonic() - t0
        for out in outputs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now

    engine.poll, engine.emit = admit, record
    steps, step_seconds = 0, 0.0
    while pending or engine.has_work():
        admit()
        if not engine.has_work():
            time.sleep(max(0.0, min(0.05, pending[0]["t"] - (time.monotonic() - t0))))
            continue
        s0 = time.perf_counter()
        record(engine.step())
        step_seconds += time.perf_counter() - s0
        steps += 1
    makespan = time.monotonic() - t0
    return dict(first=first, done=done, makespan=makespan, steps=steps, step_seconds=step_seconds)


def counters(engine: LLMEngine) -> dict:
    pre = engine.scheduler.preemptions
    return {
        "preemptions_step": sum(pre["keep_kv"].values()) + sum(pre["recompute"].values()),
        "preemptions_layer": sum(pre["pause"].values()) + sum(pre["expert_pause"].values()),
        "layer_pauses": engine.layer_hook.layer_pauses if engine.layer_hook else 0,
        "ls_merges": engine.layer_hook.ls_merges if engine.layer_hook else 0,
        "merges_declined": engine.layer_hook.merges_declined if engine.layer_hook else 0,
        "pause_every": engine.layer_hook.pause_every if engine.layer_hook else 0,
    }


def run_trace(engine: LLMEngine, trace: list[dict]) -> dict:
    """Serve the trace on an engine that may have served others (counters as deltas)."""
    before = counters(engine)
    if engine.layer_hook is not None:
        engine.layer_hook.paused_state_bytes_max = 0
    run = serve(engine, trace)
    after = counters(engine)
    return (
        summarize(trace, run, engine) | {k: after[k] - before[k] for k in after} | {"pause_every": after["pause_every"]}
    )


def summarize(trace: list[dict], run: dict, engine: LLMEngine) -> dict:
    arrival = {r["id"]: r["t"] for r in trace}
    ls = [run["first"][r["id"]] - r["t"] for r in trace if r["kind"] == "ls"]
    be = [r for r in trace if r["kind"] == "be"]
    be_tokens = sum(r["tokens"] for r in be)
    return {
        "ls_ttft_p50_s": float(np.percentile(ls, 50)) if ls else None,
        "ls_ttft_p90_s": float(np.percentile(ls, 90)) if ls else None,
        "be_throughput_tok_s": be_tokens / run["makespan"],
        "be_turnaround_mean_s": float(np.mean([run["done"][r["id"]] - arrival[r["id"]] for r in be])),
        "saved_state_bytes_max": engine.layer_hook.paused_state_bytes_max if engine.layer_hook else 0,
        "mean_step_ms": 1e3 * run["step_seconds"] / max(run["steps"], 1),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


# how a step runs when nothing preempts: (layer by layer, layers per program, per-expert queues)
VARIANTS = {  # name: (pausable, pause_every, per-expert queues, split_step)
    "fused": (False, 1, False, False),  # one program per step: layer preemption off
    # a serving engine's step that does not pause (layer preemption on): its programs per group (``split_step``;
    # ``LLM.generate``, without a poll, runs the fused program)
    "unpaused": (False, 1, False, True),
    "layer-level": (True, 1, False, True),
    "every-4-layers": (True, 4, False, True),
    "expert-queues": (True, 1, True, True),
    "default": None,  # what the default chooses on this engine (``qllm.granularity``; set in ``paired_cost``)
}
COST_OF = {"layer-level": "layer-level", "layer-nested": "layer-level"} | {
    m: m for m in ("every-4-layers", "expert-queues", "default")
}  # a trace mode -> the variant it runs when nothing preempts (the merge and the nested step: the same)


def paired_cost(layers: int, variants, rounds: int, steps: int = 4, expert_queues: int = 4, hidden: int = 256) -> dict:
    """The cost of pausable steps when nothing preempts, as a same-engine A/B: one engine (layer
    preemption on, ``expert_queues`` rounds) decodes the same 16 best-effort sequences, and each
    round runs ``steps`` steps of every variant in turn (order rotated per round): "fused" without a
    poll (one program per step, as with layer preemption off or in ``LLM.generate``), "unpaused" a
    step that does not pause in a serving engine (embed, each layer group in one call, head:
    ``split_step``), the others with a serving loop's
    poll that admits nothing (pause points checked, no arrival), the per-expert queues and
    ``pause_every`` switched on the executor between rounds. Every variant runs the same programs
    it runs in its own mode, on the same weights, KV cache and sequences, in the same slices of
    time: per round the ratio to the fused steps of that round. Returns per variant the median ms
    per step and the median ratio over rounds (tokens/s ratio = 1 / it), in wall time and in this
    process's CPU time (on a machine shared with other jobs the CPU time is the steadier one)."""
    engine = build_engine(layers, "qllm", True, expert_queues, warm=False, hidden=hidden)
    ex = engine.executor
    queues = ex.expert_rounds
    rng = np.random.default_rng(7)
    engine.emit = None
    for i in range(16):
        prompt = rng.integers(0, 256, 64).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=100000, ignore_eos=True), "be", request_id=f"cost-{i}")
    started: set[str] = set()
    while len(started) < 16:  # every sequence past its prefill
        started.update(out.request_id for out in engine.step() if out.token_ids)
    variant_of = dict(VARIANTS)
    chosen = None
    if "default" in variants:  # the default's measurement (padding rows: the sequences' KV is untouched)
        ex.expert_rounds = []
        shapes = granularity.decode_shapes(engine.runner.plan.shapes())
        costs = granularity.measure_costs(engine, shapes, granularity.candidates(ex.layer_group_sizes()))
        every = granularity.choose(costs)
        chosen = {"pause_every": every, "shapes": shapes, "costs": {k: round(c, 4) for k, c in costs.items()}}
        variant_of["default"] = (every > 0, max(every, 1), False, every > 0)

    def run(variant: str, n: int) -> tuple[float, float]:
        layered, every, queued, split = variant_of[variant]
        engine.poll = (lambda: None) if layered else None
        ex.pause_every, ex.expert_rounds, ex.split_step = every, (queues if queued else []), split
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            engine.step()
        return 1e3 * (time.perf_counter() - t0) / n, 1e3 * (time.process_time() - c0) / n

    for v in variants:  # compiles what warm-up did not (pause_every > 1)
        run(v, 1)
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            w, c = run(v, steps)
            wall[v].append(w)
            cpu[v].append(c)
    out = {}
    for v in variants:
        ratios = np.array(wall[v]) / np.array(wall["fused"])
        cpu_ratios = np.array(cpu[v]) / np.array(cpu["fused"])
        out[v] = {
            "ms": float(np.median(wall[v])),
            "ratio": float(np.median(ratios)),
            "ratios": [round(float(x), 4) for x in ratios],
            "cpu_ms": float(np.median(cpu[v])),  # CPU time of this process (all threads) per step
            "cpu_ratio": float(np.median(cpu_ratios)),
            "cpu_ratios": [round(float(x), 4) for x in cpu_ratios],
        }
    if chosen is not None:
        out["default"]["chosen"] = chosen
    return out


def capacity(engine: LLMEngine, n: int) -> float:
    """Best-effort requests per second with ``n`` of them arriving at once."""
    trace = make_trace(n, 1e9, 0.0, seed=123)
    run = serve(engine, trace)
    return n / run["makespan"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (intermediate: twice it; the demo's 256)")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--loads", default="0.4,0.7,0.9", help="arrival rates as fractions of the measured capacity")
    ap.add_argument("--ls-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=15, help="A/B rounds of the no-preemption cost (0: not measured)")
    ap.add_argument("--cost-steps", type=int, default=4, help="decode steps per variant and round of the cost")
    ap.add_argument("--cost-expert-queues", type=int, default=4, help="rounds per MoE layer of the expert-queues cost")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = ap.parse_args(argv)

    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}")
    loads = [float(x) for x in args.loads.split(",") if x.strip()]  # --loads "": the cost only
    if loads and not {"fcfs", "step-level"} & set(modes):
        ap.error("--modes: fcfs or step-level (the capacity's engine) must be one")
    engines = {mode: build_engine(args.layers, *MODES[mode], hidden=args.hidden) for mode in modes} if loads else {}
    cap = capacity(engines["fcfs" if "fcfs" in modes else "step-level"], 16) if loads else 0.0
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{args.layers} layers, hidden {args.hidden}, capacity {cap:.2f} BE req/s (16 at once)"
    )
    results = {"capacity_req_s": cap, "layers": args.layers, "rows": []}
    print(
        "| load | rate req/s | mode | LS TTFT P50 ms | LS TTFT P90 ms | BE tok/s | BE turnaround s | "
        "preempt step | preempt layer | LS merges | merges declined | max saved state KiB | machine load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for load in loads:
        rate = load * cap
        trace = make_trace(args.requests, rate, args.ls_share, args.seed)
        for mode, engine in engines.items():
            row = dict(load=load, rate=rate, mode=mode, **run_trace(engine, trace), machine_load=os.getloadavg()[0])
            results["rows"].append(row)
            label = f"{mode} (every {row['pause_every']})" if mode == "default" else mode
            print(
                f"| {load:.1f} | {rate:.2f} | {label} | "
                f"{_ms(row['ls_ttft_p50_s'])} | "
                f"{_ms(row['ls_ttft_p90_s'])} | {row['be_throughput_tok_s']:.1f} | "
                f"{row['be_turnaround_mean_s']:.2f} | {row['preemptions_step']} | {row['preemptions_layer']} | "
                f"{row['ls_merges']} | {row['merges_declined']} | "
                f"{row['saved_state_bytes_max'] / 1024:.0f} | {row['machine_load']:.1f} |",
                flush=True,
            )

    # the price of pausable steps when nothing preempts: the same 16 decodes on one engine, A/B per round
    variants = ["fused", "unpaused", *dict.fromkeys(COST_OF[m] for m in modes if m in COST_OF)]
    if args.rounds and len(variants) > 1:
        cost = paired_cost(args.layers, variants, args.rounds, args.cost_steps, args.cost_expert_queues, args.hidden)
        results["no_preemption_cost"] = cost
        print(
            f"\nNothing preempts: 16 BE decodes on one engine, {args.rounds} rounds of {args.cost_steps} steps per "
            "variant (order rotated), median ms/step and median per-round ratio to the fused steps:"
        )
        for v, c in cost.items():
            print(
                f"- {v}: wall {c['ms']:.2f} ms/step ({100 * (c['ratio'] - 1):+.1f} %, tokens/s x{1 / c['ratio']:.3f}; "
                f"per-round {min(c['ratios']):.3f}-{max(c['ratios']):.3f}); CPU {c['cpu_ms']:.2f} ms/step "
                f"({100 * (c['cpu_ratio'] - 1):+.1f} %; per-round {min(c['cpu_ratios']):.3f}-{max(c['cpu_ratios']):.3f})"
            )
            if "chosen" in c:  # 0: step-level preemption (fused steps)
                print(f"  default's choice: {c['chosen']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
