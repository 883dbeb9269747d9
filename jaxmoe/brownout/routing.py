"""BrownoutServe's Algorithm 1 (BrownoutMoE) as an expert routing (``models.routing.ExpertRouting``)
that both executors run: ``BrownoutRouting``.

After gating, count the assignments each expert got (real tokens only), sort the experts by count
(descending, ties by id), and give experts to S1 (their original weights) while the assignments
already in S1 are fewer than ``T = threshold x total``; the other experts form S2. Partial brownout
sends S2's assignments to the united expert of the expert's group, except in the paper's special
case: a group with a single S2 expert keeps its original expert (a united expert would save no
access and cost accuracy). Full brownout drops S2's assignments.

(The algorithm's printed line 10 garbles the S1 test; we read it, as the paper's worked example of
Fig. 4b / 5a shows, as "the sum so far is below T": 20 assignments over counts 2, 4, 1, 5, 2, 1, 2,
3 and threshold 0.6 give S1 = {E3, E1, E7}; ``tests/brownout/test_brownout.py`` checks that example.)

United experts are logical experts like the originals: with E original and U united experts per
layer, united expert u is logical expert ``E + u``. The executors keep a layer's E + U expert weights
together (``BrownoutRouting.logical_params``: the monolithic executor stacks them, the disaggregated
one places them in replica slots, C + ceil(U / N) per instance, so united experts get replicas and
AEBS chooses among them like hot originals), and a layer makes one expert-FFN call over the logical
ids ``route`` gives: the kept originals, then the united experts E + u, [T, 2K]. Two choices of one
token that name two experts of one group, hence one united expert, are merged into one choice with
the summed combine weight (g1 + g2) x FFN_u(x) (eq. 5-6), which keeps every expert at most one row
per token. The threshold is the routing's traced state (the executor's ``routing_state``; read and set
it with ``threshold`` / ``set_threshold``): moving it recompiles nothing. As the paper, there is one
threshold per phase (``PhaseStates(prefill, decode)``): a program call of prefill chunks splits with the
prefill threshold, a call of decodes with the decode threshold (the engine runs the two as separate
calls; ``models.routing.for_call`` states the rule for a call that could hold both).

``split`` works inside jit with ``threshold`` a traced scalar; ``split_reference`` is the direct
numpy reading the tests compare it with. ``activated_experts`` counts the weight sets a step reads
after the split (what brownout saves).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxmoe.brownout.config import BrownoutConfig, BrownoutError, check_threshold
from jaxmoe.config import MoEConfig
from jaxmoe.models.router import route as top_k
from jaxmoe.models.routing import WEIGHTS, PhaseStates, mask_padding
from jaxmoe.quantization import Quantized

PHASES = ("prefill", "decode")


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


def merge_same(ids, weights):
    """Choices of one token naming the same id become one (the first), weights summed: (ids, weights)
    [T, K] with the later duplicates -1 / 0."""
    K = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)  # [T, j, l]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [l, j]: j < l
    dup = (same & earlier[None]).any(-1)  # choice l repeats an earlier one
    merged = jnp.einsum("tjl,tl->tj", same.astype(weights.dtype), weights)
    return jnp.where(dup, -1, ids), jnp.where(dup, 0, merged)


def split_choices(groups, ids, weights, valid, threshold, full: bool):
    """Algorithm 1 on the gate's output: (logical ids [T, 2K]: the kept originals, then the united
    experts as E + u with duplicates merged; their combine weights [T, 2K]). ``groups`` [E] the united
    expert of each expert, ``ids`` [T, K] the router's, ``valid`` [T] real tokens (padding neither counts
    nor activates anything)."""
    original, united = split(ids, valid, groups, threshold, full)
    keep = valid[:, None]
    original = jnp.where(keep, original, -1)
    united, u_weights = merge_same(jnp.where(keep, united, -1), weights)
    E = groups.shape[0]
    ids_all = jnp.concatenate([original, jnp.where(united >= 0, united + E, -1)], axis=1)
    weights_all = jnp.concatenate([jnp.where(original >= 0, weights, 0), u_weights.astype(weights.dtype)], axis=1)
    return ids_all, weights_all


@dataclasses.dataclass(frozen=True)
class BrownoutRouting:
    """Algorithm 1 as an ``ExpertRouting``: partial brownout (S2 to united experts) or, with
    ``full``, full brownout (S2 dropped). The MoE parameters hold united experts (``united``:
    {w_gate, w_up, w_down} [U, ...], and ``united_groups`` [E], the expert -> united expert map:
    ``jaxmoe.brownout.united.attach``). The state is the threshold in [0, 1] (None: 1, zero brownout)."""

    full: bool = False

    @property
    def name(self) -> str:
        return "brownout (full)" if self.full else "brownout (partial)"

    def extra_experts(self, moe: dict) -> int:
        """U, the layer's united experts (the largest entry of ``united_groups`` + 1)."""
        _check_united(moe)
        return int(np.max(np.asarray(moe["united_groups"]))) + 1

    def logical_params(self, moe: dict) -> dict:
        """The originals' and the united experts' weights stacked [E + U, ...] (``united`` folded in),
        ``united_groups`` kept for ``route`` (jit-able)."""
        _check_united(moe)
        if "united" not in moe:  # already in logical form
            return dict(moe)
        out = {k: v for k, v in moe.items() if k != "united"}
        for k in WEIGHTS:
            out[k] = _stack_experts(moe[k], moe["united"][k])
        return out

    def route(self, moe: dict, cfg: MoEConfig, x, valid=None, state=None):
        ids, weights = top_k(moe, cfg, x)
        valid = jnp.ones(ids.shape[:1], bool) if valid is None else valid.reshape(-1)
        threshold = 1.0 if state is None else state
        return split_choices(moe["united_groups"], mask_padding(ids, valid), weights, valid, threshold, self.full)

    def exact(self, state) -> bool:
        """Threshold 1 (zero brownout) in every phase: the original model."""
        values = (state.prefill, state.decode) if isinstance(state, PhaseStates) else (state,)
        return all(v is None or float(v) >= 1.0 for v in values)


