"""FinDEP's fine-grained pipeline of a disaggregated step (arXiv:2512.21487): the batch split into
micro-batches whose attention, A2E, expert and E2A work the executor dispatches interleaved, so that
the attention sub-mesh computes micro-batch k+1 (or the shared experts) while the expert sub-mesh
computes micro-batch k; and each micro-batch's expert work split into chunks whose A2E, expert
program and E2A overlap with each other.

``Pipeline(r1, order, r2)``:

* r1 attention micro-batches of m_a = rows per instance / r1 sequences each. The split is on the
  host, before anything is uploaded: micro-batch k takes rows ``k*m_a .. (k+1)*m_a`` of every
  attention instance, so each instance keeps its own rows (and KV-cache slots) in every micro-batch.
* r2 expert-side chunks per micro-batch (``runtime.chunks``): each attention instance's m_a x T
  tokens are cut into r2 equal runs of m_a x T / r2 tokens (so the expert side gets r2 chunks of
  about m_e = chunk tokens x top_k / experts tokens per expert); each chunk is sent (A2E), run through
  the expert program and sent back (E2A) on its own, all dispatched asynchronously.
* order: ``ASAS`` (each micro-batch's attention, then its shared experts), ``AASS`` (every
  micro-batch's attention, then every shared-expert segment), or ``PP`` (PPPipe, MegaScale-Infer's
  ping-pong: a micro-batch's shared experts run with its attention, before its A2E is dispatched:
  no shared-expert overlap). ``Pipeline()`` with order PP, r1 = r2 = 1 is the plain sequential
  schedule.

JAX dispatches asynchronously: programs on the two sub-meshes overlap when their inputs are ready.
A batch whose rows per instance (tokens per instance) are not a multiple of r1 (r2) runs with the
largest divisor below it (``for_batch``): the engine's batch sizes change step by step.

``Pipeline.dispatch``: the order in which the executor dispatches a step's programs, a sequence of
``(task, layer, micro_batch, chunk)`` (task: attention, shared, a2e, expert, e2a; chunk -1 on the
attention side). FinDEP's choosers (``jaxmoe.findep.online``) fill it from the solver's event model
(``findep.schedule.dispatch_order``) for the shape that runs; without one the executor dispatches
in ``program_order``: per layer, the micro-batches in the order's attention-side sequence, each
chunk's A2E, expert program and E2A one after the other (for the sequential schedule this is the
event model's order).

``PipelineChooser``: anything with ``for_batch(rows, tokens, context) -> Pipeline``; the executor
asks it once per step (FinDEP's solver per batch shape lives in ``jaxmoe.findep.online``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np

from jaxmoe.models.attention import AttentionBatch

ORDERS = ("ASAS", "AASS", "PP")
NAMES = ("sequential", "pppipe", "findep")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"pipeline {name} must be a positive integer, got {value!r}")


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is <= at_most."""
    return max(d for d in range(1, min(at_most, n) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    r1: int = 1  # attention micro-batches (1: no pipelining)
    order: str = "ASAS"
    r2: int = 1  # expert-side chunks per micro-batch (1: no chunking)
    # the dispatch sequence of a step of this shape (see the module docstring); None: program_order
    dispatch: tuple[tuple[str, int, int, int], ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        _positive("r1", self.r1)
        _positive("r2", self.r2)
        if self.order not in ORDERS:
            raise ValueError(f"pipeline order must be one of {ORDERS}, got {self.order!r}")

    @classmethod
    def sequential(cls) -> Pipeline:
        """Every task one after the other: attention, shared experts, A2E, experts, E2A."""
        return cls(1, "PP", 1)

    @classmethod
    def parse(cls, value) -> Pipeline | PipelineChooser:
        """None or "sequential" -> ``sequential()``; a dict with r1 / r2 / order -> a fixed Pipeline;
        a Pipeline or a ``PipelineChooser`` as it is. ("pppipe" and "findep" need a performance
        model: ``jaxmoe.findep.online.pipeline_chooser`` builds them.)"""
        if value is None or value == "sequential":
            return cls.sequential()
        if isinstance(value, (Pipeline, PipelineChooser)):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"r1", "r2", "order"}
            if unknown:
                raise ValueError(f"pipeline: unknown field(s) {sorted(unknown)} (r1, r2, order)")
            return cls(**value)
        if isinstance(value, str) and value in NAMES:
            raise ValueError(
                f"pipeline {value!r} needs a performance model: build it with LLM(..., pipeline={value!r})"
            )
        raise ValueError(
            f"pipeline: expected one of {NAMES} or a dict like {{'order': 'ASAS', 'r1': 2, 'r2': 4}}, got {value!r}"
        )

    def for_batch(self, rows: int, tokens: int, context: int = 0) -> Pipeline:
        """What runs for a step of ``rows`` sequences per attention instance of ``tokens`` new tokens:
        r1 -> the largest divisor of rows <= r1, r2 -> the largest divisor of the micro-batch's
        tokens per instance <= r2."""
        r1 = largest_divisor(rows, self.r1)
        r2 = largest_divisor(rows // r1 * tokens, self.r2)
        return self if (r1, r2) == (self.r1, self.r2) else Pipeline(r1, self.order, r2)

    def micro_batches(self, rows_per_instance: int) -> int:
        """The r1 that runs: the largest divisor of the rows per instance that is <= r1."""
        return largest_divisor(rows_per_instance, self.r1)


TASKS = ("attention", "shared", "a2e", "expert", "e2a")


def program_order(pipe: Pipeline, moe: tuple[bool, ...]) -> tuple[tuple[str, int, int, int], ...]:
    """The dispatch sequence without an event model (``moe``: per layer, whether it has an expert
    part): per layer the attention side's sequence (ASAS / PP: A0 S0 A1 S1 ..., AASS: A0 A1 ... S0
    S1 ...), each micro-batch's chunks (A2E, experts, E2A each) right after its attention (after its
    shared experts in order PP)."""
    out = []
    for t, is_moe in enumerate(moe):
        chunks = [(task, t, k, c) for k in range(pipe.r1) for c in range(pipe.r2) for task in TASKS[2:]]
        per = pipe.r2 * 3
        for k in range(pipe.r1):
            out.append(("attention", t, k, -1))
            if not is_moe:
                continue
            if pipe.order == "PP":
                out.append(("shared", t, k, -1))
            out.extend(chunks[k * per : (k + 1) * per])
            if pipe.order == "ASAS":
                out.append(("shared", t, k, -1))
        if is_moe and pipe.order == "AASS":
            out.extend(("shared", t, k, -1) for k in range(pipe.r1))
    return tuple(out)


def expected_tasks(r1: int, r2: int, moe: tuple[bool, ...]) -> collections.Counter:
    """Every (task, layer, micro-batch, chunk) a step dispatches once (shared: one per MoE layer and
    micro-batch, skipped where the layer has none)."""
    return collections.Counter(program_order(Pipeline(r1, "PP", r2), moe))


@runtime_checkable
class PipelineChooser(Protocol):
    """Chooses the pipeline of each step from its shape (per attention instance)."""

    def for_batch(self, rows: int, tokens: int, context: int = 0) -> Pipeline: ...


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
