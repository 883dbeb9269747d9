"""Paged KV-cache block allocator (pure Python, no JAX), by a ``KVLayout``.

A sequence owns the blocks listed in ``seq.block_table`` (``jaxmoe.kv_layout`` says which slot a
position is in and which attention instance a block is on). Blocks are handed out from FIFO free
lists and returned on ``free``. No prefix sharing (each block has exactly one owner).

Partitions (block-to-instance affinity): one free list per attention instance of the layout
(``num_partitions``). A sequence gets its partition with its first block (the one the caller names,
``allocate(..., partition=)``: the scheduler's least-loaded instance, ``engine.dispatch``; else the
partition with the most free blocks, ties: the lowest id) and all its blocks come from it until it
is freed, so its KV lives on one instance.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from jaxmoe.engine.sequence import Sequence
from jaxmoe.kv_layout import KVLayout


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_partitions: int = 1):
        """Allocates the blocks of ``KVLayout(num_blocks, block_size, num_partitions)``
        (``for_layout``: of a given layout)."""
        self.layout = layout = KVLayout(num_blocks, block_size, num_partitions)
        n = layout.blocks_per_instance
        self._free: list[deque[int]] = [deque(range(p * n, (p + 1) * n)) for p in range(num_partitions)]
        self._owner: dict[int, str] = {}  # block id -> request_id

    # the layout's numbers, under the allocator's names
    num_blocks = property(lambda self: self.layout.num_blocks)
    block_size = property(lambda self: self.layout.block_size)
    num_partitions = property(lambda self: self.layout.num_instances)
    blocks_per_partition = property(lambda self: self.layout.blocks_per_instance)

    @classmethod
    def for_layout(cls, layout: KVLayout) -> "BlockManager":
        return cls(layout.num_blocks, layout.block_size, layout.num_instances)

    # -- accounting --------------------------------------------------------
    @property
    def num_free(self) -> int:
        return sum(map(len, self._free))

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
            p = max(range(self.num_partitions), key=lambda i: (len(self._free[i]), -i))
        return p

    def num_free_in(self, partition: int) -> int:
        """Free blocks of one partition."""
        return len(self._free[partition])

    def num_free_for(self, seq: Sequence | None = None) -> int:
        """Free blocks ``seq`` (or a new sequence) can get: those of its partition."""
        return len(self._free[self._partition_for(seq)])

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
        free = self._free[p]
        if need > len(free):
            raise MemoryError(f"KV cache exhausted: {seq.request_id} needs {need} blocks, {len(free)} free")
        new = [free.popleft() for _ in range(need)]
        for b in new:
            self._owner[b] = seq.request_id
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> int:
        """Return all of ``seq``'s blocks to their free lists; returns how many."""
        n = len(seq.block_table)
        for b in seq.block_table:
            if self._owner.get(b) != seq.request_id:
                raise RuntimeError(f"block {b} is not owned by {seq.request_id} (double free?)")
        for b in seq.block_table:
            del self._owner[b]
            self._free[self.layout.instance_of_block(b)].append(b)
        seq.block_table = []
        return n

    # -- addressing --------------------------------------------------------
    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``[start, end)`` of ``seq``."""
        bs, table = self.block_size, seq.block_table
        if start < 0 or end > len(table) * bs or start > end:
            raise IndexError(f"positions [{start}, {end}) outside the {len(table)} blocks of {seq.request_id}")
        return [int(s) for s in self.layout.slots(table, np.arange(start, end))]
