"""Benchmark: a traffic burst against ``jaxmoe serve`` with and without SLO-aware brownout (the
shape of BrownoutServe's Fig. 12, arXiv:2507.17133).

Two runs of the same seeded trace, each against a fresh ``jaxmoe serve`` subprocess (gRPC
streaming client, one thread per request):

* ``off``:  ``jaxmoe serve --model demo`` (the original model, no brownout; ``--model`` another one,
  e.g. one whose decode steps are bound by expert weight reads);
* ``salc``: ``jaxmoe serve --model UNITED --brownout-threshold 1.0 --salc --slo-ttft-ms ..
  --slo-tpot-ms .. --salc-window ..`` (united experts from ``jaxmoe unite``; SALC, Algorithm 2,
  moves the threshold after every step).

Trace: Poisson arrivals at ``--base-rate`` req/s for the first 30 % of ``--duration`` seconds,
then at twice that rate; prompts of ``--prompt-len`` held-out tokens, ``--max-tokens`` greedy
tokens each (ignore_eos). ``--base-rate auto``: a closed-loop probe first measures the original
server's capacity (``--max-num-seqs`` clients sending requests back to back for ``--probe-s``
seconds: finished requests/s) and uses ``--load`` x capacity. SLOs (``auto``): ``--slo-factor`` x
the probe's median TTFT and median TPOT at capacity.

Before the trace each server gets every prompt once, 0.25 s apart (both start with the prompts'
blocks in the prefix cache; SALC stays at threshold 1, so the cached KV is the exact model's).

Measured per request at the client: TTFT (submission to first token) and every gap between
output tokens. SLO violation rate, as the paper defines it, = share of tokens that miss the SLO:
first tokens against the TTFT SLO (a request the server refuses, its waiting queue full, counts as
a miss), later tokens' gaps against the TPOT SLO. Also per 5 s window
the P90 of both, and the server's ``jaxmoe_brownout_threshold{phase}`` (prefill and decode: one
SALC each) scraped twice a second. Plot: ``--png`` (P90 TTFT / TPOT over time for both runs, the
SLOs, both thresholds, the burst). Beside it, what the thresholds SALC chose cost: the held-out
perplexity (``jaxmoe eval --brownout-threshold T``) at the run's mean decode threshold over the
burst (most tokens are decode tokens).

Run (from the repository root, a few minutes; UNITED from ``jaxmoe unite``):
  PYTHONPATH=. .venv/bin/python bench/brownout_burst.py --united UNITED \\
      --png docs/brownout_burst.png --out bench/results/brownout_burst.json
Re-draw a plot from a saved run (seconds; runs saved before ``info`` kept the run's settings need
their ``--load`` / ``--base-rate`` and ``--salc-period`` given again):
  PYTHONPATH=. .venv/bin/python bench/brownout_burst.py --replot bench/results/brownout_burst.json \\
      --load 0.45 --png docs/brownout_burst.png
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WINDOW_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``jaxmoe serve`` subprocess on free local ports; stopped with SIGTERM."""

    def __init__(self, args: list[str], log: Path):
        self.grpc, self.http = free_port(), free_port()
        cmd = [sys.executable, "-m", "jaxmoe.cli", "serve", "--host", "127.0.0.1"]
        cmd += ["--grpc-port", str(self.grpc), "--http-port", str(self.http), *args]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaxmoe serve exited {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"jaxmoe serve not ready after {timeout} s (log: {self.log.name})")

    def metric(self, name: str) -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=2) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(name + " ") or line.startswith(name + "{"):
                        return float(line.rsplit(" ", 1)[1])
        except OSError:
            return None
        return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def one_request(client, prompt, max_tokens: int, out: dict) -> None:
    """Streams one request; ``out`` gets its submission time, token times."""
    out["submit"] = time.monotonic()
    times = []
    try:
        for chunk in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, timeout=600):
            now = time.monotonic()
            times += [now] * len(chunk.delta_token_ids)
    except Exception as e:  # noqa: BLE001 (a failed request is reported, the run goes on)
        out["error"] = repr(e)
    out["times"] = times


