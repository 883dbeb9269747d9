"""Benchmark: routed-expert grouped SwiGLU FFN at decode sizes.

What it measures: wall time of ``grouped_swiglu`` (gate+up+SiLU+down over
tokens already dispatched to their experts) for several implementations, and
the achieved weight bandwidth = bytes of the *active* experts' weights
(3 * D * F * itemsize per distinct routed expert) / time.  That is compared
with a device-to-device copy bandwidth measured in the same run
(``y = x + 1`` on a large f32 buffer; read+write bytes / time).

Implementations: ``pallas`` (compiled Pallas kernel: Mosaic GPU on Hopper,
Mosaic TPU on TPU; on CPU the interpret kernel, run only at a tiny size),
``ragged_dot`` (``jax.lax.ragged_dot``), ``einsum`` (padded ``[G, C, D]``
einsum with oracle capacity C = largest group, reads all G experts) and
``loop`` (masked per-expert loop; ``--small`` only).

Sizes: DeepSeek-V2-Lite experts (D=2048, F=1408, 64 experts, top-6) and
Mixtral (D=4096, F=14336, 8 experts, top-2), batch 1..256, bf16.  ``--small``
divides D and F by 8 and uses batch 1..64 so that it runs on a CPU.

Run:
  python bench/grouped_matmul.py                 # GPU/TPU, full sizes
  python bench/grouped_matmul.py --small         # CPU, prints a markdown table
  python bench/grouped_matmul.py --small --out /tmp/t.md
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe.pallas_kernels.grouped_matmul import dispatch, grouped_swiglu  # noqa: E402

MODELS = {  # name: (experts G, hidden D, intermediate F, top_k)
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
TINY = ("tiny", 8, 64, 128, 2, 4)  # name, G, D, F, k, T: interpret kernel


def _time(fn, *args, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth (read + write bytes / s)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)  # f32: no bf16 emulation on CPU
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / _time(f, x, iters=iters)


def make_inputs(key, g, d, f, k, t, dtype):
    kx, kr, k1, k2, k3 = jax.random.split(key, 5)
    x = jax.random.normal(kx, (t, d)).astype(dtype)
    scores = jax.random.normal(kr, (t, g))
    _, ids = jax.lax.top_k(scores, k)  # k distinct experts per token
    s = 1.0 / np.sqrt(d)
    wg = (jax.random.normal(k1, (g, d, f)) * s).astype(dtype)
    wu = (jax.random.normal(k2, (g, d, f)) * s).astype(dtype)
    wd = (jax.random.normal(k3, (g, f, d)) * s).astype(dtype)
    xs, gs, _ = dispatch(x, ids.astype(jnp.int32), g)
    return xs, gs, wg, wu, wd


def bench_one(name, g, d, f, k, t, impls, dtype, iters, copy_bw, interpret):
    xs, gs, wg, wu, wd = make_inputs(jax.random.PRNGKey(t), g, d, f, k, t, dtype)
    gs_np = np.asarray(gs)
    active = int((gs_np > 0).sum())
    wbytes = active * 3 * d * f * jnp.dtype(dtype).itemsize
    rows, ref = [], None
    for impl in impls:
        opts = {"capacity": int(gs_np.max())} if impl == "einsum" else None
        fn = jax.jit(
            functools.partial(
                grouped_swiglu, impl=impl, interpret=interpret if impl == "pallas" else None, kernel_options=opts
            )
        )
        try:
            sec = _time(fn, xs, gs, wg, wu, wd, iters=iters)
            y = np.asarray(fn(xs, gs, wg, wu, wd).astype(jnp.float32))
        except Exception as e:  # keep the table going; report the failure
            rows.append((name, t, impl, "error", "", "", "", type(e).__name__))
            continue
        ref = y if ref is None else ref
        err = float(np.max(np.abs(y - ref)) / (np.max(np.abs(ref)) + 1e-9))
        bw = wbytes / sec
        rows.append(
            (
                name,
                t,
                impl,
                f"{sec * 1e6:.0f}",
                f"{wbytes / 2**20:.1f}",
                f"{bw / 1e9:.1f}",
                f"{100 * bw / copy_bw:.0f}%",
                f"{err:.1e}",
            )
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="CPU-sized shapes")
    p.add_argument("--batches", default=None, help="comma list of batch sizes")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the table here")
    a = p.parse_args(argv)
    dtype = jnp.bfloat16
    on_cpu = jax.default_backend() == "cpu"
    div = 8 if a.small else 1
    batches = [int(b) for b in (a.batches or ("1,4,16,64" if a.small else "1,4,16,64,256")).split(",")]
    iters = a.iters or (5 if on_cpu else 20)
    impls = ["ragged_dot", "einsum"] + (["loop"] if a.small else [])
    if not on_cpu:
        impls = ["pallas"] + impls
    copy_bw = copy_bandwidth((64 if on_cpu else 1024) * 2**20, iters)

    rows = []
    for name, (g, d, f, k) in MODELS.items():
        for t in batches:
            rows += bench_one(
                f"{name}{'/8' if a.small else ''}", g, d // div, f // div, k, t, impls, dtype, iters, copy_bw, None
            )
    if on_cpu:  # the interpret-mode kernel is only a correctness check here
        name, g, d, f, k, t = TINY
        rows += bench_one(name, g, d, f, k, t, ["ragged_dot", "einsum", "loop", "pallas"], dtype, iters, copy_bw, True)

    dev = jax.devices()[0]
    head = [
        f"device: {dev.platform} / {dev.device_kind}; dtype bf16; "
        f"copy bandwidth (read+write): {copy_bw / 1e9:.1f} GB/s",
        "",
        "| model | T | impl | time (us) | active weights (MiB) | GB/s | % of copy | max rel err vs first |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines = head + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
