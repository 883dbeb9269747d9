"""Benchmark: async scheduling on and off (``LLM(async_scheduling=...)``), on the demo model.

What it measures, both engines in one process, runs alternating (off, on, off, on, ...) so the load of
a shared machine hits both alike (the load average is printed before and after):

* decode tokens/s: batch x new tokens / wall time of one whole greedy ``LLM.generate`` (prefill of
  short prompts + ``--new-tokens`` decode steps) at each ``--batches`` size, median of ``--repeats``;
* the host gap per step: for every decode step N, the time from the device finishing it (its
  sampled tokens ready: a watcher thread blocks on them, ``block_until_ready``) to step N+1's
  forward being enqueued (``executor.forward`` called). Synchronous: the host reads step N, does
  its stops, detokenization, outputs, schedules and pads step N+1, then enqueues it, so the gap is
  that host work. Async: step N+1 is enqueued before step N finishes, so the gap is negative (the
  device had the next step queued); "device idle" counts max(0, gap). One instrumented generation
  per setting after the timed ones (the watcher thread is not running during those).

The greedy tokens of both settings are compared ("equal").

Run (from the repository root):
  .venv/bin/python bench/async_scheduling.py                      # batch 1 and 16, 64 tokens, 3 repeats
  .venv/bin/python bench/async_scheduling.py --batches 16 --repeats 1 --new-tokens 16   # quick look
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxmoe import LLM, SamplingParams  # noqa: E402

PROMPTS = [f"def function_{i}(value):\n    " for i in range(64)]


class StepClock:
    """Enqueue times of the forwards and ready times of the sampled tokens of an engine's steps."""

    def __init__(self, llm: LLM):
        self.runner, self.executor = llm.engine.runner, llm.engine.executor
        self.enqueued: list[float] = []
        self.ready: list[float] = []
        self._todo: queue.Queue = queue.Queue()
        self._forward, self._sample = self.executor.forward, self.runner._sample
        self.executor.forward = self.forward
        self.runner._sample = self.sample
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def forward(self, *args, **kwargs):
        self.enqueued.append(time.perf_counter())
        return self._forward(*args, **kwargs)

    def sample(self, *args, fetch: bool = True, **kwargs):
        result = self._sample(*args, fetch=False, **kwargs)
        self._todo.put(result[0])
        return jax.device_get(result) if fetch else result

    def _watch(self):
        while True:
            tokens = self._todo.get()
            if tokens is None:
                return
            tokens.block_until_ready()
            self.ready.append(time.perf_counter())

    def close(self) -> list[float]:
        """Stop; the gaps (seconds): step N+1 enqueued minus step N ready, for every step but the last."""
        self._todo.put(None)
        self._thread.join()
        self.executor.forward, self.runner._sample = self._forward, self._sample
        return [e - r for r, e in zip(self.ready, self.enqueued[1:])]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    settings = dict(max_num_seqs=max(batches), num_blocks=512, block_size=16)
    print(f"load before: {load()}", flush=True)
    llms = {flag: LLM(args.model, async_scheduling=flag, **settings) for flag in (False, True)}
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    tokens: dict = {}
    for flag, llm in llms.items():  # warm-up: compiles what the timed runs use
        for b in batches:
            tokens[flag, b] = [o.token_ids for o in llm.generate(PROMPTS[:b], sp)]
    times: dict = {(flag, b): [] for flag in llms for b in batches}
    for _ in range(args.repeats):
        for b in batches:
            for flag, llm in llms.items():
                t = time.perf_counter()
                llm.generate(PROMPTS[:b], sp)
                times[flag, b].append(time.perf_counter() - t)
    gaps = {}
    for b in batches:
        for flag, llm in llms.items():
            clock = StepClock(llm)
            llm.generate(PROMPTS[:b], sp)
            gaps[flag, b] = clock.close()[2:]  # decode steps (the first steps are the prefill)
    print(f"load after: {load()}")
    print(
        f"\nmodel {args.model}, {args.new_tokens} greedy tokens, {args.repeats} repeats (median), jax {jax.__version__}"
    )
    print(
        "| batch | async | tokens/s | on/off, median of paired repeats | host gap per step, median (ms) | device idle per step, mean (ms) | steps ahead | tokens equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        for flag, llm in llms.items():
            tps = b * args.new_tokens / statistics.median(times[flag, b])
            paired = statistics.median(off / t for off, t in zip(times[False, b], times[flag, b]))
            g = gaps[flag, b]
            idle = statistics.mean(max(0.0, x) for x in g) * 1e3
            print(
                f"| {b} | {'on' if flag else 'off'} | {tps:.1f} | {paired:.2f}x | "
                f"{statistics.median(g) * 1e3:.2f} | {idle:.2f} | {llm.engine.steps_ahead} | "
                f"{tokens[True, b] == tokens[False, b]} |"
            )
    print(
        "\nraw seconds per generate:",
        {f"{'on' if f else 'off'}/b{b}": [round(x, 3) for x in v] for (f, b), v in times.items()},
    )


if __name__ == "__main__":
    main()
