"""BrownoutServe's Algorithm 1 (BrownoutMoE) as a split of every token's top-k experts.

After gating, count the assignments each expert got (real tokens only), sort the experts by count
(descending, ties by id), and give experts to S1 (their original weights) while the assignments
already in S1 are fewer than ``T = threshold x total``; the other experts form S2. Partial brownout
sends S2's assignments to the united expert of the expert's group, except in the paper's special
case: a group with a single S2 expert keeps its original expert (a united expert would save no
access and cost accuracy). Full brownout drops S2's assignments.

(The algorithm's printed line 10 garbles the S1 test; we read it, as the paper's worked example of
Fig. 4b / 5a shows, as "the sum so far is below T": 20 assignments over counts 2, 4, 1, 5, 2, 1, 2,
3 and threshold 0.6 give S1 = {E3, E1, E7}; ``tests/test_brownout.py`` checks that example.)

``split`` works inside jit with ``threshold`` a traced scalar; ``split_reference`` is the direct
numpy reading the tests compare it with. ``activated_experts`` counts the weight sets a step reads
after the split (what brownout saves).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def split(ids, valid, groups, threshold, full: bool):
    """(original ids, united ids) [T, K] for top-k ids [T, K]; -1 where a choice does not go there.

    ``valid`` [T]: real tokens (padding is not counted); ``groups`` [E]: united expert of each
    expert; ``full``: static. The two id arrays take the router's weights unchanged (eq. 5-6)."""
    E = groups.shape[0]
    counts = (
        jnp.zeros((E,), jnp.int32)
        .at[ids.reshape(-1)]
        .add(jnp.repeat(valid.astype(jnp.int32), ids.shape[1]), mode="drop")
    )
    order = jnp.lexsort((jnp.arange(E), -counts))  # count descending, then id
    before = jnp.cumsum(counts[order]) - counts[order]
    in_s1_sorted = before < threshold * counts.sum()
    in_s1 = jnp.zeros((E,), bool).at[order].set(in_s1_sorted)
    in_s2 = ~in_s1 & (counts > 0)
    per_group = jnp.zeros((E,), jnp.int32).at[groups].add(in_s2.astype(jnp.int32))
    special = in_s2 & (per_group[groups] == 1) & (not full)  # alone in its group: keeps its original expert
    original = in_s1 | special
    to_united = in_s2 & ~special & (not full)
    return jnp.where(original[ids], ids, -1), jnp.where(to_united[ids], groups[ids], -1)


def activated_experts(original, united, valid, num_experts: int, num_united: int):
    """Distinct original experts and distinct united experts the real tokens of a step use after
    ``split`` (jit-able; ``original``/``united`` [T, K] with -1 for "not there", ``valid`` [T])."""
    keep = valid[:, None]

    def distinct(ids, n):
        used = jnp.zeros((n,), bool).at[jnp.where(keep & (ids >= 0), ids, n)].set(True, mode="drop")
        return used.sum()

    return distinct(original, num_experts), distinct(united, num_united)


def split_reference(ids: np.ndarray, valid: np.ndarray, groups: np.ndarray, threshold: float, full: bool):
    """The same split, read line by line from Algorithm 1 (numpy, loops)."""
    E = len(groups)
    cnt = [0] * E
    for t in range(ids.shape[0]):
        if valid[t]:
            for e in ids[t]:
                cnt[e] += 1
    A = sorted(range(E), key=lambda e: (-cnt[e], e))
    S = sum(cnt)
    T = S * threshold
    S1, S2, sum_partial = set(), set(), 0
    for e in A:
        if sum_partial < T:
            S1.add(e)
        elif not full:
            S2.add(e)
        sum_partial += cnt[e]
    S2 = {e for e in S2 if cnt[e] > 0}
    grouped: dict[int, list[int]] = {}
    for e in sorted(S2):
        grouped.setdefault(int(groups[e]), []).append(e)
    to_original = set(S1) | {g[0] for g in grouped.values() if len(g) == 1}  # lines 23-24: special case
    to_united = {e for g in grouped.values() if len(g) > 1 for e in g}
    orig = np.where(np.isin(ids, list(to_original)), ids, -1)
    united = np.where(np.isin(ids, list(to_united)), groups[ids], -1)
    return orig, united
