"""The CPU expert kernel alone, bf16 panels against int8 panels, in one process, calls interleaved.

    python bench/int8_expert_kernel.py [F] [T,T,...] [ROUNDS]   # default: 5632 1 7

One layer of 8 experts (D 2048, F as given: the random Mixtral of ``bench/big_checkpoint.py``), 2
routed experts per token, the same int8 values in every form (bf16 holds them exactly): int8 panels,
bf16 panels widened in the tile, and, where the CPU has AVX512-BF16, bf16 panels in pairs (what the
model stores there). Prints one JSON line: min / median ms per layer call and int8's speed-up at each
batch size T over the bf16 form the model runs (``bf16_pairs`` where there is one, else ``bf16``).
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.expert_ffn.panels import to_panels, width_for
from jaxmoe.models.experts import LayerWeights
from jaxmoe.pallas_kernels.expert_ffn import expert_ffn
from jaxmoe.quantization import Quantized
from jaxmoe.models.common import pack16

E, D, F = 8, 2048, int(sys.argv[1]) if len(sys.argv) > 1 else 5632
T = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 7
rng = np.random.default_rng(0)
w = width_for(D, F)
q = {
    k: jnp.asarray(rng.integers(-127, 128, (1, E) + s, dtype=np.int8))
    for k, s in (("w_gate", (D, F)), ("w_up", (D, F)), ("w_down", (F, D)))
}
sc = {k: jnp.full((1, E, 1, v.shape[-1]), 0.01, jnp.float32) for k, v in q.items()}
forms = {
    "int8": {k: Quantized(to_panels(v, w), sc[k]) for k, v in q.items()},
    "bf16": {k: to_panels(pack16(v.astype(jnp.bfloat16)), w) for k, v in q.items()},
}
if cpu_kernel.has_bf16_dot():
    forms["bf16_pairs"] = {k: to_panels(pack16(v.astype(jnp.bfloat16)), w, pairs=True) for k, v in q.items()}
model_bf16 = "bf16_pairs" if "bf16_pairs" in forms else "bf16"
res = {f"{f}_T{t}": [] for f in forms for t in T}
fns = {}
for t in T:
    x = jax.random.normal(jax.random.key(1), (t, D), jnp.bfloat16)
    first = rng.integers(0, E, t)
    ids = jnp.asarray(np.stack([first, (first + 1 + rng.integers(0, E - 1, t)) % E], 1), jnp.int32)
    cw = jnp.full((t, 2), 0.5, jnp.float32)
    for f, p in forms.items():
        fn = jax.jit(lambda x, p: expert_ffn(x, ids, cw, LayerWeights(p, jnp.int32(0)), impl="cpu_kernel"))
        jax.block_until_ready(fn(x, p))
        fns[f"{f}_T{t}"] = (fn, x, p)
print("panel width", w, "kernel library:", cpu_kernel.LIBRARY.origin(), flush=True)
for _ in range(reps):
    for k, (fn, x, p) in fns.items():
        t0 = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(fn(x, p))
        res[k].append((time.perf_counter() - t0) / 5 * 1e3)
out = {k: {"min_ms": round(min(v), 2), "med_ms": round(float(np.median(v)), 2)} for k, v in res.items()}
for t in T:
    for stat in ("min", "med"):
        out[f"int8_speedup_T{t}_{stat}"] = round(
            out[f"{model_bf16}_T{t}"][f"{stat}_ms"] / out[f"int8_T{t}"][f"{stat}_ms"], 3
        )
out["int8_speedup_over"] = model_bf16
out["load"] = os.getloadavg()
print(json.dumps(out))
