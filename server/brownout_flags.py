"""``jaxmoe serve``'s BrownoutServe flags and how they combine with the mesh file's ``brownout:``
section: each flag given overrides its field (docs/brownout.md)."""

from __future__ import annotations

import argparse
import dataclasses


def add_brownout_args(parser: argparse.ArgumentParser) -> None:
    # BrownoutServe: these flags override the mesh file's brownout: section (docs/brownout.md); None = not given
    parser.add_argument(
        "--brownout-threshold",
        type=float,
        default=None,
        help="BrownoutServe: start threshold in [0, 1] of both phases (the model needs united experts: jaxmoe unite)",
    )
    for phase in ("prefill", "decode"):
        parser.add_argument(
            f"--brownout-{phase}-threshold",
            type=float,
            default=None,
            help=f"BrownoutServe: start threshold in [0, 1] of the {phase} phase (default: --brownout-threshold)",
        )
    parser.add_argument(
        "--full-brownout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="drop browned-out assignments (else united experts)",
    )
    parser.add_argument(
        "--salc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SLO-aware latency control of the brownout threshold (--no-salc: off, whatever the mesh file says)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="SALC: TTFT SLO (P90)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="SALC and --autoscale: TPOT SLO (P90)")
    parser.add_argument(
        "--salc-window", type=float, default=None, help="SALC: seconds of the P90 window (tw; default 10)"
    )
    parser.add_argument("--salc-warning-factor", type=float, default=None, help="SALC (default 0.8)")
    parser.add_argument("--salc-increment", type=float, default=None, help="SALC (default 0.1)")
    parser.add_argument("--salc-shrink-ratio", type=float, default=None, help="SALC (default 0.8)")
    parser.add_argument(
        "--salc-period",
        type=float,
        default=None,
        help="SALC: seconds between threshold updates (default 0: every step)",
    )


def serve_brownout(args, spec=None):
    """The ``BrownoutSettings`` ``jaxmoe serve`` runs with: the mesh file's ``brownout:`` section
    (``spec.brownout``), each flag given overriding its field; None (no brownout) when the mesh file
    has no such section and no flag among ``--brownout-threshold`` (or its per-phase
    ``--brownout-prefill-threshold`` / ``--brownout-decode-threshold``), ``--full-brownout``, ``--salc``
    is given. ``--brownout-threshold`` sets both phases (over the file's per-phase keys too). Raises
    ``BrownoutError`` naming a value out of range."""
    from jaxmoe.brownout.config import BrownoutSettings, mesh_brownout

    base = mesh_brownout(spec) if spec is not None else None
    prefill, decode = args.brownout_prefill_threshold, args.brownout_decode_threshold
    given = (args.brownout_threshold, prefill, decode)
    if base is None and all(v is None for v in given) and not args.full_brownout and not args.salc:
        return None
    base = base or BrownoutSettings()
    if args.brownout_threshold is not None:  # both phases
        base = dataclasses.replace(base, prefill_threshold=None, decode_threshold=None)
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    return base.replace(
        threshold=args.brownout_threshold,
        prefill_threshold=prefill,
        decode_threshold=decode,
        use_full_brownout=args.full_brownout,
        salc=args.salc,
        slo_ttft_s=ms(args.slo_ttft_ms),
        slo_tpot_s=ms(args.slo_tpot_ms),
        window_s=args.salc_window,
        warning_factor=args.salc_warning_factor,
        increment=args.salc_increment,
        shrink_ratio=args.salc_shrink_ratio,
        period_s=args.salc_period,
    )
