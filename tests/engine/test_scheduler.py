"""Scheduler, policies and request lifecycle, driven by a fake model.

The fake model writes (request, position, token) into a dict keyed by KV slot
and, before every step, checks that the whole cached context of each scheduled
sequence is still there -- so "resumed with its KV intact" and "no two
sequences share a slot" are checked on every step. Token ids are a pure
function of (request, position), so a run that loses or repeats a token is
caught by comparing outputs with ``expected_outputs``.
"""

import importlib.util
import pathlib
from types import SimpleNamespace

import pytest

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.policies import FCFSPolicy, Policy, Queues, SchedulingPolicy, make_policy
from jaxmoe.qllm.policy import QLLMPolicy
from jaxmoe.engine.scheduler import OverloadedError, ScheduledBatch, Scheduler
from jaxmoe.engine.sequence import Priority, Sequence, SequenceStatus

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tok(rid: str, n: int) -> int:
    """The token the fake model samples for ``rid`` given ``n`` tokens of context."""
    return (sum(map(ord, rid)) * 131 + n * 7) % 30000


def mk(rid, n_prompt, prio="be", t=0.0, max_tokens=4):
    return Sequence(
        rid,
        [(i * 13 + len(rid)) % 97 for i in range(n_prompt)],
        SimpleNamespace(max_tokens=max_tokens),
        prio,
        arrival_time=t,
    )


def expected_outputs(seq):
    p = seq.num_prompt_tokens
    return [tok(seq.request_id, p + i) for i in range(seq.max_tokens)]


