"""AEBS Pallas kernel: janus Algorithm 1 ("aebs") and the improved "aebs_plus".

One kernel body, three ways to run it (``backends.build``, chosen by ``jaxmoe.pallas_kernels.aebs.api``):

* CPU / anywhere: ``pl.pallas_call(..., interpret=True)`` -- verified by tests.
* NVIDIA GPU: ``plgpu.kernel`` (Mosaic GPU, one warpgroup; inputs/outputs in
  GMEM, replica tables and workspace in SMEM).
  The body only uses ops with Lane-semantics lowering rules (1-D strided
  vectors of a multiple of 128 elements, whole-vector reductions, scalar
  loads/stores at dynamic indices, ``fori_loop``/``while_loop``/``pl.when``).
  Lowering to the Mosaic GPU MLIR module is checked on CPU by the tests
  (cross-platform lowering); compiled and run on an H200 (jax 0.11.2) by the
  ``gpu``-marked test, equal to the reference (bench/results/2026-11-28-h200.md).
* TPU: not this body (scalar and vector access to the same refs, which Mosaic TPU does not
  take): ``kernel_tpu.py`` is Algorithm 1 on the scalar core, every array in SMEM.

Data layout (prepared by ``api._prepare``; all int32):
  ids   [TKp]       flattened top-k logical ids, -1 = empty slot, padded with -1
  rt    [R, W]      replica_table transposed: rt[r, e] = r-th physical id of e
  it    [R, W]      instance of rt[r, e] (-1 where rt is -1)
  iota  [W]         0..W-1
outputs:
  phys  [TKp]       physical replica per (token, slot), -1 where ids is -1
  loads [W]         activated replicas per instance (entries >= N are 0)
  ws    [NROWS, W]  workspace (rows below): an extra, dropped output when
                    interpreted, SMEM scratch on Mosaic GPU
W = round_up(max(E, N), 128), TKp = round_up(T*k, 128).
"""

from __future__ import annotations


import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BIG = 1 << 30

# Workspace rows.
ACT, NREP, DEG, REP_A, CUR_A, LOAD_A, REP_B, CUR_B, LOAD_B = range(9)
REACHED, FRONT, NEWF, PAR_E, PAR_F, FMIN, FLAG, ONF = range(9, 17)
NROWS = 24  # 17 used, rounded up to a multiple of 8


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def _lowest_replica_on(rt_ref, it_ref, e, g, R):
    """Lowest physical id of expert ``e`` on instance ``g`` (BIG if none)."""
    best = _i32(BIG)
    for r in range(R):
        p = rt_ref[r, e]
        best = jnp.where((it_ref[r, e] == g) & (p >= 0), jnp.minimum(best, p), best)
    return best


def _greedy_one(ws_ref, rt_ref, it_ref, e, R, rep_row, cur_row, load_row):
    """Algorithm 1 lines 11-13 for one expert: least-loaded hosting instance.

    Lexicographic minimum of (load[g], g, p) over the replicas p of ``e``: the
    least-loaded instance, the lowest instance id among equals, and the lowest
    physical id among several replicas on that instance.
    """
    bl, bg, bp = _i32(BIG), _i32(BIG), _i32(BIG)
    for r in range(R):
        p = rt_ref[r, e]
        g = it_ref[r, e]
        ok = p >= 0
        l = jnp.where(ok, ws_ref[load_row, jnp.maximum(g, 0)], BIG)
        better = ok & ((l < bl) | ((l == bl) & ((g < bg) | ((g == bg) & (p < bp)))))
        bl = jnp.where(better, l, bl)
        bg = jnp.where(better, g, bg)
        bp = jnp.where(better, p, bp)
    ws_ref[load_row, bg] = ws_ref[load_row, bg] + 1
    ws_ref[rep_row, e] = bp
    ws_ref[cur_row, e] = bg


def _count_per_instance(ws_ref, cur, load_row, N, W):
    """loads[g] = #{e : cur[e] == g} (vectorised over experts)."""
    ws_ref[load_row, :] = cur * 0

    def body(g, c):
        ws_ref[load_row, g] = jnp.sum(jnp.where(cur == g, 1, 0))
        return c

    lax.fori_loop(0, N, body, 0)


