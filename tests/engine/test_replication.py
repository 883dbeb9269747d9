"""Multi-host serving's step journal (``jaxmoe.engine.replication``) in one process: the leader's
``AsyncEngine`` sends what it admits, aborts and steps; a follower engine replaying it makes the same
tokens; a broadcast that fails ends every request with ``ClusterFailedError`` and refuses new ones.
(The broadcast itself is JAX's across processes: tests/multihost/test_multihost_serve.py.)"""

from __future__ import annotations

import queue
import threading

import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.async_engine import AsyncEngine, EngineClosedError
from jaxmoe.engine.replication import HEADER_BYTES, ClusterFailedError, Leader, StepChannel, follow

pytestmark = pytest.mark.timeout(300)
ENGINE = dict(dtype="float32", num_blocks=64, block_size=8, max_num_seqs=4)


def _pipe():
    """(leader's channel, follower's channel) over a queue, checking both sides broadcast equal shapes."""
    q: queue.Queue = queue.Queue()

    def send(buf):
        q.put(buf.copy())
        return buf

    def receive(buf):
        got = q.get(timeout=120)
        assert got.shape == buf.shape and got.dtype == buf.dtype
        return got

    return StepChannel(send), StepChannel(receive)


def test_channel_carries_small_and_long_journals():
    tx, rx = _pipe()
    small = [("abort", "r1"), ("step",)]
    long = [("add", "r2", list(range(3000)), None, "be", None, 7)]
    tx.send(small)
    assert rx.receive() == small and tx.broadcasts == 1
    tx.send(long)
    assert rx.receive() == long and tx.broadcasts == 3  # header + the rest, padded to a power of two
    assert tx.bytes_sent > HEADER_BYTES


def _final(stream) -> dict:
    last = None
    for out in stream:
        last = out
    return {"tokens": list(last.token_ids), "finish": last.finish_reason}


@pytest.mark.slow
def test_follower_replaying_the_journal_makes_the_leaders_tokens():
    leader_llm, follower_llm = LLM("tiny-random", **ENGINE), LLM("tiny-random", **ENGINE)
    tx, rx = _pipe()
    finals: dict = {}

    def on_step(outputs):
        for out in outputs:
            if out.finished:
                finals[out.request_id] = {"tokens": list(out.token_ids), "finish": out.finish_reason}

    result: dict = {}
    follower = threading.Thread(
        target=lambda: result.update(code=follow(follower_llm.engine, rx, on_step=on_step)), daemon=True
    )
    follower.start()
    ae = AsyncEngine(leader_llm.engine, leader=Leader(tx), idle_poll_s=0.05).start()
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    streams = {
        "g0": ae.add("The mixture of experts", greedy, request_id="g0"),
        "g1": ae.add([5, 17, 99, 3], greedy, request_id="g1"),
        "s0": ae.add("Hello", SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True), request_id="s0"),
    }
    long = ae.add("abort me", SamplingParams(max_tokens=200, ignore_eos=True), request_id="a0")
    next(iter(long))  # it ran a step, then it is aborted here and there
    ae.abort("a0")
    got = {rid: _final(s) for rid, s in streams.items()}
    assert _final(long)["finish"] == "abort"
    ae.shutdown(abort_inflight=False, timeout=30)
    follower.join(60)
    assert result == {"code": 0}  # STOP reached the follower
    assert {rid: finals[rid] for rid in got} == got
    assert "a0" not in finals  # aborted on the follower too (no final output of its own)
    assert all(len(v["tokens"]) == 8 for v in got.values())
    assert not follower_llm.engine.has_work() and follower_llm.engine.block_manager.num_free == 64
    assert ae.leader.channel.broadcasts > 0
    # a follower whose last step ran other requests than process 0's stops before the next step
    tx.send([("check", ["g0", "g1"]), ("step",)])
    with pytest.raises(ClusterFailedError, match=r"engines diverged: .* process 0's ran \['g0', 'g1'\]"):
        follow(follower_llm.engine, rx)


@pytest.mark.slow
def test_a_failed_broadcast_ends_every_request_and_refuses_new_ones():
    llm = LLM("tiny-random", **ENGINE)
    calls = {"n": 0}

    def broadcast(buf):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("Gloo all-reduce failed: Connection closed by peer")
        return buf

    reasons: list[str] = []
    ae = AsyncEngine(llm.engine, leader=Leader(StepChannel(broadcast)), on_cluster_failure=reasons.append).start()
    stream = ae.add("The mixture of experts", SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(ClusterFailedError, match="a process of the cluster is gone: RuntimeError: Gloo"):
        for _ in stream:
            pass
    assert len(reasons) == 1 and "Connection closed by peer" in reasons[0]
    with pytest.raises(EngineClosedError, match="the serving cluster stopped: a process of the cluster is gone"):
        ae.add("again", SamplingParams(max_tokens=2))
    assert not ae.running
    assert calls["n"] == 4  # no broadcast after the failed one


@pytest.mark.slow
def test_a_process_reported_gone_from_outside_the_loop_ends_requests_at_once():
    """``fail_cluster`` (process 0's watchdog thread): the request in flight ends with the reason and a
    new one is refused, without waiting for the loop; the loop stops at its next broadcast."""
    llm = LLM("tiny-random", **ENGINE)
    reasons: list[str] = []
    ae = AsyncEngine(llm.engine, leader=Leader(StepChannel(lambda buf: buf)), on_cluster_failure=reasons.append)
    ae.start()
    stream = ae.add("The mixture of experts", SamplingParams(max_tokens=400, ignore_eos=True))
    assert next(iter(stream)).finished is False
    ae.fail_cluster("process 1 stopped sending heartbeats")
    with pytest.raises(ClusterFailedError, match="process 1 stopped sending heartbeats"):
        for _ in stream:
            pass
    with pytest.raises(EngineClosedError, match="the serving cluster stopped: process 1"):
        ae.add("again", SamplingParams(max_tokens=2))
    ae.shutdown(timeout=30)
    assert not ae.running
    assert reasons == ["process 1 stopped sending heartbeats"]  # once, though the loop failed too
