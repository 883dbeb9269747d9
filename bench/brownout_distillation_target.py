"""United-expert distillation targets on the demo model (k = 2, index grouping, 300 Adam steps on the
hidden states of 8,192 training-part tokens), scored by held-out perplexity (first 1,024 tokens) under
partial brownout at thresholds 0 and 0.8:

- ``group``: eq. 4 on every token routed to the group, against every group expert's output;
- ``routed``: eq. 4 on each expert's own tokens (the (token, expert) pairs the router chose);
- ``routed_w``: the same pairs weighted by the router's combine weight (what ``jaxmoe unite`` does).

Usage: ``python bench/brownout_distillation_target.py STEPS VARIANT...`` (e.g. ``300 routed_w group``).
"""

import sys
import time
import os
import tempfile
import numpy as np
import jax
import jax.numpy as jnp
import optax
from jaxmoe.checkpoint.model import load_model
from jaxmoe.train import data
from jaxmoe.train.corpus import load_corpus
from jaxmoe.train.evaluate import perplexity
from jaxmoe.brownout.united import collect_moe_inputs, NAMES
from jaxmoe.models.common import swiglu_mlp
from jaxmoe.models.router import route

cfg, params, tok = load_model("demo", "float32")
cache = os.path.join(tempfile.gettempdir(), "jaxmoe-demo-moe-inputs.npz")
if not os.path.exists(cache):
    texts = [d.text for d in load_corpus("stdlib").train]
    stream = data.encode_documents(tok, texts[:: max(1, len(texts) // 64)])
    w = data.eval_windows(stream, 256)
    w = w[np.linspace(0, len(w) - 1, 32).astype(int)]
    t0 = time.time()
    inp = collect_moe_inputs(cfg, params, w)
    np.savez(cache, **{str(k): v for k, v in inp.items()})
    print("collect", time.time() - t0, flush=True)
inp = {int(k): v for k, v in np.load(cache).items()}
texts = [d.text for d in load_corpus("stdlib").heldout]
windows = data.eval_windows(data.encode_documents(tok, texts), 256, 1024)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
opt = optax.adam(3e-3)


def distil(moe, xs, variant):
    E = 8
    ways = 2
    x = jnp.asarray(xs)
    w = {k: jnp.asarray(moe[k]) for k in NAMES}
    ids, gw = route({k: v for k, v in moe.items() if k not in NAMES}, cfg.moe, x)
    ids, gw = np.asarray(ids), np.asarray(gw)
    outs = jax.vmap(lambda e: swiglu_mlp(jax.tree.map(lambda a: a[e], w), x))(jnp.arange(E))
    groups = np.arange(E) // ways
    res = {k: [] for k in NAMES}
    for g in range(4):
        members = np.flatnonzero(groups == g)
        if variant == "group":
            rows = np.flatnonzero(np.isin(ids, members).any(axis=1))
            xg, tgt = x[rows], outs[members][:, rows]
            lf = lambda p, xg=xg, tgt=tgt: jnp.mean((swiglu_mlp(p, xg)[None] - tgt) ** 2)
        else:
            r, c = np.nonzero(np.isin(ids, members))
            xg, tgt = x[r], outs[ids[r, c], r]
            wt = jnp.asarray(gw[r, c] if variant == "routed_w" else np.ones(len(r)), jnp.float32)
            lf = lambda p, xg=xg, tgt=tgt, wt=wt: (
                jnp.sum(wt[:, None] * (swiglu_mlp(p, xg) - tgt) ** 2) / (wt.sum() * tgt.shape[-1])
            )
        p = {k: w[k][members].mean(0) for k in NAMES}

        @jax.jit
        def up(p, s):
            l, gr = jax.value_and_grad(lf)(p)
            u, s = opt.update(gr, s, p)
            return optax.apply_updates(p, u), s, l

        s = opt.init(p)
        l0 = float(lf(p))
        for _ in range(steps):
            p, s, l = up(p, s)
        print(variant, g, "loss", l0, "->", float(lf(p)), flush=True)
        for k in NAMES:
            res[k].append(p[k])
    return {k: jnp.stack(v) for k, v in res.items()}, groups


t0 = time.time()
print("orig", perplexity(cfg, params, windows, False)["perplexity"], time.time() - t0, flush=True)
for variant in sys.argv[2:]:
    layers = list(params["layers"])
    for i, xs in inp.items():
        u, groups = distil(layers[i]["moe"], xs, variant)
        layers[i] = dict(layers[i], moe=dict(layers[i]["moe"], united=u, united_groups=jnp.asarray(groups, jnp.int32)))
    p2 = dict(params, layers=layers)
    for th in (0.0, 0.8):
        print(variant, steps, th, perplexity(cfg, p2, windows, False, brownout=(th, False))["perplexity"], flush=True)
