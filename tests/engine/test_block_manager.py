"""Paged KV block allocator: allocation, free, utilisation, slot mapping."""

import pytest

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.sequence import Sequence


def seq(rid="a", n=1):
    return Sequence(rid, list(range(n)))


def test_allocate_grows_table_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a")
    assert bm.num_free == 8 and bm.utilization() == 0.0
    assert bm.allocate(a, 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert bm.allocate(a, 8) == []  # still covered
    assert bm.allocate(a, 9) == [2]  # grows by one block
    assert a.block_table == [0, 1, 2] and bm.num_free == 5
    assert bm.utilization() == pytest.approx(3 / 8)
    assert bm.free(a) == 3
    assert a.block_table == [] and bm.num_free == 8 and bm.utilization() == 0.0


def test_can_allocate_from_scratch_and_for_growth():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a")
    assert bm.can_allocate(16) and not bm.can_allocate(17)
    bm.allocate(a, 12)  # 3 blocks, 1 free
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    assert bm.can_allocate(16, a) and not bm.can_allocate(17, a)
    assert bm.num_blocks_needed(a, 13) == 1 and bm.num_blocks_needed(a, 3) == 0


def test_allocate_failure_is_atomic():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    with pytest.raises(MemoryError):
        bm.allocate(b, 4)  # needs 2, 1 free
    assert b.block_table == [] and bm.num_free == 1


def test_slot_mapping_follows_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)  # a: [0]
    bm.allocate(b, 4)  # b: [1]
    bm.allocate(a, 7)  # a: [0, 2] -- not contiguous
    assert a.block_table == [0, 2]
    # slot = block_table[p // bs] * bs + p % bs
    assert bm.slot_mapping(a, 0, 7) == [0, 1, 2, 3, 8, 9, 10]
    assert bm.slot_mapping(a, 5, 6) == [9]
    assert bm.slot_mapping(b, 2, 4) == [6, 7]
    assert bm.slot_mapping(a, 3, 3) == []
    with pytest.raises(IndexError):
        bm.slot_mapping(a, 0, 9)  # beyond the 2 blocks


def test_freed_blocks_are_reused_and_ownership_checked():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    bm.free(a)
    bm.allocate(b, 4)
    assert sorted(b.block_table) == [0, 1]
    a.block_table = [0]  # forged table: not a's block
    with pytest.raises(RuntimeError):
        bm.free(a)
    assert bm.num_free == 0  # the failed free changed nothing
    assert bm.free(b) == 2 and bm.num_free == 2


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# -- partitions (block-to-instance affinity) ------------------------------------


def test_partitions_pick_most_free_and_keep_a_sequence_in_one():
    bm = BlockManager(num_blocks=8, block_size=2, num_partitions=2)  # blocks 0-3 | 4-7
    a, b, c = seq("a"), seq("b"), seq("c")
    assert bm.blocks_per_partition == 4 and bm.max_seq_tokens == 8 and bm.capacity_tokens == 16
    assert bm.partition_of(a) is None
    assert bm.allocate(a, 3) == [0, 1]  # tie: lowest partition
    assert bm.allocate(b, 2) == [4]  # partition 1 has more free blocks
    assert bm.allocate(c, 2) == [5]  # 2 free in p0, 3 in p1
    assert bm.allocate(a, 8) == [2, 3]  # a grows in its own partition only
    assert [bm.partition_of(s) for s in (a, b, c)] == [0, 1, 1]
    assert bm.num_free == 2 and bm.utilization() == pytest.approx(6 / 8)
    assert not bm.can_allocate(10, a) and bm.num_free_for(a) == 0
    with pytest.raises(MemoryError):
        bm.allocate(a, 10)  # p0 is full although p1 has 2 free blocks
    assert bm.can_allocate(6, b) and not bm.can_allocate(7, b)  # b: 1 block + 2 free
    assert bm.can_allocate(4) and not bm.can_allocate(5)  # a new one: the best partition
    assert bm.free(a) == 4 and bm.num_free_for(a) == 4  # a holds nothing: best partition
    assert bm.allocate(a, 2) == [0]  # p0 (4 free) again, blocks back in their own list
    assert bm.partition_of(a) == 0 and bm.free(b) == 1 and bm.free(c) == 1
    assert bm.allocate(b, 8) == [6, 7, 4, 5]  # FIFO within p1: freed blocks at the end
    assert bm.free(a) + bm.free(b) == 5 and bm.num_free == 8


def test_partitions_must_divide_blocks():
    with pytest.raises(ValueError):
        BlockManager(6, 4, num_partitions=4)
    with pytest.raises(ValueError):
        BlockManager(6, 4, num_partitions=0)
    assert BlockManager(6, 4, num_partitions=3).max_seq_tokens == 8
