"""AEBS scheduling overhead (janus Fig. 12): wall time of one jitted ``schedule`` call.

Same setting as bench/aebs_imbalance.py (160 experts, top-8, 192 slots,
Zipf s=1.0 routing), batch 16 .. 512 on N = 8 and 16 instances. For each
(implementation, policy, N, batch): compile once, warm up, then report the
median (and p10/p90) over repeated calls of ``jax.jit(schedule)`` with
``block_until_ready``; inputs are already on the device.

Implementations timed:
  * CPU: "reference" (Algorithm 1 in jnp, compiled by XLA), "reference" for
    aebs_plus (numpy through ``jax.pure_callback``), and the Pallas kernel in
    interpret mode. Interpret-mode time is the cost of the XLA loops the
    interpreter emits on the host; it says nothing about GPU kernel time.
  * GPU (when ``jax.default_backend() == "gpu"``): additionally the compiled
    Mosaic GPU kernel (``interpret=False``) for aebs and aebs_plus, and the jnp
    reference on the GPU. Failures are reported in the table, not hidden.

Run:  .venv/bin/python bench/aebs_overhead.py [--reps 30] [--batches 16,64,512]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aebs_imbalance import BATCHES, placement, popularity, tokens  # noqa: E402

from jaxmoe.pallas_kernels.aebs import schedule  # noqa: E402


def time_call(f, args, reps):
    jax.block_until_ready(f(*args))  # compile
    jax.block_until_ready(f(*args))  # warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return np.percentile(np.asarray(ts) * 1e6, [50, 10, 90])


def configs():
    out = [
        ("reference (jnp)", "aebs", "reference", None),
        ("reference (numpy callback)", "aebs_plus", "reference", None),
    ]
    if jax.default_backend() == "gpu":
        out += [("kernel (Mosaic GPU)", "aebs", "kernel", False), ("kernel (Mosaic GPU)", "aebs_plus", "kernel", False)]
    out += [("kernel (interpret)", "aebs", "kernel", True), ("kernel (interpret)", "aebs_plus", "kernel", True)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dev = jax.devices()[0]
    print(f"# jax {jax.__version__}, device {dev.platform}:{dev.device_kind}, reps={args.reps}")
    print("| impl | policy | N | batch | median us | p10 us | p90 us |")
    print("|---|---|---|---|---|---|---|")
    for N in (8, 16):
        rng = np.random.default_rng(args.seed + N)
        pop = popularity(rng)
        rt, ri = placement(rng, N, pop)
        rt, ri = jnp.asarray(rt, jnp.int32), jnp.asarray(ri, jnp.int32)
        for name, policy, impl, interpret in configs():
            f = jax.jit(functools.partial(schedule, num_instances=N, policy=policy, impl=impl, interpret=interpret))
            for T in batches:
                ids = jnp.asarray(tokens(rng, T, pop), jnp.int32)
                try:
                    med, p10, p90 = time_call(f, (ids, rt, ri), args.reps)
                    print(f"| {name} | {policy} | {N} | {T} | {med:.0f} | {p10:.0f} | {p90:.0f} |", flush=True)
                except Exception as e:  # report, do not hide (e.g. an unverified lowering)
                    msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
                    print(f"| {name} | {policy} | {N} | {T} | FAILED: {type(e).__name__}: {msg} | | |", flush=True)
                    break


if __name__ == "__main__":
    main()
