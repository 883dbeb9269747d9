"""Paged KV-cache block allocator (pure Python, no JAX), by a ``KVLayout``.

A sequence holds the blocks listed in ``seq.block_table`` (``jaxmoe.kv_layout`` says which slot a
position is in and which attention instance a block is on). Blocks are handed out from FIFO free
lists and returned on ``free``.

Prefix caching (``prefix_caching=True``; ``engine.prefix_cache`` defines the block hash): a block that
is full and computed may be registered under its hash (``cache_blocks``) in the index of its
partition; a new sequence may then take the longest run of cached blocks of its tokens
(``cached_prefix`` + ``take_cached``) instead of computing them, so a block can be held by several
sequences (a reference count: the set of holders). A block in use is never evicted, and nobody
writes a registered block (its positions are computed before it is registered; readers start after
it). When its last holder frees it, a registered block stays cached with no holder ("evictable");
allocation takes blocks that hold no cached KV first and only then evicts cached ones, least
recently released first (a freed sequence's deepest blocks before its first ones: a block is useless
without its prefix). ``reset_prefix_cache`` forgets every hash (the cache's contents were lost).

Partitions (block-to-instance affinity): one free list per attention instance of the layout
(``num_partitions``). A sequence gets its partition with its first block (the one the caller names,
``allocate(..., partition=)``: the scheduler's least-loaded instance, ``engine.dispatch``; else the
partition with the most free blocks, ties: the lowest id) and all its blocks come from it until it
is freed, so its KV lives on one instance.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from jaxmoe.engine.sequence import Sequence
from jaxmoe.kv_layout import KVLayout


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_partitions: int = 1, prefix_caching: bool = False):
        """Allocates the blocks of ``KVLayout(num_blocks, block_size, num_partitions)``
        (``for_layout``: of a given layout); ``prefix_caching``: keep and share full computed blocks."""
        self.layout = layout = KVLayout(num_blocks, block_size, num_partitions)
        self.prefix_caching = bool(prefix_caching)
        n = layout.blocks_per_instance
        self._free: list[deque[int]] = [deque(range(p * n, (p + 1) * n)) for p in range(num_partitions)]
        # cached blocks no sequence holds, per partition, least recently released first
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_partitions)]
        self._holders: dict[int, set[str]] = {}  # block id -> the request ids holding it
        self._index: list[dict[bytes, int]] = [{} for _ in range(num_partitions)]  # hash -> block
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self.num_evictions = 0

    # the layout's numbers, under the allocator's names
    num_blocks = property(lambda self: self.layout.num_blocks)
    block_size = property(lambda self: self.layout.block_size)
    num_partitions = property(lambda self: self.layout.num_instances)
    blocks_per_partition = property(lambda self: self.layout.blocks_per_instance)

    @classmethod
    def for_layout(cls, layout: KVLayout, prefix_caching: bool = False) -> "BlockManager":
        return cls(layout.num_blocks, layout.block_size, layout.num_instances, prefix_caching)

    # -- accounting --------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted when needed)."""
        return sum(map(len, self._free)) + sum(map(len, self._evictable))

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or not)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence holds."""
        return sum(map(len, self._evictable))

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.layout.num_slots

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens one sequence can hold (all its blocks are in one partition)."""
        return self.layout.slots_per_instance

    def utilization(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks needed to hold ``n_tokens`` tokens."""
        return self.layout.blocks_for(n_tokens)

    def num_blocks_needed(self, seq: Sequence, n_tokens: int) -> int:
        """Extra blocks ``seq`` needs so its table covers ``n_tokens`` tokens."""
        return max(0, self.blocks_for(n_tokens) - len(seq.block_table))

    def partition_of(self, seq: Sequence) -> int | None:
        """The partition of ``seq``'s blocks; None while it holds none."""
        return self.layout.instance_of_block(seq.block_table[0]) if seq.block_table else None

    def _partition_for(self, seq: Sequence | None) -> int:
        """``seq``'s partition, or for a sequence without blocks the one with the most free blocks."""
        p = None if seq is None else self.partition_of(seq)
        if p is None:
            p = max(range(self.num_partitions), key=lambda i: (self.num_free_in(i), -i))
        return p

    def num_free_in(self, partition: int) -> int:
        """Free blocks of one partition (cached blocks nobody holds included)."""
        return len(self._free[partition]) + len(self._evictable[partition])

    def num_free_for(self, seq: Sequence | None = None) -> int:
        """Free blocks ``seq`` (or a new sequence) can get: those of its partition."""
        return self.num_free_in(self._partition_for(seq))

    def can_allocate(self, n_tokens: int, seq: Sequence | None = None) -> bool:
        """Whether ``n_tokens`` tokens fit: from scratch, or, with ``seq``,
        whether ``seq``'s table can grow to cover ``n_tokens`` tokens."""
        need = self.blocks_for(n_tokens) if seq is None else self.num_blocks_needed(seq, n_tokens)
        return need <= self.num_free_for(seq)

    # -- allocation --------------------------------------------------------
    def allocate(self, seq: Sequence, n_tokens_needed: int, partition: int | None = None) -> list[int]:
        """Grow ``seq.block_table`` to cover ``n_tokens_needed`` tokens.

        ``partition``: where a sequence without blocks goes (ignored once it has some; None: the
        partition with the most free blocks). Returns the newly added block ids. Raises
        ``MemoryError`` (and allocates nothing) when its partition has not enough free blocks.
        """
        need = self.num_blocks_needed(seq, n_tokens_needed)
        if partition is not None and not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition {partition} does not exist (0..{self.num_partitions - 1})")
        p = partition if partition is not None and not seq.block_table else self._partition_for(seq)
        if need > self.num_free_in(p):
            raise MemoryError(f"KV cache exhausted: {seq.request_id} needs {need} blocks, {self.num_free_in(p)} free")
        new = [self._pop_free(p) for _ in range(need)]
        for b in new:
            self._holders[b] = {seq.request_id}
        seq.block_table.extend(new)
        return new

    def _pop_free(self, p: int) -> int:
        """A block of partition ``p`` for new KV: a never-cached one, else the least recently
        released cached one (its hash is forgotten)."""
        if self._free[p]:
            return self._free[p].popleft()
        b, _ = self._evictable[p].popitem(last=False)
        del self._index[p][self._hash_of.pop(b)]
        self.num_evictions += 1
        return b

    def free(self, seq: Sequence) -> int:
        """Release all of ``seq``'s blocks; a block nobody holds any more goes back to its free list,
        or, when cached, stays cached until evicted. Returns how many ``seq`` held."""
        n, rid = len(seq.block_table), seq.request_id
        for b in seq.block_table:
            if rid not in self._holders.get(b, ()):
                raise RuntimeError(f"block {b} is not owned by {rid} (double free?)")
        released = []
        for b in seq.block_table:
            holders = self._holders[b]
            holders.discard(rid)
            if not holders:
                del self._holders[b]
                released.append(b)
        for b in released:
            if b not in self._hash_of:
                self._free[self.layout.instance_of_block(b)].append(b)
        for b in reversed(released):  # cached: the last block is released first, so evicted first
            if b in self._hash_of:
                self._evictable[self.layout.instance_of_block(b)][b] = None
        seq.block_table = []
        return n

    # -- prefix caching ----------------------------------------------------
    def cached_prefix(self, hashes: list[bytes], partition: int = 0) -> list[int]:
        """The cached blocks of the longest run of leading ``hashes`` in ``partition``'s index."""
        index, out = self._index[partition], []
        if not self.prefix_caching:
            return out
        for h in hashes:
            b = index.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take_cached(self, seq: Sequence, blocks: list[int]) -> None:
        """Make cached ``blocks`` (from ``cached_prefix``) the start of ``seq``'s empty block table."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id} already holds blocks; cached blocks start a table")
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"block {b} is not cached")
        for b in blocks:
            self._evictable[self.layout.instance_of_block(b)].pop(b, None)
            self._holders.setdefault(b, set()).add(seq.request_id)
        seq.block_table = list(blocks)

    def cache_blocks(self, seq: Sequence, hashes: list[bytes]) -> int:
        """Register ``seq``'s leading blocks, full and computed, under ``hashes`` (one per block)
        from ``seq.num_registered_blocks`` on; a hash another block already holds is skipped (that
        block stays the cached one). Returns how many blocks were newly registered."""
        if not self.prefix_caching or not seq.block_table:
            return 0
        index, new = self._index[self.partition_of(seq)], 0
        for i in range(seq.num_registered_blocks, min(len(hashes), len(seq.block_table))):
            b, h = seq.block_table[i], hashes[i]
            if b not in self._hash_of and h not in index:
                index[h], self._hash_of[b] = b, h
                new += 1
        seq.num_registered_blocks = max(seq.num_registered_blocks, min(len(hashes), len(seq.block_table)))
        return new

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their KV is gone): unheld ones become plain free blocks.
        Returns how many were cached."""
        n = len(self._hash_of)
        for p, evictable in enumerate(self._evictable):
            self._free[p].extend(evictable)
            evictable.clear()
            self._index[p].clear()
        self._hash_of.clear()
        return n

    # -- addressing --------------------------------------------------------
    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``[start, end)`` of ``seq``."""
        bs, table = self.block_size, seq.block_table
        if start < 0 or end > len(table) * bs or start > end:
            raise IndexError(f"positions [{start}, {end}) outside the {len(table)} blocks of {seq.request_id}")
        return [int(s) for s in self.layout.slots(table, np.arange(start, end))]