def _stack_experts(originals, united):
    """[E, ...] and [U, ...] expert weights as one [E + U, ...] table (quantized ones value by value and
    scale by scale: ``united.like`` quantized the united experts by the originals' method)."""
    if isinstance(originals, Quantized):
        q = jnp.concatenate([originals.q, united.q])
        return Quantized(q, jnp.concatenate([originals.scale, united.scale]), originals.block)
    return jnp.concatenate([jnp.asarray(originals), jnp.asarray(united, originals.dtype)])


def _check_united(moe: dict) -> None:
    if "united_groups" not in moe:
        raise BrownoutError(
            "no united experts: brownout needs a model directory made by `jaxmoe unite --model DIR --ways K --out DIR2`"
        )


def routing_for(config: BrownoutConfig) -> tuple[BrownoutRouting, PhaseStates]:
    """(the routing, the start thresholds per phase: the executor's ``routing_state``) that ``config``
    asks for."""
    return BrownoutRouting(config.use_full_brownout), PhaseStates(config.prefill, config.decode)


def is_brownout(executor) -> bool:
    """Whether ``executor`` routes its MoE layers with brownout."""
    return isinstance(getattr(executor, "routing", None), BrownoutRouting)


def thresholds(executor) -> dict[str, float] | None:
    """{"prefill": t, "decode": t}: the brownout thresholds of ``executor``'s next steps per phase
    (None: it was built without brownout)."""
    if not is_brownout(executor):
        return None
    state = executor.routing_state
    if not isinstance(state, PhaseStates):
        state = PhaseStates(state, state)
    return {phase: 1.0 if v is None else float(v) for phase, v in zip(PHASES, (state.prefill, state.decode))}


def threshold(executor, phase: str | None = None) -> float | None:
    """The brownout threshold of ``executor``'s next steps in ``phase`` ("prefill" or "decode"; None:
    the lower of the two, which is both when they were set together); None without brownout."""
    both = thresholds(executor)
    if both is None:
        return None
    return min(both.values()) if phase is None else both[_phase(phase)]


def set_threshold(executor, value, phase: str | None = None) -> None:
    """Set the brownout threshold of ``executor``'s next steps (a number in [0, 1]; no recompile) in
    ``phase`` ("prefill" or "decode"; None: both); a ``BrownoutError`` when it is out of range or the
    executor was built without brownout."""
    if not is_brownout(executor):
        routing = getattr(getattr(executor, "routing", None), "name", None)
        raise BrownoutError(f"brownout threshold: this executor was built without brownout (routing: {routing})")
    value = check_threshold(value)
    now = thresholds(executor)
    now.update({p: value for p in PHASES} if phase is None else {_phase(phase): value})
    executor.routing_state = PhaseStates(now["prefill"], now["decode"])


def _phase(phase) -> str:
    if phase not in PHASES:
        raise BrownoutError(f"brownout phase must be 'prefill' or 'decode', got {phase!r}")
    return phase
