"""Scheduling policies: the plug-in that decides what runs each step.

Interface (see docs/scheduling_policies.md)
-------------------------------------------
Every step the scheduler hands a policy the unfinished sequences split into
four FCFS queues (``Queues``: LS-prefill, LS-decode, BE-prefill, BE-decode,
each in arrival order) and the step budget (``Budget``). The policy returns

* ``order(queues, budget) -> list[Sequence]``: the sequences that may run
  this step, most urgent first. The scheduler packs them greedily into the
  budget (a decode costs 1 token, a prefill chunk as many prompt tokens as are
  left, possibly cut short). Anything not packed is *not run this step*: if it
  holds KV blocks it keeps them (priority preemption, resumed in place later).
* ``victim(candidates) -> Sequence``: when the KV cache is full, which of the
  candidates loses its blocks (recompute preemption). The scheduler only
  offers sequences that rank *below* the one that needs memory (later in
  ``order`` or absent from it), so a policy can never evict a more urgent
  sequence for a less urgent one.

Policies are plain objects; subclass ``Policy`` to inherit the default victim
rule (BE before LS, newest first). They must not mutate sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from jaxmoe.engine.sequence import Priority, Sequence


def arrival_key(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.arrival_seq)


@dataclass
class Queues:
    """The four FCFS queues of QLLM (each sorted by arrival)."""

    ls_prefill: list[Sequence] = field(default_factory=list)
    ls_decode: list[Sequence] = field(default_factory=list)
    be_prefill: list[Sequence] = field(default_factory=list)
    be_decode: list[Sequence] = field(default_factory=list)

    @classmethod
    def from_seqs(cls, seqs: list[Sequence]) -> "Queues":
        q = cls()
        for s in sorted(seqs, key=arrival_key):
            ls = s.priority is Priority.LS
            if s.is_prefill:
                (q.ls_prefill if ls else q.be_prefill).append(s)
            else:
                (q.ls_decode if ls else q.be_decode).append(s)
        return q

    def all(self) -> list[Sequence]:
        """Every sequence, in arrival order."""
        return sorted(self.ls_prefill + self.ls_decode + self.be_prefill + self.be_decode, key=arrival_key)

    def lengths(self) -> dict[str, int]:
        return {
            "ls_prefill": len(self.ls_prefill),
            "ls_decode": len(self.ls_decode),
            "be_prefill": len(self.be_prefill),
            "be_decode": len(self.be_decode),
        }


@dataclass(frozen=True)
class Budget:
    """What one step may use."""

    max_batch_tokens: int
    max_num_seqs: int
    num_free_blocks: int
    block_size: int


@runtime_checkable
class SchedulingPolicy(Protocol):
    name: str

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        """Sequences allowed to run this step, most urgent first."""
        ...

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The sequence whose KV blocks are freed when memory runs out."""
        ...


class Policy:
    """Convenience base: default victim rule, BE before LS, newest first."""

    name = "base"

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        raise NotImplementedError

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=lambda s: (s.priority is Priority.BE, arrival_key(s)))


class QLLMPolicy(Policy):
    """QLLM's batch selection (qllm.txt Sec. 3.2, "Batch selection logic").

    Our copy of the paper contains Algorithm 1 only as the prose that explains
    it (its pseudocode listing is missing), so this follows that prose line by
    line; the quotes below are verbatim. "Maximum batch size" maps to our
    budget (``max_num_seqs`` and ``max_batch_tokens``); "fill" = the
    scheduler's greedy packing in the returned order.

    Where the prose is silent -- which BE jobs "some BE jobs" (lines 6-7) are --
    we use the rule the paper states for BE work elsewhere, "prioritizing
    decode over prefill" (lines 16-19). Note that lines 10-14 admit only BE
    *decode* jobs next to LS decodes: a BE prompt does not start prefilling
    while LS jobs are decoding and none is prefilling (the paper lists
    starvation as a known limitation). ``be_prefill_with_ls_decode=True``
    relaxes exactly that one rule.
    """

    name = "qllm"

    def __init__(self, be_prefill_with_ls_decode: bool = False):
        self.be_prefill_with_ls_decode = be_prefill_with_ls_decode

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        q = queues
        if q.ls_prefill:
            # "The algorithm prioritizes filling the batch first with LS jobs
            #  at the decode stage (lines 2-3). If a maximum-sized batch cannot
            #  be created, it prioritizes LS jobs in the prefill stage to
            #  produce more LS jobs in the decode stage (lines 4-5). The
            #  algorithm also attempts to add some BE jobs to fill the batch if
            #  possible (lines 6-7)."
            return q.ls_decode + q.ls_prefill + q.be_decode + q.be_prefill
        if q.ls_decode:
            # "If there are no LS jobs at the prefill stage, the algorithm
            #  simply executes the LS jobs at the decode stage, filling the
            #  batch with BE jobs at the decode stage (lines 10-14)."
            extra = q.be_prefill if self.be_prefill_with_ls_decode else []
            return q.ls_decode + q.be_decode + extra
        # "If there are no LS jobs, it simply executes BE jobs, prioritizing
        #  decode over prefill (lines 16-19)."
        return q.be_decode + q.be_prefill


class FCFSPolicy(Policy):
    """Priority-oblivious baseline: every sequence in plain arrival order
    (decode or prefill alike), like iteration-level FCFS in vLLM/TGI."""

    name = "fcfs"

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        return queues.all()


POLICIES: dict[str, type] = {"qllm": QLLMPolicy, "fcfs": FCFSPolicy}


def make_policy(name: str, **kwargs) -> SchedulingPolicy:
    """Build a built-in policy by name ("qllm", "fcfs"; case-insensitive)."""
    try:
        cls = POLICIES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {sorted(POLICIES)}") from None
    return cls(**kwargs)