class FakeModel:
    def __init__(self, bm: BlockManager):
        self.bm, self.kv = bm, {}

    def run(self, batch: ScheduledBatch) -> dict:
        out = {}
        items = list(batch.prefills) + [(s, s.num_tokens - 1, s.num_tokens) for s in batch.decodes]
        for seq, start, end in items:
            rid, ids = seq.request_id, seq.all_ids
            assert start == seq.num_computed and seq.num_scheduled == end - start
            assert seq.step_token_ids == ids[start:end]
            assert len({b // self.bm.blocks_per_partition for b in seq.block_table}) == 1  # one partition
            for p, slot in enumerate(self.bm.slot_mapping(seq, 0, start)):
                assert self.kv[slot] == (rid, p, ids[p]), f"KV of {rid}@{p} lost"
            for p, slot in zip(range(start, end), self.bm.slot_mapping(seq, start, end)):
                self.kv[slot] = (rid, p, ids[p])
            if end == seq.num_tokens:
                out[rid] = tok(rid, end)
        return out


def make(num_blocks=64, block_size=4, policy=None, num_partitions=1, **kw):
    bm = BlockManager(num_blocks, block_size, num_partitions)
    kw.setdefault("max_batch_tokens", 64)
    kw.setdefault("max_num_seqs", 8)
    return Scheduler(bm, policy or QLLMPolicy(), **kw), FakeModel(bm)


def step(sched, model, finished=None):
    batch = sched.schedule()
    done = sched.postprocess(batch, model.run(batch), finished)
    return batch, done


def drain(sched, model, max_steps=1000):
    done = []
    for _ in range(max_steps):
        if not sched.has_work():
            return done
        done += step(sched, model)[1]
    raise AssertionError("scheduler did not drain")


def ids(seqs):
    return [s.request_id for s in seqs]


# -- Sequence / Priority ------------------------------------------------------


def test_priority_parsing():
    assert Priority("LS") is Priority.LS and Priority.parse("Latency_Sensitive") is Priority.LS
    assert Priority.parse("be") is Priority.BE and Priority("BEST_EFFORT") is Priority.BE
    with pytest.raises(ValueError, match="latency_sensitive.*best_effort"):
        Priority.parse("urgent")


def test_is_prefill_definition():
    s = mk("a", 1)
    assert s.is_prefill  # 1-token prompt: prefill of [0, 1)
    s.num_computed = 1
    s.output_ids.append(5)
    assert not s.is_prefill and s.num_uncomputed == 1  # decode feeds token 5 at pos 1
    s.output_ids.append(6)
    s.num_computed = 0  # after a recompute preemption
    assert s.is_prefill and s.num_uncomputed == 3  # re-prefill prompt + outputs


# -- lifecycle ----------------------------------------------------------------


@pytest.mark.parametrize("policy", [QLLMPolicy(), FCFSPolicy()])
def test_chunked_prefill_then_decode_to_completion(policy):
    sched, model = make(policy=policy, max_batch_tokens=8)
    a = mk("a", 20, max_tokens=3)
    sched.add(a)
    chunks = []
    while a.num_computed < 20:
        batch, _ = step(sched, model)
        chunks += [(st, e) for _, st, e in batch.prefills]
        assert batch.num_tokens <= 8
    assert chunks == [(0, 8), (8, 16), (16, 20)]  # only the last chunk samples
    assert a.output_ids == [tok("a", 20)] and a.first_token_time is not None
    done = drain(sched, model)
    assert done == [a] and a.finish_reason == "length"
    assert a.output_ids == expected_outputs(a) and a.tpot is not None and a.ttft >= 0
    assert sched.bm.num_free == sched.bm.num_blocks


def test_budget_limits_tokens_and_seqs():
    sched, model = make(max_batch_tokens=10, max_num_seqs=3)
    for i in range(5):
        sched.add(mk(f"s{i}", 6, t=i))
    batch, _ = step(sched, model)
    assert batch.num_tokens <= 10 and len(batch.seqs) <= 3
    assert [(s.request_id, st, e) for s, st, e in batch.prefills] == [("s0", 0, 6), ("s1", 0, 4)]


def test_preemption_on_block_exhaustion_keeps_tokens():
    # 6 blocks x 4 slots = 24 tokens; 4 seqs that need up to 10 tokens each.
    sched, model = make(num_blocks=6, block_size=4, policy=FCFSPolicy(), max_batch_tokens=32)
    seqs = [mk(f"r{i}", 6, t=i, max_tokens=4) for i in range(4)]
    for s in seqs:
        sched.add(s)
    done = drain(sched, model)
    assert sum(sched.preemptions["recompute"].values()) > 0
    assert sorted(ids(done)) == ids(seqs)
    for s in seqs:
        assert s.output_ids == expected_outputs(s)  # nothing lost, nothing repeated
    assert sched.bm.num_free == 6


def test_recompute_reprefills_prompt_plus_generated():
    sched, model = make(num_blocks=4, block_size=4, max_batch_tokens=32)
    be = mk("be", 6, "be", t=0, max_tokens=8)
    sched.add(be)
    for _ in range(4):
        step(sched, model)  # prefill + 3 decodes: 9 computed, 3 blocks
    assert be.output_ids == expected_outputs(be)[:4]
    ls = mk("ls", 8, "ls", t=1, max_tokens=2)  # needs 2 blocks, 1 free -> evict BE
    sched.add(ls)
    batch, _ = step(sched, model)
    assert batch.preempted == [be] and not be.has_kv and be.num_computed == 0
    assert be.status is SequenceStatus.PREEMPTED and be.output_ids == expected_outputs(be)[:4]
    assert sched.preemptions["recompute"] == {"ls": 0, "be": 1}
    drain(sched, model)
    # once re-admitted it was prefilled over 6 prompt + 4 generated tokens
    assert be.output_ids == expected_outputs(be) and ls.output_ids == expected_outputs(ls)


def test_victim_is_never_more_urgent_than_requester():
    sched, model = make(num_blocks=4, block_size=4, policy=QLLMPolicy(be_prefill_with_ls_decode=True))
    ls = mk("ls", 8, "ls", t=0, max_tokens=8)  # 2 blocks, its first decode takes a 3rd
    sched.add(ls)
    step(sched, model)
    be = mk("be", 8, "be", t=1)  # needs 2 blocks, 1 left: must not evict LS
    sched.add(be)
    batch, _ = step(sched, model)
    assert ls.has_kv and batch.preempted == []
    assert [(s.request_id, st, e) for s, st, e in batch.prefills] == [("be", 0, 4)]
    drain(sched, model)
    assert ls.output_ids == expected_outputs(ls) and be.output_ids == expected_outputs(be)


def test_partitions_evict_only_in_the_partition_that_needs_blocks():
    # 2 partitions x 3 blocks x 4 slots: a, b in partition 0; c, d (the newest) in partition 1.
    sched, model = make(num_blocks=6, block_size=4, policy=FCFSPolicy(), num_partitions=2)
    a, c, b, d = mk("a", 4, t=0, max_tokens=6), mk("c", 8, t=1), mk("b", 8, t=2), mk("d", 3, t=3)
    for s in (a, c, b, d):
        sched.add(s)
    step(sched, model)
    assert [sched.bm.partition_of(s) for s in (a, b, c, d)] == [0, 0, 1, 1]
    batch, _ = step(sched, model)
    # a's decode needs a block of partition 0: it evicts b, not the newer d (whose blocks would not
    # help); then c's decode needs one of partition 1 and evicts d.
    assert batch.decodes == [a, c] and batch.preempted == [b, d]
    drain(sched, model)
    assert all(s.output_ids == expected_outputs(s) for s in (a, b, c, d))
    with pytest.raises(ValueError, match="capacity"):
        sched.add(mk("e", 13))  # more than one partition holds


def test_sequence_longer_than_cache_finishes_with_length():
    sched, model = make(num_blocks=2, block_size=4)
    a = mk("a", 7, max_tokens=10)
    sched.add(a)
    done = drain(sched, model)
    assert done == [a] and a.finish_reason == "length" and a.num_tokens == 9
    with pytest.raises(ValueError, match="capacity"):
        sched.add(mk("b", 9))


def test_abort_frees_blocks_immediately():
    sched, model = make()
    a, b = mk("a", 10), mk("b", 5)
    sched.add(a), sched.add(b)
    batch = sched.schedule()
    out = model.run(batch)  # "a" is aborted while the step runs
    used = sched.bm.num_used
    assert sched.abort("a") is True and a.status is SequenceStatus.FINISHED
    assert a.block_table == [] and sched.bm.num_used == used - 3 and a.finish_reason == "abort"
    assert sched.abort("a") is False and sched.abort("nope") is False
    sched.postprocess(batch, out)  # in-flight result of "a" is ignored
    assert a.output_ids == [] and sched.get("a") is None
    drain(sched, model)
    assert sched.bm.num_free == sched.bm.num_blocks and sched.num_aborted == 1


def test_finished_from_engine_and_validation():
    sched, model = make(max_batch_tokens=4)
    a, b = mk("a", 6, max_tokens=100), mk("b", 2, max_tokens=100)
    sched.add(a), sched.add(b)
    batch = sched.schedule()  # a: [0, 4) partial chunk
    with pytest.raises(ValueError, match="partial"):
        sched.postprocess(batch, {"a": 1})
    sched.postprocess(batch, model.run(batch))
    batch = sched.schedule()
    out = model.run(batch)
    done = sched.postprocess(batch, out, {"a": "stop", "b": "stop"})
    assert sorted(ids(done)) == ["a", "b"] and a.finish_reason == "stop"
    assert a.output_ids == [tok("a", 6)] and not sched.has_work()


def test_overload_raises_and_nothing_is_dropped():
    sched, model = make(max_waiting=2)
    a, b = mk("a", 4), mk("b", 4)
    sched.add(a), sched.add(b)
    with pytest.raises(OverloadedError):
        sched.add(mk("c", 4))
    assert sched.num_rejected == 1 and sched.get("c") is None
    step(sched, model)  # a, b start: queue has room again
    c = mk("c", 4)
    sched.add(c)
    drain(sched, model)
    assert all(s.output_ids == expected_outputs(s) for s in (a, b, c))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(mk("a", 4)) or sched.add(mk("a", 4))
    with pytest.raises(ValueError, match="empty"):
        sched.add(Sequence("e", []))


# -- QLLM Algorithm 1 (qllm.txt Sec. 3.2 "Batch selection logic") -------------


def four_queues():
    ls_d = [mk("lsd0", 3, "ls", t=0), mk("lsd1", 3, "ls", t=3)]
    be_d = [mk("bed0", 3, "be", t=1), mk("bed1", 3, "be", t=4)]
    for s in ls_d + be_d:  # put them in the decode stage
        s.output_ids, s.num_computed = [1], 3
    ls_p = [mk("lsp0", 5, "ls", t=2), mk("lsp1", 5, "ls", t=5)]
    be_p = [mk("bep0", 5, "be", t=0.5), mk("bep1", 5, "be", t=6)]
    return ls_d, ls_p, be_d, be_p


def test_queues_split_and_fcfs():
    ls_d, ls_p, be_d, be_p = four_queues()
    q = Queues.from_seqs(list(reversed(ls_d + ls_p + be_d + be_p)))
    assert (q.ls_decode, q.ls_prefill, q.be_decode, q.be_prefill) == (ls_d, ls_p, be_d, be_p)
    assert q.lengths() == dict(ls_prefill=2, ls_decode=2, be_prefill=2, be_decode=2)


def test_qllm_lines_2_to_7_ls_decode_then_ls_prefill_then_be():
    ls_d, ls_p, be_d, be_p = four_queues()
    order = QLLMPolicy().order(Queues.from_seqs(ls_d + ls_p + be_d + be_p), None)
    assert order == ls_d + ls_p + be_d + be_p


def test_qllm_lines_10_to_14_no_ls_prefill_fills_with_be_decode():
    ls_d, _, be_d, be_p = four_queues()
    q = Queues.from_seqs(ls_d + be_d + be_p)
    assert QLLMPolicy().order(q, None) == ls_d + be_d
    assert QLLMPolicy(be_prefill_with_ls_decode=True).order(q, None) == ls_d + be_d + be_p


def test_qllm_lines_16_to_19_only_be_decode_over_prefill():
    _, _, be_d, be_p = four_queues()
    assert QLLMPolicy().order(Queues.from_seqs(be_p + be_d), None) == be_d + be_p


def test_qllm_batch_fill_respects_max_batch_size():
    ls_d, ls_p, be_d, be_p = four_queues()
    sched, _ = make(max_num_seqs=3, max_batch_tokens=100)
    for s in ls_d + ls_p + be_d + be_p:
        sched.add(s)
        if s.output_ids:  # give decode-stage seqs their KV blocks
            sched.bm.allocate(s, s.num_tokens)
            s.status = SequenceStatus.RUNNING
    batch = sched.schedule()
    assert ids(batch.decodes) == ["lsd0", "lsd1"]
    assert [(s.request_id, st, e) for s, st, e in batch.prefills] == [("lsp0", 0, 5)]
    assert sorted(ids(batch.preempted)) == ["bed0", "bed1"]  # kept their KV
    assert all(s.has_kv for s in be_d)


def test_qllm_ls_arrival_preempts_be_and_be_resumes_intact():
    sched, model = make(max_num_seqs=3, max_batch_tokens=16)
    bes = [mk(f"be{i}", 5, "be", t=i, max_tokens=6) for i in range(3)]
    for s in bes:
        sched.add(s)
    step(sched, model)
    step(sched, model)  # all 3 BE decoding
    snap = {s.request_id: (list(s.block_table), s.num_computed, list(s.output_ids)) for s in bes}
    ls = mk("ls", 12, "ls", t=10, max_tokens=3)
    sched.add(ls)
    batch, _ = step(sched, model)
    # LS prefill (12 tokens) + BE decodes fill the 16-token/3-seq batch; the
    # newest BE is preempted at the step boundary but keeps its KV and tokens.
    assert [s.request_id for s, _, _ in batch.prefills] == ["ls"]
    assert ids(batch.decodes) == ["be0", "be1"] and batch.preempted == [bes[2]]
    be2 = bes[2]
    assert be2.status is SequenceStatus.PREEMPTED and be2.has_kv
    assert (be2.block_table, be2.num_computed, be2.output_ids) == snap["be2"]
    batch, _ = step(sched, model)  # LS decode first (lines 2-3 / 10-14)
    assert batch.decodes[0] is ls and be2 not in batch.decodes
    drain(sched, model)
    assert ls.first_token_time < be2.finish_time
    assert be2.num_preemptions == 1 and sched.preemptions["keep_kv"]["be"] >= 1
    assert sched.preemptions["recompute"] == {"ls": 0, "be": 0}  # KV never dropped
    for s in bes + [ls]:
        assert s.output_ids == expected_outputs(s)


def test_qllm_ls_needing_blocks_recompute_preempts_newest_be():
    sched, model = make(num_blocks=6, block_size=4, max_num_seqs=8, max_batch_tokens=32)
    bes = [mk(f"be{i}", 7, "be", t=i, max_tokens=5) for i in range(3)]  # 2 blocks each
    for s in bes:
        sched.add(s)
    step(sched, model)
    assert sched.bm.num_free == 0
    ls = mk("ls", 4, "ls", t=9, max_tokens=2)
    sched.add(ls)
    batch, _ = step(sched, model)
    assert not bes[2].has_kv and bes[0].has_kv and bes[1].has_kv  # newest BE evicted
    assert bes[2] in batch.preempted and ls.output_ids == [tok("ls", 4)]
    drain(sched, model)
    for s in bes + [ls]:
        assert s.output_ids == expected_outputs(s)


# -- FCFS and custom policies -------------------------------------------------


def test_fcfs_is_plain_arrival_order():
    sched, model = make(policy=FCFSPolicy(), max_num_seqs=2)
    b0, b1 = mk("b0", 3, "be", t=0, max_tokens=3), mk("b1", 3, "be", t=1, max_tokens=3)
    sched.add(b0), sched.add(b1)
    step(sched, model)
    ls = mk("ls", 3, "ls", t=2, max_tokens=3)
    sched.add(ls)
    batch, _ = step(sched, model)
    assert ids(batch.seqs) == ["b0", "b1"] and ls.status is SequenceStatus.WAITING
    done = drain(sched, model)
    assert ids(done) == ["b0", "b1", "ls"]


def test_make_policy_and_protocol():
    assert isinstance(make_policy("QLLM"), QLLMPolicy) and make_policy("fcfs").name == "fcfs"
    with pytest.raises(ValueError, match="available"):
        make_policy("lottery")
    assert isinstance(QLLMPolicy(), SchedulingPolicy) and isinstance(FCFSPolicy(), SchedulingPolicy)


class Dup(Policy):
    name = "dup"

    def order(self, queues, budget):
        return queues.all() * 2


class Raises(Policy):
    name = "raises"

    def order(self, queues, budget):
        raise ZeroDivisionError("policy bug")


class WrongVictim(QLLMPolicy):
    name = "wrong_victim"

    def victim(self, candidates):
        return "nobody"


@pytest.mark.parametrize("bad", [Dup(), Raises()], ids=["duplicate", "raises"])
def test_bad_policy_decision_is_logged_and_made_by_qllm(bad, caplog):
    """A policy that returns an invalid order or raises: logged, QLLM decides that step, nothing lost."""
    sched, model = make(policy=bad)
    sched.add(mk("a", 3))
    sched.add(mk("b", 2, "ls"))
    with caplog.at_level("ERROR"):
        finished = ids(drain(sched, model))
    assert set(finished) == {"a", "b"} and sched.stats()["policy_errors"] >= 1
    assert bad.name in caplog.text and ("duplicate" in caplog.text or "policy bug" in caplog.text)


def test_bad_victim_falls_back():
    sched, model = make(num_blocks=4, block_size=4, policy=WrongVictim(), max_num_seqs=4)
    sched.add(mk("be", 8))
    step(sched, model)  # BE takes the blocks
    sched.add(mk("ls", 8, "ls"))
    finished = ids(drain(sched, model))
    assert set(finished) == {"be", "ls"} and sched.stats()["policy_errors"] >= 1


def test_policy_from_a_module_spec():
    assert make_policy("jaxmoe.engine.policies:FCFSPolicy").name == "fcfs"
    assert make_policy("examples.custom_policy:ShortestPromptFirst").name == "shortest_prompt_first"
    policy = QLLMPolicy(True)
    assert make_policy(policy) is policy
    for bad in ("nomodule_xyz:Policy", "jaxmoe.engine.policies:Nope", "jaxmoe.engine.sequence:Priority"):
        with pytest.raises(ValueError, match="policy"):
            make_policy(bad)


def test_custom_policy_example_plugs_in():
    path = ROOT / "examples" / "custom_policy.py"
    assert len(path.read_text().splitlines()) < 50
    spec = importlib.util.spec_from_file_location("custom_policy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert isinstance(mod.ShortestPromptFirst(), SchedulingPolicy)
    assert mod.demo() == ["short", "mid", "long"]
    sched, model = make(num_blocks=5, policy=mod.ShortestPromptFirst(), max_num_seqs=2)
    seqs = [mk(f"r{i}", n, t=i, max_tokens=3) for i, n in enumerate([9, 2, 5, 7])]
    for s in seqs:
        sched.add(s)
    drain(sched, model)
    assert all(s.output_ids == expected_outputs(s) for s in seqs)


# -- hooks and metrics --------------------------------------------------------


def test_stats():
    sched, model = make()
    sched.add(mk("a", 4, "ls")), sched.add(mk("b", 4, "be"))
    st = sched.stats()
    assert st["num_waiting"] == 2 and st["queue_ls_prefill"] == 1 and st["queue_be_prefill"] == 1
    step(sched, model)
    st = sched.stats()
    assert st["num_running"] == 2 and st["queue_ls_decode"] == 1 and st["kv_utilization"] > 0
    assert {"preemptions_keep_kv_be", "preemptions_recompute_ls", "rejected"} <= set(st)
    assert ids(sched.running) == ["a", "b"] and sched.waiting == [] and sched.preempted == []


@pytest.mark.parametrize("policy", ["qllm", "fcfs", "qllm_relaxed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("parts", [1, 2])
def test_random_soak_never_loses_tokens(policy, seed, parts):
    import random

    rng = random.Random(seed)
    pol = QLLMPolicy(True) if policy == "qllm_relaxed" else make_policy(policy)
    sched, model = make(
        num_blocks=12 * parts,
        block_size=4,
        policy=pol,
        num_partitions=parts,
        max_batch_tokens=rng.choice([5, 8, 16]),
        max_num_seqs=rng.choice([2, 4, 8]),
    )
    seqs, t = [], 0
    for _ in range(400):
        if len(seqs) < 30 and rng.random() < 0.3:
            s = mk(f"q{len(seqs)}", rng.randint(1, 20), rng.choice(["ls", "be"]), t=t, max_tokens=rng.randint(1, 12))
            sched.add(s)
            seqs.append(s)
        if rng.random() < 0.02 and sched.has_work():
            sched.abort(rng.choice(seqs).request_id)
        t += 1
        if sched.has_work():
            batch, _ = step(sched, model)
            assert not batch.is_empty
    drain(sched, model)
    assert sched.bm.num_free == sched.bm.num_blocks
    for s in seqs:
        if s.finish_reason == "abort":
            assert s.output_ids == expected_outputs(s)[: len(s.output_ids)]
        else:
            assert s.output_ids == expected_outputs(s), s


@pytest.mark.slow
def test_the_documented_policy_runs():
    """docs/scheduling.md's example policy (order and pause) works as written."""
    text = (ROOT / "docs" / "scheduling.md").read_text()
    code = next(block for block in text.split("```python")[1:] if "class EarlyPause" in block).split("```")[0]
    namespace: dict = {}
    exec(code, namespace)
    policy = make_policy(namespace["EarlyPause"]())
    sched, model = make(policy=policy)
    sched.add(mk("long", 9))
    sched.add(mk("short", 2))
    sched.add(mk("urgent", 5, "ls"))
    assert ids(sched.schedule().seqs)[0] == "urgent"
    waiting = Queues.from_seqs([mk("ls", 3, "ls")])
    assert policy.pause_at_layer([], waiting, 3) and not policy.pause_at_layer([], waiting, 20)
    assert not policy.pause_at_layer([], Queues(), 3)
