"""``KVLayout``: where a sequence's KV lives, in one place.

The paged KV cache is ``num_blocks`` blocks of ``block_size`` token slots. Token position ``p`` of a
sequence whose blocks are ``block_table`` lives in slot::

    block_table[p // block_size] * block_size + p % block_size

With ``num_instances = m`` attention instances (the disaggregated executor's data-parallel attention)
the blocks are split into m contiguous equal ranges: instance j holds blocks j*n .. (j+1)*n - 1 (its
KV slot range), and every block of a sequence comes from one instance (instance affinity), so its
attention never reads another instance's cache. An executor states its layout (``Executor.kv_layout``);
the engine's ``BlockManager`` allocates by it and the ``ModelRunner`` addresses slots by it.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    block_size: int
    num_instances: int = 1

    def __post_init__(self):
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {self.num_blocks}, {self.block_size}")
        if self.num_instances <= 0 or self.num_blocks % self.num_instances:
            raise ValueError(
                f"num_partitions must be > 0 and divide num_blocks={self.num_blocks}, got {self.num_instances}"
            )

    @classmethod
    def for_slots(cls, num_slots: int, block_size: int, num_instances: int = 1) -> "KVLayout":
        """The smallest layout with at least ``num_slots`` slots in whole blocks per instance."""
        per = num_instances * block_size
        return cls(-(-num_slots // per) * num_instances, block_size, num_instances)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_instance(self) -> int:
        return self.num_blocks // self.num_instances

    @property
    def slots_per_instance(self) -> int:
        return self.blocks_per_instance * self.block_size

    def instance_of_block(self, block):
        """The attention instance that holds ``block`` (int or int array)."""
        return block // self.blocks_per_instance

    def instance_of_slot(self, slot):
        """The attention instance that holds ``slot`` (int or int array; negative: padding)."""
        return slot // self.slots_per_instance

    def first_block(self, instance):
        """The first block of an instance's range (int or int array)."""
        return instance * self.blocks_per_instance

    def slots(self, block_table, positions) -> np.ndarray:
        """The cache slots of token ``positions`` (int array) of a sequence with ``block_table``."""
        table, pos = np.asarray(block_table, np.int32), np.asarray(positions)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)
