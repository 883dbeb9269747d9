"""Expert placement (JANUS 3.4): activated experts per instance under AEBS, by placement.

Setting (janus Scaled-DS-1 sizes: 160 routed experts, top-8, 8 instances x 24 slots = 192):
  * routing with both patterns of janus 3.4: skewed popularity (Zipf s over a random permutation)
    and co-activation (experts in random groups of 8; a token picks a group by its popularity and
    draws ``--in-group`` of its 8 experts from that group, the rest by popularity, Gumbel top-k);
  * a calibration window (``--window`` tokens) gives counts and co-activations; placements are
    evaluated on fresh tokens (``--trials`` batches per size), AEBS (Algorithm 1) choosing replicas.
Placements compared:
  round_robin   ``replicas.default_placement`` without statistics (spare slots cycle experts);
  replicated    ``default_placement`` with the window's counts (hot experts replicated,
                positions still round-robin);
  algorithm2    ``placement.plan_placement``: the same replication, Algorithm 2 positions.
Reported per batch size: mean over trials of the max activated replicas per instance (what AEBS
balances, the MoE-layer latency proxy of janus) and of the max co-activation load I(g).

Run:  python bench/placement.py [--trials 20] [--window 4096]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from jaxmoe.janus.placement import coactivation, coactivation_load, plan_placement
from jaxmoe.runtime.replicas import ReplicaLayout, default_placement
from jaxmoe.pallas_kernels.aebs import schedule

E, K, N, C, GROUP = 160, 8, 8, 24, 8


def make_router(rng, zipf: float):
    pop = np.empty(E)
    pop[rng.permutation(E)] = 1.0 / np.arange(1, E + 1) ** zipf
    pop /= pop.sum()
    groups = rng.permutation(E).reshape(-1, GROUP)
    group_pop = pop[groups].sum(1) / pop.sum()
    return pop, groups, group_pop


def draw(rng, router, tokens: int, in_group: int) -> np.ndarray:
    """[tokens, K] distinct expert ids."""
    pop, groups, group_pop = router
    out = np.empty((tokens, K), np.int32)
    gumbel = lambda n: -np.log(-np.log(rng.random(n)))  # noqa: E731
    for t in range(tokens):
        g = groups[rng.choice(len(groups), p=group_pop)]
        inside = g[np.argsort(-(np.log(pop[g]) + gumbel(GROUP)))[:in_group]]
        score = np.log(pop) + gumbel(E)
        score[inside] = -np.inf
        out[t] = np.concatenate([inside, np.argsort(-score)[: K - in_group]])
    return out


def evaluate(layout: ReplicaLayout, ids_batches, a_test) -> tuple[float, float]:
    table, inst = layout.replica_table(), layout.replica_instance()
    peaks = [int(np.max(schedule(ids, table, inst, N, policy="aebs", impl="reference")[1])) for ids in ids_batches]
    return float(np.mean(peaks)), max(coactivation_load(layout.slot_to_expert, a_test, C))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--window", type=int, default=4096, help="calibration tokens")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--in-group", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    router = make_router(rng, args.zipf)
    calib = draw(rng, router, args.window, args.in_group)
    counts, a = np.bincount(calib.reshape(-1), minlength=E), coactivation(calib, E)
    t0 = time.perf_counter()
    layouts = {
        "round_robin": default_placement(E, N, C),
        "replicated": default_placement(E, N, C, counts=counts),
        "algorithm2": plan_placement(counts, a, N, C),
    }
    plan_s = time.perf_counter() - t0
    layouts = {k: ReplicaLayout(tuple(v), E, N, C) for k, v in layouts.items()}
    print(
        f"# {platform.node()} {time.strftime('%Y-%m-%d')}  E={E} top-{K} N={N} C={C} zipf={args.zipf} "
        f"in_group={args.in_group} window={args.window} trials={args.trials}; planning took {plan_s:.2f} s"
    )
    print("| batch | placement | max activated / instance | max I(g) (test tokens) |")
    print("|---|---|---|---|")
    for B in (int(b) for b in args.batches.split(",")):
        batches = [draw(rng, router, B, args.in_group) for _ in range(args.trials)]
        a_test = coactivation(np.concatenate(batches), E)
        base = None
        for name, layout in layouts.items():
            peak, load = evaluate(layout, batches, a_test)
            base = base or peak
            print(f"| {B} | {name} | {peak:.2f} ({peak / base:.2f}x) | {load:.0f} |")


if __name__ == "__main__":
    main()
