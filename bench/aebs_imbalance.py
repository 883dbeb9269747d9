"""AEBS activation imbalance (janus Fig. 11): max - min activated experts per instance.

Setting (Scaled-DS-1 of janus §5: 160 routed experts, top-8; expert width does
not affect the counts):
  * instances N in {8, 16}; 192 expert slots in total (160 primaries + 32
    redundant replicas), i.e. 24 slots/instance at N=8, 12 at N=16;
  * routing: Zipf(s=1.0) expert popularity over a fixed random permutation of
    the experts; each token draws top-8 distinct experts with probability
    proportional to popularity (Gumbel top-k);
  * placement (fixed per N, seeded): primaries dealt evenly over instances in
    a random order; the 32 most popular experts get one extra replica each, on
    the instance with the most free slots not yet hosting that expert;
  * batch (tokens per step) 16 .. 512; every trial draws fresh tokens.
Policies: "random" (each activated expert picks a replica uniformly, the
paper's Base), "aebs" (Algorithm 1), "aebs_plus". Reported: mean over trials
of (max - min) and of max activated experts per instance.

Run:  .venv/bin/python bench/aebs_imbalance.py [--trials 20] [--impl reference|kernel]
(``--impl kernel`` runs the Pallas kernel, interpreted on CPU; same numbers,
slower.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jax
import jax.numpy as jnp

from jaxmoe.pallas_kernels.aebs import schedule

E, K, TOTAL_SLOTS = 160, 8, 192
BATCHES = (16, 32, 64, 128, 256, 512)


def popularity(rng, s=1.0):
    p = np.empty(E)
    p[rng.permutation(E)] = 1.0 / np.arange(1, E + 1) ** s
    return p / p.sum()


def placement(rng, N, pop):
    slots_per = TOTAL_SLOTS // N
    inst_of_primary = rng.permutation(np.arange(E) % N)
    hosted = [set() for _ in range(N)]
    rt = -np.ones((E, 2), np.int64)
    ri = []
    for e in range(E):
        g = int(inst_of_primary[e])
        rt[e, 0] = len(ri)
        ri.append(g)
        hosted[g].add(e)
    free = [slots_per - len(h) for h in hosted]
    for e in np.argsort(-pop, kind="stable")[: TOTAL_SLOTS - E]:
        g = max((g for g in range(N) if e not in hosted[g] and free[g] > 0), key=lambda g: (free[g], -g))
        rt[e, 1] = len(ri)
        ri.append(g)
        hosted[g].add(e)
        free[g] -= 1
    return rt, np.asarray(ri, np.int64)


def tokens(rng, T, pop):
    gumbel = rng.gumbel(size=(T, E)) + np.log(pop)[None, :]
    return np.argsort(-gumbel, axis=1)[:, :K]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--impl", default="reference", choices=("reference", "kernel"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"# jax {jax.__version__}, backend {jax.default_backend()}, impl={args.impl}, trials={args.trials}")
    print(
        "| N | batch | random gap | aebs gap | aebs_plus gap | random max | aebs max "
        "| aebs_plus max | distinct experts |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    t0 = time.time()
    for N in (8, 16):
        rng = np.random.default_rng(args.seed + N)
        pop = popularity(rng)
        rt, ri = placement(rng, N, pop)
        rt_j, ri_j = jnp.asarray(rt, jnp.int32), jnp.asarray(ri, jnp.int32)
        for T in BATCHES:
            res = {p: ([], []) for p in ("random", "aebs", "aebs_plus")}
            distinct = []
            for trial in range(args.trials):
                ids = jnp.asarray(tokens(rng, T, pop), jnp.int32)
                distinct.append(len(np.unique(np.asarray(ids))))
                for pol in res:
                    _, load = schedule(ids, rt_j, ri_j, N, policy=pol, impl=args.impl, seed=1000 * trial + T)
                    load = np.asarray(load)
                    res[pol][0].append(load.max() - load.min())
                    res[pol][1].append(load.max())
            gaps = " | ".join(f"{np.mean(res[p][0]):.2f}" for p in res)
            maxes = " | ".join(f"{np.mean(res[p][1]):.2f}" for p in res)
            print(f"| {N} | {T} | {gaps} | {maxes} | {np.mean(distinct):.1f} |", flush=True)
    print(f"# {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
