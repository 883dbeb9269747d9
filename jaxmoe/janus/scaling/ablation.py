"""JANUS Fig. 10's ablation variants (arXiv:2512.13525, section 5.4) of the disaggregated engine.

======== ============================================ ===============================================
variant  A2E / E2A (mesh file ``transfer.mode``)     expert scheduling (``replica_policy``)
======== ============================================ ===============================================
base     ``direct``: every attention instance sends   ``random``: a uniformly random replica per
         to every expert device (m x n hops)          activated expert (no load balancing)
+2pc     the mesh file's two-phase policy             ``random``
         (``adaptive`` / ``two_phase``)
+2pc+lb  two-phase                                    ``aebs``: JANUS Algorithm 1 (activation-
                                                      balanced replica choice)
======== ============================================ ===============================================

Replicas hold identical weights, so every variant computes the same tokens (up to the order of
floating-point sums); ``bench/scaling_model.py --part ablation`` measures their decode TPOT.
"""

from __future__ import annotations

from jaxmoe.mesh import ClusterSpec
from jaxmoe.janus.scaling.fit import build_llm

VARIANTS: dict[str, tuple[bool, str]] = {
    "base": (False, "random"),
    "+2pc": (True, "random"),
    "+2pc+lb": (True, "aebs"),
}


def build_variant(model, base: ClusterSpec, attention: int, experts: int, variant: str, **llm_kwargs):
    """An ``LLM`` of ``model`` on aXeY of ``base``'s devices, run as ablation ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    two_phase, policy = VARIANTS[variant]
    kwargs = dict(llm_kwargs.pop("executor_kwargs", None) or {}, replica_policy=policy)
    return build_llm(model, base, attention, experts, two_phase, executor_kwargs=kwargs, **llm_kwargs)
