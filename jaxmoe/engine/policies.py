"""Scheduling policies: the plug-in that decides what runs each step.

Interface (see docs/scheduling.md)
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
* ``pause_at_layer(running, waiting, layer) -> bool``: with layer-level
  preemption on, between two layers of a best-effort step (``running``),
  whether to pause it there and run the waiting latency-sensitive work
  (``waiting``: the LS queues) first. ``layer`` is a ``PausePoint``: an int
  (the layers done) that also says the ``stage`` ("layer": a layer boundary;
  with per-expert queues, inside a MoE layer: "attention", "routing",
  "experts" between its expert groups) and the per-expert ``queue_depth``
  there (None before the routing).

Policies are plain objects; subclass ``Policy`` to inherit the default victim
rule (BE before LS, newest first) and pause rule (whenever LS work waits). They must not mutate sequences. The scheduler calls a policy through
``GuardedPolicy``: a decision that raises or is invalid is logged and taken by
the default policy (QLLM's, ``jaxmoe.qllm``, where registered) for that call instead; no request is lost.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from jaxmoe.engine.sequence import Priority, Sequence

log = logging.getLogger(__name__)


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

    def pause_at_layer(self, running: list[Sequence], waiting: Queues, layer: int) -> bool:
        """Whether the best-effort step ``running`` pauses after ``layer`` layers for ``waiting``."""
        ...


class PausePoint(int):
    """Where a pausable step waits: the layers done (the int), the ``stage`` ("layer": a layer
    boundary; with per-expert queues, inside the next MoE layer: "attention" after its attention
    side, "routing" after its routing, "experts" between its expert groups) and, after the routing,
    the assignments waiting in each logical expert's queue (``queue_depth``, read from the device when
    first asked; None at the other stages)."""

    stage: str

    def __new__(cls, layers_done: int, stage: str = "layer", queue_depth=None):
        """``queue_depth``: the depths, or a function that reads them."""
        point = super().__new__(cls, layers_done)
        point.stage, point._depth = stage, queue_depth
        return point

    @property
    def queue_depth(self) -> list[int] | None:
        if callable(self._depth):
            depth = self._depth()
            self._depth = None if depth is None else [int(n) for n in depth]
        return self._depth


class Policy:
    """Convenience base: default victim rule, BE before LS, newest first."""

    name = "base"

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        raise NotImplementedError

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=lambda s: (s.priority is Priority.BE, arrival_key(s)))

    def pause_at_layer(self, running: list[Sequence], waiting: Queues, layer: int) -> bool:
        # QLLM: an LS job that arrives while a BE batch is in layer l does not wait for the rest
        return bool(waiting.ls_prefill or waiting.ls_decode)


class FCFSPolicy(Policy):
    """Priority-oblivious baseline: every sequence in plain arrival order
    (decode or prefill alike), like iteration-level FCFS in vLLM/TGI."""

    name = "fcfs"

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        return queues.all()


class PolicyError(ValueError):
    """A policy's decision that the scheduler cannot use."""


class GuardedPolicy:
    """``policy`` with a guard: a decision that raises or is invalid (an unknown or duplicate
    sequence, a victim that was not offered, a pause answer that is not a bool) is logged with its
    traceback and made by ``fallback`` (the default policy) for that call instead; ``errors`` counts them."""

    def __init__(self, policy: SchedulingPolicy, fallback: SchedulingPolicy | None = None):
        self.policy, self.fallback, self.errors = policy, fallback or make_policy(DEFAULT_POLICY), 0

    @property
    def name(self) -> str:
        return self.policy.name

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        def check(order):
            offered, seen = {id(s) for s in queues.all()}, set()
            for s in order:
                if id(s) not in offered or id(s) in seen:
                    raise PolicyError(f"order() returned an unknown or duplicate entry {s!r}")
                seen.add(id(s))
            return order

        return self._decide(
            "order", lambda: check(list(self.policy.order(queues, budget))), lambda: self.fallback.order(queues, budget)
        )

    def victim(self, candidates: list[Sequence]) -> Sequence:
        def check(victim):
            if not any(victim is c for c in candidates):
                raise PolicyError(f"victim() chose {victim!r}, which was not a candidate")
            return victim

        return self._decide(
            "victim", lambda: check(self.policy.victim(list(candidates))), lambda: self.fallback.victim(candidates)
        )

    def pause_at_layer(self, running: list[Sequence], waiting: Queues, layer: int) -> bool:
        def check(answer):
            if not isinstance(answer, bool):
                raise PolicyError(f"pause_at_layer() returned {answer!r}, not a bool")
            return answer

        return self._decide(
            "pause_at_layer",
            lambda: check(self.policy.pause_at_layer(running, waiting, layer)),
            lambda: self.fallback.pause_at_layer(running, waiting, layer),
        )

    def _decide(self, what: str, decide, fallback):
        try:
            return decide()
        except Exception:
            self.errors += 1
            log.exception("scheduling policy %r: %s failed; the default policy decides this time", self.name, what)
            return fallback()


# by name: a class, or the "module:Class" of a feature's policy (imported when first asked for, so
# the core imports no feature); ``register_policy`` adds more
POLICIES: dict[str, type | str] = {"fcfs": FCFSPolicy, "qllm": "jaxmoe.qllm.policy:QLLMPolicy"}
DEFAULT_POLICY = "qllm"  # the engine's default and the guard's fallback


def register_policy(name: str, cls: type | str) -> None:
    """Make ``cls`` (a ``SchedulingPolicy`` built with no arguments, or its "module:Class") available
    by ``name``."""
    POLICIES[name] = cls


def make_policy(spec) -> SchedulingPolicy:
    """A policy from a registered name ("qllm", "fcfs"; case-insensitive), a ``"module:Class"`` spec
    (the class is imported and built with no arguments) or a policy object (returned as it is)."""
    if isinstance(spec, str) and isinstance(POLICIES.get(spec.strip().lower()), str):
        spec = POLICIES[spec.strip().lower()]
    if not isinstance(spec, str):
        if not isinstance(spec, SchedulingPolicy):
            raise ValueError(f"policy: {spec!r} is not a SchedulingPolicy (order, victim, pause_at_layer, name)")
        return spec
    name = spec.strip()
    if ":" not in name:
        try:
            return POLICIES[name.lower()]()
        except KeyError:
            raise ValueError(f"unknown policy {spec!r}; available: {sorted(POLICIES)} or module:Class") from None
    module, _, attr = name.partition(":")
    try:
        policy = getattr(importlib.import_module(module), attr)()
    except Exception as e:
        raise ValueError(f"policy {spec!r} could not be loaded: {type(e).__name__}: {e}") from e
    if not isinstance(policy, SchedulingPolicy):
        raise ValueError(f"policy {spec!r} is not a SchedulingPolicy (order, victim, pause_at_layer, name)")
    return policy
