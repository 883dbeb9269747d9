"""QLLM (arXiv:2503.09304): latency-sensitive requests ahead of best-effort ones, with preemption
below the iteration level.

``policy`` (the batch selection, registered as the ``"qllm"`` scheduling policy), ``layer_preemption``
(a best-effort step pauses between layers while latency-sensitive work runs) and ``expert_queues``
(per-expert queues served in rounds with pause points between them).
"""

from jaxmoe.qllm.policy import QLLMPolicy

__all__ = ["QLLMPolicy"]
