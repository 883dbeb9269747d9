"""Benchmark: the cost of structured output (a JSON schema) against plain decoding, on the demo model.

What it measures: output tokens/s = output tokens / wall time of one whole ``LLM.generate`` call
(prefill + decode) over ``--batch`` prompts, greedy, for

* json_schema: ``SamplingParams(max_tokens=N, structured_outputs=StructuredOutputsParams(json=SCHEMA))``
  (a request ends when its JSON is complete);
* plain: ``SamplingParams(max_tokens=L_i, ignore_eos=True)``, L_i the number of tokens prompt i
  made under the schema: both modes make the same tokens per request, so the rates compare;

at batch 1 and 8. Each mode first runs once (that compiles its programs and builds llguidance's
tokenizer), then the modes alternate ``--repeats`` times and the median rate of each is reported.
Also reported: the host work of the grammar per token (``Grammar.mask`` + ``Grammar.accept``,
replayed over the tokens the json_schema run made), the part of the cost that is not on the device.

Run (from the repository root):
  .venv/bin/python bench/structured_output.py                 # batch 1 and 8, 3 repeats
  .venv/bin/python bench/structured_output.py --out /tmp/so.md # also write the markdown table
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "lines": {
            "type": "array",
            "items": {"type": "string", "minLength": 16, "maxLength": 40},
            "minItems": 6,
            "maxItems": 6,
        },
        "count": {"type": "integer", "minimum": 0, "maximum": 9999},
    },
    "required": ["name", "lines", "count"],
    "additionalProperties": False,
}
PROMPTS = ["def main():", "import os", "class Parser:", "# read the file", "for line in", "with open(", "x = ", "if "]


def run(llm, prompts, params) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, tokens, outs


def host_cost(llm, outs, so) -> float:
    """Microseconds of grammar work (mask + accept) per token, replayed over ``outs``' tokens."""
    backend = llm.engine.grammars
    total, n = 0.0, 0
    for o in outs:
        grammar = backend.grammar(so)
        for t in o.outputs[0].token_ids:
            t0 = time.perf_counter()
            grammar.mask()
            grammar.accept(t)
            total += time.perf_counter() - t0
            n += 1
    return 1e6 * total / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import llguidance

    from jaxmoe import LLM
    from jaxmoe.sampling import SamplingParams
    from jaxmoe.structured_output import StructuredOutputsParams

    llm = LLM("demo", max_num_seqs=8)
    tok = llm.tokenizer
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(max_tokens=args.max_tokens, structured_outputs=so)
    rows = []
    load = os.getloadavg()[0]
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = chats[:batch]
        _, _, first = run(llm, prompts, constrained)  # compiles
        lengths = [len(o.outputs[0].token_ids) for o in first]
        modes = {
            "plain": [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths],
            "json_schema": constrained,
        }
        run(llm, prompts, modes["plain"])  # compiles
        rates = {m: [] for m in modes}
        tokens, outs = {}, None
        for _ in range(args.repeats):
            for m, params in modes.items():
                rate, tokens[m], o = run(llm, prompts, params)
                rates[m].append(rate)
                if m == "json_schema":
                    outs = o
        plain, structured = statistics.median(rates["plain"]), statistics.median(rates["json_schema"])
        rows.append((batch, plain, tokens["plain"], structured, tokens["json_schema"], host_cost(llm, outs, so)))
        print(rows[-1], flush=True)
    load = f"{load:.1f} / {os.getloadavg()[0]:.1f}"
    lines = [
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {load} (start / end)",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}, llguidance {llguidance.__version__}",
        f"command: python bench/structured_output.py --batches {args.batches} --max-tokens {args.max_tokens} --repeats {args.repeats}",
        "",
        "| batch | plain tok/s (tokens) | json_schema tok/s (tokens) | json_schema / plain | grammar host work per token |",
        "|---|---|---|---|---|",
    ]
    for batch, plain, pt, structured, st, us in rows:
        lines.append(
            f"| {batch} | {plain:.1f} ({pt}) | {structured:.1f} ({st}) | {structured / plain:.2f}x | {us:.0f} us |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
