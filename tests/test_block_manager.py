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
    assert bm.allocate(a, 5) == [0, 1]          # 5 tokens -> 2 blocks
    assert bm.allocate(a, 8) == []              # still covered
    assert bm.allocate(a, 9) == [2]             # grows by one block
    assert a.block_table == [0, 1, 2] and bm.num_free == 5
    assert bm.utilization() == pytest.approx(3 / 8)
    assert bm.free(a) == 3
    assert a.block_table == [] and bm.num_free == 8 and bm.utilization() == 0.0


def test_can_allocate_from_scratch_and_for_growth():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a")
    assert bm.can_allocate(16) and not bm.can_allocate(17)
    bm.allocate(a, 12)                          # 3 blocks, 1 free
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    assert bm.can_allocate(16, a) and not bm.can_allocate(17, a)
    assert bm.num_blocks_needed(a, 13) == 1 and bm.num_blocks_needed(a, 3) == 0


def test_allocate_failure_is_atomic():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    with pytest.raises(MemoryError):
        bm.allocate(b, 4)                       # needs 2, 1 free
    assert b.block_table == [] and bm.num_free == 1


def test_slot_mapping_follows_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)                           # a: [0]
    bm.allocate(b, 4)                           # b: [1]
    bm.allocate(a, 7)                           # a: [0, 2] -- not contiguous
    assert a.block_table == [0, 2]
    # slot = block_table[p // bs] * bs + p % bs
    assert bm.slot_mapping(a, 0, 7) == [0, 1, 2, 3, 8, 9, 10]
    assert bm.slot_mapping(a, 5, 6) == [9]
    assert bm.slot_mapping(b, 2, 4) == [6, 7]
    assert bm.slot_mapping(a, 3, 3) == []
    with pytest.raises(IndexError):
        bm.slot_mapping(a, 0, 9)                # beyond the 2 blocks


def test_freed_blocks_are_reused_and_ownership_checked():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    bm.free(a)
    bm.allocate(b, 4)
    assert sorted(b.block_table) == [0, 1]
    a.block_table = [0]                         # forged table: not a's block
    with pytest.raises(RuntimeError):
        bm.free(a)
    assert bm.num_free == 0                     # the failed free changed nothing
    assert bm.free(b) == 2 and bm.num_free == 2


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
