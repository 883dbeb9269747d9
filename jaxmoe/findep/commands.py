"""``jaxmoe profile`` and ``jaxmoe plan`` (registered into ``jaxmoe.cli`` by ``register``).

``jaxmoe profile --mesh FILE --model DIR --out P.json [--plot P.png] [--compare OLD.json]`` measures
and fits the FinDEP stage models of the disaggregated runtime on that mesh (``measure``) and caches
the profile for its (mesh, model, dtype) (``profile.cache_profile``); ``jaxmoe plan --profile P.json
--batch B`` runs the solver (FinDEP Algorithm 1) and prints the chosen configuration beside the best
PPPipe one. Without ``--profile`` it uses the cached profile of ``--model`` on ``--mesh``, and
measures (and caches) one only when there is none or with ``--remeasure``.
"""

from __future__ import annotations

import argparse
import json
import sys


def int_list(text: str) -> tuple[int, ...]:
    """An argparse ``type``: "1,2,4" -> (1, 2, 4); argparse names the flag of a bad value."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def register(sub, add_model_args) -> None:
    prof = sub.add_parser("profile", help="measure the FinDEP stage models of a model on a mesh")
    add_model_args(prof)
    prof.add_argument("--rows", type=int_list, default="1,2,4,8,16", help="sequences per attention instance to measure")
    prof.add_argument("--contexts", type=int_list, default="16,128", help="tokens attended per sequence to measure")
    prof.add_argument("--tokens", type=int, default=1, help="new tokens per sequence (1: decode)")
    prof.add_argument("--repeats", type=int, default=5, help="timed steps per point (see --stat)")
    prof.add_argument(
        "--stat",
        default="min",
        choices=["min", "median", "trimmed"],
        help="per point over the repeats: min (default: load from other processes only slows a program), "
        "median or trimmed (mean of the middle half)",
    )
    prof.add_argument(
        "--chunks", type=int_list, default="1", help="expert-side chunk counts r2 each point also runs with (e.g. 1,8)"
    )
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--plot", default=None, help="PNG of measured points against the fits (matplotlib)")
    prof.add_argument(
        "--compare", default=None, help="an earlier profile JSON: print how far each stage is from it (%%)"
    )
    prof.add_argument(
        "--no-cache", action="store_true", help="do not store the profile as the cached one for this mesh and model"
    )
    prof.set_defaults(func=cmd_profile)

    plan = sub.add_parser("plan", help="FinDEP configuration (r1, r2, order) for a batch, from a profile")
    add_model_args(plan)
    plan.add_argument(
        "--profile",
        default=None,
        help="profile JSON from `jaxmoe profile` (default: the cached profile of --model on --mesh; "
        "measured and cached first when there is none)",
    )
    plan.add_argument(
        "--remeasure", action="store_true", help="without --profile: measure a new profile even if one is cached"
    )
    plan.add_argument("--batch", type=int, required=True, help="sequences per attention instance")
    plan.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence in the step (a prefill of "
        "that length); default: a decode step (--tokens 1 attending --context)",
    )
    plan.add_argument("--tokens", type=int, default=1, help="new tokens per sequence (1: decode)")
    plan.add_argument("--context", type=int, default=0, help="tokens attended (default: --tokens)")
    plan.add_argument(
        "--mode",
        default="batch",
        choices=["batch", "max"],
        help="batch: run exactly --batch; max: --batch is the memory limit (the paper)",
    )
    plan.add_argument("--brute-force", action="store_true", help="search every configuration instead")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=cmd_plan)


def _measure(model, mesh, dtype, sweep):
    from jaxmoe.assembly import RuntimeConfig, build_engine
    from jaxmoe.engine.config import EngineConfig
    from jaxmoe.findep.measure import profile_executor
    from jaxmoe.mesh import load_mesh

    if mesh is None:
        raise ValueError("--mesh: profiling measures the disaggregated runtime; give a mesh file")
    spec, block_size = load_mesh(mesh), 16
    blocks = spec.attention.count * -(-sweep.max_context // block_size)  # one longest context per instance
    config = RuntimeConfig(model=model, dtype=dtype, mesh=spec, engine=EngineConfig(block_size, blocks))
    return profile_executor(build_engine(config).executor, sweep, progress=lambda line: print(line, file=sys.stderr))


def _identity(model, mesh, dtype) -> tuple[str, str, str]:
    """(mesh, model, dtype) identities of a profile of ``model`` on ``mesh`` (``profile.mesh_identity``,
    ``model_identity``), from the mesh file and the model's config and weights' dtype."""
    import numpy as np

    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.findep.profile import mesh_identity, model_identity
    from jaxmoe.mesh import load_mesh

    if mesh is None:
        raise ValueError("--mesh: a profile is for a disaggregated mesh; give a mesh file (or --profile)")
    if model is None:
        raise ValueError("--model: give the model to plan for (or --profile)")
    spec = load_mesh(mesh)
    cfg, params, _ = load_model(model, dtype)
    return mesh_identity(spec), model_identity(cfg), str(np.dtype(params["embed"].dtype))


def cmd_profile(args) -> int:
    from jaxmoe.findep.measure import Sweep, plot_profile
    from jaxmoe.findep.profile import Profile, agreement, cache_profile

    sweep = Sweep(
        rows=args.rows,
        contexts=args.contexts,
        tokens=args.tokens,
        repeats=args.repeats,
        chunks=args.chunks,
        stat=args.stat,
    )
    earlier = Profile.load(args.compare) if args.compare else None
    profile = _measure(args.model, args.mesh, args.dtype, sweep)
    profile.save(args.out)
    for stage in ("attention", "a2e", "expert", "e2a"):
        m = getattr(profile.stages, stage)
        betas = ", ".join(f"{b:.3e}" for b in m.betas)
        print(f"{stage:>9}: alpha {m.alpha * 1e3:.4f} ms, beta ({betas}) s/unit, R² {m.r2:.4f}, {m.points} points")
    host = profile.host
    if host is not None:
        c = "unlimited (separate hardware)" if host.concurrency is None else f"{host.concurrency:.3f}"
        print(f"     host: concurrency {c}, dispatch {host.dispatch * 1e3:.4f} ms per program")
    print(f"profile written to {args.out}")
    if not args.no_cache:
        print(f"cached as {cache_profile(profile)}")
    if earlier is not None:
        diffs = agreement(profile, earlier)
        print("against " + args.compare + ": " + ", ".join(f"{s} {d * 100:.1f} %" for s, d in diffs.items()))
    if args.plot:
        plot_profile(profile, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def cmd_plan(args) -> int:
    from jaxmoe.findep import BatchShape, Profile, brute_force, pppipe, solve
    from jaxmoe.findep.measure import Sweep

    from jaxmoe.findep.profile import cache_profile, cached_profile

    if args.profile:
        profile = Profile.load(args.profile)
    else:
        profile = None if args.remeasure else cached_profile(*_identity(args.model, args.mesh, args.dtype))
        if profile is None:
            print("no --profile and none cached: measuring one first", file=sys.stderr)
            profile = _measure(args.model, args.mesh, args.dtype, Sweep(rows=(1, 2, 4, 8), contexts=(16, 128)))
            print(f"cached as {cache_profile(profile)}", file=sys.stderr)
        else:
            print(f"no --profile: using the cached {profile.source}", file=sys.stderr)
    tokens = args.seq_len or args.tokens
    shape = BatchShape(batch=args.batch, tokens=tokens, context=args.context)
    search = brute_force if args.brute_force else solve
    best, base = search(profile, shape, mode=args.mode), pppipe(profile, shape, mode=args.mode)
    speedup = best.tokens_per_s / base.tokens_per_s
    if args.json:
        print(
            json.dumps(
                {
                    **best.as_dict(),
                    "search": "brute_force" if args.brute_force else "solver",
                    "pppipe": base.as_dict(),
                    "speedup_vs_pppipe": speedup,
                    "profile": profile.source,
                }
            )
        )
        return 0
    for name, p in (("FinDEP", best), ("PPPipe", base)):
        print(
            f"{name:>6}: {p.order} r1={p.r1} m_a={p.m_a} r2={p.r2} m_e={p.m_e:.2f} "
            f"step {p.time_s * 1e3:.3f} ms, {p.tokens_per_s:.1f} tokens/s (solved in {p.solve_ms:.2f} ms)"
        )
    print(f"predicted speedup over PPPipe: {speedup:.3f}x")
    return 0
