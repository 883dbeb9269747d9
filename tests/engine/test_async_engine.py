"""AsyncEngine: streaming from threads and asyncio, admission errors, abort, step failures, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxmoe.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError
from jaxmoe.engine.engine import StepFailedError
from jaxmoe.sampling import SamplingParams
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.server.testing import engine_idle_and_free, crashing_run, failing_steps, shared_demo_llm, wait_until

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["One fish", "Two fish", "Red fish", "Blue fish"]
GREEDY = SamplingParams(max_tokens=10)
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return shared_demo_llm()


@pytest.fixture(scope="module")
def reference(llm):
    return {p: out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


@pytest.fixture
def aengine(llm, reference):
    ae = AsyncEngine(llm.engine).start()
    yield ae
    ae.shutdown(abort_inflight=True, timeout=10)
    assert not ae.running
    bm = llm.engine.block_manager
    assert not llm.engine.has_work() and bm.num_free == bm.num_blocks


def _drain(stream):
    outs = list(stream)
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


@pytest.mark.slow
def test_threads_stream_the_standalone_tokens(aengine, reference):
    results, errors = {}, []

    def client(i, prompt):
        try:
            outs = _drain(aengine.add(prompt, GREEDY, "ls" if i % 2 else "be"))
            ids = [t for o in outs for t in o.delta_token_ids]
            assert ids == outs[-1].token_ids
            results[prompt] = ids
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert results == reference


@pytest.mark.slow
def test_asyncio_stream(aengine, reference):
    async def main():
        streams = [await aengine.add_async(p, GREEDY, "be") for p in PROMPTS[:2]]
        return [[o async for o in s] for s in streams]

    for prompt, outs in zip(PROMPTS, asyncio.run(main())):
        assert outs[-1].finished and outs[-1].token_ids == reference[prompt]
        assert "".join(o.delta_text for o in outs) == outs[-1].text


@pytest.mark.parametrize(
    "prompt, sampling, match",
    [
        ([], GREEDY, "empty prompt"),
        ([1, 2, 99999], GREEDY, "outside the vocabulary"),
        ("x" * 300, GREEDY, "does not fit the context"),
        ("hi", None, None),  # valid, for contrast
    ],
)
def test_admission_errors_are_raised_to_the_caller(aengine, prompt, sampling, match):
    if match is None:
        assert _drain(aengine.add(prompt, sampling))[-1].finish_reason in ("length", "stop")
        return
    with pytest.raises(ValueError, match=match):
        aengine.add(prompt, sampling)


def test_bad_priority_is_a_value_error(aengine):
    with pytest.raises(ValueError, match="unknown priority"):
        aengine.add("hi", GREEDY, "urgent")


def test_overload(aengine):
    old = aengine.call(lambda e: e.scheduler.max_waiting)
    aengine.call(lambda e: setattr(e.scheduler, "max_waiting", 0))
    try:
        with pytest.raises(OverloadedError):
            aengine.add("hi", GREEDY)
    finally:
        aengine.call(lambda e: setattr(e.scheduler, "max_waiting", old))


def test_abort_mid_stream_frees_blocks(aengine):
    stream = aengine.add("Count to forty", LONG, "be")
    first = stream.get(timeout=30)
    assert first is not None and not first.finished
    aengine.abort(stream.request_id)
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(rest[-1].token_ids) < LONG.max_tokens
    assert engine_idle_and_free(aengine)


def test_step_exception_fails_the_request_not_the_loop(aengine, reference):
    with failing_steps(aengine) as calls:
        stream = aengine.add("doomed", GREEDY)
        with pytest.raises(EngineStepError, match="injected device failure"):
            list(stream)
    assert calls.calls >= 1 and aengine.running and aengine.step_errors >= 1
    assert engine_idle_and_free(aengine)
    # the failed program deleted the KV cache: the engine allocated a new one
    assert _drain(aengine.add(PROMPTS[0], GREEDY))[-1].token_ids == reference[PROMPTS[0]]


def test_lost_cache_is_recomputed_for_requests_outside_the_failed_step(aengine, reference):
    """A BE request with KV, preempted (keep-KV) by an LS request whose step fails and deletes
    the cache, recomputes its KV and still produces the standalone tokens."""

    def scenario(engine):
        be = engine.add_request(PROMPTS[1], GREEDY, "be")
        engine.step(), engine.step()  # prefill + one decode: be holds KV
        old = engine.scheduler.max_num_seqs
        engine.scheduler.max_num_seqs = 1  # the LS request alone next step: be is keep-KV preempted
        ls = engine.add_request("urgent", GREEDY, "ls")
        real_run = engine.runner.run
        engine.runner.run = failing_run = crashing_run(engine.runner)
        try:
            with pytest.raises(StepFailedError) as err:
                engine.step()
        finally:
            engine.runner.run, engine.scheduler.max_num_seqs = real_run, old
        assert err.value.request_ids == [ls] and failing_run.calls == 1
        seq = engine.scheduler.get(be)
        recomputing = seq.num_computed == 0 and not seq.block_table and seq.num_output_tokens == 2
        engine.abort(ls)
        return be, recomputing, engine.run_until_done(timeout=60)

    be, recomputing, final = aengine.call(scenario)
    assert recomputing
    assert final[be].token_ids == reference[PROMPTS[1]]
    assert engine_idle_and_free(aengine)


def test_shutdown_aborts_inflight(llm):
    ae = AsyncEngine(llm.engine).start()
    stream = ae.add("Count to forty", LONG)
    assert stream.get(timeout=30) is not None
    ae.shutdown(abort_inflight=True)
    assert list(stream)[-1].finish_reason == "abort"
    with pytest.raises(EngineClosedError):
        ae.add("late", GREEDY)
    assert not llm.engine.has_work()


def test_shutdown_lets_inflight_finish(llm):
    ae = AsyncEngine(llm.engine).start()
    stream = ae.add("Count", SamplingParams(max_tokens=6, ignore_eos=True))
    ae.shutdown(abort_inflight=False, timeout=30)
    outs = list(stream)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 6


def test_snapshot_is_published(aengine):
    _drain(aengine.add("hi", GREEDY, "ls"))
    assert wait_until(lambda: aengine.snapshot().get("in_flight") == 0)
    snap = aengine.snapshot()
    assert set(snap["queues"]) == {"ls_prefill", "ls_decode", "be_prefill", "be_decode"}
    assert snap["kv_free_blocks"] == snap["num_blocks"]


@pytest.mark.slow
def test_default_warmup_compiles_the_shapes_serving_meets(llm):
    """warmup() compiles every shape of the engine's ShapePlan (decodes of every power-of-two batch up
    to max_num_seqs, prefill chunks of 1-4 rows of 16..max_prefill_chunk tokens; block tables have
    one width whatever the context): afterwards, a mixed load (prompts of 4-15 and 101-121 tokens,
    up to 3 KV blocks of 64 with their outputs, arriving while others decode) runs no step shape that
    warm-up did not, and XLA compiles nothing."""
    import numpy as np

    ex = llm.executor
    seen, real, real_lower = set(), ex.forward, ex.lower

    def recording(tokens, batch, *args, **kwargs):
        seen.add((np.shape(tokens), np.shape(batch.block_tables)))
        return real(tokens, batch, *args, **kwargs)

    def recording_lower(tokens, batch, *args, **kwargs):  # warm-up lowers ahead and compiles, runs nothing
        seen.add((np.shape(tokens), np.shape(batch.block_tables)))
        return real_lower(tokens, batch, *args, **kwargs)

    ex.forward, ex.lower = recording, recording_lower
    ae = AsyncEngine(llm.engine).start()
    try:
        ae.warmup()
        warm = set(seen)
        streams = [ae.add("x" * n, SamplingParams(max_tokens=6, ignore_eos=True)) for n in (3, 100, 9, 14, 120)]
        late = [ae.add("y" * n, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)) for n in (12, 110, 5)]
        for stream in streams + late:
            _drain(stream)
        compiled_late = ae.compiles_after_warmup
    finally:
        ae.shutdown(abort_inflight=True, timeout=10)
        ex.forward, ex.lower = real, real_lower
    assert {t[0] for t, nb in warm if t[1] == 1} >= {1, 2, 4, 8}  # decode batches up to max_num_seqs
    assert len({nb[1] for t, nb in warm}) == 1  # one block-table width serves every context length
    assert seen <= warm, sorted(seen - warm)
    assert compiled_late == 0


@pytest.mark.slow
def test_warmup_can_be_cancelled_between_programs(llm):
    import threading

    from jaxmoe.engine.async_engine import WarmupCancelled

    cancel = threading.Event()
    cancel.set()
    ae = AsyncEngine(llm.engine).start()
    try:
        with pytest.raises(WarmupCancelled):
            ae.warmup(cancel=cancel)
    finally:
        ae.shutdown(abort_inflight=True, timeout=10)
