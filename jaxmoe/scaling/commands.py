"""``jaxmoe simulate`` (registered into ``jaxmoe.cli`` by ``register``): replay a synthetic two-day
trace at cluster scale under JANUS scaling, DisAgg and monolithic deployments (``simulator``)."""

from __future__ import annotations

import json


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


def cmd_simulate(args) -> int:
    from jaxmoe.scaling.perf_model import PerfModel
    from jaxmoe.scaling.simulator import compare, plot, summary, throughput_table
    from jaxmoe.scaling.trace import TraceShape, synthesize

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
