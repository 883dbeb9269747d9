"""Benchmark: what brownout costs in quality on the trained demo model (the shape of BrownoutServe's
Table I, arXiv:2507.17133), per ways k, threshold and grouping of the united experts.

For every grouping in ``--groupings`` (index: the paper's; coactivation: our extension, experts the
router picks together) and k in ``--ways``, the united experts are made with ``jaxmoe unite --model
demo --ways K --grouping G --tokens T --steps S --out ROOT/demo-uK-G`` (skipped when that directory
already holds them). Then, for every threshold (partial brownout) and the ``--full`` thresholds
(full brownout):

* held-out perplexity: ``jaxmoe eval --model ROOT/demo-uK-G --brownout-threshold T
  [--full-brownout] --max-tokens N --json`` (run in this process through ``jaxmoe.cli.main``), the
  first N tokens of the standard library's held-out part, the original model's value beside it;
* next-token agreement with the original model: on the same held-out windows, teacher-forced, the
  share of positions whose greedy (argmax) next token equals the original model's (brownout's
  split then sees a whole 256-token window per step, as in ``jaxmoe eval``);
* free-running greedy agreement with the original model: ``--prompts`` prompts of ``--prompt-len`` tokens cut
  from the held-out text after the scored part, ``--gen-tokens`` greedy tokens each with
  ``LLM(dir, brownout=BrownoutConfig(T, full))`` vs ``LLM("demo")``; "tokens" = share of positions
  whose token equals the original's, "prefix" = mean share of the generation before the first
  difference (free-running: one early difference changes the rest).

Threshold 1 rows are the check that zero brownout is the model itself (perplexity equal,
agreement 1.0).

Run (from the repository root):
  PYTHONPATH=. .venv/bin/python bench/brownout_quality.py --root RUNS \\
      --out bench/results/brownout_quality.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def run_cli(args: list[str]) -> dict:
    """``jaxmoe ARGS --json`` in this process; its JSON output."""
    from jaxmoe.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args + ["--json"])
    if rc != 0:
        raise RuntimeError(f"jaxmoe {' '.join(args)} exited {rc}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def heldout_prompts(n: int, length: int, skip: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens spread over the held-out stream after its first ``skip``."""
    import numpy as np

    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.train import data
    from jaxmoe.train.corpus import load_corpus

    _, _, tokenizer = load_model("demo")
    stream = data.encode_documents(tokenizer, [d.text for d in load_corpus("stdlib").heldout])[skip:]
    starts = np.linspace(0, len(stream) - length - 1, n).astype(int)
    return [stream[s : s + length].tolist() for s in starts]


def heldout_windows(max_tokens: int):
    """The windows ``jaxmoe eval --max-tokens N`` scores (the same encoding and cut)."""
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.train import data
    from jaxmoe.train.corpus import load_corpus

    _, _, tokenizer = load_model("demo")
    stream = data.encode_documents(tokenizer, [d.text for d in load_corpus("stdlib").heldout])
    return data.eval_windows(stream, 256, max_tokens)


