"""Benchmark: where a brownout step's time goes, against the original model's, in one process.

Engines of one model side by side (``--max-num-seqs`` 16, float32, the monolithic executor as
``jaxmoe serve`` builds it): the original (``--model``, default the demo) and each united-expert
directory ``--united`` (one or more, e.g. k = 2 and k = 4) with brownout at each of ``--thresholds``
(default 1, 0 and 0.5; partial brownout).

* ``forward``: each engine's prefill forward (16 prompts of 32 tokens, one call) and decode forward
  (16 one-token rows) are captured once and replayed, the engines in turn, ``--repeats`` rounds: the
  median and least time per forward (load from other jobs hits all alike), the XLA programs compiled
  meanwhile (0: moving the threshold recompiles nothing), and
  with ``--trace`` the per-forward time of the busiest XLA:CPU thunks (``jax.profiler``; the expert
  FFN is the largest ``ffi_call``).
* ``loop``: a closed loop as a server sees it (16 requests in flight, 64 held-out prompts reused,
  32 tokens each, prefills and decodes mixed), the engines stepped in turn for ``--steps`` steps:
  mean step time, time in the step hooks (SALC), prompt tokens found in the prefix cache. The
  brownout engines here: SALC with SLOs no step misses (threshold stays 1), SALC with SLOs every step
  misses (thresholds shrink towards 0, a new value every step), and threshold 0 without SALC.

Run (from the repository root):
  PYTHONPATH=. .venv/bin/python bench/brownout_step_profile.py --united DIR forward --repeats 200 --trace
  PYTHONPATH=. .venv/bin/python bench/brownout_step_profile.py --model /tmp/jaxmoe-bench-107m \
      --united DIR-u2 DIR-u4 --thresholds 1,0 forward --repeats 20
  PYTHONPATH=. .venv/bin/python bench/brownout_step_profile.py --united DIR loop --steps 250
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engines(model: str, united: list[str], salc: bool, thresholds=(1.0, 0.0, 0.5)):
    from jaxmoe import LLM, BrownoutConfig
    from jaxmoe.brownout.config import SALCConfig

    kw = dict(dtype="float32", max_num_seqs=16, max_batch_tokens=512)
    out = {"original": LLM(model, **kw).engine}
    if salc:
        united = united[0]
        never, always = SALCConfig(slo_ttft_s=100.0, slo_tpot_s=100.0), SALCConfig(slo_ttft_s=1e-4, slo_tpot_s=1e-4)
        out["salc (t stays 1)"] = LLM(united, brownout=BrownoutConfig(1.0), salc=never, **kw).engine
        out["salc (t -> 0)"] = LLM(united, brownout=BrownoutConfig(1.0), salc=always, **kw).engine
        out["t = 0"] = LLM(united, brownout=BrownoutConfig(0.0), **kw).engine
    else:
        for path in united:
            k = json.load(open(os.path.join(path, "brownout.json")))["ways"]
            for t in thresholds:
                out[f"k = {k} t = {t:g}"] = LLM(path, brownout=BrownoutConfig(t), **kw).engine
    return out


def forward(args) -> None:
    import jax

    from bench.brownout_quality import heldout_prompts
    from jaxmoe import SamplingParams
    from jaxmoe.compilation import compile_events

    es = engines(args.model, args.united, salc=False, thresholds=args.thresholds)
    vocab = es["original"].executor.cfg.vocab_size
    captured = {}  # name -> {"prefill": (args, kwargs), "decode": ...}
    for name, e in es.items():  # the prefill (one call: 16 x 32 tokens), then one decode of all 16
        for p in heldout_prompts(16, 32, 0):
            e.add_request([t % vocab for t in p], SamplingParams(max_tokens=8, ignore_eos=True))
        real = e.executor.forward
        calls = []

        def capture(*a, _f=real, _calls=calls, **k):
            _calls.append((a, k))
            return _f(*a, **k)

        e.executor.forward = capture
        while e.has_work():
            e.step()
        e.executor.forward = real
        prefill = [c for c in calls if c[0][0].shape[1] > 1]
        decode = [c for c in calls if c[0][0].shape == (16, 1)]
        captured[name] = {"prefill": prefill[0], "decode": decode[-1]}

    def run(name, phase="decode"):
        a, k = captured[name][phase]
        return jax.block_until_ready(es[name].executor.forward(*a, **k))

    for phase in ("decode", "prefill"):
        times = {n: [] for n in es}
        for name in es:
            run(name, phase)
        before = compile_events()["programs"]
        for _ in range(args.repeats):
            for name in es:
                t0 = time.perf_counter()
                run(name, phase)
                times[name].append(time.perf_counter() - t0)
        shape = captured["original"][phase][0][0].shape
        print(
            f"== {phase} forward {shape}: load {os.getloadavg()}; programs compiled while timing: "
            f"{compile_events()['programs'] - before}"
        )
        base = statistics.median(times["original"])
        for name, v in times.items():
            m = statistics.median(v)
            print(f"{name:16s} median {m * 1e3:8.2f} ms (least {min(v) * 1e3:8.2f})  x{m / base:.3f}")
    if args.trace:
        per = trace(es, run, 20)
        for name in es:
            print(f"== {name}: busiest XLA:CPU thunks, us per forward")
            for op, us in per[name].most_common(8):
                print(f"  {us:10.1f}  {op}")


def trace(es, run, n: int) -> dict:
    import jax

    d = tempfile.mkdtemp(prefix="brownout_trace_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(n):
            for i, name in enumerate(es):
                with jax.profiler.TraceAnnotation(f"brownout_cfg_{i}"):  # no ":" (the trace drops such names)
                    run(name)
    events = json.load(gzip.open(sorted(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True))[-1]))
    events = [e for e in (events["traceEvents"] if isinstance(events, dict) else events) if e.get("ph") == "X"]
    names = list(es)
    tag = "brownout_cfg_"
    spans = [
        (e["ts"], e["ts"] + e["dur"], names[int(e["name"][len(tag) :])]) for e in events if e["name"].startswith(tag)
    ]
    per = collections.defaultdict(collections.Counter)
    for e in events:  # XLA thunks only (their names carry no "$" or "::")
        if e["name"].startswith(tag) or "$" in e["name"] or "::" in e["name"] or "(" in e["name"]:
            continue
        for start, end, name in spans:
            if start <= e["ts"] < end:
                per[name][e["name"]] += e["dur"] / n
                break
    return per


def loop(args) -> None:
    from bench.brownout_quality import heldout_prompts
    from jaxmoe import SamplingParams
    from jaxmoe.brownout.routing import thresholds

    es = engines(args.model, args.united, salc=True)
    prompts = heldout_prompts(64, 32, 0)
    hook_s = collections.Counter()
    for name, e in es.items():
        for h in e.hooks:
            real = h.after_step

            def timed(*a, _f=real, _n=name, **k):
                t0 = time.perf_counter()
                _f(*a, **k)
                hook_s[_n] += time.perf_counter() - t0

            h.after_step = timed
    order = {n: itertools.cycle(range(len(prompts))) for n in es}
    inflight = dict.fromkeys(es, 0)
    step_s = {n: [] for n in es}
    cached, finished = collections.Counter(), collections.Counter()
    warm = 50
    for i in range(args.steps + warm):
        if i == warm:
            hook_s.clear()
        for name, e in es.items():
            while inflight[name] < 16:
                e.add_request(prompts[next(order[name])], SamplingParams(max_tokens=32, ignore_eos=True))
                inflight[name] += 1
            t0 = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - t0
            for o in outs:
                if o.finished:
                    inflight[name] -= 1
                    if i >= warm:
                        cached[name] += o.num_cached_tokens
                        finished[name] += 1
            if i >= warm:
                step_s[name].append(dt)
    print(f"load {os.getloadavg()}")
    base = statistics.mean(step_s["original"])
    for name, e in es.items():
        m = statistics.mean(step_s[name])
        print(
            f"{name:18s} step mean {m * 1e3:8.2f} ms x{m / base:.3f}; hooks {hook_s[name] / args.steps * 1e3:.3f} ms/step; "
            f"cached prompt tokens {cached[name] / max(1, finished[name]):.1f}/32 over {finished[name]} requests; "
            f"thresholds at the end {thresholds(e.executor)}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="the original model (default: the demo)")
    ap.add_argument("--united", required=True, nargs="+", help="`jaxmoe unite --model MODEL` directories")
    ap.add_argument(
        "--thresholds",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[1.0, 0.0, 0.5],
        help="brownout thresholds of the forward mode's engines (comma-separated)",
    )
    sub = ap.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("forward")
    f.add_argument("--repeats", type=int, default=200)
    f.add_argument("--trace", action="store_true")
    lp = sub.add_parser("loop")
    lp.add_argument("--steps", type=int, default=250)
    args = ap.parse_args()
    forward(args) if args.mode == "forward" else loop(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
