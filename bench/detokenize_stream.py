"""Streaming detokenization cost: the old way (decode the whole output again every step) against
``jaxmoe.tokenizer.Detokenizer`` (``tokenizers``' DecodeStream: each token decoded once), per
stream length, on a tokenizer.json (default: the demo model's).

    python bench/detokenize_stream.py [--tokenizer DIR] [--lengths 500,1000,2000,4000]
"""

from __future__ import annotations

import argparse
import time

from jaxmoe.demo import DEMO_DIR
from jaxmoe.tokenizer import Detokenizer, load_tokenizer

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)  # naïve 東京 🙂\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(DEMO_DIR))
    ap.add_argument("--lengths", default="500,1000,2000,4000")
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    ids = []
    lengths = [int(x) for x in args.lengths.split(",")]
    while len(ids) < max(lengths):
        ids += tok.encode(TEXT, add_special_tokens=False)
    print(
        "| tokens | re-decode every step (s) | DecodeStream (s) | per token, re-decode (µs) | per token, DecodeStream (µs) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for n in lengths:
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            tok.decode(ids[:i])
        old = time.perf_counter() - t0
        t0 = time.perf_counter()
        d = Detokenizer(tok)
        for t in ids[:n]:
            d.add(t)
            _ = d.text
        d.finish(ids[:n])
        new = time.perf_counter() - t0
        print(f"| {n} | {old:.3f} | {new:.3f} | {old / n * 1e6:.1f} | {new / n * 1e6:.1f} |")


if __name__ == "__main__":
    main()
