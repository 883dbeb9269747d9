"""FinDEP's fine-grained pipeline of a disaggregated step (arXiv:2512.21487): the batch split into
micro-batches whose attention, A2E, expert and E2A work the executor dispatches interleaved, so that
the attention sub-mesh computes micro-batch k+1 (or the shared experts) while the expert sub-mesh
computes micro-batch k.

``Pipeline(r1, order)``: r1 attention micro-batches of m_a = rows per instance / r1 sequences each,
in order ``ASAS`` (each micro-batch's attention, then its shared experts) or ``AASS`` (every
micro-batch's attention, then every shared-expert segment). The split is on the host, before
anything is uploaded: micro-batch k takes rows ``k*m_a .. (k+1)*m_a`` of every attention instance,
so each instance keeps its own rows (and KV-cache slots) in every micro-batch. JAX dispatches
asynchronously: programs on the two sub-meshes overlap when their inputs are ready. Not built yet:
r2 (expert-side chunks of a micro-batch).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmoe.models.attention import AttentionBatch

ORDERS = ("ASAS", "AASS")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    r1: int = 1  # attention micro-batches (1: no pipelining)
    order: str = "ASAS"

    def __post_init__(self):
        if not isinstance(self.r1, int) or isinstance(self.r1, bool) or self.r1 < 1:
            raise ValueError(f"pipeline r1 must be a positive integer, got {self.r1!r}")
        if self.order not in ORDERS:
            raise ValueError(f"pipeline order must be one of {ORDERS}, got {self.order!r}")

    @classmethod
    def parse(cls, value) -> Pipeline:
        if value is None:
            return cls()
        if isinstance(value, Pipeline):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"r1", "order"}
            if unknown:
                raise ValueError(f"pipeline: unknown field(s) {sorted(unknown)} (r1, order)")
            return cls(**value)
        raise ValueError(f"pipeline: expected a Pipeline or a dict with r1 and order, got {value!r}")

    def micro_batches(self, rows_per_instance: int) -> int:
        """The r1 that runs: the largest divisor of the rows per instance that is <= r1."""
        return max(d for d in range(1, min(self.r1, rows_per_instance) + 1) if rows_per_instance % d == 0)


def split_rows(tokens: np.ndarray, batch: AttentionBatch, index: np.ndarray | None, instances: int, r1: int):
    """Host arrays of r1 micro-batches, and ``where`` [B]: the row of the concatenated micro-batch
    outputs that holds each original row (rows are instance-major: instance j has rows j*R..)."""
    B = tokens.shape[0]
    R = B // instances
    m = R // r1
    parts, order = [], []
    for k in range(r1):
        rows = np.concatenate([np.arange(j * R + k * m, j * R + (k + 1) * m) for j in range(instances)])
        order.append(rows)
        parts.append((tokens[rows], AttentionBatch(*(a[rows] for a in batch)), None if index is None else index[rows]))
    where = np.empty(B, np.int64)
    where[np.concatenate(order)] = np.arange(B)
    return parts, where
