"""Iteration-level scheduler with chunked prefill and preemption (pure Python).

One engine step::

    batch = scheduler.schedule()            # what to compute, KV blocks reserved
    tokens = runner.run(batch)              # the lead's jitted prefill/decode
    done = scheduler.postprocess(batch, tokens, finished)

``schedule`` asks the policy for an order (see ``policies.py``) and packs it
greedily under ``max_batch_tokens`` / ``max_num_seqs``; prefills may be
chunked. KV blocks are reserved here, so the runner never runs out.

Two kinds of preemption, both reported in ``ScheduledBatch.preempted``:

* **keep-KV** ("priority") preemption: a sequence that ran last step is not
  in this step's batch (e.g. QLLM put LS work first). It keeps its blocks,
  ``num_computed`` and tokens and resumes in place when scheduled again.
* **recompute** preemption: the cache is full, so the policy's ``victim``
  loses its blocks (``num_computed = 0``). Prompt *and* generated tokens are
  kept; it is re-prefilled over both later. Victims always rank below the
  sequence that needs the memory.

Prefix caching (``BlockManager(prefix_caching=True)``, ``engine.prefix_cache``): when a sequence
without KV is scheduled (new, or after a recompute preemption) it takes the longest run of cached
full blocks of its tokens -- never all of them: at least its last token is computed, for its
logits -- and its prefill starts after them (on a partitioned cache in the partition
``dispatch.choose_cached_instance`` picks). After each step the blocks a sequence has completed
are registered under their hash.

A prefix still being computed is shared too (SGLang's rule for requests that share a prefix within a
batch): a sequence without KV whose next uncached full block is one a running prefill is computing
(allocated, hashed, not yet registered) waits -- it is not scheduled this step, other work is -- and
takes the blocks from the cache once they are registered. A running prefill is one of this call's
sequences that ran in the previous step or was scheduled earlier in this one; a keep-KV-preempted,
recompute-preempted or aborted one is none, so nobody waits on blocks that are not being filled. A
sequence waits at most ``max_prefix_wait_steps`` steps in all, then computes the prefix itself. The
hash includes the sequence's ``cache_salt`` and the executor's
KV key (``kv_key``: the engine sets it to its expert routing's state, e.g. the brownout threshold); a sequence whose KV was computed
under more than one key (brownout changed while it ran) registers no more blocks until it is
recomputed. KV of the exact model (``exact_kv_key``: brownout at threshold 1) is read under every
key: a browned-out sequence may start from it (and then registers nothing); the exact model never
reads browned-out KV. ``drop_all_kv`` forgets the cache; ``move_kv_to`` (live re-scaling) starts the new
allocator with an empty index: the sequences it moves register their blocks there again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.dispatch import choose_cached_instance, choose_instance
from jaxmoe.engine.policies import Budget, GuardedPolicy, Queues, SchedulingPolicy, make_policy
from jaxmoe.engine.prefix_cache import cache_key, extend_hashes
from jaxmoe.engine.sequence import Priority, Sequence, SequenceStatus

_INF = float("inf")


class OverloadedError(RuntimeError):
    """The waiting queue is full; the request was not accepted (retry later)."""


# kind -> where it happens; "expert_pause": inside a MoE layer (per-expert queues)
PREEMPTION_LEVELS = {"keep_kv": "step", "recompute": "step", "pause": "layer", "expert_pause": "expert"}


@dataclass
class ScheduledBatch:
    """One step. Prefill chunk ``(seq, start, end)`` computes KV of positions
    ``[start, end)``; it samples a token iff ``end == seq.num_tokens``. A decode
    feeds ``seq.last_token_id`` at position ``seq.num_tokens - 1``."""

    prefills: list[tuple[Sequence, int, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [s for s, _, _ in self.prefills] + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(e - s for _, s, e in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        policy: SchedulingPolicy | None = None,
        max_batch_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_waiting: int = 1024,
        max_prefill_chunk: int | None = None,
        max_prefix_wait_steps: int = 32,
    ):
        if max_batch_tokens < 1 or max_num_seqs < 1 or max_waiting < 0:
            raise ValueError("max_batch_tokens and max_num_seqs must be >= 1, max_waiting >= 0")
        if max_prefill_chunk is not None and max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {max_prefill_chunk}")
        self.max_prefill_chunk = max_prefill_chunk or max_batch_tokens
        if max_prefix_wait_steps < 0:
            raise ValueError(f"max_prefix_wait_steps must be >= 0, got {max_prefix_wait_steps}")
        self.max_prefix_wait_steps = max_prefix_wait_steps
        self.bm = block_manager
        self.policy = GuardedPolicy(policy if policy is not None else make_policy("qllm"))  # bad decisions: the default
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self._seqs: dict[str, Sequence] = {}  # unfinished, by request id
        self.num_steps = 0
        self.num_admitted = self.num_rejected = self.num_aborted = self.num_finished = 0
        # preemptions[kind][priority value]: "keep_kv" / "recompute" at step boundaries, "pause" (a
        # request paused between layers for latency-sensitive work, counted by LLMEngine) and
        # "expert_pause" (paused inside a MoE layer: per-expert queues)
        self.preemptions = {k: {"ls": 0, "be": 0} for k in PREEMPTION_LEVELS}
        self.kv_key = lambda: None  # what else the KV depends on (the engine: its expert routing's state)
        self.exact_kv_key = lambda: None  # the KV key every kv_key may also read (the exact model's; None: none)
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens looked up / found in the cache
        self.prefix_cache_waits = 0  # steps sequences waited for a prefix a running prefill computed
        self.num_prefill_tokens = 0  # prompt (and recompute) tokens scheduled in prefill chunks

    # -- admission ---------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Accept a request or raise; an accepted request is never dropped.

        Raises ``OverloadedError`` when ``max_waiting`` requests are already
        waiting, ``ValueError`` for an empty prompt, a duplicate id, or a
        prompt that cannot fit in the KV cache (``bm.max_seq_tokens``).
        """
        if seq.request_id in self._seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if not seq.prompt_ids:
            raise ValueError(f"request {seq.request_id!r} has an empty prompt")
        if seq.num_tokens > self.bm.max_seq_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: {seq.num_tokens} tokens exceed the "
                f"KV cache capacity of {self.bm.max_seq_tokens} tokens per sequence"
            )
        if self.num_waiting >= self.max_waiting:
            self.num_rejected += 1
            raise OverloadedError(f"{self.num_waiting} requests waiting (max_waiting={self.max_waiting})")
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.request_id] = seq
        self.num_admitted += 1

    def abort(self, request_id: str) -> bool:
        """Finish a request now (reason "abort") and free its KV blocks."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort", time.monotonic())
        self.num_aborted += 1
        return True

    # -- one step ----------------------------------------------------------
    def schedule(self, exclude: frozenset[str] = frozenset(), priority: Priority | None = None) -> ScheduledBatch:
        """The next batch. ``exclude``: sequences of a step that is paused between layers (they are
        neither scheduled, evicted nor preempted); ``priority``: schedule only those (the step that
        runs inside a paused one, QLLM layer-level preemption)."""
        live = [
            s
            for s in self._seqs.values()
            if s.request_id not in exclude and (priority is None or s.priority is priority)
        ]
        queues = Queues.from_seqs(live)
        budget = Budget(self.max_batch_tokens, self.max_num_seqs, self.bm.num_free, self.bm.block_size)
        order = self.policy.order(queues, budget)
        rank = {s.request_id: i for i, s in enumerate(order)}

        batch = ScheduledBatch()
        scheduled: set[str] = set()
        evicted: set[str] = set()
        tokens_left = self.max_batch_tokens
        pending: list[dict[bytes, str]] | None = None  # per partition: block hash -> the prefill computing it
        for seq in order:
            if len(scheduled) >= self.max_num_seqs or tokens_left == 0:
                break
            if seq.request_id in evicted:
                continue
            fresh = not seq.block_table and seq.num_computed == 0
            if fresh and pending is None and self.bm.prefix_caching:
                pending = self._pending_blocks(live, evicted)
            cached = self._take_cached_prefix(seq, pending) if fresh else 0
            if cached is None:  # its prefix is being computed by a running prefill: it waits
                seq.num_prefix_waits += 1
                self.prefix_cache_waits += 1
                continue
            prefill = seq.is_prefill
            want = min(seq.num_uncomputed, tokens_left, self.max_prefill_chunk) if prefill else 1
            n = self._reserve(seq, want, prefill, rank, scheduled, evicted, live, batch)
            if n == 0:
                if cached:  # it waits: the cached blocks it took stay cached, unheld
                    self.bm.free(seq)
                    seq.num_computed = 0
                continue
            if fresh and self.bm.prefix_caching and seq.use_prefix_cache:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += cached
            if fresh and seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            seq.num_scheduled = n
            seq.status = SequenceStatus.RUNNING
            scheduled.add(seq.request_id)
            tokens_left -= n
            if prefill:
                batch.prefills.append((seq, seq.num_computed, seq.num_computed + n))
                self.num_prefill_tokens += n
                if pending is not None:
                    self._add_pending(pending, seq)
            else:
                batch.decodes.append(seq)

        for seq in live:  # ran last step, not this one: keep-KV preemption
            if seq.request_id in scheduled:
                continue
            seq.num_scheduled = 0
            if seq.status is SequenceStatus.RUNNING:
                self._mark_preempted(seq, "keep_kv", batch)
        self.num_steps += 1
        return batch

    def pause_at_layer(self, paused: frozenset[str], layer: int) -> bool:
        """The policy's answer: does the step of ``paused`` (best-effort requests) pause after
        ``layer`` layers for the latency-sensitive work that waits (QLLM layer-level preemption)?"""
        running = [s for s in self._seqs.values() if s.request_id in paused]
        waiting = [s for s in self._seqs.values() if s.request_id not in paused and s.priority is Priority.LS]
        return self.policy.pause_at_layer(running, Queues.from_seqs(waiting), layer)

    def _pending_blocks(self, live: list[Sequence], evicted: set[str]) -> list[dict[bytes, str]]:
        """Per partition, the hashes of the blocks the running prefills of ``live`` are computing
        (a prefill that ran last step and still holds its KV) and have not registered yet."""
        pending: list[dict[bytes, str]] = [{} for _ in range(self.bm.num_partitions)]
        for seq in live:
            if seq.status is SequenceStatus.RUNNING and seq.request_id not in evicted:
                self._add_pending(pending, seq)
        return pending

    def _add_pending(self, pending: list[dict[bytes, str]], seq: Sequence) -> None:
        """Add the blocks ``seq`` (a prefill) has hashed and not registered to ``pending``."""
        if not (seq.has_kv and seq.is_prefill and seq.use_prefix_cache) or seq.cache_key is None:
            return
        if seq.cache_key != cache_key(seq.cache_salt, self.kv_key()):
            return  # it will register nothing
        index = pending[self.bm.partition_of(seq)]
        for h in seq.block_hashes[seq.num_registered_blocks :]:
            index.setdefault(h, seq.request_id)

    def _waits_for(self, seq: Sequence, hits: list[list[int]], usable: int, pending) -> bool:
        """Whether ``seq`` (no KV yet) waits: in some partition the blocks after its cached run there
        are being computed by a running prefill, so that run would grow beyond the longest cached one."""
        if pending is None or seq.num_prefix_waits >= self.max_prefix_wait_steps:
            return False
        best = max(map(len, hits))
        for p, hit in enumerate(hits):
            n = len(hit)
            while n < usable and seq.block_hashes[n] in pending[p]:
                n += 1
            if n > best:
                return True
        return False

    def _take_cached_prefix(self, seq: Sequence, pending: list[dict[bytes, str]] | None = None) -> int | None:
        """A sequence about to compute its KV from scratch: set its cache key and, with prefix
        caching, give it the longest run of cached blocks of its tokens but the last (in the
        partition ``choose_cached_instance`` picks). Returns the tokens it took (its ``num_computed``),
        or None when it should wait for blocks a running prefill is computing (``pending``, see
        ``_pending_blocks``): then it takes nothing."""
        bm = self.bm
        key = cache_key(seq.cache_salt, self.kv_key())
        if key != seq.cache_key:
            seq.cache_key, seq.block_hashes = key, []
        seq.num_registered_blocks = 0
        if not (bm.prefix_caching and seq.use_prefix_cache):
            return 0
        tokens = seq.all_ids
        usable = (len(tokens) - 1) // bm.block_size  # the last token is always computed
        extend_hashes(seq.block_hashes, tokens[: usable * bm.block_size], bm.block_size, key)
        hits = [bm.cached_prefix(seq.block_hashes[:usable], p) for p in range(bm.num_partitions)]
        exact = self.exact_kv_key()
        exact = None if exact is None else cache_key(seq.cache_salt, exact)
        from_exact = [False] * len(hits)
        if exact is not None and exact != key:  # e.g. browned out: the exact model's KV serves too
            hashes = extend_hashes([], tokens[: usable * bm.block_size], bm.block_size, exact)
            for p in range(bm.num_partitions):
                other = bm.cached_prefix(hashes, p)
                if len(other) > len(hits[p]):
                    hits[p], from_exact[p] = other, True
        if self._waits_for(seq, hits, usable, pending):
            return None
        if not any(hits):
            return 0
        chunk = min(self.max_prefill_chunk, self.max_batch_tokens)
        p = choose_cached_instance(bm, self._seqs.values(), seq.num_tokens, [len(h) for h in hits], chunk)
        if p is None or not hits[p]:
            return 0
        bm.take_cached(seq, hits[p])
        seq.num_computed = len(hits[p]) * bm.block_size
        seq.num_registered_blocks = len(hits[p])
        if from_exact[p]:  # its KV mixes two keys: it registers none (as after a key change)
            seq.cache_key, seq.block_hashes = None, []
        return seq.num_computed

    def _register_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s full computed blocks to the prefix cache -- unless its KV was computed under
        another key than the executor's now (then never, until it is recomputed)."""
        if not self.bm.prefix_caching or seq.cache_key is None:
            return
        if seq.cache_key != cache_key(seq.cache_salt, self.kv_key()):
            seq.cache_key = None
            return
        full = min(seq.num_computed, seq.num_tokens) // self.bm.block_size
        if full > seq.num_registered_blocks:
            if full > len(seq.block_hashes):
                extend_hashes(
                    seq.block_hashes, seq.all_ids[: full * self.bm.block_size], self.bm.block_size, seq.cache_key
                )
            self.bm.cache_blocks(seq, seq.block_hashes[:full])

    def _reserve(self, seq, want, prefill, rank, scheduled, evicted, live, batch) -> int:
        """Allocate blocks for ``want`` more tokens of ``seq``, evicting
        lower-ranked sequences if needed. Returns the tokens granted (a prefill
        chunk may shrink to what fits; 0 = cannot run this step)."""
        bm, my_rank = self.bm, rank[seq.request_id]
        part = bm.partition_of(seq)  # None: a new one takes any partition, so any victim may help
        if part is None:  # a new sequence: the least-loaded attention instance with room (dispatch)
            choice = choose_instance(bm, self._seqs.values(), bm.blocks_for(seq.num_computed + want))
            if choice is not None:
                bm.allocate(seq, seq.num_computed + want, partition=choice)
                return want
        while not bm.can_allocate(seq.num_computed + want, seq):
            victims = [
                s
                for s in live
                if s.has_kv
                and s is not seq
                and s.request_id not in scheduled
                and rank.get(s.request_id, _INF) > my_rank
                and part in (None, bm.partition_of(s))
            ]
            if not victims:
                break
            victim = self.policy.victim(victims)
            self._preempt_recompute(victim, batch)
            evicted.add(victim.request_id)
        if not bm.can_allocate(seq.num_computed + want, seq):
            if not prefill:
                return 0  # a decode cannot shrink; it keeps its KV and waits
            # Shrink the prefill chunk to the blocks it has plus the free ones.
            want = (len(seq.block_table) + bm.num_free_for(seq)) * bm.block_size - seq.num_computed
            if want <= 0:
                return 0
        bm.allocate(seq, seq.num_computed + want)
        return want

    def _preempt_recompute(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.bm.free(seq)
        seq.num_computed = 0
        seq.num_scheduled = 0
        self._mark_preempted(seq, "recompute", batch)

    def drop_all_kv(self) -> list[Sequence]:
        """The KV cache was lost (re-allocated after a failed step): every sequence holding
        blocks is recompute-preempted, keeping its prompt and generated tokens. Returns them."""
        hit = [s for s in self._seqs.values() if s.has_kv or s.num_computed]
        batch = ScheduledBatch()
        for seq in hit:
            self._preempt_recompute(seq, batch)
        self.bm.reset_prefix_cache()
        return hit

    def move_kv_to(self, bm: BlockManager) -> tuple[list[tuple[list[int], list[int]]], list[Sequence]]:
        """Hand the KV of every sequence over to a new block manager (live re-scaling, between steps):
        longest first, each sequence holding blocks gets as many from one partition of ``bm``; one
        that does not fit is recompute-preempted (its tokens are kept). Returns the (old blocks, new
        blocks) to copy and the recomputed sequences; ``bm`` is the allocator from now on."""
        moves, recomputed = [], []
        for seq in sorted((s for s in self._seqs.values() if s.has_kv), key=lambda s: -len(s.block_table)):
            old, seq.block_table = seq.block_table, []
            seq.num_registered_blocks = 0  # registered again in bm's (empty) index after its next step
            if bm.can_allocate(len(old) * bm.block_size):
                bm.allocate(seq, len(old) * bm.block_size)
                moves.append((old, list(seq.block_table)))
            else:
                seq.num_computed = seq.num_scheduled = 0
                self._mark_preempted(seq, "recompute", ScheduledBatch())
                recomputed.append(seq)
        self.bm = bm
        return moves, recomputed

    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence."""
        return list(self._seqs.values())

    def _mark_preempted(self, seq: Sequence, kind: str, batch: ScheduledBatch) -> None:
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.preemptions[kind][seq.priority.value] += 1
        if seq not in batch.preempted:
            batch.preempted.append(seq)

    # -- after the model ran -------------------------------------------------
    def postprocess(
        self,
        batch: ScheduledBatch,
        new_token_ids: dict[str, int | None],
        finished: dict[str, str] | None = None,
    ) -> list[Sequence]:
        """Record the step's results; returns the sequences finished now.

        ``new_token_ids[rid]`` is the sampled token for every sequence whose
        step reached ``num_tokens`` (decodes, last prefill chunks) and None /
        absent for a partial prefill chunk. ``finished[rid] = reason`` ends a
        request (its token, if any, is appended first). The scheduler itself
        also finishes with reason "length" when ``sampling.max_tokens`` is
        reached or the sequence can no longer fit in the KV cache (``bm.max_seq_tokens``).
        Sequences aborted since ``schedule()`` are skipped.
        """
        finished = finished or {}
        now = time.monotonic()
        items = [(s, st, e) for s, st, e in batch.prefills]
        items += [(s, s.num_tokens - 1, s.num_tokens) for s in batch.decodes]
        done: list[Sequence] = []
        for seq, start, end in items:
            rid = seq.request_id
            if self._seqs.get(rid) is not seq:
                continue  # aborted meanwhile
            if start != seq.num_computed or end > seq.num_tokens:
                raise RuntimeError(f"stale batch for {seq!r}: chunk [{start}, {end})")
            samples = end == seq.num_tokens
            token = new_token_ids.get(rid)
            if token is not None and not samples:
                raise ValueError(f"{rid}: token for a partial prefill chunk [{start}, {end})")
            if token is None and samples and rid not in finished:
                raise ValueError(f"{rid}: missing sampled token for chunk [{start}, {end})")
            seq.num_computed = end
            seq.num_scheduled = 0
            self._register_blocks(seq)
            if token is not None:
                seq.output_ids.append(int(token))
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.last_token_time = now
            reason = finished.get(rid)
            if reason is None and samples and seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
                reason = "length"
            if reason is None and seq.num_tokens > self.bm.max_seq_tokens:
                reason = "length"  # the next decode could never get its KV block
            if reason is not None:
                self._finish(seq, reason, now)
                done.append(seq)
        for rid, reason in finished.items():  # finished requests not in this batch
            seq = self._seqs.get(rid)
            if seq is not None:
                self._finish(seq, reason, now)
                done.append(seq)
        return done

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        seq.num_scheduled = 0
        del self._seqs[seq.request_id]
        self.num_finished += 1

    # -- hooks & views -------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._seqs)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def _with(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self._seqs.values() if s.status is status]

    @property
    def waiting(self) -> list[Sequence]:
        """Accepted, never scheduled (counts against ``max_waiting``)."""
        return self._with(SequenceStatus.WAITING)

    @property
    def running(self) -> list[Sequence]:
        """In the latest scheduled batch."""
        return self._with(SequenceStatus.RUNNING)

    @property
    def preempted(self) -> list[Sequence]:
        """Started, not in the latest batch (``has_kv`` tells which kind)."""
        return self._with(SequenceStatus.PREEMPTED)

    @property
    def num_waiting(self) -> int:
        return sum(s.status is SequenceStatus.WAITING for s in self._seqs.values())

    def queue_lengths(self) -> dict[str, int]:
        """Lengths of the four QLLM queues (ls/be x prefill/decode)."""
        return Queues.from_seqs(list(self._seqs.values())).lengths()

    def stats(self) -> dict[str, float]:
        """Flat gauges and counters, ready for Prometheus."""
        out: dict[str, float] = {
            "num_waiting": self.num_waiting,
            "num_running": len(self.running),
            "num_preempted": len(self.preempted),
            "kv_utilization": self.bm.utilization(),
            "kv_free_blocks": self.bm.num_free,
            "steps": self.num_steps,
            "admitted": self.num_admitted,
            "rejected": self.num_rejected,
            "aborted": self.num_aborted,
            "finished": self.num_finished,
            "policy_errors": self.policy.errors,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_blocks": self.bm.num_cached_blocks,
            "prefix_cache_waits": self.prefix_cache_waits,
            "prefill_tokens": self.num_prefill_tokens,
        }
        out.update({f"queue_{k}": v for k, v in self.queue_lengths().items()})
        for kind, per in self.preemptions.items():
            out.update({f"preemptions_{kind}_{p}": n for p, n in per.items()})
        return out
