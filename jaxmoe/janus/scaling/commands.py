"""``jaxmoe simulate`` (registered into ``jaxmoe.cli`` by ``register``): replay a synthetic two-day
trace at cluster scale under JANUS scaling, DisAgg and monolithic deployments (``simulator``).
``jaxmoe scaling-profile``: fit the scaling model on a mesh (``fit.profile_mesh``) for
``jaxmoe serve --autoscale --scaling-profile``."""

from __future__ import annotations

import argparse
import json
import sys

from jaxmoe.findep.commands import int_list


def register(sub, add_model_args) -> None:
    sim = sub.add_parser("simulate", help="cluster simulator: JANUS scaling vs monolithic and DisAgg (GPU-hours, SLO)")
    sim.add_argument("--mean-rate", type=float, default=30.0, help="requests/s averaged over a day")
    sim.add_argument("--peak-to-trough", type=float, default=4.0)
    sim.add_argument("--bursts-per-day", type=float, default=6.0)
    sim.add_argument("--days", type=float, default=2.0)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--slo-tpot-ms", type=float, default=200.0, help="TPOT SLO (JANUS Fig. 7 uses 200 ms)")
    sim.add_argument("--target", type=float, default=0.99, help="SLO attainment every policy is provisioned for")
    sim.add_argument("--interval", type=int, default=30, help="minutes between scaling decisions (Fig. 9: 30)")
    sim.add_argument("--plot", default=None, help="PNG of the load and each policy's GPUs over time")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(func=cmd_simulate)

    fit = sub.add_parser(
        "scaling-profile",
        help="fit the JANUS scaling model (per-layer parts and decode TPOT) of a model on a mesh's layouts",
    )
    add_model_args(fit)
    fit.add_argument(
        "--layouts", type=layout_list, default="1a7e,2a6e,4a4e", help="aXeY layouts of the mesh's devices to measure"
    )
    fit.add_argument(
        "--batches", type=int_list, default="1,4,16", help="decode batches whose engine TPOT the step model fits"
    )
    fit.add_argument(
        "--rows",
        type=int_list,
        default="1,2,4,8,16",
        help="rows per attention instance of the parts sweep (cover the rows a step serves)",
    )
    fit.add_argument("--contexts", type=int_list, default="32,96", help="tokens attended of the parts sweep")
    fit.add_argument("--repeats", type=int, default=5, help="timed repeats per part point (least-contended)")
    fit.add_argument("--rounds", type=int, default=2, help="rounds per TPOT (least-contended)")
    fit.add_argument("--prompt-tokens", type=int, default=48)
    fit.add_argument("--output-tokens", type=int, default=24)
    fit.add_argument("--no-direct", action="store_true", help="skip the parts sweep with direct transfers")
    fit.add_argument("--max-num-seqs", type=int, default=16, help="engine setting while measuring")
    fit.add_argument("--num-blocks", type=int, default=256, help="engine setting while measuring")
    fit.add_argument(
        "--out", required=True, help="profile JSON to write (a directory: under the name --scaling-profile looks for)"
    )
    fit.set_defaults(func=cmd_scaling_profile)


def layout_list(text: str) -> list[tuple[int, int]]:
    """An argparse ``type``: "1a7e,2a6e" -> [(1, 7), (2, 6)] (attention, expert instances)."""
    out = []
    for item in text.split(","):
        a, sep, e = item.strip().lower().rstrip("e").partition("a")
        if not (sep and a.isdigit() and e.isdigit()):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not an aXeY layout such as 2a6e")
        out.append((int(a), int(e)))
    return out


def cmd_scaling_profile(args) -> int:
    from jaxmoe.mesh import load_mesh
    from jaxmoe.janus.scaling.fit import FitSweep, profile_mesh

    if args.mesh is None:
        raise ValueError("--mesh: the scaling model is fitted on a mesh file's devices; give one")
    base = load_mesh(args.mesh)
    sweep = FitSweep(rows=args.rows, contexts=args.contexts, repeats=args.repeats)
    prof, steps = profile_mesh(
        args.model,
        base,
        args.layouts,
        args.batches,
        sweep=sweep,
        prompt=args.prompt_tokens,
        output=args.output_tokens,
        rounds=args.rounds,
        direct_sweep=None if args.no_direct else FitSweep(rows=(1, 8), contexts=(32,), repeats=3),
        progress=lambda line: print(line, file=sys.stderr),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        num_blocks=args.num_blocks,
    )
    path = prof.save(args.out)
    print("R²: " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in prof.r2().items()))
    for p in steps:
        print(f"{p.attention}a{p.experts}e batch {p.batch}: decode step {p.tpot * 1e3:.2f} ms")
    print(f"scaling profile written to {path}")
    return 0


def cmd_simulate(args) -> int:
    from jaxmoe.janus.scaling.perf_model import PerfModel
    from jaxmoe.janus.scaling.simulator import compare, plot, summary, throughput_table
    from jaxmoe.janus.scaling.trace import TraceShape, synthesize

    if not 0 < args.target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {args.target}")
    if args.slo_tpot_ms <= 0:
        raise ValueError(f"--slo-tpot-ms must be > 0, got {args.slo_tpot_ms}")
    shape = TraceShape(
        days=args.days, mean_rate=args.mean_rate, peak_to_trough=args.peak_to_trough, bursts_per_day=args.bursts_per_day
    )
    rates = synthesize(shape, args.seed)
    pm = PerfModel()
    result = compare(
        rates,
        pm=pm,
        slo_tpot=args.slo_tpot_ms / 1e3,
        interval=args.interval,
        target=args.target,
        output_tokens=shape.output_tokens,
        input_tokens=shape.input_tokens,
    )
    out = summary(result)
    out["trace"] = {
        "minutes": len(rates),
        "mean_rate": round(float(rates.mean()), 2),
        "peak_rate": round(float(rates.max()), 2),
        "seed": args.seed,
    }
    out["model"], out["hardware"] = pm.model.name, pm.hw.name
    if args.plot:
        plot(result, rates, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"trace: {out['trace']['minutes']} minutes, mean {out['trace']['mean_rate']} req/s, "
        f"peak {out['trace']['peak_rate']} req/s; {pm.model.name} on {pm.hw.name}; "
        f"TPOT SLO {args.slo_tpot_ms:g} ms, every policy provisioned for {100 * args.target:g} % attainment"
    )
    for key in ("janus", "monolithic_best", "disagg"):
        r = out[key]
        print(
            f"{key:>16} ({r['policy']}): {r['gpu_hours']:8.1f} GPU-hours, SLO attainment "
            f"{100 * r['slo_attainment']:.2f} %, headroom {r['headroom']}"
        )
    print(f"JANUS saves {100 * out['gpu_hours_saved_vs_monolithic']:.1f} % of GPU-hours against the best monolithic")
    print("\nper-GPU throughput under the SLO (Fig. 7), context 144:")
    for row in throughput_table(pm, slo_tpot=args.slo_tpot_ms / 1e3):
        cells = [
            f"{k} {v['layout']} {v['tokens_per_s_per_gpu']} tok/s/GPU ({v['tpot_ms']} ms)" if v else f"{k} -"
            for k, v in row.items()
            if k != "batch"
        ]
        print(f"  batch {row['batch']:>4}: " + "; ".join(cells))
    return 0
