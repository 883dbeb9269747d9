"""The expert FFN on XLA:CPU: ``cpu_kernel`` (the C++ custom call) on plain weights, on weights
stored as column panels (how the monolithic executor stores them for it) and, for bfloat16, on panels
in pairs of rows (the bf16 dot instruction's layout, stored where the CPU has it) against ``bucketed_loop``
(the XLA form it replaced as the CPU default), at the shapes of the 107 M Mixtral-style
checkpoint.

One jitted program scans the expert FFN over 8 layers of stacked weights (hidden 512, 8 experts,
expert width 1024, top-2), the way the monolithic executor does, so the weights come from memory and
not from cache (50 MB per layer in float32). For each token count (``--tokens``) and dtype, both
variants run in one process, interleaved, ``--repeats`` times each; the table gives the median, the
GB/s of the routed experts' weights read, and the speed-ups over ``bucketed_loop``. Where
``cpu_kernel`` hands a prefill-sized batch of plain weights to its fallback, that column runs
``bucketed_loop`` (marked); on panels it takes every batch.

    PYTHONPATH=. python bench/expert_ffn_cpu.py
    PYTHONPATH=. python bench/expert_ffn_cpu.py --tokens 1,16 --dtypes float32 --repeats 50
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from jaxmoe.models.common import pack16
from jaxmoe.models.experts import LayerWeights
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel, expert_ffn
from jaxmoe.pallas_kernels.expert_ffn.panels import to_panels, width_for

VARIANTS = {  # name: (impl, weight layout)
    "bucketed_loop": ("bucketed_loop", "plain"),
    "plain": ("cpu_kernel", "plain"),
    "panels": ("cpu_kernel", "panels"),
    "pairs": ("cpu_kernel", "pairs"),
}
L, E, D, F, K = 8, 8, 512, 1024, 2


def programs(ids, weights):
    def make(impl):
        @jax.jit
        def run(p, x):
            def body(x, layer):
                return x + expert_ffn(x, ids, weights, LayerWeights(p, layer), impl=impl) * 0.5, None

            return jax.lax.scan(body, x, jnp.arange(L))[0]

        return run

    return {name: make(impl) for name, (impl, _) in VARIANTS.items()}


def measure(T: int, dtype, repeats: int) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(T), 6)
    shapes = {"w_gate": (L, E, D, F), "w_up": (L, E, D, F), "w_down": (L, E, F, D)}
    p = {n: pack16((jax.random.normal(k, s) * D**-0.5).astype(dtype)) for (n, s), k in zip(shapes.items(), keys)}
    x = jax.random.normal(keys[3], (T, D)).astype(dtype)
    ids = jnp.argsort(jax.random.uniform(keys[4], (T, E)), axis=1)[:, :K].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[5], (T, K)), -1).astype(dtype)
    width = width_for(D, F)
    stored = {"plain": p, "panels": {n: to_panels(a, width) for n, a in p.items()}}
    if jnp.dtype(dtype).itemsize == 2:
        stored["pairs"] = {n: to_panels(a, width, pairs=True) for n, a in p.items()}
    runs = {name: run for name, run in programs(ids, weights).items() if VARIANTS[name][1] in stored}
    for name, run in runs.items():
        run(stored[VARIANTS[name][1]], x).block_until_ready()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run(stored[VARIANTS[name][1]], x).block_until_ready()
            times[name].append(time.perf_counter() - t)
    routed = len(set(ids.reshape(-1).tolist()))
    gb = L * routed * 3 * D * F * jnp.dtype(dtype).itemsize / 1e9
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    kernel = cpu_kernel.supports(x, ids, LayerWeights(p, 0))
    return {"routed": routed, "gb": gb, "ms": {k: v * 1e3 for k, v in med.items()}, "kernel": kernel}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,32,64,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not cpu_kernel.available():
        raise SystemExit(f"cpu_kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    print(
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{len(jax.devices())} device(s); 8 layers x 8 experts, hidden {D}, expert width {F}, top-{K}; "
        f"median of {args.repeats}, interleaved\n"
    )
    print(
        "| dtype | tokens | experts routed | bucketed_loop ms (GB/s) | cpu_kernel, plain ms (GB/s) "
        "| cpu_kernel, panels ms (GB/s) | cpu_kernel, pairs ms (GB/s) | speed-up plain / panels / pairs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            r = measure(T, jnp.dtype(dtype), args.repeats)
            ms = r["ms"]
            cells = [f"{ms[i]:.2f} ({r['gb'] / ms[i] * 1e3:.0f})" if i in ms else "-" for i in VARIANTS]
            note = "" if r["kernel"] else " (fallback: prefill-sized)"
            ups = " / ".join(f"{ms['bucketed_loop'] / ms[i]:.2f}x" for i in ("plain", "panels", "pairs") if i in ms)
            print(
                f"| {dtype} | {T} | {r['routed']} | {cells[0]} | {cells[1]}{note} | {cells[2]} | {cells[3]} | {ups} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
