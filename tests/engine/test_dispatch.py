"""Dispatch of new sequences over attention instances by load (``jaxmoe.engine.dispatch``).

An instance's load is the tokens its sequences still have to compute (queued prefill + outputs
still to generate). Under an uneven load the new sequence goes to the less-loaded instance, even
when the other one has more free KV blocks (the old rule); tokens do not change.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.dispatch import choose_instance, instance_loads, sequence_load
from jaxmoe.engine.scheduler import Scheduler
from jaxmoe.engine.sequence import Sequence

ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)


def _seq(rid, n_prompt, max_tokens):
    return Sequence(rid, list(range(1, n_prompt + 1)), SimpleNamespace(max_tokens=max_tokens))


def test_sequence_load_counts_prefill_and_outputs_to_come():
    s = _seq("a", 10, 5)
    assert sequence_load(s) == 10 + 5
    s.num_computed, s.output_ids = 10, [1, 2]
    assert sequence_load(s) == 3
    assert sequence_load(_seq("b", 4, None)) == 4 + 1


def test_new_sequence_goes_to_the_less_loaded_instance():
    """Instance 0: one short prompt with 60 tokens to generate (1 block). Instance 1: a long prompt
    with 1 token to go (4 blocks, fewer free). The old rule (most free blocks) picks 0; load picks 1."""
    bm = BlockManager(num_blocks=16, block_size=8, num_partitions=2)  # 8 blocks per instance
    sched = Scheduler(bm, max_batch_tokens=256)
    busy, nearly_done = _seq("busy", 3, 60), _seq("nearly_done", 30, 1)
    for s in (busy, nearly_done):
        sched.add(s)
    sched.schedule()
    assert (bm.partition_of(busy), bm.partition_of(nearly_done)) == (0, 1)
    assert bm.num_free_in(0) > bm.num_free_in(1)
    assert instance_loads(bm, sched.sequences()) == [3 + 60, 30 + 1]

    new = _seq("new", 5, 4)
    sched.add(new)
    batch = sched.schedule()
    assert new in [s for s, _, _ in batch.prefills]
    assert bm.partition_of(new) == 1
    assert BlockManager(16, 8, 2)._partition_for(None) == 0  # what the free-blocks rule alone would give


def test_no_room_on_the_less_loaded_instance_falls_back():
    bm = BlockManager(num_blocks=8, block_size=4, num_partitions=2)  # 4 blocks per instance
    sched = Scheduler(bm, max_batch_tokens=256)
    long_short = _seq("full", 16, 1)  # fills instance 0: 4 blocks, load 17
    sched.add(long_short)
    sched.schedule()
    busy = _seq("busy", 2, 50)
    sched.add(busy)
    sched.schedule()
    assert (bm.partition_of(long_short), bm.partition_of(busy)) == (0, 1)
    assert choose_instance(bm, sched.sequences(), 1) == 1  # instance 0 has no free block
    assert choose_instance(bm, sched.sequences(), 4) is None  # no instance holds 4 blocks


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(checkpoint_dir("mixtral"), dtype="float32", mesh="meshes/cpu-8.yaml", **ENGINE)


@pytest.mark.slow
def test_engine_dispatches_by_load_and_tokens_unchanged(llm, checkpoint_dir):
    """Through the engine on 2 attention instances: the long-running request sits on instance 0,
    a long prompt that is almost done on instance 1 (more blocks); a new request joins instance 1.
    Every greedy output equals its standalone (monolithic) output."""
    engine, bm = llm.engine, llm.engine.block_manager
    prompts = {
        "busy": [5, 9, 13],
        "nearly_done": [(3 * i) % 150 + 1 for i in range(30)],
        "new": [17, 4, 66, 8, 21],
    }
    params = {"busy": 24, "nearly_done": 3, "new": 6}
    seqs = {}
    for rid in ("busy", "nearly_done"):
        engine.add_request(prompts[rid], SamplingParams(max_tokens=params[rid], ignore_eos=True), request_id=rid)
    outs = {o.request_id: o for o in engine.step()}  # both prefill in one step
    seqs = {s.request_id: s for s in engine.scheduler.sequences()}
    assert (bm.partition_of(seqs["busy"]), bm.partition_of(seqs["nearly_done"])) == (0, 1)
    assert bm.num_free_in(0) > bm.num_free_in(1)
    engine.add_request(prompts["new"], SamplingParams(max_tokens=params["new"], ignore_eos=True), request_id="new")
    outs.update({o.request_id: o for o in engine.step()})
    new = next(s for s in engine.scheduler.sequences() if s.request_id == "new")
    assert bm.partition_of(new) == 1
    outs.update(engine.run_until_done(timeout=120))
    assert bm.num_used == 0
    mono = LLM(checkpoint_dir("mixtral"), dtype="float32", **ENGINE)
    for rid, prompt in prompts.items():
        want = mono.generate([prompt], SamplingParams(max_tokens=params[rid], ignore_eos=True))[0].token_ids
        assert outs[rid].token_ids == want, rid