def _argmin_masked(vals, mask, iota):
    """(min value, lowest index attaining it) of vals[mask]; (BIG, BIG) if empty."""
    m = jnp.min(jnp.where(mask, vals, BIG))
    return m, jnp.min(jnp.where(mask & (vals == m), iota, BIG))


def _argmax_masked(vals, mask, iota):
    m = jnp.max(jnp.where(mask, vals, -BIG))
    return m, jnp.min(jnp.where(mask & (vals == m), iota, BIG))


def _forward_bfs(ws_ref, it_rows, iota, u, N, W):
    """Layered BFS over instances from ``u`` along "an expert on g has a replica on h".

    PAR_E[h] = lowest-id expert (on a previous-layer instance) used to reach h.
    """
    zeros = iota * 0
    ws_ref[REACHED, :] = jnp.where(iota == u, 1, 0)
    ws_ref[FRONT, :] = jnp.where(iota == u, 1, 0)
    ws_ref[NEWF, :] = zeros
    ws_ref[PAR_E, :] = iota * 0 - 1

    def round_(_, c):
        cur = ws_ref[CUR_B, :]

        ws_ref[ONF, :] = zeros

        def on_front(g, c2):  # ONF[e] = FRONT[cur[e]] (a gather, as N selects)
            ws_ref[ONF, :] = jnp.where((cur == g) & (ws_ref[FRONT, g] == 1), 1, ws_ref[ONF, :])
            return c2

        lax.fori_loop(0, N, on_front, 0)
        onf = ws_ref[ONF, :]

        def visit(h, c2):
            hits = onf == 1
            has = zeros == 1
            for row in it_rows:
                has = has | (row == h)
            e_star = jnp.min(jnp.where(hits & has, iota, BIG))

            @pl.when((ws_ref[REACHED, h] == 0) & (e_star < BIG))
            def _():
                ws_ref[REACHED, h] = 1
                ws_ref[NEWF, h] = 1
                ws_ref[PAR_E, h] = e_star

            return c2

        lax.fori_loop(0, N, visit, 0)
        ws_ref[FRONT, :] = ws_ref[NEWF, :]
        ws_ref[NEWF, :] = zeros
        return c

    lax.fori_loop(0, N - 1, round_, 0)


def _backward_bfs(ws_ref, it_rows, rt_rows, iota, w, N, W):
    """Layered BFS over instances that can push one expert towards ``w``.

    For a newly reached h: PAR_E[h] = lowest-id expert on h having a replica on
    the previous layer, PAR_F[h] = lowest-id previous-layer instance hosting it.
    """
    zeros = iota * 0
    ws_ref[REACHED, :] = jnp.where(iota == w, 1, 0)
    ws_ref[FRONT, :] = jnp.where(iota == w, 1, 0)
    ws_ref[NEWF, :] = zeros
    ws_ref[PAR_E, :] = iota * 0 - 1
    ws_ref[PAR_F, :] = iota * 0 - 1

    def round_(_, c):
        ws_ref[FMIN, :] = iota * 0 + BIG

        def fmin_body(g, c2):  # FMIN[e] = lowest frontier instance hosting e
            has = zeros == 1
            for row_i, row_p in zip(it_rows, rt_rows):
                has = has | ((row_i == g) & (row_p >= 0))
            acc = ws_ref[FMIN, :]
            ws_ref[FMIN, :] = jnp.where(has & (ws_ref[FRONT, g] == 1), jnp.minimum(acc, g), acc)
            return c2

        lax.fori_loop(0, N, fmin_body, 0)

        def visit(h, c2):
            cand = (ws_ref[ACT, :] == 1) & (ws_ref[CUR_B, :] == h) & (ws_ref[FMIN, :] < BIG)
            e_star = jnp.min(jnp.where(cand, iota, BIG))

            @pl.when((ws_ref[REACHED, h] == 0) & (e_star < BIG))
            def _():
                ws_ref[REACHED, h] = 1
                ws_ref[NEWF, h] = 1
                ws_ref[PAR_E, h] = e_star
                ws_ref[PAR_F, h] = ws_ref[FMIN, e_star]

            return c2

        lax.fori_loop(0, N, visit, 0)
        ws_ref[FRONT, :] = ws_ref[NEWF, :]
        ws_ref[NEWF, :] = zeros
        return c

    lax.fori_loop(0, N - 1, round_, 0)


