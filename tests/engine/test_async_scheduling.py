"""Async scheduling (``LLM(async_scheduling=True)``): each step is dispatched before the step
before it is read. Through ``LLM`` and its engine, in batch-invariant mode: the same tokens,
logprobs, texts and finish reasons as the synchronous loop -- with stops by length, stop token, stop string and EOS in the
middle of a batch, seeded sampling, requests arriving and aborted mid-stream, a request that needs
the synchronous path in between, and prompts read again from the prefix cache -- and the overlap
really ran (``steps_ahead``)."""

from __future__ import annotations

import pytest

from jaxmoe import LLM, SamplingParams

ENGINE = dict(num_blocks=128, block_size=8, max_num_seqs=4)
LONG = "The quick brown fox jumps over the lazy dog"  # > one KV block: its prefix is cached


@pytest.fixture(scope="module")
def pair():
    """Batch-invariant mode (its CPU kernels): a request's tokens and logprobs do not depend on what it
    is batched with, so they can be compared bit for bit (the default mode's differ in the last bits
    between two runs of the synchronous loop itself, with the KV blocks placed elsewhere)."""
    return (
        LLM("tiny-random", deterministic=True, **ENGINE),
        LLM("tiny-random", deterministic=True, async_scheduling=True, **ENGINE),
    )


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    for x, y in zip(a, b):
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert [(t.token_id, t.logprob, t.top) for t in x.logprobs] == [
                (t.token_id, t.logprob, t.top) for t in y.logprobs
            ]


