"""The bf16 LM head on XLA:CPU: XLA's dot (``jnp.matmul(x, w, preferred_element_type=f32)``, which
converts the whole bf16 matrix to fp32 before the product, every call) against the CPU kernel's
``layer_matmul`` reading the bf16 matrix in place (``lm_head(in_place=True)``), in one process,
calls interleaved; the Mixtral head's shape (hidden 2048, vocab 32000, 131 MB in bf16).

    python bench/lm_head_cpu.py [ROWS,ROWS,...] [ROUNDS]   # default: 1,16 5

Prints one JSON line: per form and row count, min / median ms per call, GB/s of the bf16 matrix,
and the largest error against numpy's fp32 product of the same bf16 values.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel

assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
D, V = 2048, 32000
ROWS = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,16").split(",")]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
w = (jax.random.normal(jax.random.key(0), (D, V)) * 0.02).astype(jnp.bfloat16)
forms = {
    "xla_dot": lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32),
    "kernel": lambda x, w: cpu_kernel.layer_matmul(x.astype(jnp.float32), w[None], 0),
}
res, fns = {}, {}
for m in ROWS:
    x = jax.random.normal(jax.random.key(m), (m, D)).astype(jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    for name, f in forms.items():
        fn = jax.jit(f)
        fns[f"{name}_M{m}"] = (fn, x)
        res[f"{name}_M{m}"] = {"max_err": float(np.abs(np.asarray(fn(x, w)) - want).max()), "ms": []}
for _ in range(ROUNDS):
    for key, (fn, x) in fns.items():
        t0 = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(fn(x, w))
        res[key]["ms"].append((time.perf_counter() - t0) / 3 * 1e3)
for v in res.values():
    ms = v.pop("ms")
    v["min_ms"], v["med_ms"] = round(min(ms), 2), round(float(np.median(ms)), 2)
    v["GBps"] = round(D * V * 2 / v["min_ms"] / 1e6, 1)
res["load"] = os.getloadavg()
print(json.dumps(res))