def _move(ws_ref, rt_ref, it_ref, e, h, R):
    ws_ref[REP_B, e] = _lowest_replica_on(rt_ref, it_ref, e, h, R)
    ws_ref[CUR_B, e] = h


def _improve_step(ws_ref, rt_ref, it_ref, it_rows, rt_rows, iota, N, W, R):
    """One cost-reducing-path move (aebs_plus); sets ws[FLAG, 0] = 1 if it moved."""
    ok = iota < N
    ws_ref[FLAG, 0] = 0
    lb = ws_ref[LOAD_B, :]
    lmax, u = _argmax_masked(lb, ok, iota)
    _forward_bfs(ws_ref, it_rows, iota, u, N, W)
    lb = ws_ref[LOAD_B, :]
    lv, v = _argmin_masked(lb, ok & (ws_ref[REACHED, :] == 1) & (iota != u), iota)

    @pl.when(lv <= lmax - 2)
    def _forward():
        # Walk back from v to u: the expert that reached h moves onto h.
        def step(_, h):
            e = ws_ref[PAR_E, jnp.maximum(h, 0)]
            active = h != u
            g = ws_ref[CUR_B, jnp.maximum(e, 0)]

            @pl.when(active)
            def _():
                _move(ws_ref, rt_ref, it_ref, e, h, R)

            return jnp.where(active, g, h)

        lax.fori_loop(0, N, step, v)
        ws_ref[LOAD_B, u] = ws_ref[LOAD_B, u] - 1
        ws_ref[LOAD_B, v] = ws_ref[LOAD_B, v] + 1
        ws_ref[FLAG, 0] = 1

    @pl.when(ws_ref[FLAG, 0] == 0)
    def _backward():
        lb2 = ws_ref[LOAD_B, :]
        lmin, w = _argmin_masked(lb2, ok, iota)
        _backward_bfs(ws_ref, it_rows, rt_rows, iota, w, N, W)
        lb3 = ws_ref[LOAD_B, :]
        lx, x = _argmax_masked(lb3, ok & (ws_ref[REACHED, :] == 1) & (iota != w), iota)

        @pl.when(lx >= lmin + 2)
        def _push():
            def step(_, h):
                active = h != w
                hh = jnp.maximum(h, 0)
                e = ws_ref[PAR_E, hh]
                f = ws_ref[PAR_F, hh]

                @pl.when(active)
                def _():
                    _move(ws_ref, rt_ref, it_ref, e, f, R)

                return jnp.where(active, f, h)

            lax.fori_loop(0, N, step, x)
            ws_ref[LOAD_B, x] = ws_ref[LOAD_B, x] - 1
            ws_ref[LOAD_B, w] = ws_ref[LOAD_B, w] + 1
            ws_ref[FLAG, 0] = 1


