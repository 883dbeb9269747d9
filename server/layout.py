"""The layout serving now: after a live rescale (``janus.live_rescale``) the new attention / expert
instances, as ``ModelInfo``, ``/v1/models`` and ``/metrics`` report them."""

from __future__ import annotations


def current_layout(engine) -> tuple[str, int, int] | None:
    """(mesh description, attention instances, expert instances) of the layout serving now (it
    changes with a live rescale); None for the monolithic executor."""
    ex = engine.runner.executor
    spec = getattr(getattr(ex, "sub", None), "spec", None)
    if spec is None or not hasattr(ex, "num_attention"):
        return None
    return spec.describe(), ex.num_attention, ex.num_expert_instances
