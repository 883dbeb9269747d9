"""AEBS references: numpy reading of janus Algorithm 1, aebs_plus, and jnp versions.

* ``aebs_numpy``      -- janus §3.3 Algorithm 1, line by line (ground truth).
* ``aebs_plus_numpy`` -- the improved policy, same output contract (ground truth
  for the kernel's ``aebs_plus``).
* ``aebs_jnp``        -- Algorithm 1 in plain jnp (jittable; the "reference" impl
  under ``jax.jit`` and the CPU overhead baseline).
* ``random_jnp``      -- Fig. 11 baseline: each activated expert picks one of its
  replicas uniformly at random.

Common contract. Inputs: ``topk_ids`` [T, k] logical ids (-1 = empty slot; any
id outside [0, E) is treated as empty), ``replica_table`` [E, R_max] physical
slot ids (-1 padded), ``replica_instance`` [S] instance of each slot (in
[0, N)), ``num_instances`` N. Outputs: ``physical_ids`` [T, k] int32 (-1 where
the slot is empty, or where an activated expert has no replica at all) and
``activated_per_instance`` [N] int32 = distinct activated replicas per instance.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax


# --------------------------------------------------------------------------
# Shared helpers for the numpy references (the paper's R, G and P).


def _replicas(replica_table, e):
    return [int(p) for p in replica_table[e] if p >= 0]


def _P(replica_table, replica_instance, e, g):
    """P(e, g): physical replica of e on instance g (lowest id if several)."""
    return min(p for p in _replicas(replica_table, e) if replica_instance[p] == g)


def _G(replica_table, replica_instance, e):
    """G(e): sorted set of instances hosting a replica of e."""
    return sorted({int(replica_instance[p]) for p in _replicas(replica_table, e)})


def _remap(L, activated_replica):
    """Lines 14-17: O(i, j) <- activated_replica[L(i, j)] (-1 stays -1)."""
    O = np.full(L.shape, -1, np.int32)
    for i in range(L.shape[0]):
        for j in range(L.shape[1]):
            if L[i, j] in activated_replica:
                O[i, j] = activated_replica[L[i, j]]
    return O


def _clean(topk_ids, replica_table, replica_instance):
    L = np.asarray(topk_ids, np.int64)
    rt = np.asarray(replica_table, np.int64)
    ri = np.asarray(replica_instance, np.int64)
    E = rt.shape[0]
    L = np.where((L >= 0) & (L < E), L, -1)
    return L, rt, ri


# --------------------------------------------------------------------------
# Algorithm 1.


def aebs_numpy(topk_ids, replica_table, replica_instance, num_instances):
    L, rt, ri = _clean(topk_ids, replica_table, replica_instance)
    N = num_instances
    # Line 1: E <- union over tokens i and slots j of {L(i, j)}.
    activated = sorted({int(e) for e in L.ravel() if e >= 0})
    R = {e: len(_replicas(rt, e)) for e in activated}
    # Line 2: activated_replica[e] <- -1 for all e in E.
    activated_replica = {e: -1 for e in activated}
    # Line 3: load[g] <- 0 for all instances g.
    load = [0] * N
    # Lines 4-8: single-replica experts go to their unique instance.
    for e in activated:  # ascending logical id
        if R[e] == 1:
            (g,) = _G(rt, ri, e)  # line 6
            activated_replica[e] = _P(rt, ri, e, g)  # line 7
            load[g] += 1  # line 8
    # Lines 9-13: multi-replica experts go to the least-loaded hosting instance.
    for e in activated:  # ascending logical id
        if R[e] > 1:
            g_star = min(_G(rt, ri, e), key=lambda g: (load[g], g))  # line 11, ties->lowest g
            activated_replica[e] = _P(rt, ri, e, g_star)  # line 12
            load[g_star] += 1  # line 13
    # Lines 14-17.
    return _remap(L, activated_replica), np.asarray(load, np.int32)


# --------------------------------------------------------------------------
# aebs_plus: most-constrained-first greedy + cost-reducing paths, never worse.


def _forward_bfs(u, cur, cands, N):
    """Layered BFS from u; parent[h] = lowest-id expert on the previous layer
    that has a replica on h."""
    reached, parent, front = {u}, {}, {u}
    for _ in range(N - 1):
        on_front = sorted(e for e, g in cur.items() if g in front)
        new = set()
        for h in range(N):
            if h in reached:
                continue
            es = [e for e in on_front if h in cands[e]]
            if es:
                reached.add(h), new.add(h)
                parent[h] = es[0]
        front = new
    return reached, parent


def _backward_bfs(w, cur, cands, N):
    """Layered BFS of instances that can push an expert towards w; for h:
    parent[h] = (lowest-id expert on h with a replica on the previous layer,
    lowest-id previous-layer instance hosting it)."""
    reached, parent, front = {w}, {}, {w}
    for _ in range(N - 1):
        fmin = {e: min(g for g in cands[e] if g in front) for e in cur if any(g in front for g in cands[e])}
        new = set()
        for h in range(N):
            if h in reached:
                continue
            es = sorted(e for e, g in cur.items() if g == h and e in fmin)
            if es:
                reached.add(h), new.add(h)
                parent[h] = (es[0], fmin[es[0]])
        front = new
    return reached, parent


def _improve(cur, cands, load, N, max_moves):
    """Apply up to max_moves cost-reducing paths in place; returns the number
    of (forward, backward) moves made."""
    moves = [0, 0]
    for _ in range(max_moves):
        lmax = max(load)
        u = load.index(lmax)
        reached, parent = _forward_bfs(u, cur, cands, N)
        others = [h for h in sorted(reached) if h != u]
        if others:
            v = min(others, key=lambda h: (load[h], h))
            if load[v] <= lmax - 2:
                h = v
                while h != u:
                    e = parent[h]
                    g = cur[e]
                    cur[e] = h
                    h = g
                load[u] -= 1
                load[v] += 1
                moves[0] += 1
                continue
        lmin = min(load)
        w = load.index(lmin)
        reached, parent = _backward_bfs(w, cur, cands, N)
        others = [h for h in sorted(reached) if h != w]
        if others:
            x = min(others, key=lambda h: (-load[h], h))
            if load[x] >= lmin + 2:
                h = x
                while h != w:
                    e, f = parent[h]
                    cur[e] = f
                    h = f
                load[x] -= 1
                load[w] += 1
                moves[1] += 1
                continue
        break
    return tuple(moves)


def aebs_plus_numpy(
    topk_ids, replica_table, replica_instance, num_instances, max_moves=None, compare_with_alg1=True, stats=None
):
    """Improved AEBS. Never a larger max load than Algorithm 1 on the same input.

    1. Most-constrained first: experts hosted on one instance, then by ascending
       number of hosting instances (ascending logical id within a class), each
       to its least-loaded hosting instance (Algorithm 1's argmin rule).
    2. Up to ``max_moves`` (default 4N) cost-reducing-path moves: from the
       max-loaded instance u (lowest id) to the least-loaded instance v reachable
       by a chain "an expert on g also has a replica on h" if load[v] <= load[u]-2;
       else from the highest-loaded instance able to push a chain into the
       least-loaded instance w if that gains >= 2. Each move shifts one unit of
       load and never raises the max; without moves left, the max and the min are
       optimal (semi-matching optimality, Harvey et al. 2003).
    3. Return it only if (max, -min) is lexicographically smaller than Algorithm
       1's, otherwise return Algorithm 1's result (``compare_with_alg1=False``
       skips this, for tests). ``stats`` (a dict) receives the move counts.
    """
    L, rt, ri = _clean(topk_ids, replica_table, replica_instance)
    N = num_instances
    max_moves = 4 * N if max_moves is None else max_moves
    O_a, load_a = aebs_numpy(L, rt, ri, N)
    activated = sorted({int(e) for e in L.ravel() if e >= 0})
    cands = {e: set(_G(rt, ri, e)) for e in activated if _replicas(rt, e)}
    cur, load = {}, [0] * N
    for e in activated:
        if e in cands and len(cands[e]) == 1:
            (cur[e],) = cands[e]
            load[cur[e]] += 1
    for d in range(2, rt.shape[1] + 1):
        for e in activated:
            if e in cands and len(cands[e]) == d:
                cur[e] = min(cands[e], key=lambda g: (load[g], g))
                load[cur[e]] += 1
    moves = _improve(cur, cands, load, N, max_moves)
    if stats is not None:
        stats["forward_moves"], stats["backward_moves"] = moves
    max_a, min_a = int(load_a.max()), int(load_a.min())
    if not compare_with_alg1 or (max(load), -min(load)) < (max_a, -min_a):
        rep = {e: _P(rt, ri, e, g) for e, g in cur.items()}
        return _remap(L, rep), np.asarray(load, np.int32)
    return O_a, load_a


# --------------------------------------------------------------------------
# jnp versions (jittable).


def aebs_jnp(topk_ids, replica_table, replica_instance, num_instances):
    """Algorithm 1 in jnp: vectorised lines 1 and 14-17, fori_loop for 5-13."""
    E, R = replica_table.shape
    N = num_instances
    L = jnp.asarray(topk_ids, jnp.int32)
    L = jnp.where((L >= 0) & (L < E), L, -1)
    rt = jnp.asarray(replica_table, jnp.int32)
    it = jnp.where(rt >= 0, jnp.asarray(replica_instance, jnp.int32)[jnp.maximum(rt, 0)], -1)
    # Line 1 (parallel over tokens).
    act = jnp.zeros((E + 1,), bool).at[jnp.where(L >= 0, L, E).ravel()].set(True)[:E]
    nrep = jnp.sum(rt >= 0, axis=1)

    def assign(e, state, want_single):
        rep, load = state
        ok = rt[e] >= 0
        big = 1 << 30
        # Lines 6/11: least-loaded hosting instance, lowest instance id among
        # equals, lowest physical id on it (line 7/12's P(e, g)).
        l = jnp.where(ok, load[jnp.maximum(it[e], 0)], big)
        g = jnp.min(jnp.where(ok & (l == jnp.min(l)), it[e], big))
        p = jnp.min(jnp.where(ok & (it[e] == g), rt[e], big))
        take = act[e] & ((nrep[e] == 1) if want_single else (nrep[e] > 1))
        rep = rep.at[e].set(jnp.where(take, p, rep[e]))
        load = load.at[jnp.where(take, g, N)].add(1, mode="drop")
        return rep, load

    state = (jnp.full((E,), -1, jnp.int32), jnp.zeros((N,), jnp.int32))
    state = lax.fori_loop(0, E, lambda e, s: assign(e, s, True), state)  # lines 5-8
    rep, load = lax.fori_loop(0, E, lambda e, s: assign(e, s, False), state)  # 10-13
    O = jnp.where(L >= 0, rep[jnp.maximum(L, 0)], -1)  # 15-17
    return O.astype(jnp.int32), load


def random_jnp(topk_ids, replica_table, replica_instance, num_instances, key):
    """Baseline: every activated expert serves all its tokens from one replica
    chosen uniformly at random (``key``: a PRNG key or an int seed)."""
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
        key = jax.random.key(key)
    E, R = replica_table.shape
    L = jnp.asarray(topk_ids, jnp.int32)
    L = jnp.where((L >= 0) & (L < E), L, -1)
    rt = jnp.asarray(replica_table, jnp.int32)
    ri = jnp.asarray(replica_instance, jnp.int32)
    nrep = jnp.sum(rt >= 0, axis=1)
    # Rank of each valid entry among its row's valid entries (robust to holes).
    rank = jnp.cumsum(rt >= 0, axis=1) - 1
    pick = jnp.floor(jax.random.uniform(key, (E,)) * nrep).astype(jnp.int32)
    sel = (rt >= 0) & (rank == pick[:, None])
    rep = jnp.max(jnp.where(sel, rt, -1), axis=1)
    act = jnp.zeros((E + 1,), bool).at[jnp.where(L >= 0, L, E).ravel()].set(True)[:E]
    inst = jnp.where(act & (rep >= 0), ri[jnp.maximum(rep, 0)], num_instances)
    load = jnp.zeros((num_instances + 1,), jnp.int32).at[inst].add(1)[:num_instances]
    O = jnp.where(L >= 0, rep[jnp.maximum(L, 0)], -1)
    return O.astype(jnp.int32), load
