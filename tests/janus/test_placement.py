"""Activation-aware replication and placement (JANUS Algorithm 2): jaxmoe/runtime/placement.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxmoe.janus.placement import (
    coactivation,
    coactivation_load,
    place_replicas,
    plan_placement,
    replica_counts,
    to_slots,
)
from jaxmoe.runtime.replicas import ReplicaLayout, default_placement


def test_coactivation_counts_token_pairs():
    rng = np.random.default_rng(0)
    E = 6
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(50)])
    ids[::7] = -1  # padding tokens select nothing
    a = coactivation(ids, E)
    want = np.zeros((E, E), np.int64)
    for row in ids:
        for e in row[row >= 0]:
            for f in row[row >= 0]:
                want[e, f] += 1
    np.testing.assert_array_equal(a, want)


def test_replica_counts_equalise_per_replica_load():
    rng = np.random.default_rng(1)
    for _ in range(20):
        E, N = 8, int(rng.integers(2, 5))
        C = int(rng.integers(-(-E // N), -(-E // N) + 4))
        c = rng.integers(1, 1000, E).astype(float)
        r = replica_counts(c, N, C)
        assert sum(r) == min(N * C, E * N) and all(1 <= x <= N for x in r)
        # greedy optimality: taking a replica from any expert and giving it to another (that can
        # take one) never lowers the largest per-replica load
        peak = max(c[e] / r[e] for e in range(E))
        for e, f in itertools.permutations(range(E), 2):
            if r[e] > 1 and r[f] < N:
                moved = list(r)
                moved[e] -= 1
                moved[f] += 1
                assert max(c[x] / moved[x] for x in range(E)) >= peak - 1e-9
    assert replica_counts([100, 1, 1, 1], 2, 3) == [2, 2, 1, 1]  # the hot one first, then by c/r


def _valid(hosted, r, C):
    assert all(len(h) <= C for h in hosted)
    for e, n in enumerate(r):
        assert sum(e in h for h in hosted) == n  # r_e replicas, on distinct instances


def test_coactivated_pairs_are_spread_across_instances():
    # experts e and e+4 are always activated together: round-robin (e on e % 4) puts every pair on
    # one instance; Algorithm 2 separates them, which is optimal here (brute force over placements)
    E, N, C = 8, 4, 2
    counts = np.array([40, 38, 36, 34, 40, 38, 36, 34], float)
    a = np.zeros((E, E))
    for e in range(4):
        a[e, e + 4] = a[e + 4, e] = 30
    a[0, 1] = a[1, 0] = 1
    r = [1] * E
    hosted = place_replicas(r, counts, a, N, C)
    _valid(hosted, r, C)
    ours = max(coactivation_load(to_slots(hosted, C), a, C))
    round_robin = max(coactivation_load(default_placement(E, N, C, redundant=False), a, C))
    best = min(max(coactivation_load(list(p), a, C)) for p in itertools.permutations(range(E)))
    assert round_robin == 30 and ours == best == 0


def test_swap_branch_hand_worked():
    """N=2, C=3, r=[1,1,1,1,2]. Order: e0, e1, e2, e3, e4, e4. e0 -> g0; e1 -> g1 (0 < a01);
    e2, e3 -> g0 (a(2,1) = a(3,1) = 100); e4 -> g1; e4 again: g0 is full and g1 hosts e4, so
    lines 11-18 swap: moving j=0 from g0 to g1 adds a(0,1) + a(0,4) = 0 (j=2 or 3 would add 100)."""
    a = np.zeros((5, 5))
    a[2, 1] = a[1, 2] = a[3, 1] = a[1, 3] = 100
    a[0, 1] = a[1, 0] = 0
    hosted = place_replicas([1, 1, 1, 1, 2], [10, 9, 8, 7, 2], a, 2, 3)
    assert sorted(hosted[0]) == [2, 3, 4] and sorted(hosted[1]) == [0, 1, 4]
    _valid(hosted, [1, 1, 1, 1, 2], 3)


def test_random_plans_are_valid_layouts_and_keep_slots():
    rng = np.random.default_rng(2)
    for _ in range(30):
        E, N = int(rng.integers(4, 10)), int(rng.integers(2, 5))
        C = int(rng.integers(-(-E // N), -(-E // N) + 3))
        ids = np.stack([rng.choice(E, 2, replace=False, p=_skewed(E, rng)) for _ in range(64)])
        a, counts = coactivation(ids, E), np.bincount(ids.reshape(-1), minlength=E)
        previous = default_placement(E, N, C)
        placement = plan_placement(counts, a, N, C, previous=previous)
        ReplicaLayout(tuple(placement), E, N, C)  # validates: every expert has a slot
        for g in range(N):
            mine = [e for e in placement[g * C : (g + 1) * C] if e >= 0]
            assert len(mine) == len(set(mine))
            # an expert the instance hosted before stays in its old slot
            for s in range(g * C, (g + 1) * C):
                if previous[s] in mine:
                    assert placement[s] == previous[s]


def _skewed(E, rng):
    p = rng.pareto(1.0, E) + 0.05
    return p / p.sum()


def test_bad_inputs():
    with pytest.raises(ValueError, match="slots"):
        replica_counts([1, 2, 3], 1, 2)
    with pytest.raises(ValueError, match="do not fit"):
        place_replicas([3, 1], [1, 1], np.zeros((2, 2)), 2, 2)


# --------------------------------------------------------------------------- the controller, end to end


@pytest.mark.slow
def test_controller_rebalances_between_steps_without_changing_tokens():
    """LLM(mesh=..., rebalance_every=k): the host controller re-places replicas from the window's
    co-activations every k steps; greedy tokens stay those of the monolithic model; a rebalance
    installs exactly plan_placement of the window's statistics."""
    from jaxmoe import LLM, SamplingParams
    from jaxmoe.janus.placement_controller import PlacementController

    prompts, sampling = ["The mixture of experts", "Hello, world", "abc"], SamplingParams(max_tokens=10)
    want = [o.token_ids for o in LLM("tiny-random").generate(prompts, sampling)]
    llm = LLM("tiny-random", mesh="meshes/cpu-8-4a4e.yaml", rebalance_every=3)
    ex, first = llm.executor, llm.executor.placement()
    assert [o.token_ids for o in llm.generate(prompts, sampling)] == want
    history = llm.controller.history
    assert len(history) >= 2 and all(t > 0 for r in history for t in r.tokens)
    assert sum(r.slots_moved for r in history) > 0 and ex.placement() != first

    llm.engine.hooks.clear()
    manual = PlacementController(ex)
    before = ex.expert_coactivation()
    assert [o.token_ids for o in llm.generate(prompts[::-1], sampling)] == want[::-1]
    window = [a - b for a, b in zip(ex.expert_coactivation(), before)]
    old = [ex.placement(i) for i in ex.moe_layers]
    N, C = ex.num_expert_instances, ex.slots_per_instance
    plans = [plan_placement(np.diagonal(w), w, N, C, previous=p) for w, p in zip(window, old)]
    result = manual.rebalance()
    assert [ex.placement(i) for i in ex.moe_layers] == plans
    assert result.max_load_after == [max(coactivation_load(p, w, C)) for p, w in zip(plans, window)]
    assert result.tokens == [int(np.diagonal(w).sum()) for w in window]


@pytest.mark.slow
def test_controller_needs_expert_replicas():
    from jaxmoe import LLM

    with pytest.raises(TypeError, match="mesh file"):
        LLM("tiny-random", rebalance_every=2)