class NextToken:
    """Teacher-forced greedy choices on the held-out windows (the training forward, which equals the
    serving one), with brownout at a traced threshold: one compile per model and mode."""

    def __init__(self, model, full: bool | None):
        import jax
        import jax.numpy as jnp

        from jaxmoe.brownout.united import attach
        from jaxmoe.checkpoint.model import load_model
        from jaxmoe.brownout.routing import BrownoutRouting
        from jaxmoe.train.model import forward

        cfg, params, _ = load_model(str(model), "float32")
        if full is not None:
            params = attach(params, cfg, model)

        routing = None if full is None else BrownoutRouting(full)

        def choose(params, window, threshold):
            logits, _ = forward(params, cfg, window[None], 0.0, routing, threshold)
            return jnp.argmax(logits[0], -1)

        self.params, self.fn = params, jax.jit(choose)

    def __call__(self, windows, threshold: float = 1.0):
        import numpy as np

        return np.concatenate([np.asarray(self.fn(self.params, w[:-1], np.float32(threshold))) for w in windows])


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, float]:
    tokens = prefix = 0.0
    for g, w in zip(got, want):
        same = [a == b for a, b in zip(g, w)]
        tokens += sum(same) / len(w)
        prefix += (same.index(False) if False in same else len(w)) / len(w)
    return tokens / len(want), prefix / len(want)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/brownout", help="where the united-expert models are (made)")
    ap.add_argument("--ways", default="2,4,8")
    ap.add_argument("--groupings", default="index,coactivation")
    ap.add_argument("--thresholds", type=floats, default=floats("1.0,0.8,0.6,0.4,0.2,0.0"))
    ap.add_argument("--full", type=floats, default=floats("0.6"), help="thresholds also run as full brownout")
    ap.add_argument("--unite-tokens", type=int, default=4096)
    ap.add_argument("--unite-steps", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()

    from jaxmoe import LLM, BrownoutConfig, SamplingParams
    from jaxmoe.brownout.routing import set_threshold

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    greedy = SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True)
    prompts = heldout_prompts(args.prompts, args.prompt_len, args.max_tokens + 1)
    base = run_cli(["eval", "--model", "demo", "--max-tokens", str(args.max_tokens)])["perplexity"]
    original = [o.token_ids for o in LLM("demo", dtype="float32").generate(prompts, greedy)]
    windows = heldout_windows(args.max_tokens)
    original_next = NextToken("demo", None)(windows)
    print(f"original demo model: held-out perplexity {base:.3f}", flush=True)
    rows = []
    for grouping in args.groupings.split(","):
        for k in (int(v) for v in args.ways.split(",")):
            model = root / f"demo-u{k}-{grouping}"
            if not (model / "brownout.json").exists():
                t0 = time.perf_counter()
                from jaxmoe.cli import main as jaxmoe

                rc = jaxmoe(
                    ["unite", "--model", "demo", "--ways", str(k), "--grouping", grouping]
                    + ["--tokens", str(args.unite_tokens), "--steps", str(args.unite_steps), "--out", str(model)]
                )
                if rc != 0:
                    raise RuntimeError(f"jaxmoe unite exited {rc}")
                print(f"united k={k} {grouping}: {time.perf_counter() - t0:.0f} s", flush=True)
            meta = json.loads((model / "brownout.json").read_text())
            mse = [v for layer in meta["layers"].values() for v in layer["losses"]]
            for full in (False, True):
                thresholds = args.full if full else args.thresholds
                if not thresholds:
                    continue
                llm = LLM(model, dtype="float32", brownout=BrownoutConfig(1.0, use_full_brownout=full))

                next_token = NextToken(model, full)
                for t in thresholds:
                    extra = ["--full-brownout"] if full else []
                    ppl = run_cli(
                        ["eval", "--model", str(model), "--max-tokens", str(args.max_tokens)]
                        + ["--brownout-threshold", str(t)]
                        + extra
                    )["perplexity"]
                    set_threshold(llm.executor, t)
                    got = [o.token_ids for o in llm.generate(prompts, greedy)]
                    tok, pre = agreement(got, original)
                    teacher = float((next_token(windows, t) == original_next).mean())
                    row = dict(
                        grouping=grouping,
                        ways=k,
                        threshold=t,
                        brownout="full" if full else "partial",
                        perplexity=round(ppl, 3),
                        vs_original=round(ppl / base, 3),
                        agreement_next=round(teacher, 4),
                        agreement_tokens=round(tok, 3),
                        agreement_prefix=round(pre, 3),
                        distill_mse_mean=round(sum(mse) / len(mse), 4),
                    )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del llm
    print(f"\noriginal model: held-out perplexity {base:.2f} (first {args.max_tokens} held-out tokens)\n")
    print(
        "| grouping | ways k | threshold | brownout | held-out ppl | vs original | next-token agreement | "
        "free-running agreement (tokens) | (prefix) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['grouping']} | {r['ways']} | {r['threshold']} | {r['brownout']} | {r['perplexity']:.2f} | "
            f"{r['vs_original']:.2f}x | {r['agreement_next']:.3f} | {r['agreement_tokens']:.3f} | "
            f"{r['agreement_prefix']:.3f} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"original_perplexity": base, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
