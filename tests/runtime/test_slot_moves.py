"""Expert replica slots moved with collectives (``runtime.slot_moves``), in one process (8 CPU devices).

The collective path of ``set_placement`` (``relayout_layer(..., collective=True)``: ppermute rounds
over the expert devices, the path taken when the expert sub-mesh spans processes) gives exactly the
arrays of the ``device_put`` path and of placing the new layout from the logical weights, on
layouts whose expert instances span both nodes; the rounds carry only the moved slots. (Expert
instances of several devices split their FFN columns, and the collective path refuses them:
tests/runtime/test_tensor_parallel.py.)
The two-process run is in tests/multihost/test_multiprocess.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxmoe.mesh import build_meshes, load_mesh
from jaxmoe.runtime import slot_moves
from jaxmoe.runtime.expert_program import place_layer, relayout_layer
from jaxmoe.runtime.replicas import ReplicaLayout, default_placement
from jaxmoe.janus.reshard import MoveStats, reshard_experts, rescaled_spec, reuse_placement
from mesh_layouts import MESHES

E, D, F = 8, 6, 5
LAYOUTS = {
    "1a7e": MESHES / "cpu-8-1a7e.yaml",  # 7 expert instances on both nodes
    "2a6e": MESHES / "cpu-8.yaml",  # 6 expert instances on both nodes
}


def _layer(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "moe": {
            "router": rng.standard_normal((D, E), dtype=np.float32),
            "w_gate": rng.standard_normal((E, D, F), dtype=np.float32),
            "w_up": rng.standard_normal((E, D, F), dtype=np.float32),
            "w_down": rng.standard_normal((E, F, D), dtype=np.float32),
        }
    }


def _random_placement(rng, N, C):
    """Every expert at least once, the other slots random experts or unused (-1)."""
    S = N * C
    slots = list(range(E)) + list(rng.integers(-1, E, S - E))
    rng.shuffle(slots)
    return [int(s) for s in slots]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collective_relayout_equals_device_put_and_fresh_placement(name):
    spec = load_mesh(LAYOUTS[name])
    sub = build_meshes(spec)
    N, C = spec.experts.count, spec.experts.slots_per_instance
    layer = _layer()
    rng = np.random.default_rng(1)
    old = ReplicaLayout(tuple(default_placement(E, N, C)), E, N, C)
    placed = place_layer(layer, old, sub, False)
    mover = slot_moves.mover_for(sub)
    for trial in range(3):
        new = ReplicaLayout(tuple(_random_placement(rng, N, C)), E, N, C)
        rounds0, rows0 = mover.collectives, mover.rows_moved
        by_collective, moved = relayout_layer(placed, old, new, sub, collective=True)
        by_device_put, moved_dp = relayout_layer(placed, old, new, sub, collective=False)
        fresh = place_layer(layer, new, sub, False)
        assert moved == moved_dp
        # moved: new slots filled from a slot on another instance (counted by hand)
        assert moved == sum(
            1
            for s, e in enumerate(new.slot_to_expert)
            if e >= 0 and old.slot_to_expert[s] != e and all(h // C != s // C for h in old.replicas(e))
        )
        for k in ("w_gate", "w_up", "w_down"):
            got = by_collective[k]
            assert got.sharding == fresh[k].sharding and got.shape == fresh[k].shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(fresh[k]))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(by_device_put[k]))
            for shard in got.addressable_shards:  # every device of an instance holds its slots
                j = shard.index[0].start // C
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(fresh[k])[j * C : (j + 1) * C])
        assert by_collective["router"] is placed["router"]
        # rows that crossed devices: one per moved slot and per device of its instance
        tp = spec.experts.devices_per_instance
        assert mover.rows_moved - rows0 == moved * tp
        assert (mover.collectives > rounds0) == (moved > 0)
        placed, old = by_collective, new


def test_rounds_pack_the_copies():
    copies = [
        slot_moves.RowCopy(0, 1, 1, 0),
        slot_moves.RowCopy(0, 2, 1, 3),  # same pair: one hop of 2 rows
        slot_moves.RowCopy(2, 0, 1, 1),  # dst 1 busy in the first round
        slot_moves.RowCopy(1, 0, 2, 2),
        slot_moves.RowCopy(2, 3, 0, 0),
    ]
    keep = {0: (-1, 1, 2, 3), 1: (-1, -1, 2, -1), 2: (0, 1, -1, 3)}
    plan = slot_moves.SlotPlan((0, 1, 2), 4, 4, keep, tuple(copies))
    plan.check()
    rounds = plan.rounds()
    seen = []
    for r in rounds:
        srcs, dsts = [s for s, _ in r.pairs], [d for _, d in r.pairs]
        assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
        assert {len(a) for a, _ in r.rows} == {len(b) for _, b in r.rows} == {r.k}
        for (s, d), (a, b) in zip(r.pairs, r.rows):
            seen += [(s, x, d, y) for x, y in zip(a, b)]
    assert sorted(seen) == sorted((c.src, c.src_row, c.dst, c.dst_row) for c in copies)
    # the 2-row hop alone; source 2 sends twice: 3 rounds
    assert [r.k for r in rounds] == [2, 1, 1]
    with pytest.raises(ValueError, match="writes a row twice"):
        slot_moves.SlotPlan((0, 1), 4, 4, {1: (0, -1, -1, -1)}, (slot_moves.RowCopy(0, 0, 1, 0),)).check()


def test_fixed_rounds_pair_every_device_and_pad_to_a_bucket():
    """The KV move's rounds, fixed before the copies are known: every (old, other new) device pair,
    distinct sources and destinations per round; a plan's copies fall in them, padded to the
    smallest bucket holding its busiest pair; copies outside the pairs or past the rows are refused."""
    fixed = slot_moves.FixedRounds.between([0, 4], [0, 1, 2, 3], 256, 128, 8)
    pairs = [p for r in fixed.rounds for p in r]
    assert sorted(pairs) == [(0, 1), (0, 2), (0, 3), (4, 0), (4, 1), (4, 2), (4, 3)]
    for r in fixed.rounds:
        assert len({s for s, _ in r}) == len(r) == len({d for _, d in r})
    assert len(fixed.rounds) == 4 and fixed.buckets == (8, 32, 128) and fixed.devices == (0, 1, 2, 3, 4)
    copies = tuple(slot_moves.RowCopy(4, 16 + i, 1, 40 + i) for i in range(9))  # 9 rows: the bucket of 32
    plan = slot_moves.SlotPlan(fixed.devices, 256, 128, {0: tuple(range(128))}, copies)
    run = fixed.for_plan(plan)
    assert run.k == 32
    rounds = run.rounds_for(plan)
    got = {p: rows for r in rounds for p, rows in zip(r.pairs, r.rows)}
    assert got[4, 1] == (tuple(range(16, 25)), tuple(range(40, 49))) and got[0, 1] == ((), ())
    tables = slot_moves._round_tables(
        next(r for r in rounds if (4, 1) in r.pairs), {d: d for d in range(5)}, 5, 128, 32
    )
    assert list(tables[1][1]) == list(range(40, 49)) + [128] * 23  # padding rows are written nowhere
    with pytest.raises(ValueError, match="do not pair"):
        run.rounds_for(dataclasses.replace(plan, copies=(slot_moves.RowCopy(1, 0, 2, 0),)))
    with pytest.raises(ValueError, match="devices or rows differ"):
        fixed.for_plan(dataclasses.replace(plan, old_rows=128))


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, target", [("cpu-8-1a7e", (2, 6)), ("cpu-8-1a7e", (4, 4)), ("cpu-8", (1, 7)), ("cpu-8", (3, 2))]
)
def test_collective_reshard_equals_device_put_and_fresh_placement(mesh, target):
    """Live re-scaling's expert re-shard (mesh -> target): the collective path == the device_put path
    == placing the new layout from the logical weights, router included; the same stats. cpu-8 (2a6e)
    -> 1a7e: device 1 becomes an expert device (it gets the router)."""
    spec = load_mesh(MESHES / f"{mesh}.yaml")
    sub = build_meshes(spec)
    N, C = spec.experts.count, spec.experts.slots_per_instance
    layer = _layer(2)
    old = ReplicaLayout(tuple(default_placement(E, N, C)), E, N, C)
    placed = place_layer(layer, old, sub, False)
    new_spec = rescaled_spec(spec, *target)
    new_sub = build_meshes(new_spec)
    n2 = new_spec.experts.count
    new = ReplicaLayout(tuple(reuse_placement(old, spec, new_spec)), E, n2, C)
    mover = slot_moves.mover_for(new_sub)
    rows0 = mover.rows_moved
    stats_c, stats_d = MoveStats(), MoveStats()
    by_collective = reshard_experts(placed, old, sub, new, new_sub, stats_c, collective=True)
    by_device_put = reshard_experts(placed, old, sub, new, new_sub, stats_d, collective=False)
    fresh = place_layer(layer, new, new_sub, False)
    assert stats_c == stats_d and stats_c.expert_slots_local + stats_c.expert_slots_copied == new.used().sum()
    assert stats_c.expert_slots_local > 0
    assert set(by_collective) == set(fresh)
    for k in fresh:
        assert by_collective[k].sharding == fresh[k].sharding, k
        np.testing.assert_array_equal(np.asarray(by_collective[k]), np.asarray(fresh[k]))
        np.testing.assert_array_equal(np.asarray(by_device_put[k]), np.asarray(fresh[k]))
    # rows that crossed devices: the copied slots, plus the router for each new expert device that
    # was no expert device before
    gained = len({i[0] for i in new_spec.experts.devices} - {i[0] for i in spec.experts.devices})
    assert mover.rows_moved - rows0 == stats_c.expert_slots_copied + gained * D