def drive(server: Server, trace, prompts, max_tokens: int) -> tuple[list[dict], dict]:
    """Sends the trace [(arrival s, prompt index)]; returns per-request records and the threshold
    samples per phase {"prefill" | "decode": [(s since start, value)]}."""
    from jaxmoe.server.client import JaxmoeClient

    client = JaxmoeClient(f"127.0.0.1:{server.grpc}")
    records, threads, thresholds = [], [], {"prefill": [], "decode": []}
    stop = threading.Event()
    t0 = time.monotonic()

    def scrape():
        while not stop.is_set():
            for phase, samples in thresholds.items():
                value = server.metric(f'jaxmoe_brownout_threshold{{phase="{phase}"}}')
                if value is not None:
                    samples.append((time.monotonic() - t0, value))
            stop.wait(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    for arrival, p in trace:
        time.sleep(max(0.0, t0 + arrival - time.monotonic()))
        rec = {"arrival": arrival}
        records.append(rec)
        th = threading.Thread(target=one_request, args=(client, prompts[p], max_tokens, rec), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=900)
    stop.set()
    scraper.join()
    client.close()
    for rec in records:
        rec["submit"] -= t0
        rec["times"] = [t - t0 for t in rec["times"]]
    return records, thresholds


def make_trace(rate: float, duration: float, burst_at: float, seed: int, num_prompts: int):
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while True:
        t += rng.exponential(1.0 / (rate if t < burst_at else 2 * rate))
        if t >= duration:
            return out
        out.append((float(t), int(rng.integers(num_prompts))))


def summarise(records, slo_ttft: float, slo_tpot: float, duration: float) -> dict:
    ttft = [(r["submit"], r["times"][0] - r["submit"]) for r in records if r["times"]]
    gaps = [(b, b - a) for r in records for a, b in zip(r["times"], r["times"][1:])]
    windows = []
    for start in np.arange(0, max([duration] + [t for t, _ in gaps]), WINDOW_S):
        row = {"t": float(start + WINDOW_S / 2)}
        for name, xs in (("ttft", ttft), ("tpot", gaps)):
            vals = [v for t, v in xs if start <= t < start + WINDOW_S]
            row[name] = float(np.percentile(vals, 90)) if vals else None
        windows.append(row)
    refused = sum(not r["times"] for r in records)  # e.g. RESOURCE_EXHAUSTED: the waiting queue was full
    return {
        "requests": len(records),
        "failed": sum("error" in r for r in records),
        "refused": refused,
        # a refused request never gets its first token: it misses the TTFT SLO
        "ttft_violation": (sum(v > slo_ttft for _, v in ttft) + refused) / max(1, len(records)),
        "tpot_violation": sum(v > slo_tpot for _, v in gaps) / max(1, len(gaps)),
        "ttft_p90": float(np.percentile([v for _, v in ttft], 90)) if ttft else None,
        "tpot_p90": float(np.percentile([v for _, v in gaps], 90)) if gaps else None,
        "windows": windows,
    }


def probe(server: Server, prompts, max_tokens: int, concurrency: int, seconds: float) -> dict:
    """Closed loop: ``concurrency`` clients each send requests back to back for ``seconds``:
    capacity (finished requests/s) and the median TTFT / TPOT at that load."""
    from jaxmoe.server.client import JaxmoeClient

    client = JaxmoeClient(f"127.0.0.1:{server.grpc}")
    done: list[dict] = []
    end = time.monotonic() + seconds

    def worker(i):
        while time.monotonic() < end:
            rec: dict = {}
            one_request(client, prompts[(i + len(done)) % len(prompts)], max_tokens, rec)
            if time.monotonic() <= end and rec["times"]:
                done.append(rec)

    t0 = time.monotonic()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    client.close()
    return {
        "capacity_req_s": len(done) / (end - t0),
        "ttft_at_capacity": statistics.median(r["times"][0] - r["submit"] for r in done),
        "tpot_at_capacity": statistics.median(float(np.median(np.diff(r["times"]))) for r in done),
    }


def plot(
    results: dict, path: str, slo_ttft: float, slo_tpot: float, burst_at: float, setting: str = "", model: str = "demo"
) -> None:
    """Three panels (P90 TTFT, P90 TPOT, SALC's threshold over time); ``setting`` (the run's load and
    SALC period) goes into the title, so the pictures of different runs say which is which; legends
    sit to the right of the panels, over no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for mode, style in (("off", "tab:red"), ("salc", "tab:blue")):
        w = results[mode]["summary"]["windows"]
        for ax, name in zip(axes[:2], ("ttft", "tpot")):
            pts = [(r["t"], r[name]) for r in w if r[name] is not None]
            ax.plot(*zip(*pts), color=style, marker=".", label=f"{'no brownout' if mode == 'off' else 'SALC'}")
        th = results[mode]["thresholds"]
        if isinstance(th, list):  # a run saved before the per-phase thresholds: one for both phases
            th = {"both phases'": th}
        for phase, samples in th.items():
            if samples:
                ls = "--" if phase == "prefill" else "-"
                axes[2].plot(*zip(*samples), color=style, ls=ls, label=f"SALC {phase} threshold")
    for ax, slo, name in ((axes[0], slo_ttft, "TTFT"), (axes[1], slo_tpot, "TPOT")):
        ax.axhline(slo, color="k", ls="--", lw=1, label=f"{name} SLO")
        ax.set_ylabel(f"P90 {name} (s, {WINDOW_S:.0f} s windows)")
        ax.set_yscale("log")
    axes[2].set_ylabel("brownout threshold (share kept)")
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].set_xlabel("time since the trace started (s)")
    for ax in axes:
        ax.axvline(burst_at, color="gray", ls=":", lw=1)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    axes[0].set_title(
        "P90 latency and brownout threshold in a traffic burst, without brownout and with SALC\n"
        f"jaxmoe serve, {model} model{setting}; the request rate doubles at the dotted line",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _setting(info: dict) -> str:
    """The run's settings for the plot's title: its base rate (a share of the measured capacity, or
    fixed) and SALC period."""
    arg = info.get("base_rate_arg", "auto")
    rate = f"load {float(info['load']):g} of capacity" if arg == "auto" else f"{float(arg):g} req/s"
    return f" ({rate}, SALC period {float(info['salc_period']):g} s)"


def perplexity(model: str, threshold: float | None, max_tokens: int) -> float:
    cmd = [sys.executable, "-m", "jaxmoe.cli", "eval", "--model", model, "--max-tokens", str(max_tokens), "--json"]
    if threshold is not None:
        cmd += ["--brownout-threshold", f"{threshold:.4f}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["perplexity"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="the original model (default: the demo)")
    ap.add_argument("--united", help="a model directory with united experts (jaxmoe unite); required unless --replot")
    ap.add_argument("--replot", help="only re-draw --png from this saved --out JSON")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of trace per run")
    ap.add_argument("--base-rate", default="auto", help="req/s before the burst, or auto")
    ap.add_argument("--load", type=float, default=0.8, help="auto base rate = this x measured capacity")
    ap.add_argument("--probe-s", type=float, default=15.0, help="seconds of the closed-loop capacity probe")
    ap.add_argument("--slo-ttft-ms", default="auto")
    ap.add_argument("--slo-tpot-ms", default="auto")
    ap.add_argument("--slo-factor", type=float, default=2.0, help="auto SLO = this x the median at capacity")
    ap.add_argument("--salc-window", type=float, default=5.0)
    ap.add_argument("--salc-period", type=float, default=0.0, help="seconds between SALC updates (0: every step)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--png", default="docs/brownout_burst.png")
    ap.add_argument("--out", default=None, help="also write everything as JSON here")
    ap.add_argument("--logs", default="/tmp/brownout_burst")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        info = {**vars(args), "base_rate_arg": args.base_rate, **saved["info"]}  # saved settings win
        burst_at = 0.3 * float(info["duration"])
        model = Path(info.get("model", "demo")).name
        plot(saved["results"], args.png, info["slo_ttft"], info["slo_tpot"], burst_at, _setting(info), model)
        print(f"plot: {args.png}")
        return 0
    if not args.united:
        ap.error("--united is required (or --replot)")

    from bench.brownout_quality import heldout_prompts

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    from jaxmoe.checkpoint.model import model_dir

    vocab = json.load(open(model_dir(args.model) / "config.json"))["vocab_size"]
    prompts = [[t % vocab for t in p] for p in heldout_prompts(64, args.prompt_len, 0)]  # the demo's ids
    common = ["--max-num-seqs", str(args.max_num_seqs), "--max-batch-tokens", "512", "--dtype", "float32"]
    results: dict = {}
    info: dict = {k: getattr(args, k) for k in ("duration", "load", "salc_period")}
    info["base_rate_arg"] = args.base_rate
    for mode in ("off", "salc"):
        if mode == "off":
            server = Server(["--model", args.model, *common], logs / "off.log")
        else:
            salc = ["--salc", "--slo-ttft-ms", f"{info['slo_ttft'] * 1e3:.1f}"]
            salc += ["--slo-tpot-ms", f"{info['slo_tpot'] * 1e3:.1f}", "--salc-window", str(args.salc_window)]
            salc += ["--salc-period", str(args.salc_period)]
            server = Server(["--model", args.united, "--brownout-threshold", "1.0", *salc, *common], logs / "salc.log")
        try:
            server.wait_ready()
            # warm the client path and the prefix cache alike in both runs (the probe below runs on
            # ``off`` only): every prompt once, spaced below capacity so SALC stays at threshold 1
            drive(server, [(0.25 * i, i) for i in range(len(prompts))], prompts, args.max_tokens)
            if mode == "off":
                measured = probe(server, prompts, args.max_tokens, args.max_num_seqs, args.probe_s)
                info["probe"] = measured
                auto = lambda v, d: d if v == "auto" else float(v)  # noqa: E731
                info["base_rate"] = auto(args.base_rate, args.load * measured["capacity_req_s"])
                info["slo_ttft"] = auto(args.slo_ttft_ms, args.slo_factor * measured["ttft_at_capacity"] * 1e3) / 1e3
                info["slo_tpot"] = auto(args.slo_tpot_ms, args.slo_factor * measured["tpot_at_capacity"] * 1e3) / 1e3
                info["trace"] = make_trace(info["base_rate"], args.duration, 0.3 * args.duration, args.seed, 64)
                print(json.dumps({k: v for k, v in info.items() if k != "trace"}), flush=True)
            records, thresholds = drive(server, info["trace"], prompts, args.max_tokens)
        finally:
            server.stop()
        summary = summarise(records, info["slo_ttft"], info["slo_tpot"], args.duration)
        results[mode] = {"summary": summary, "thresholds": thresholds}
        print(mode, json.dumps({k: v for k, v in summary.items() if k != "windows"}), flush=True)

    burst_at = 0.3 * args.duration
    for phase, samples in results["salc"]["thresholds"].items():
        th = [v for t, v in samples if t >= burst_at]
        info[f"mean_{phase}_threshold_after_burst"] = statistics.mean(th) if th else 1.0
        info[f"min_{phase}_threshold"] = min((v for _, v in samples), default=1.0)
    mean_t = info["mean_decode_threshold_after_burst"]
    info["model"] = args.model
    if args.model == "demo":  # held-out text in the demo's tokenizer
        info["ppl_original"] = perplexity("demo", None, args.ppl_tokens)
        info["ppl_at_mean_threshold"] = perplexity(args.united, mean_t, args.ppl_tokens)
    else:
        info["ppl_original"] = info["ppl_at_mean_threshold"] = float("nan")
    plot(results, args.png, info["slo_ttft"], info["slo_tpot"], burst_at, _setting(info), Path(args.model).name)
    n = len(info["trace"])
    print(
        f"\ntrace: {n} requests over {args.duration:.0f} s, {info['base_rate']:.2f} req/s then "
        f"{2 * info['base_rate']:.2f} from {burst_at:.0f} s (capacity probe: "
        f"{info['probe']['capacity_req_s']:.2f} req/s); SLOs: TTFT {info['slo_ttft'] * 1e3:.0f} ms, "
        f"TPOT {info['slo_tpot'] * 1e3:.0f} ms (P90)\n"
    )
    print(
        "| run | TTFT violations | TPOT violations | P90 TTFT (s) | P90 TPOT (ms) | prefill / decode threshold after the burst (mean; min) | held-out ppl at the mean decode threshold |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in ("off", "salc"):
        s = results[mode]["summary"]
        cost = (
            f"{info['mean_prefill_threshold_after_burst']:.2f} / {mean_t:.2f} "
            f"({info['min_prefill_threshold']:.2f} / {info['min_decode_threshold']:.2f}) | {info['ppl_at_mean_threshold']:.2f}"
            if mode == "salc"
            else f"1 (no brownout) | {info['ppl_original']:.2f}"
        )
        print(
            f"| {'no brownout' if mode == 'off' else 'SALC'} | {s['ttft_violation']:.1%} | {s['tpot_violation']:.1%} | "
            f"{s['ttft_p90']:.2f} | {s['tpot_p90'] * 1e3:.0f} | {cost} |"
        )
    print(f"\nplot: {args.png}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"info": info, "results": results}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
