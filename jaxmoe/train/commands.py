"""``jaxmoe train``, ``jaxmoe eval`` and ``jaxmoe unite`` (registered into ``jaxmoe.cli`` by ``register``).

``jaxmoe train --preset demo --out DIR`` trains (or resumes) a run in DIR and exports the model to
DIR/model; ``jaxmoe eval --model DIR`` prints held-out perplexity (``--json``: one JSON object).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def register(sub, add_model_args) -> None:
    tr = sub.add_parser("train", help="train a small MoE (the demo model) on the Python standard library")
    tr.add_argument("--preset", default="demo", help="settings to start from: demo | tiny")
    tr.add_argument("--config", default=None, help="a train_config.json to start from instead of a preset")
    tr.add_argument("--out", required=True, help="run directory (created; an existing run there resumes)")
    tr.add_argument("--steps", type=int, default=None, help="optimisation steps (default: the preset's)")
    tr.add_argument("--corpus", default=None, help="'stdlib' (default), a folder of text files, or a text file")
    tr.add_argument("--seed", type=int, default=None)
    tr.add_argument("--dense", action="store_true", help="train the dense baseline (same active parameters)")
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="held-out perplexity of a model on the standard library's held-out part")
    add_model_args(ev, mesh=False, quantization=True)  # scored on one device
    ev.add_argument("--corpus", default="stdlib", help="text to score: its held-out part (as in training)")
    ev.add_argument("--text-file", default=None, help="score this text file instead (all of it)")
    ev.add_argument("--heldout-fraction", type=float, default=0.05)
    ev.add_argument("--seq-len", type=int, default=256, help="tokens per scored window")
    ev.add_argument("--max-tokens", type=int, default=32768, help="tokens to score (0: all held-out text)")
    ev.add_argument(
        "--brownout-threshold",
        type=float,
        default=None,
        help="score with brownout at this threshold (the model needs united experts: jaxmoe unite)",
    )
    ev.add_argument("--full-brownout", action="store_true", help="full brownout instead of partial")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=cmd_eval)

    un = sub.add_parser("unite", help="distil united experts (BrownoutServe) for a checkpoint")
    add_model_args(un, mesh=False, dtype=False)  # distilled in float32 on one device
    un.add_argument(
        "--ways",
        type=int,
        required=True,
        help="experts per united expert (k); ceil(m / k) groups, the last one short when k does not divide m",
    )
    un.add_argument("--grouping", default="index", choices=["index", "similarity", "coactivation"])
    un.add_argument("--tokens", type=int, default=8192, help="tokens of text whose hidden states train them")
    un.add_argument("--steps", type=int, default=300, help="Adam steps per united expert")
    un.add_argument("--out", required=True, help="new directory: the checkpoint plus its united experts")
    un.set_defaults(func=cmd_unite)


def cmd_train(args) -> int:
    from jaxmoe.train.config import PRESETS, load_train_config
    from jaxmoe.train.loop import train

    if args.config:
        tc = load_train_config(args.config)
    elif args.preset in PRESETS:
        tc = PRESETS[args.preset]
    else:
        raise ValueError(f"--preset: unknown preset {args.preset!r} (known: {', '.join(PRESETS)})")
    changes = {k: v for k, v in (("steps", args.steps), ("corpus", args.corpus), ("seed", args.seed)) if v is not None}
    if args.dense:
        changes["dense"] = True
    tc = dataclasses.replace(tc, **changes)
    report = train(tc, args.out, progress=not args.no_progress)
    print(json.dumps(report, indent=2))
    return 0


def cmd_eval(args) -> int:
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.train import data
    from jaxmoe.train.corpus import load_corpus
    from jaxmoe.train.evaluate import expert_token_share, perplexity

    cfg, params, tokenizer = load_model(args.model, args.dtype or "float32", args.quantization, args.quantize_attention)
    if args.quantization:  # the training forward scores the quantized weights, dequantized to the eval dtype
        from jaxmoe.quantization import dequantize_params

        params = dequantize_params(params, params["embed"].dtype)
    brownout = None
    if args.brownout_threshold is not None or args.full_brownout:
        from jaxmoe.brownout import BrownoutConfig
        from jaxmoe.brownout.united import attach
        from jaxmoe.demo import DEMO_DIR

        config = BrownoutConfig(1.0 if args.brownout_threshold is None else args.brownout_threshold, args.full_brownout)
        params = attach(params, cfg, DEMO_DIR if args.model == "demo" else args.model)
        brownout = (config.threshold, config.use_full_brownout)
    if args.text_file:
        texts = [Path(args.text_file).read_text(encoding="utf-8")]
    else:
        texts = [d.text for d in load_corpus(args.corpus, args.heldout_fraction).heldout]
    stream = data.encode_documents(tokenizer, texts)
    windows = data.eval_windows(stream, args.seq_len, args.max_tokens)
    t0 = time.perf_counter()
    result = perplexity(cfg, params, windows, progress=not args.json, brownout=brownout)
    result["tokens_per_s"] = round(result["tokens"] / (time.perf_counter() - t0), 1)
    result["model"] = str(args.model)
    if args.quantization:
        result["quantization"] = args.quantization + ("+attention" if args.quantize_attention else "")
    if brownout is not None:
        result["brownout"] = {"threshold": brownout[0], "full": brownout[1]}
    if cfg.num_moe_layers and brownout is None:
        result["expert_share"] = [[round(x, 4) for x in row] for row in expert_token_share(cfg, params, windows)]
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model}: held-out perplexity {result['perplexity']:.3f} ({result['tokens']} tokens, "
            f"{result['loss']:.4f} nats/token)"
        )
    return 0


def cmd_unite(args) -> int:
    from jaxmoe.brownout.united import unite

    report = unite(args.model, args.ways, args.out, grouping=args.grouping, tokens=args.tokens, steps=args.steps)
    for layer, r in report.items():
        print(
            f"layer {layer}: groups {r['groups']}, eq. 4 loss per united expert (group-mean start -> distilled) "
            + ", ".join(f"{a:.4g} -> {b:.4g}" for a, b in zip(r["initial_losses"], r["losses"]))
        )
    print(f"united experts written to {args.out}")
    return 0
