"""Block-to-instance affinity of the KV cache in the disaggregated runtime.

Through the public path (``LLM(path, mesh=...)``): the block manager has one partition per
attention instance, each exactly that instance's slot range; the runner puts every row on the
instance that holds its blocks, so the executor runs attention per instance (``is_local``) with no
collectives; greedy tokens equal the monolithic executor's.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import Row
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.runtime.attention_program import attention_side_params

ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)
PROMPTS = [[(7 * i + 3 * n) % 200 + 1 for i in range(n)] for n in (3, 9, 17, 26, 40, 5)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
COLLECTIVE = re.compile(r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\(")


@pytest.fixture(scope="module")
def llms(checkpoint_dir):
    made = {}

    def get(family, mesh=None):
        if (family, mesh) not in made:
            made[family, mesh] = LLM(checkpoint_dir(family), dtype="float32", mesh=mesh, **ENGINE)
        return made[family, mesh]

    return get


def _record_batches(runner):
    """Wraps ``runner.prepare``; returns the list it appends (rows, prepared) to."""
    seen, prepare = [], runner.prepare

    def spy(rows):
        out = prepare(rows)
        seen.append((rows, out))
        return out

    runner.prepare = spy
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, mesh",
    [
        ("deepseek_v2", "meshes/cpu-8.yaml"),  # 2 instances, MLA
        ("mixtral", "meshes/cpu-8-4a4e.yaml"),
    ],
)  # 4 instances, GQA
def test_rows_and_blocks_stay_on_their_instance(llms, family, mesh):
    dis = llms(family, mesh)
    ex, bm, runner = dis.executor, dis.engine.block_manager, dis.engine.runner
    m = ex.num_attention
    assert bm.num_partitions == m and bm.num_blocks * bm.block_size == ex.num_cache_slots
    seen = _record_batches(runner)
    try:
        got = [o.token_ids for o in dis.generate(PROMPTS, GREEDY)]
    finally:
        del runner.prepare
    assert got == [o.token_ids for o in llms(family).generate(PROMPTS, GREEDY)]

    per, used = ex.num_cache_slots // m, set()
    for rows, (tokens, batch, _, where) in seen:
        R = tokens.shape[0] // m
        for row, w in zip(rows, where):
            inst = w // R
            used.add(inst)
            assert {b // bm.blocks_per_partition for b in row.block_table} == {inst}
            slots = batch.slots[w][batch.slots[w] >= 0]
            assert len(slots) and (slots // per == inst).all()
        assert ex.is_local(batch)  # so attention ran per instance
    assert used == set(range(m))  # the sequences were spread over all instances
    assert bm.num_free == bm.num_blocks


@pytest.mark.slow
def test_local_attention_program_has_no_collectives(llms):
    ex = llms("mixtral", "meshes/cpu-8-4a4e.yaml").executor
    B, T, NB = 8, 4, 4
    rows = ex.attention.rows
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)  # noqa: E731
    x = spec((B, T, ex.cfg.hidden_size), np.float32)
    batch = AttentionBatch(spec((B, T), np.int32), spec((B, T), np.int32), spec((B, NB), np.int32))
    layer = attention_side_params(ex.params["layers"][0])

    def collectives(local):
        return COLLECTIVE.findall(ex.attention.layer.lower(layer, x, x, batch, ex.cache[0], local).compile().as_text())

    assert collectives(local=False) and not collectives(local=True)


@pytest.mark.slow
def test_rows_spanning_instances_fall_back_to_the_partitioned_program(llms):
    """Blocks of one row on two instances: not local, still the monolithic result."""
    dis, mono = llms("mixtral", "meshes/cpu-8-4a4e.yaml"), llms("mixtral")
    rows = [Row(PROMPTS[2], 0, [40, 5, 60]), Row(PROMPTS[0], 0, [9])]
    tokens, batch, last, where = dis.engine.runner.prepare(rows)
    assert list(where) == [2, 0] and not dis.executor.is_local(batch)  # row 0 on instance 2 (blocks 32-47)
    got, want = dis.engine.runner.forward(rows), mono.engine.runner.forward(rows)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-5 * np.abs(np.asarray(want)).max()
