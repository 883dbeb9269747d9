"""The cluster simulator (``jaxmoe simulate``): replay a trace minute by minute under a scaling
policy and count GPU-hours and SLO attainment (JANUS Fig. 9), plus the per-GPU throughput table
of Fig. 7.

Every ``interval`` minutes a policy's controller picks a layout for ``headroom`` x the peak request
rate of the previous interval (all policies see the same statistics; only their choices differ).
``compare`` gives every scaling policy the least headroom that reaches the same SLO attainment
target, so GPU-hours are compared at equal service. Each minute
is then served by the current layout: it meets the SLO when the load's steady state exists and its
TPOT is under the SLO. Attainment counts requests (minutes weighted by their rate).

Policies: ``janus`` (any attention / expert instance counts, AEBS-balanced experts, two-phase
transfers), ``disagg`` (whole nodes per side, random expert scheduling, direct transfers),
``monolithic`` (16 / 32 / 64 GPUs, re-chosen each interval) and ``monolithic-N`` (fixed).
"""

from __future__ import annotations

import numpy as np

from jaxmoe.janus.scaling.controller import DISAGG, JANUS, MONOLITHIC, Layout, Load, ScalingController, candidates
from jaxmoe.janus.scaling.controller import steady_state
from jaxmoe.janus.scaling.perf_model import PerfModel

FIXED = (16, 32, 64)


def _controller(pm: PerfModel, policy: str, slo: float) -> ScalingController:
    if policy == "janus":
        return ScalingController(pm, JANUS, candidates(pm, "janus"), slo)
    if policy == "disagg":
        return ScalingController(pm, DISAGG, candidates(pm, "disagg"), slo)
    if policy == "monolithic":
        return ScalingController(pm, MONOLITHIC, candidates(pm, "monolithic"), slo)
    if policy.startswith("monolithic-") and policy[len("monolithic-") :].isdigit():
        return ScalingController(pm, MONOLITHIC, [Layout(int(policy[len("monolithic-") :]))], slo)
    raise ValueError(f"unknown policy {policy!r} (janus, disagg, monolithic, monolithic-N)")


