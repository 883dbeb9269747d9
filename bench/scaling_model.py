"""JANUS scaling on the CPU mesh: the fitted performance model vs the engine's measured TPOT, and
Fig. 10's ablation (base, +two-phase transfers, +AEBS).

``--part fit``: measure the parts of the scaling model (``jaxmoe.janus.scaling.fit.measure_layouts``: the
runtime's own programs over a sweep of rows x contexts, two-phase and direct transfers) on
``--fit-layouts``; measure the engine's decode TPOT on ``--layouts`` x ``--batches`` (``--rounds``
rounds interleaved over layouts and batches; the median decode step of the least-contended round:
other jobs on a shared machine only add time); fit the step model on the TPOTs of the fit layouts
at ``--fit-batches`` only, and print predicted vs measured for every cell, marking which ones the
fit saw.

``--part ablation``: the three variants of ``jaxmoe.janus.scaling.ablation`` on ``--ablation-layouts`` at
``--ablation-batches`` (rounds interleaved), decode TPOT and tokens/s, transfer hops per MoE layer,
the activation imbalance (max - min activated replicas per expert instance), the fitted model's
prediction (when ``fit`` ran too), and whether the greedy tokens agree.

Model: ``tiny-random`` (Mixtral-shaped: 4 layers, hidden 256, 8 experts top-2; fp32) on
``meshes/cpu-8.yaml``'s 8 host devices (2 nodes of 4, 4 slots per expert instance); every request
has a 48-token prompt (prefilled in one step) and 24 greedy output tokens.

Run:  PYTHONPATH=. python bench/scaling_model.py [--part fit,ablation] [--out scaling.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe import SamplingParams  # noqa: E402
from jaxmoe.mesh import load_mesh  # noqa: E402
from jaxmoe.findep.commands import int_list as _ints  # noqa: E402
from jaxmoe.janus.scaling.ablation import VARIANTS, build_variant  # noqa: E402
from jaxmoe.janus.scaling.commands import layout_list as _layouts  # noqa: E402
from jaxmoe.janus.scaling.fit import FitSweep, StepPoint, build_llm, decode_tpot, fit_llm, measure_layouts  # noqa: E402
from jaxmoe.janus.scaling.fitted import FittedPerfModel  # noqa: E402

ENGINE = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_prefill_chunk=64, max_batch_tokens=1024)
PROMPT, OUTPUT = 48, 24


def _name(a: int, e: int) -> str:
    return f"{a}a{e}e"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def part_fit(args, base):
    t0 = time.perf_counter()
    fit_layouts, fit_batches = _layouts(args.fit_layouts), _ints(args.fit_batches)
    sweep = FitSweep(rows=tuple(_ints(args.rows)), contexts=tuple(_ints(args.contexts)), repeats=args.repeats)
    samples = measure_layouts(args.model, base, fit_layouts, sweep, progress=log, **ENGINE)
    parts_s = time.perf_counter() - t0

    layouts = list(dict.fromkeys(fit_layouts + _layouts(args.layouts)))  # the fit layouts' TPOTs too
    batches = sorted(set(fit_batches) | set(_ints(args.batches)))
    llms = {lay: build_llm(args.model, base, *lay, **ENGINE) for lay in layouts}
    measured: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for lay in layouts:
            for b in batches:
                p = decode_tpot(llms[lay].engine, b, PROMPT, OUTPUT, seed=r)
                measured.setdefault((lay, b), []).append(p.tpot)
                log(f"round {r} {_name(*lay)} batch {b}: {p.tpot * 1e3:.2f} ms")
    context = PROMPT + OUTPUT / 2
    tpot = {k: min(v) for k, v in measured.items()}  # the least-contended round
    steps = [StepPoint(*lay, b, context, tpot[(lay, b)]) for lay in fit_layouts for b in fit_batches]
    where = f"layouts {args.fit_layouts}, step fitted at batches {args.fit_batches}"
    prof = fit_llm(llms[layouts[0]], base, samples, steps, where)
    if args.out:
        prof.save(args.out)
    pm = FittedPerfModel(prof, base, ENGINE["num_blocks"] * ENGINE["block_size"], ENGINE["max_num_seqs"])
    r2 = ", ".join(f"{k} {v:.3f}" for k, v in prof.r2().items())
    print(f"\nparts measured in {parts_s:.0f} s on {args.fit_layouts} (two-phase and direct); R²: {r2}")
    for k in ("attention", "expert", "a2e", "e2a", "step"):
        f = getattr(prof.fits, k)
        print(f"  {k}: alpha {f.alpha:.3e} s, betas {', '.join(f'{b:.3e}' for b in f.betas)}")
    print(
        f"\nPredicted vs measured decode TPOT (context {context:g}; measured: median decode step of the "
        f"least-contended of {args.rounds} interleaved rounds). 'step fit': the cell is one of the TPOTs the "
        "step model was fitted on; 'parts': its layout's parts were measured, its batch not fitted; "
        "'held out': neither\n"
    )
    print("| layout | used | batch | rows run | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"step fit": [], "parts": [], "held out": []}
    for lay in layouts:
        for b in batches:
            pred = pm.parts(b, context, *lay)
            err = pred["tpot"] / tpot[(lay, b)] - 1
            used = "held out" if lay not in fit_layouts else ("step fit" if b in fit_batches else "parts")
            errors[used].append(abs(err))
            print(
                f"| {_name(*lay)} | {used} | {b} | {pred['rows']} | {pred['tpot'] * 1e3:.2f} | "
                f"{tpot[(lay, b)] * 1e3:.2f} | {100 * err:+.0f} % |"
            )
    for used, errs in errors.items():
        if errs:
            n = sum(e <= 0.15 for e in errs)
            print(
                f"\n{used}: {n} of {len(errs)} within 15 %, mean |error| {100 * statistics.fmean(errs):.1f} %, "
                f"max {100 * max(errs):.1f} %"
            )
    del llms
    return pm


def part_ablation(args, base, pm):
    layouts, batches = _layouts(args.ablation_layouts), _ints(args.ablation_batches)
    llms = {(lay, v): build_variant(args.model, base, *lay, v, **ENGINE) for lay in layouts for v in VARIANTS}
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, size=int(rng.integers(8, 40)))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {k: [o.token_ids for o in llm.generate(prompts, greedy)] for k, llm in llms.items()}
    same = {lay: all(tokens[(lay, v)] == tokens[(lay, "base")] for v in VARIANTS) for lay in layouts}
    measured: dict[tuple, list[float]] = {}
    imbalance: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for lay in layouts:
            for b in batches:
                for v in VARIANTS:
                    ex = llms[(lay, v)].executor
                    p = decode_tpot(llms[(lay, v)].engine, b, PROMPT, OUTPUT, seed=r)
                    measured.setdefault((lay, b, v), []).append(p.tpot)
                    act = ex.activated_per_instance()  # the last step's (a decode step of this batch)
                    imbalance.setdefault((lay, b, v), []).append(
                        statistics.fmean(max(x) - min(x) for x in act.values())
                    )
                    log(f"round {r} {_name(*lay)} batch {b} {v}: {p.tpot * 1e3:.2f} ms")
    context = PROMPT + OUTPUT / 2
    print(
        f"\nFig. 10 ablation on the CPU mesh: decode TPOT (median step of the least-contended of {args.rounds} "
        f"interleaved rounds), context {context:g}\n"
    )
    print(
        "| layout | batch | variant | A2E+E2A hops / MoE layer | activated max-min | TPOT ms | tokens/s | "
        "vs base | predicted ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lay in layouts:
        for b in batches:
            base_t = min(measured[(lay, b, "base")])
            for v in VARIANTS:
                two_phase, policy = VARIANTS[v]
                t = min(measured[(lay, b, v)])
                stats = next(iter(llms[(lay, v)].executor.transfer_stats().values()))
                hops = stats["transfers_per_step"]
                pred = (
                    "-"
                    if pm is None
                    else f"{pm.tpot_disaggregated(b, context, *lay, policy != 'random', two_phase) * 1e3:.2f}"
                )
                print(
                    f"| {_name(*lay)} | {b} | {v} ({stats['strategy']}, {policy}) | {hops:.0f} | "
                    f"{statistics.fmean(imbalance[(lay, b, v)]):.2f} | {t * 1e3:.2f} | {b / t:.0f} | "
                    f"{base_t / t:.2f}x | {pred} |"
                )
    for lay in layouts:
        print(f"\n{_name(*lay)}: greedy tokens of 6 prompts x 16 tokens equal across the variants: {same[lay]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="fit,ablation")
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--mesh", default="meshes/cpu-8.yaml")
    ap.add_argument("--fit-layouts", default="1a7e,2a6e,4a4e")
    ap.add_argument("--fit-batches", default="1,4,16")
    ap.add_argument("--rows", default="1,2,4,8,16", help="sweep: rows per attention instance")
    ap.add_argument("--contexts", default="32,96", help="sweep: tokens attended")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", default="1a7e,2a6e,3a5e,4a4e,6a2e")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=4, help="measurement rounds, interleaved (the least is kept)")
    ap.add_argument("--ablation-layouts", default="2a6e,4a4e")
    ap.add_argument("--ablation-batches", default="4,16")
    ap.add_argument(
        "--out",
        default=None,
        help="write the fitted profile JSON here (a directory: under the name jaxmoe serve --scaling-profile DIR looks for)",
    )
    args = ap.parse_args()
    parts = set(args.part.split(","))
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    print(
        f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.device_count()} host devices; load average at start {load0[0]:.1f}"
    )
    base = load_mesh(args.mesh)
    pm = part_fit(args, base) if "fit" in parts else None
    if "ablation" in parts:
        part_ablation(args, base, pm)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
