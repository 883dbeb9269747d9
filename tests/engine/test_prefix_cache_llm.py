"""Prefix caching through ``LLM``: outputs with the cache equal those without it (greedy tokens, logprobs
within 1e-3) for prompts that share 0-100 % of their blocks, run concurrently (and sharing a prefix
nobody cached yet: the later ones wait for it and compute fewer prefill tokens), on both executors and
several model families; across recompute preemptions, ``drop_all_kv`` and live re-scaling; prompt
logprobs and brownout thresholds bypass it; and the disaggregated dispatcher sends a repeated prompt
to the attention instance that cached it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.dispatch import instance_loads

BLOCK = 8
ENGINE = dict(num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_prefill_chunk=32)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)


def shared_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts sharing 0 %, a part, and all of their full blocks with ``base`` (and with each other)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(6, 250, 5 * BLOCK).tolist()  # 5 full blocks
    tail = lambda n: rng.integers(6, 250, n).tolist()  # noqa: E731
    return [
        tail(21),  # shares nothing
        base[:BLOCK] + tail(3),  # 1 of 1 (11 tokens)
        base[: 3 * BLOCK] + tail(5),  # 3 of 3
        base[: 2 * BLOCK + 3] + tail(9),  # 2 of 3 (diverges inside the third)
        base,  # the whole prompt cached: its last block is computed again
        base + tail(2),  # 5 of 5
    ]


def generate_twice(llm, prompts):
    """The prompts once to fill the cache (``base`` alone), then all of them at once."""
    llm.generate([prompts[-2]], GREEDY)
    return llm.generate(prompts, GREEDY)


def assert_same(cached, plain, tol=1e-3):
    for c, p in zip(cached, plain):
        assert c.token_ids == p.token_ids
        assert np.allclose([t.logprob for t in c.logprobs], [t.logprob for t in p.logprobs], atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", pytest.param("deepseek_v2", marks=pytest.mark.slow)])
def test_cached_and_uncached_outputs_agree_monolithic(checkpoint_dir, family):
    path = checkpoint_dir(family)
    prompts = shared_prompts()
    plain_llm = LLM(path, dtype="float32", prefix_caching=False, **ENGINE)
    plain = generate_twice(plain_llm, prompts)
    llm = LLM(path, dtype="float32", **ENGINE)
    cached = generate_twice(llm, prompts)
    assert_same(cached, plain)
    assert [o.num_cached_tokens for o in cached] == [0, 8, 24, 16, 32, 40]
    assert all(o.num_cached_tokens == 0 for o in plain)
    st = llm.engine.scheduler.stats()
    assert st["prefix_cache_hits"] == 8 + 24 + 16 + 32 + 40 and st["prefix_cache_blocks"] > 0
    # submitted together, sharing 6 full blocks (2 prefill chunks) nobody cached yet: the later two
    # wait while the first computes them and read them from the cache
    rng = np.random.default_rng(9)
    prefix = rng.integers(6, 250, 6 * BLOCK + 4).tolist()
    burst = [prefix + rng.integers(6, 250, 5).tolist() for _ in range(3)]
    counts, outs = [], []
    for engine in (plain_llm, llm):
        before = engine.engine.scheduler.num_prefill_tokens
        outs.append(engine.generate(burst, GREEDY))
        counts.append(engine.engine.scheduler.num_prefill_tokens - before)
    plain_outs, outs = outs
    assert_same(outs, plain_outs)
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48] and llm.engine.scheduler.prefix_cache_waits > 0
    assert counts == [3 * 57, 57 + 2 * 9]


@pytest.mark.slow
def test_preemption_drop_all_kv_and_scoring_with_the_cache():
    """A cache too small for the batch: recompute preemptions evict cached blocks and re-admitted
    sequences read the cache again; outputs still equal the uncached run's. ``drop_all_kv`` forgets
    the cache; a request asking for prompt logprobs computes its whole prompt."""
    small = dict(num_blocks=12, block_size=BLOCK, max_num_seqs=8, max_prefill_chunk=32)
    prompts = shared_prompts(2)
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    plain = LLM("tiny-random", prefix_caching=False, **small).generate(prompts, sp)
    llm = LLM("tiny-random", **small)
    cached = llm.generate(prompts, sp)
    assert_same(cached, plain)
    sched = llm.engine.scheduler
    assert sum(sched.preemptions["recompute"].values()) > 0 and llm.engine.block_manager.num_evictions > 0
    again = llm.generate(prompts[-1], sp)[0]
    assert again.num_cached_tokens == 40 and again.token_ids == plain[-1].token_ids
    sched.drop_all_kv()
    assert llm.engine.block_manager.num_cached_blocks == 0
    assert llm.generate(prompts[-1], sp)[0].num_cached_tokens == 0
    scored = llm.generate(prompts[-1], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == len(prompts[-1])


@pytest.mark.slow
def test_cache_salt_through_the_engine():
    llm = LLM("tiny-random", **ENGINE)
    prompt = shared_prompts()[-1]
    eng = llm.engine
    ids = [eng.add_request(prompt, GREEDY, cache_salt="tenant-a")]
    eng.run_until_done()
    for salt, want in (("tenant-b", 0), (None, 0), ("tenant-a", 40)):
        rid = eng.add_request(prompt, GREEDY, cache_salt=salt)
        assert eng.run_until_done()[rid].num_cached_tokens == want, salt
        ids.append(rid)
    with pytest.raises(ValueError, match="cache_salt"):
        eng.add_request(prompt, GREEDY, cache_salt=3)


@pytest.mark.slow
def test_repeated_prompt_goes_to_the_instance_that_cached_it(checkpoint_dir):
    """Disaggregated (2 attention instances): a long prompt served once is cached on one instance;
    sent again while that instance is the busier one (by less than the cached tokens) it still lands
    there, reads the cache, and matches the uncached output."""
    llm = LLM(checkpoint_dir("mixtral"), dtype="float32", mesh="meshes/cpu-8.yaml", **ENGINE)
    eng, bm = llm.engine, llm.engine.block_manager
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = shared_prompts(3)[-1]  # 42 tokens, 5 full blocks
    busy0 = eng.add_request([9] * 3, long)
    eng.step()
    first = eng.add_request(prompt, GREEDY)
    eng.step()
    home = bm.partition_of(eng.scheduler.get(first))
    assert home != bm.partition_of(eng.scheduler.get(busy0))  # the least loaded one
    while eng.scheduler.get(first) is not None:
        eng.step()
    busy1 = eng.add_request([9] * 3, long)
    eng.step()
    assert bm.partition_of(eng.scheduler.get(busy1)) == home  # now the least loaded again
    loads = instance_loads(bm, eng.scheduler.sequences())
    assert loads[home] > loads[1 - home]  # home is the busier instance now
    again = eng.add_request(prompt, GREEDY)
    eng.step()
    assert bm.partition_of(eng.scheduler.get(again)) == home
    out = eng.run_until_done()
    assert out[again].num_cached_tokens == 40
    plain = LLM(checkpoint_dir("mixtral"), dtype="float32", mesh="meshes/cpu-8.yaml", prefix_caching=False, **ENGINE)
    assert_same([out[again]], plain.generate([prompt], GREEDY))
