"""``KVLayout``: slots of positions, instance of a block / slot, rounding to whole blocks per instance."""

import numpy as np
import pytest

from jaxmoe.kv_layout import KVLayout


def test_slots_follow_the_block_table():
    kv = KVLayout(num_blocks=8, block_size=4)
    table = [0, 2]
    assert kv.slots(table, np.arange(7)).tolist() == [0, 1, 2, 3, 8, 9, 10]
    assert kv.blocks_for(0) == 0 and kv.blocks_for(4) == 1 and kv.blocks_for(5) == 2
    assert kv.num_slots == 32 and kv.slots_per_instance == 32


def test_instances_own_contiguous_ranges():
    kv = KVLayout(num_blocks=12, block_size=4, num_instances=3)  # blocks 0-3 | 4-7 | 8-11
    assert kv.blocks_per_instance == 4 and kv.slots_per_instance == 16
    assert [kv.instance_of_block(b) for b in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert kv.instance_of_slot(np.array([0, 15, 16, 47])).tolist() == [0, 0, 1, 2]
    assert kv.first_block(np.arange(3)).tolist() == [0, 4, 8]
    # a sequence on instance 1: every slot it writes is in instance 1's slot range
    slots = kv.slots([5, 7, 4], np.arange(12))
    assert set(kv.instance_of_slot(slots).tolist()) == {1}


def test_for_slots_rounds_up_to_whole_blocks_per_instance():
    kv = KVLayout.for_slots(num_slots=100, block_size=8, num_instances=2)
    assert kv.num_slots >= 100 and kv.num_blocks % 2 == 0 and kv.num_slots == 112
    assert KVLayout.for_slots(64, 8) == KVLayout(8, 8, 1)


@pytest.mark.parametrize("args", [(0, 4, 1), (4, 0, 1), (6, 4, 4), (6, 4, 0)])
def test_bad_layouts_are_refused(args):
    with pytest.raises(ValueError):
        KVLayout(*args)
