"""GQA paged attention on XLA:CPU: the C++ kernel that reads the stacked KV cache in place
(``pallas_kernels/paged_attention``, what the monolithic scan runs with the CPU kernels) against the
model's XLA form (``models.attention.gqa_xla``: keys gathered 128 at a time, online softmax) and the
plain jnp reference, at the attention shapes of the 107 M checkpoint (8 query / 2 KV heads of
64, blocks of 16 tokens).

One jitted program scans the attention core over 8 layers of a stacked cache, the way the monolithic
executor does. For each case (rows x query tokens at a context) and dtype, the variants run in one
process, interleaved, ``--repeats`` times each; the table gives the medians and the speed-up of the
kernel over the XLA form. Attention projections, the KV write and RoPE are not in it (they are the
same either way).

    PYTHONPATH=. python bench/paged_attention_cpu.py
    PYTHONPATH=. python bench/paged_attention_cpu.py --cases 16x1@100 --dtypes float32 --repeats 50
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.models.attention import AttentionBatch, gqa_kernel, gqa_xla
from jaxmoe.models.common import pack16
from jaxmoe.pallas_kernels.paged_attention import cpu_kernel, paged_attention_reference

L, H, KVH, HD, BLOCK = 8, 8, 2, 64, 16
CASES = "1x1@100,16x1@40,16x1@150,64x1@300,1x256@0,4x256@0"


def reference(q, cache, layer, batch, block_size, scale, dtype):
    return paged_attention_reference(
        q, cache["k"], cache["v"], layer, batch.block_tables, batch.positions, block_size=block_size, scale=scale,
        dtype=dtype,
    )  # fmt: skip


VARIANTS = {"xla": gqa_xla, "kernel": gqa_kernel, "reference": reference}


def program(attend, dtype):
    @jax.jit
    def run(q, cache, batch):
        def body(acc, layer):
            return acc + attend(q, cache, layer, batch, BLOCK, HD**-0.5, dtype), None

        return jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), jnp.arange(L))[0]

    return run


def measure(B: int, T: int, ctx: int, dtype, repeats: int) -> dict:
    NB = (ctx + T) // BLOCK + 1
    slots = B * NB * BLOCK
    keys = jax.random.split(jax.random.PRNGKey(B * 1000 + T), 3)
    cache = {n: pack16(jax.random.normal(k, (L, slots, KVH, HD)).astype(dtype)) for n, k in zip("kv", keys)}
    q = jax.random.normal(keys[2], (B, T, H, HD)).astype(dtype)
    tables = np.arange(B * NB, dtype=np.int32).reshape(B, NB)
    positions = np.broadcast_to(ctx + np.arange(T, dtype=np.int32), (B, T)).copy()
    batch = AttentionBatch(jnp.asarray(positions), jnp.asarray(positions), jnp.asarray(tables))
    runs = {name: program(fn, dtype) for name, fn in VARIANTS.items()}
    outs = {name: run(q, cache, batch).block_until_ready() for name, run in runs.items()}
    error = float(jnp.max(jnp.abs(outs["kernel"] - outs["reference"])))
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run(q, cache, batch).block_until_ready()
            times[name].append(time.perf_counter() - t)
    return {"ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}, "error": error}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="rows x query tokens @ context, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not cpu_kernel.available():
        raise SystemExit(f"the paged-attention kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    print(
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, jax {jax.__version__}; "
        f"{L} layers, {H} / {KVH} heads of {HD}, blocks of {BLOCK}; median of {args.repeats}, interleaved\n"
    )
    print(
        "| dtype | rows x tokens @ context | XLA form ms | kernel ms | reference ms | kernel vs XLA | max abs diff vs reference |"
    )
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for case in args.cases.split(","):
            shape, ctx = case.split("@")
            B, T = (int(n) for n in shape.split("x"))
            r = measure(B, T, int(ctx), jnp.dtype(dtype), args.repeats)
            ms = r["ms"]
            print(
                f"| {dtype} | {case} | {ms['xla']:.3f} | {ms['kernel']:.3f} | {ms['reference']:.3f} "
                f"| {ms['xla'] / ms['kernel']:.2f}x | {r['error']:.1e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
