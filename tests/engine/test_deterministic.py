"""Deterministic (batch-invariant) mode: a request's greedy tokens and logprobs are bit-identical alone,
beside other requests, with its prompt chunked differently, with its prefix read from the cache, and
after a recompute preemption re-prefilled its prompt and generated tokens, and when it waited for a
prefix another request was computing (that one aborted or not); in both of its forms (the
batch-invariant CPU kernels on the ordinary bucketed shapes, and one fixed shape with dense experts),
and on the disaggregated executor, across a live re-scale too; seeded top-k / top-p / min-p draws too."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.assembly import deterministic_expert_impl
from jaxmoe.demo import demo_config
from jaxmoe.engine.config import EngineConfig
from jaxmoe.models.transformer import invariant_unsupported

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)


def logprobs(out) -> np.ndarray:
    return np.array([t.logprob for t in out.logprobs], np.float32)


def assert_identical(a, b):
    assert a.token_ids == b.token_ids
    assert np.array_equal(logprobs(a), logprobs(b))  # bit for bit, not approximately


def workload(seed=0):
    rng = np.random.default_rng(seed)
    target = rng.integers(6, 250, 40).tolist()
    others = [rng.integers(6, 250, n).tolist() for n in (13, 57, 30, 5, 70)]
    return target, others


def check(llm, target, others):
    eng = llm.engine
    alone = llm.generate([target], SP)[0]
    cached = llm.generate([target], SP)[0]
    assert cached.num_cached_tokens == 32
    assert_identical(cached, alone)
    eng.block_manager.reset_prefix_cache()
    batched = llm.generate(others[:3] + [target] + others[3:], SP)[3]
    assert batched.num_cached_tokens == 0
    assert_identical(batched, alone)
    eng.block_manager.reset_prefix_cache()
    chunk, eng.scheduler.max_prefill_chunk = eng.scheduler.max_prefill_chunk, 7  # boundaries inside blocks
    try:
        assert_identical(llm.generate([target], SP)[0], alone)
    finally:
        eng.scheduler.max_prefill_chunk = chunk
    eng.block_manager.reset_prefix_cache()
    rid = eng.add_request(target, SP)
    for prompt in others[:2]:
        eng.add_request(prompt, SP)
    for _ in range(5):  # the prompt and a few tokens computed, then the KV is lost
        eng.step()
    assert eng.scheduler.get(rid).num_output_tokens >= 1
    eng.scheduler.drop_all_kv()  # recompute: prompt + generated tokens re-prefilled in chunks
    assert_identical(eng.run_until_done()[rid], alone)
    check_shared_prefix_in_flight(llm)


def check_shared_prefix_in_flight(llm):
    """Three prompts sharing two full blocks, submitted together: the later two wait while the first
    computes the prefix and then read it from the cache, computing fewer prefill tokens in all than
    with caching off, with identical tokens and logprobs; with the first aborted while they wait, they
    still finish identically."""
    eng, bm = llm.engine, llm.engine.block_manager
    rng = np.random.default_rng(5)
    prefix = rng.integers(6, 250, 2 * bm.block_size + 4).tolist()  # diverges inside the third block
    prompts = [prefix + rng.integers(6, 250, 7).tolist() for _ in range(3)]

    def run(caching):
        bm.reset_prefix_cache()
        bm.prefix_caching, before = caching, eng.scheduler.num_prefill_tokens
        try:
            return llm.generate(prompts, SHORT), eng.scheduler.num_prefill_tokens - before
        finally:
            bm.prefix_caching = True

    plain, plain_tokens = run(False)
    cached, cached_tokens = run(True)
    assert [o.num_cached_tokens for o in cached] == [0, 32, 32] and plain_tokens == 3 * 43
    assert cached_tokens == 43 + 2 * 11
    for c, p in zip(cached, plain):
        assert_identical(c, p)
    bm.reset_prefix_cache()
    waits = eng.scheduler.prefix_cache_waits
    rids = [eng.add_request(p, SHORT) for p in prompts]
    eng.step()  # the first prompt's first chunk; the others wait for it
    assert eng.scheduler.prefix_cache_waits == waits + 2
    eng.abort(rids[0])
    out = eng.run_until_done()
    assert rids[0] not in out and out[rids[2]].num_cached_tokens == 32
    for rid, p in zip(rids[1:], plain[1:]):
        assert_identical(out[rid], p)


@pytest.mark.slow
def test_deterministic_mode_is_batch_chunk_cache_and_preemption_invariant():
    """The CPU kernels' form: bucketed shapes (decodes of 1 and 8 rows, prefill chunks of 16-64 tokens in
    one call or many), each token's sums in an order of its own."""
    if invariant_unsupported(demo_config()) is not None:
        pytest.skip(f"the batch-invariant CPU kernels cannot run here: {invariant_unsupported(demo_config())}")
    llm = LLM("tiny-random", deterministic=True, block_size=16, num_blocks=128, max_num_seqs=8, max_prefill_chunk=64)
    assert llm.engine.executor.expert_impl == "cpu_kernel_invariant"
    assert llm.engine.scheduler.max_prefill_chunk == 64 and len(llm.engine.runner.plan.shapes()) > 1
    check(llm, *workload())


