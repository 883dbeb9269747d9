"""Request lifecycle: ``Priority``, ``SequenceStatus`` and ``Sequence``.

Pure Python, no JAX. A ``Sequence`` is one request: its prompt, the tokens
generated so far, its KV-cache block table and how much of it is cached.

Token accounting (the one invariant everything else relies on)
---------------------------------------------------------------
``all_ids = prompt_ids + output_ids`` and ``num_computed`` counts the leading
tokens of ``all_ids`` whose KV is in the cache. A step computes the KV of the
tokens ``[num_computed, end)``; when ``end == num_tokens`` the logits at
position ``num_tokens - 1`` are sampled and the new token is appended.

* **decode**: exactly the newest token lacks KV and there is cached context
  (``num_computed == num_tokens - 1 >= 1``); the step feeds that one token.
* **prefill**: otherwise, i.e. while the KV of the prompt -- plus, after a
  recompute preemption freed the blocks, the tokens generated before it -- is
  not in the cache. It may be computed in several chunks; only the chunk that
  reaches ``num_tokens`` samples a token. After a recompute preemption the
  re-prefill covers prompt + generated tokens, so nothing is lost or repeated.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

_arrival_counter = itertools.count()


class Priority(enum.Enum):
    """Request class; the value doubles as a metrics label."""

    LS = "ls"  # latency-sensitive
    BE = "be"  # best-effort

    @classmethod
    def _missing_(cls, value):
        key = str(value).strip().lower().replace("-", "_")
        alias = {"ls": cls.LS, "latency_sensitive": cls.LS, "be": cls.BE, "best_effort": cls.BE}
        if key in alias:
            return alias[key]
        raise ValueError(
            f"unknown priority {value!r}; allowed (case-insensitive): 'ls', 'latency_sensitive', 'be', 'best_effort'"
        )

    @classmethod
    def parse(cls, value: "str | Priority") -> "Priority":
        """``Priority.parse("Latency_Sensitive") is Priority.LS``; same as ``Priority(value)``."""
        return value if isinstance(value, Priority) else cls(value)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # accepted, never scheduled, holds no KV blocks
    RUNNING = "running"  # scheduled in the latest step, holds KV blocks
    PREEMPTED = "preempted"  # was running, not scheduled now; see Sequence.has_kv
    FINISHED = "finished"


class Sequence:
    """One request. The scheduler owns the lifecycle fields; the model runner
    reads ``block_table``, ``num_computed`` and the step tokens/positions."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: Any = None,
        priority: "Priority | str" = Priority.BE,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.priority = Priority.parse(priority)
        self.sampling = sampling  # opaque, owned by the engine; has .max_tokens
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0
        self.num_scheduled = 0  # tokens scheduled in the current step (0 if none)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_counter)  # tie-break for equal times
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # prefix caching (engine.prefix_cache, BlockManager): the tenant's salt, whether a new
        # admission may read cached blocks, the prompt tokens it read from the cache (first admission)
        self.cache_salt = cache_salt
        self.use_prefix_cache = True
        self.num_cached_tokens: int | None = None
        self.cache_key: bytes | None = None  # the key its KV is computed under (None: holds none)
        self.block_hashes: list[bytes] = []  # of its full blocks, under cache_key
        self.num_registered_blocks = 0  # leading blocks already offered to the cache
        self.num_prefix_waits = 0  # steps it waited for blocks a running prefill was computing

    # -- token views -------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token lacks KV (see module doc)."""
        return not (1 <= self.num_computed == self.num_tokens - 1)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is still to compute (1 for a decode)."""
        return self.num_tokens - self.num_computed

    @property
    def has_kv(self) -> bool:
        """Holds KV blocks (a PREEMPTED sequence with KV resumes in place)."""
        return bool(self.block_table)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_tokens(self) -> int | None:
        return getattr(self.sampling, "max_tokens", None)

    # -- what to feed this step -------------------------------------------
    @property
    def step_token_ids(self) -> list[int]:
        """Input tokens of this step: ``all_ids[num_computed:num_computed+num_scheduled]``."""
        start = self.num_computed
        return self.all_ids[start : start + self.num_scheduled]

    # -- metrics -----------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds), None before the first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, None if < 2 tokens."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.priority.name}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed}, "
            f"blocks={len(self.block_table)})"
        )
