"""QLLM's per-expert queues (arXiv:2503.09304, section 3.3) for a step run layer by layer.

With ``expert_queues = R`` the routed-expert work of each MoE layer of a pausable (best-effort) step
is not one program but R rounds. After gating, every (token, choice) assignment waits in the FIFO
queue of its expert (token order = row order); round r serves the queues of the experts in
``expert_bounds(E, R)[r]``, and between two rounds the engine may pause the step to run
latency-sensitive work (which runs as its own step: latency-sensitive tokens are served before the
waiting best-effort queue entries). A token's partial output accumulates over the rounds; it is
combined into the token's hidden state only after the last round, when all of its top-k experts are
done. Nothing is recomputed: a paused step keeps its queues (the gating result), the partial
outputs and the attention side's residual stream on the device.

Cost: R expert programs per MoE layer instead of one (each reads only its experts' weights with the
``cpu_kernel`` and ``bucketed_loop`` implementations; ids outside the round are -1, "no expert").
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmoe.models.experts import routed_experts


def expert_bounds(num_experts: int, rounds: int) -> list[tuple[int, int]]:
    """The experts [lo, hi) whose queues each round serves: ``rounds`` contiguous groups (at most
    one round per expert)."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"expert_queues must be a positive integer (rounds per MoE layer), got {rounds!r}")
    edges = np.linspace(0, num_experts, min(rounds, num_experts) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def serve_round(p: dict, xn, ids, weights, partial, lo, hi, layer=None, impl: str = "auto"):
    """``partial`` plus the output of the assignments queued at experts [lo, hi) (``lo``/``hi``
    traced: one program serves every round). ``xn`` [T, D] the routed experts' input, ``ids`` /
    ``weights`` [T, k] the gating result, ``partial`` [T, D] in float32."""
    mine = (ids >= lo) & (ids < hi)
    out = routed_experts(p, xn, jnp.where(mine, ids, -1), weights, layer, impl)
    return partial + out.astype(jnp.float32)


def queue_depth(ids: np.ndarray, served_below: int, num_experts: int) -> np.ndarray:
    """Assignments still queued at each expert [E] when the experts below ``served_below`` are done."""
    ids = np.asarray(ids).reshape(-1)
    waiting = ids[ids >= served_below]
    return np.bincount(waiting, minlength=num_experts)[:num_experts]
