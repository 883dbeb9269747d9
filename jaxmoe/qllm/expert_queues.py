"""QLLM's per-expert queues (arXiv:2503.09304, section 3.3) for a step run layer by layer: the rounds.

With ``expert_queues = R`` the routed-expert work of each MoE layer of a pausable (best-effort) step
is not one program but R rounds. After routing, every (token, choice) assignment waits in the FIFO
queue of its expert (token order = row order); round r serves the queues of the experts in
``expert_bounds(E', R)[r]`` (E' the logical experts: the originals and any the routing adds), and
between two rounds the engine may pause the step to run latency-sensitive work (which runs as its
own step: latency-sensitive tokens are served before the waiting best-effort queue entries). A
token's partial output accumulates over the rounds; it is combined into the token's hidden state
only after the last round, when all of its experts are done. Nothing is recomputed: a paused step
keeps its queues (the routing result), the partial outputs and the attention side's residual stream
on the device.

The mechanism is the monolithic executor's (``MonolithicExecutor(expert_rounds=...)``: one program
per round, ``models.experts.routed_experts_in``; its ``expert_queue_depth`` is what still waits);
this module owns the policy, how the experts are grouped into rounds.

Cost: R expert programs per MoE layer instead of one (each reads only its experts' weights with the
``cpu_kernel`` and ``bucketed_loop`` implementations; ids outside the round are -1, "no expert").
"""

from __future__ import annotations

import numpy as np


def expert_bounds(num_experts: int, rounds: int) -> list[tuple[int, int]]:
    """The experts [lo, hi) whose queues each round serves: ``rounds`` contiguous groups (at most
    one round per expert)."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"expert_queues must be a positive integer (rounds per MoE layer), got {rounds!r}")
    edges = np.linspace(0, num_experts, min(rounds, num_experts) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]