@pytest.mark.slow
def test_async_scheduling_matches_the_synchronous_loop(pair):
    sync, overlap = pair
    eight = SamplingParams(max_tokens=8, ignore_eos=True)
    probe = sync.generate([LONG, "a"], eight)  # both engines: the same prefix cache from here on
    assert [o.token_ids for o in overlap.generate([LONG, "a"], eight)] == [o.token_ids for o in probe]
    stop_token = probe[0].token_ids[3]  # stops the first request after 4 tokens
    stop_text = probe[1].text[2:3]  # a character of the second request's text
    assert stop_text
    sampling = [
        SamplingParams(max_tokens=8, logprobs=2, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(max_tokens=8, stop=[stop_text], ignore_eos=True),
        SamplingParams(max_tokens=3, logprobs=0),
        SamplingParams(max_tokens=10, temperature=2.0, seed=6, logprobs=1),  # this seed draws EOS
    ]
    prompts = [LONG, "a", "Hello, MoE world", "eos?"]
    ref = sync.generate(prompts, sampling)
    before = overlap.engine.steps_ahead
    got = overlap.generate(prompts, sampling)
    _same(ref, got)
    assert overlap.engine.steps_ahead - before >= 7  # the decodes ran one step ahead
    assert sync.engine.steps_ahead == 0
    # the stops this checks happened mid-batch: stop token, stop string, length, EOS (seeded sampling)
    assert ref[0].finish_reason == "stop" and len(ref[0].token_ids) == 4
    assert ref[1].finish_reason == "stop" and len(ref[1].token_ids) < 8
    assert ref[2].finish_reason == "length"
    assert ref[3].finish_reason == "stop" and ref[3].token_ids[-1] in sync.cfg.eos_token_ids
    assert len(ref[3].token_ids) < 10
    # both engines read the long prompt's blocks from the prefix cache (the overlapping one's registered
    # while its steps ran ahead)
    assert ref[0].num_cached_tokens == got[0].num_cached_tokens > 0
    assert not overlap.engine.has_work() and overlap.engine.block_manager.num_free == ENGINE["num_blocks"]


def _drive(llm, late_sampling):
    """Two requests; a third arrives after two steps; the second is aborted after three; the rest
    run out. Returns (the final outputs, every streamed output, the aborted request's tokens)."""
    engine, greedy = llm.engine, SamplingParams(max_tokens=10, ignore_eos=True)
    a, b = engine.add_request(LONG, greedy), engine.add_request("a", greedy)
    streamed = engine.step() + engine.step()
    c = engine.add_request("Hello, MoE world", late_sampling)
    streamed += engine.step()
    seq = engine.scheduler.get(b)
    assert engine.abort(b)
    aborted = list(seq.output_ids)
    mark = len(streamed)
    final = {}
    while engine.has_work():
        for out in engine.step():
            streamed.append(out)
            if out.finished:
                final[out.request_id] = out
    assert not any(out.request_id == b for out in streamed[mark:])  # nothing after its abort
    return [final[a], final[c]], streamed, aborted, (a, b, c)


@pytest.mark.slow
@pytest.mark.parametrize(
    "late", [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, repetition_penalty=1.3)], ids=["plain", "sync"]
)
def test_arrivals_and_aborts_mid_stream(pair, late):
    """``sync``: the late request has a penalty, so the steps it is in run synchronously (the
    fallback) between overlapped ones."""
    sync, overlap = pair
    ref, _, ref_aborted, _ = _drive(sync, late)
    before = overlap.engine.steps_ahead
    got, streamed, aborted, (a, b, c) = _drive(overlap, late)
    _same(ref, got)
    assert overlap.engine.steps_ahead > before
    full = sync.generate("a", SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    assert aborted == full[: len(aborted)] and len(aborted) >= 2  # no placeholder, no token twice
    for rid, final in ((a, got[0]), (c, got[1])):  # streamed deltas add up to the output, token by token
        deltas = [t for out in streamed if out.request_id == rid for t in out.delta_token_ids]
        assert deltas == final.token_ids
    assert all(t >= 0 for out in streamed for t in out.token_ids)
    # finished by length when its step was dispatched, not read yet: still the engine's to abort (as
    # AsyncEngine does: it sends the stream a final "abort" output), its unread token never shown
    engine = overlap.engine
    d = engine.add_request("d", SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step(), engine.step()
    seq = engine.sequence(d)
    assert seq is not None and seq.is_finished and engine.scheduler.get(d) is None
    assert engine.abort(d) and engine.sequence(d) is None
    assert seq.output_ids == sync.generate("d", SamplingParams(max_tokens=1))[0].token_ids  # the read one only
    assert d not in engine.run_until_done(timeout=60)
    assert overlap.engine.block_manager.num_free == ENGINE["num_blocks"]


@pytest.mark.slow
def test_served_streams(pair):
    """Through ``AsyncEngine`` (the serving loop): streams of the overlapping engine carry the
    synchronous loop's tokens, their deltas add up, and a stream aborted mid-way ends with an
    "abort" output holding only tokens read."""
    from jaxmoe.engine.async_engine import AsyncEngine

    sync, overlap = pair
    prompts, sp = [LONG, "Hello, MoE world"], SamplingParams(max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in sync.generate(prompts, sp)]
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    before = overlap.engine.steps_ahead
    ae = AsyncEngine(overlap.engine).start()
    try:
        streams = [ae.add(p, sp) for p in prompts]
        doomed, seen = ae.add("a", long), []
        for out in doomed:
            seen.append(out)
            if len(out.token_ids) >= 3:
                ae.abort(doomed.request_id)
        outs = [list(s) for s in streams]
    finally:
        ae.shutdown(abort_inflight=True, timeout=10)
    assert [o[-1].token_ids for o in outs] == ref
    assert all([t for out in o for t in out.delta_token_ids] == o[-1].token_ids for o in outs)
    last = seen[-1]
    assert last.finished and last.finish_reason == "abort" and len(last.token_ids) >= 3
    alone = sync.generate("a", SamplingParams(max_tokens=len(last.token_ids), ignore_eos=True))[0]
    assert last.token_ids == alone.token_ids  # only tokens read, none twice
    assert overlap.engine.steps_ahead > before
    assert not overlap.engine.has_work() and overlap.engine.block_manager.num_free == ENGINE["num_blocks"]