@pytest.mark.slow
def test_fixed_shape_deterministic_mode_is_batch_chunk_cache_and_preemption_invariant():
    """The form that needs no CPU kernel (other platforms, MLA): one step shape, dense experts."""
    llm = LLM("tiny-random", deterministic=True, expert_impl="dense", block_size=16, num_blocks=128, max_num_seqs=8)
    assert llm.engine.runner.plan.shapes() == [(8, 16)] and llm.engine.scheduler.max_prefill_chunk == 16
    check(llm, *workload())


def check_sampling(llm, target, others):
    """A seeded top-k / top-p / min-p request draws the same tokens (and logprobs) alone and beside rows
    that sample otherwise or greedily."""
    sp = SamplingParams(
        max_tokens=6, temperature=0.9, top_k=40, top_p=0.85, min_p=0.02, seed=7, ignore_eos=True, logprobs=0
    )
    mixed = [
        SamplingParams(max_tokens=6, temperature=1.2, top_p=0.5, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=2, ignore_eos=True),
    ]
    alone = llm.generate([target], sp)[0]
    batched = llm.generate(others[:3] + [target], mixed + [sp])[3]
    assert_identical(batched, alone)
    assert len(set(alone.token_ids)) > 1  # sampled, not stuck on one token


@pytest.mark.slow
def test_disaggregated_deterministic_mode_is_batch_chunk_cache_preemption_sampling_and_rescale_invariant():
    """The disaggregated executor on the smallest test mesh (2 attention, 6 expert instances of 4 slots:
    the 8 experts have replicas, so AEBS places a token's experts by the batch's load): the attention
    program, the gate, the expert FFN over AEBS's replicas and the transfers give each token's results
    whatever it is batched with; the sampler's top-k / top-p / min-p draws too; and a live re-scale
    changes no token or logprob."""
    if invariant_unsupported(demo_config()) is not None:
        pytest.skip(f"the batch-invariant CPU kernels cannot run here: {invariant_unsupported(demo_config())}")
    llm = LLM(
        "tiny-random",
        mesh="meshes/cpu-8.yaml",
        deterministic=True,
        block_size=16,
        num_blocks=128,
        max_num_seqs=8,
        max_prefill_chunk=64,
    )
    assert llm.engine.executor.expert_impl == "cpu_kernel_invariant"
    target, others = workload()
    check(llm, target, others)
    check_sampling(llm, target, others)
    check_across_a_rescale(llm, target, others)


def check_across_a_rescale(llm, target, others):
    """Across a live re-scale (2a6e -> 4a4e: the attention instances, the experts' devices and AEBS's
    replicas change): the request's tokens and logprobs are those it had before, read from the cache
    and computed anew, alone and in a batch."""
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    before = llm.generate([target], SP)[0]
    llm.rescale(4, 4)
    assert (llm.executor.num_attention, llm.executor.num_expert_instances) == (4, 4)
    assert_identical(llm.generate([target], SP)[0], before)  # from the cache, if the re-scale kept it
    eng.block_manager.reset_prefix_cache()
    fresh = llm.generate(others[:2] + [target], SP)[2]
    assert fresh.num_cached_tokens == 0
    assert_identical(fresh, before)
    cached = llm.generate([target], SP)[0]
    assert cached.num_cached_tokens == 32
    assert_identical(cached, before)


def test_deterministic_mode_on_a_mesh_needs_the_invariant_kernels():
    with pytest.raises(ValueError, match="deterministic mode with a mesh file runs on the batch-invariant"):
        LLM("tiny-random", mesh="meshes/cpu-8.yaml", deterministic=True, expert_impl="dense")


def test_deterministic_config():
    assert EngineConfig(deterministic=True).expert_impl == "auto"  # resolved with the model (assembly)
    with pytest.raises(ValueError, match="expert_impl"):
        EngineConfig(deterministic=True, expert_impl="cpu_kernel")  # its work split follows the batch
    mla = dataclasses.replace(demo_config(), attn=dataclasses.replace(demo_config().attn, kind="mla"))
    assert invariant_unsupported(mla) == "mla attention runs in XLA"
    ec = EngineConfig(deterministic=True)
    assert deterministic_expert_impl(mla, {}, ec) == "dense"
    with pytest.raises(ValueError, match="cpu_kernel_invariant.*mla"):
        deterministic_expert_impl(mla, {}, dataclasses.replace(ec, expert_impl="cpu_kernel_invariant"))
