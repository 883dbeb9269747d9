"""Where a decode step's time goes on a big checkpoint, against the bytes it must read.

For each batch size: ``LLM(ckpt, dtype)`` (the monolithic executor, as ``jaxmoe serve`` builds it)
takes that many 16-token prompts, runs the prefill and one decode step, and the next decode step's
``executor.forward`` arguments are captured. Then:

* start-up: ``LLM(...)``'s wall time and peak resident memory (VmHWM growth) / checkpoint bytes, and
  the time to first token of one ``--ttft-len``-token prompt (after one compiling run);
* ``step``: the mean wall time of whole engine steps (scheduler, model runner, forward, sampler,
  stop checks) over the rest of the generation;
* ``forward``: the captured forward replayed ``--repeats`` times (best and median);
* with ``--trace``: ``jax.profiler`` over 3 replays, the busiest XLA:CPU thunks summed per forward
  (ms; ``ffi_call.*`` are the C++ custom calls: expert FFN, paged attention; ``while.*`` is the layer
  loop and contains the others);
* the roofline: bytes a step must read (``bench/device_check.py``'s ``_model_bytes``: every weight but
  the embedding table, routed experts by the expected distinct experts per layer) / copy bandwidth of
  a 1 GiB bf16 array (read + write).

    python bench/big_decode_profile.py --ckpt /tmp/mixtral-3b --batches 1,16 --trace

Prints one JSON object (and the thunk table on stderr).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def status(key: str) -> int:
    """This process's ``/proc/self/status`` entry in bytes (VmRSS, VmHWM: its peak)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def profile_batch(llm, batch: int, repeats: int, trace: bool, new_tokens: int) -> dict:
    import jax

    from jaxmoe import SamplingParams

    e = llm.engine
    for b in range(batch):
        e.add_request(
            [(5 * i + b) % 200 + 3 for i in range(16)], SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        )
    e.step(), e.step()
    captured = {}
    real = e.executor.forward

    def capture(*a, **k):
        captured.setdefault("args", (a, k))
        return real(*a, **k)

    e.executor.forward = capture
    e.step()
    e.executor.forward = real
    steps = []
    while e.has_work():
        t = time.perf_counter()
        e.step()
        steps.append(time.perf_counter() - t)
    a, k = captured["args"]

    def run():
        return jax.block_until_ready(e.executor.forward(*a, **k))

    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    out = {
        "batch": batch,
        "step_ms_mean": round(1e3 * statistics.mean(steps[2:] or steps), 1),
        "forward_ms_best": round(1e3 * min(times), 1),
        "forward_ms_median": round(1e3 * statistics.median(times), 1),
    }
    if trace:
        out["thunks_ms"] = thunks(run, 3)
    return out


def thunks(run, n: int) -> dict:
    import jax

    d = tempfile.mkdtemp(prefix="big_decode_trace_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(n):
            with jax.profiler.TraceAnnotation("bigforward"):
                run()
    events = json.load(gzip.open(sorted(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True))[-1]))
    events = [e for e in (events["traceEvents"] if isinstance(events, dict) else events) if e.get("ph") == "X"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "bigforward"]
    per = collections.Counter()
    for e in events:  # XLA thunks only (their names carry no "$" or "::")
        if e["name"] == "bigforward" or "$" in e["name"] or "::" in e["name"] or "(" in e["name"]:
            continue
        if any(s <= e["ts"] < t for s, t in spans):
            per[e["name"]] += e["dur"] / n / 1e3
    return {name: round(ms, 2) for name, ms in per.most_common(12)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--ttft-len", type=int, default=128, help="time the first token of one prompt this long (0: no)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens per request of the generation profiled")
    p.add_argument("--settings", default="{}", help='extra LLM settings as JSON (e.g. \'{"expert_impl": "xla"}\')')
    args = p.parse_args()

    from device_check import _model_bytes, copy_gbs

    from jaxmoe import LLM
    from jaxmoe.config import load_config

    from jaxmoe import SamplingParams

    cfg = load_config(args.ckpt)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg(), "runs": []}
    ckpt = sum(os.path.getsize(f) for f in glob.glob(os.path.join(args.ckpt, "*.safetensors")))
    base = status("VmRSS")
    t = time.perf_counter()
    llm = LLM(args.ckpt, dtype=args.dtype, max_num_seqs=16, **json.loads(args.settings))
    result["start_s"] = round(time.perf_counter() - t, 1)
    result["start_peak_rss_x_ckpt"] = round((status("VmHWM") - base) / ckpt, 3)
    result["serving_rss_x_ckpt"] = round((status("VmRSS") - base) / ckpt, 3)
    print(json.dumps(result), file=sys.stderr, flush=True)
    if args.ttft_len:
        prompt, one = [(7 * i) % 200 + 3 for i in range(args.ttft_len)], SamplingParams(max_tokens=1)
        llm.generate([prompt], one)  # compiles this prefill
        t = time.perf_counter()
        llm.generate([prompt], one)
        result["ttft_s"] = round(time.perf_counter() - t, 3)
        print(json.dumps({"ttft_s": result["ttft_s"]}), file=sys.stderr, flush=True)
    scale = {"bfloat16": 1, "float32": 2}[args.dtype]
    for b in map(int, args.batches.split(",")):
        r = profile_batch(llm, b, args.repeats, args.trace, args.new_tokens)
        r["step_bytes_gb"] = round(scale * _model_bytes(cfg, b)[1] / 1e9, 3)
        result["runs"].append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    del llm
    result["copy_gbs"] = round(copy_gbs(), 1)
    for r in result["runs"]:
        floor = r["step_bytes_gb"] / result["copy_gbs"] * 1e3
        r["floor_ms"] = round(floor, 1)
        r["forward_share_of_roofline"] = round(floor / r["forward_ms_best"], 3)
        r["step_share_of_roofline"] = round(floor / r["step_ms_mean"], 3)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