def simulate(
    rates: np.ndarray,
    policy: str,
    *,
    pm: PerfModel | None = None,
    slo_tpot: float = 0.2,
    interval: int = 30,
    output_tokens: float = 256.0,
    input_tokens: float = 16.0,
    headroom: float = 1.0,
) -> dict:
    """One policy over a trace of per-minute request rates; the controller provisions for
    ``headroom`` x the peak rate it saw. Returns gpu_hours, slo_attainment, per-minute GPUs and
    the layouts chosen."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1 minute, got {interval}")
    pm = pm or PerfModel()
    ctl = _controller(pm, policy, slo_tpot)
    context = input_tokens + output_tokens / 2
    gpus = np.zeros(len(rates))
    ok = np.zeros(len(rates), bool)
    layouts = []
    for start in range(0, len(rates), interval):
        seen = rates[max(0, start - interval) : start] if start else rates[:1]
        layout = ctl.decide(Load(headroom * float(seen.max()), output_tokens, context))
        layouts.append(layout.name)
        for m in range(start, min(start + interval, len(rates))):
            state = steady_state(pm, ctl.system, layout, Load(float(rates[m]), output_tokens, context))
            gpus[m] = layout.gpus
            ok[m] = state is not None and state[1] <= slo_tpot
    served = float((rates * ok).sum() / rates.sum())
    return {
        "policy": policy,
        "gpu_hours": float(gpus.sum() / 60.0),
        "slo_attainment": served,
        "gpus": gpus,
        "layouts": layouts,
        "headroom": headroom,
    }


def provision(
    rates: np.ndarray, policy: str, target: float, *, max_headroom: float = 4.0, steps: int = 8, **kw
) -> dict:
    """The run of ``policy`` with the least headroom whose SLO attainment reaches ``target``
    (bisection on the headroom; attainment grows with it). If even ``max_headroom`` misses the
    target, that run."""
    best = simulate(rates, policy, headroom=max_headroom, **kw)
    if best["slo_attainment"] < target:
        return best
    lo, hi = 1.0, max_headroom
    low = simulate(rates, policy, headroom=lo, **kw)
    if low["slo_attainment"] >= target:
        return low
    for _ in range(steps):
        mid = (lo + hi) / 2
        run = simulate(rates, policy, headroom=mid, **kw)
        if run["slo_attainment"] >= target:
            hi, best = mid, run
        else:
            lo = mid
    return best


def compare(
    rates: np.ndarray,
    *,
    pm: PerfModel | None = None,
    slo_tpot: float = 0.2,
    interval: int = 30,
    target: float = 0.99,
    **load,
) -> dict:
    """Every policy provisioned (``provision``) to reach the same SLO attainment ``target``; the
    best monolithic one is the cheapest that reaches it (if none does: the highest attainment)."""
    pm = pm or PerfModel()
    kw = dict(pm=pm, slo_tpot=slo_tpot, interval=interval, **load)
    runs = {p: provision(rates, p, target, **kw) for p in ("janus", "disagg", "monolithic")}
    runs.update({f"monolithic-{g}": simulate(rates, f"monolithic-{g}", **kw) for g in FIXED})
    mono = [runs[p] for p in runs if p.startswith("monolithic")]
    good = [r for r in mono if r["slo_attainment"] >= target]
    best = min(good, key=lambda r: r["gpu_hours"]) if good else max(mono, key=lambda r: r["slo_attainment"])
    janus = runs["janus"]
    return {
        "janus": janus,
        "monolithic_best": best,
        "disagg": runs["disagg"],
        "runs": runs,
        "target": target,
        "gpu_hours_saved_vs_monolithic": 1 - janus["gpu_hours"] / best["gpu_hours"],
    }


def summary(result: dict) -> dict:
    """The JSON form: gpu_hours and slo_attainment per policy (keys janus, monolithic_best, disagg)."""
    out = {}
    for key in ("janus", "monolithic_best", "disagg"):
        r = result[key]
        out[key] = {
            "policy": r["policy"],
            "gpu_hours": round(r["gpu_hours"], 2),
            "slo_attainment": round(r["slo_attainment"], 5),
            "headroom": round(r["headroom"], 3),
        }
    out["gpu_hours_saved_vs_monolithic"] = round(result["gpu_hours_saved_vs_monolithic"], 4)
    out["slo_attainment_target"] = result["target"]
    out["all"] = {
        p: {"gpu_hours": round(r["gpu_hours"], 2), "slo_attainment": round(r["slo_attainment"], 5)}
        for p, r in result["runs"].items()
    }
    return out


def throughput_table(
    pm: PerfModel | None = None, batches=(4, 16, 64, 256, 512), context: float = 144.0, slo_tpot: float = 0.2
) -> list[dict]:
    """Fig. 7: per batch, the TPOT and per-GPU throughput of the best layout of each system under the SLO."""
    pm = pm or PerfModel()
    rows = []
    for b in batches:
        row = {"batch": b}
        for name, system, kind in (
            ("janus", JANUS, "janus"),
            ("disagg", DISAGG, "disagg"),
            ("monolithic", MONOLITHIC, "monolithic"),
        ):
            best = None
            for layout in candidates(pm, kind):
                if system.capacity(pm, layout, context) < b:
                    continue
                tpot = system.tpot(pm, layout, b, context)
                per_gpu = b / tpot / layout.gpus
                if tpot <= slo_tpot and (best is None or per_gpu > best[2]):
                    best = (layout.name, tpot, per_gpu)
            row[name] = (
                None
                if best is None
                else {"layout": best[0], "tpot_ms": round(best[1] * 1e3, 1), "tokens_per_s_per_gpu": round(best[2], 1)}
            )
        rows.append(row)
    return rows


def plot(result: dict, rates: np.ndarray, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = np.arange(len(rates)) / 60.0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ax1.plot(hours, rates, lw=0.7, color="gray", label="request rate")
    ax1.set_ylabel("request rate (requests / s)")
    ax1.set_title("synthesised trace (top) and the GPUs each scaling policy holds (bottom)", fontsize=10)
    for key, style in (("janus", "-"), ("monolithic_best", "--"), ("disagg", ":")):
        r = result[key]
        ax2.plot(
            hours,
            r["gpus"],
            style,
            label=f"{key} ({r['policy']}): {r['gpu_hours']:.0f} GPU-h, SLO {100 * r['slo_attainment']:.1f} %",
        )
    ax2.set(xlabel="time (hours)", ylabel="GPUs held")
    # below the panels, over no data
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