def aebs_kernel_body(
    ids_ref,
    rt_ref,
    it_ref,
    iota_ref,
    phys_ref,
    loads_ref,
    ws_ref,
    *,
    num_experts,
    num_instances,
    num_replicas,
    policy,
    max_moves,
    compare_with_alg1=True,
):
    E, N, R = num_experts, num_instances, num_replicas
    W = ws_ref.shape[1]
    # iota comes in as an input: a loaded vector has a known (strided) layout on
    # Mosaic GPU, unlike lax.iota / jnp.zeros created inside the kernel.
    iota = iota_ref[...]
    ids = ids_ref[...]
    rt_rows = [rt_ref[r, :] for r in range(R)]
    it_rows = [it_ref[r, :] for r in range(R)]

    # ---- Step 1 (line 1): collect activated experts, vectorised over tokens.
    ws_ref[ACT, :] = iota * 0

    def collect(e, c):
        ws_ref[ACT, e] = jnp.max(jnp.where(ids == e, 1, 0))
        return c

    lax.fori_loop(0, E, collect, 0)
    act = ws_ref[ACT, :] == 1

    # R(e) = number of replicas; DEG(e) = number of distinct hosting instances.
    nrep = iota * 0
    deg = iota * 0
    for r in range(R):
        valid = rt_rows[r] >= 0
        nrep = nrep + jnp.where(valid, 1, 0)
        fresh = valid
        for q in range(r):
            fresh = fresh & ~((rt_rows[q] >= 0) & (it_rows[q] == it_rows[r]))
        deg = deg + jnp.where(fresh, 1, 0)
    ws_ref[NREP, :] = nrep
    ws_ref[DEG, :] = deg
    p_max = rt_rows[0]
    i_max = it_rows[0]
    p_min = jnp.where(rt_rows[0] >= 0, rt_rows[0], BIG)
    for r in range(1, R):
        p_max = jnp.maximum(p_max, rt_rows[r])
        i_max = jnp.maximum(i_max, it_rows[r])
        p_min = jnp.minimum(p_min, jnp.where(rt_rows[r] >= 0, rt_rows[r], BIG))

    # ---- Step 2, Algorithm 1 lines 2-8: single-replica experts (order-free, so
    # vectorised): the unique replica, +1 on its instance.
    single = act & (nrep == 1)
    ws_ref[REP_A, :] = jnp.where(single, p_max, -1)
    ws_ref[CUR_A, :] = jnp.where(single, i_max, -1)
    _count_per_instance(ws_ref, ws_ref[CUR_A, :], LOAD_A, N, W)

    # Lines 10-13: multi-replica experts, ascending logical id, sequential.
    def multi(e, c):
        @pl.when((ws_ref[ACT, e] == 1) & (ws_ref[NREP, e] > 1))
        def _():
            _greedy_one(ws_ref, rt_ref, it_ref, e, R, REP_A, CUR_A, LOAD_A)

        return c

    lax.fori_loop(0, E, multi, 0)
    rep_row, load_row = REP_A, LOAD_A

    if policy == "aebs_plus":
        # Most-constrained first: experts with one hosting instance (lowest
        # physical id there), then by ascending number of hosting instances.
        one = act & (deg == 1)
        ws_ref[REP_B, :] = jnp.where(one, p_min, -1)
        ws_ref[CUR_B, :] = jnp.where(one, i_max, -1)
        _count_per_instance(ws_ref, ws_ref[CUR_B, :], LOAD_B, N, W)
        for d in range(2, R + 1):

            def by_deg(e, c, d=d):
                @pl.when((ws_ref[ACT, e] == 1) & (ws_ref[DEG, e] == d))
                def _():
                    _greedy_one(ws_ref, rt_ref, it_ref, e, R, REP_B, CUR_B, LOAD_B)

                return c

            lax.fori_loop(0, E, by_deg, 0)

        # Bounded local improvement by cost-reducing paths.
        def cond(state):
            it, moved = state
            return (it < max_moves) & (moved == 1)

        def body(state):
            it, _ = state
            _improve_step(ws_ref, rt_ref, it_ref, it_rows, rt_rows, iota, N, W, R)
            return it + 1, ws_ref[FLAG, 0]

        lax.while_loop(cond, body, (_i32(0), _i32(1)))

        # Never worse than Algorithm 1: keep B only if (max, -min) is smaller.
        ok = iota < N
        la, lb = ws_ref[LOAD_A, :], ws_ref[LOAD_B, :]
        max_a, min_a = jnp.max(jnp.where(ok, la, -BIG)), jnp.min(jnp.where(ok, la, BIG))
        max_b, min_b = jnp.max(jnp.where(ok, lb, -BIG)), jnp.min(jnp.where(ok, lb, BIG))
        use_b = (max_b < max_a) | ((max_b == max_a) & (min_b > min_a)) | (not compare_with_alg1)
        ws_ref[REP_A, :] = jnp.where(use_b, ws_ref[REP_B, :], ws_ref[REP_A, :])
        ws_ref[LOAD_A, :] = jnp.where(use_b, lb, la)

    # ---- Step 3 (lines 15-17): remap tokens, vectorised over tokens.
    phys_ref[...] = ids * 0 - 1

    def remap(e, c):
        phys_ref[...] = jnp.where(ids == e, ws_ref[rep_row, e], phys_ref[...])
        return c

    lax.fori_loop(0, E, remap, 0)
    loads_ref[...] = ws_ref[load_row, :]
