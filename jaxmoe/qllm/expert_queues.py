"""QLLM's per-expert queues (arXiv:2503.09304, section 3.3) for a step run layer by layer: the rounds.

With ``expert_queues = R`` each MoE layer of a pausable (best-effort) step runs as: its attention
side; its routing, after which every (token, choice) assignment waits in the FIFO queue of its
logical expert (token order = row order; with brownout the threshold has already chosen the
original or united expert, so the queues hold what the routing chose); then R rounds, round r
serving the queues of the experts in ``expert_bounds(E', R)[r]`` (E' the logical experts: the
originals and any the routing adds). A served assignment leaves its queue; a token's partial output
accumulates (float32) and joins its hidden state only after the layer's last round, when all of its
experts are done. The queues persist across the layer's pause points (after the attention side,
after the routing, between rounds): a paused step keeps them, the partial outputs and its residual
stream on the device, and nothing is recomputed.

Latency-sensitive work that arrives at one of those pause points is merged into the step where the
merge's cost model takes it (``layer_preemption``; else it runs nested while the queues wait) (the
paper's Fig. 1b): its rows run the layers before alone, then this layer's attention side and
routing, and their assignments enter the queues ahead of the waiting best-effort ones: the next
round serves them at every expert (also at the experts whose round is done), then the best-effort
rounds go on over the merged batch, which shares the remaining layers. A pause point's
``PausePoint`` gives the policy the stage and the queue depths.

The mechanism is the monolithic executor's (``MonolithicExecutor(expert_rounds=...)``: programs
``attend``, ``route`` and one ``expert_round`` program for every range; its ``expert_queue_depth`` is
what waits); this module owns the policy, how the experts are grouped into rounds.

Cost: per MoE layer two programs plus R expert programs instead of one program (each round reads
only its experts' weights with the ``cpu_kernel`` and ``bucketed_loop`` implementations; assignments
outside the round are -1, "no expert").
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
