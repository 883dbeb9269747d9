"""Automatic prefix caching: the block allocator's cache (LRU eviction, held blocks never evicted),
the scheduler's use of it (cached prefix taken at admission, never the whole prompt, salts and KV
keys, waiting for a prefix a running prefill computes -- never for an aborted or stalled one, and
for a bounded number of steps), cache-aware dispatch, and a fake-model soak that checks every cached position a step reads
holds the KV of exactly that sequence's tokens."""

import random
from types import SimpleNamespace

import pytest

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.dispatch import choose_cached_instance
from jaxmoe.engine.prefix_cache import block_hash, cache_key, extend_hashes
from jaxmoe.engine.policies import FCFSPolicy
from jaxmoe.engine.scheduler import Scheduler
from jaxmoe.engine.sequence import Sequence, SequenceStatus

BS = 4


def mk(rid, tokens, max_tokens=2, salt=None):
    return Sequence(rid, list(tokens), SimpleNamespace(max_tokens=max_tokens), cache_salt=salt)


def hashes(tokens, salt=None, key=None):
    return extend_hashes([], list(tokens), BS, cache_key(salt, key))


def cached_seq(bm, rid, tokens, salt=None):
    """A sequence that computed ``tokens`` and registered its full blocks."""
    s = mk(rid, tokens, salt=salt)
    bm.allocate(s, len(tokens))
    bm.cache_blocks(s, hashes(tokens, salt))
    return s


def test_hash_chains_over_prefix_salt_and_key():
    a = hashes(range(12))
    assert len(a) == 3 and hashes(range(13)) == a  # a partial block has no hash
    b = hashes([99] + list(range(1, 12)))
    assert all(x != y for x, y in zip(a, b))  # one token differs: every later block differs too
    assert hashes(range(12), salt="tenant-a") != a and hashes(range(12), key=0.5) != a
    assert a[1] == block_hash(a[0], cache_key(None, None), range(4, 8))


def test_free_keeps_cached_blocks_until_needed_then_evicts_lru():
    bm = BlockManager(num_blocks=8, block_size=BS, prefix_caching=True)
    a = cached_seq(bm, "a", range(12))  # blocks 0 1 2
    b = cached_seq(bm, "b", range(100, 108))  # blocks 3 4
    assert bm.num_cached_blocks == 5 and bm.num_free == 3
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8 and bm.num_evictable == 5 and bm.utilization() == 0.0
    assert bm.cached_prefix(hashes(range(12))) == [0, 1, 2]
    c = mk("c", range(200, 232))
    # never-cached blocks first (5 6 7), then the least recently released cached ones: a's last block
    # first, a's first block last (useless without its prefix), then b's
    assert bm.allocate(c, 4 * BS) == [5, 6, 7, 2]
    assert bm.cached_prefix(hashes(range(12))) == [0, 1] and bm.num_evictions == 1
    assert bm.allocate(c, 6 * BS) == [1, 0]
    assert bm.cached_prefix(hashes(range(12))) == [] and bm.cached_prefix(hashes(range(100, 108))) == [3, 4]


def test_held_cached_blocks_are_never_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS, prefix_caching=True)
    a = cached_seq(bm, "a", range(8))  # blocks 0 1, held
    b = mk("b", range(8))
    bm.take_cached(b, bm.cached_prefix(hashes(range(8))))
    assert b.block_table == [0, 1]
    bm.free(a)  # b still holds them: not evictable
    assert bm.num_evictable == 0 and bm.num_free == 2
    c = mk("c", range(50, 70))
    with pytest.raises(MemoryError):
        bm.allocate(c, 3 * BS)
    assert bm.allocate(c, 2 * BS) == [2, 3] and b.block_table == [0, 1]
    assert bm.cached_prefix(hashes(range(8))) == [0, 1]
    bm.free(b)
    assert bm.num_evictable == 2
    b.block_table = [0]  # forged: b holds nothing any more
    with pytest.raises(RuntimeError):
        bm.free(b)


def test_reset_forgets_every_hash_and_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS, prefix_caching=True)
    bm.free(cached_seq(bm, "a", range(8)))
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0 and bm.num_evictable == 0 and bm.num_free == 4
    off = BlockManager(num_blocks=4, block_size=BS)
    s = cached_seq(off, "a", range(8))
    assert off.num_cached_blocks == 0 and off.cached_prefix(hashes(range(8))) == []
    off.free(s)


def run_step(sched, tokens_for=lambda seq: 7):
    batch = sched.schedule()
    new = {}
    for seq, _, end in batch.prefills:
        if end == seq.num_tokens:
            new[seq.request_id] = tokens_for(seq)
    for seq in batch.decodes:
        new[seq.request_id] = tokens_for(seq)
    sched.postprocess(batch, new)
    return batch


def drain(sched, limit=100):
    for _ in range(limit):
        if not sched.has_work():
            return
        run_step(sched)
    raise AssertionError("did not finish")


def test_scheduler_takes_the_cached_prefix_but_never_the_last_token():
    sched = Scheduler(BlockManager(16, BS, prefix_caching=True), max_prefill_chunk=64)
    sched.add(mk("a", range(10)))
    drain(sched)  # a's KV: 10 prompt + 1 output token computed -> blocks of tokens 0-7 full
    assert sched.bm.num_cached_blocks == 2
    b = mk("b", list(range(8)) + [50, 51, 52])
    sched.add(b)
    batch = run_step(sched)
    assert [(s.request_id, st, e) for s, st, e in batch.prefills] == [("b", 8, 11)]
    assert b.num_cached_tokens == 8
    c = mk("c", range(8))  # the whole prompt is cached: its last block is computed again
    sched.add(c)
    batch = run_step(sched)
    assert [(s.request_id, st, e) for s, st, e in batch.prefills] == [("c", 4, 8)] and c.num_cached_tokens == 4
    d = mk("d", range(5))  # 4 cached + 1: a decode-shaped step over the last prompt token
    sched.add(d)
    batch = run_step(sched)
    assert d in batch.decodes and d.num_cached_tokens == 4
    drain(sched)
    st = sched.stats()
    assert st["prefix_cache_queries"] == 10 + 11 + 8 + 5 and st["prefix_cache_hits"] == 8 + 4 + 4


def test_salt_and_kv_key_keep_caches_apart():
    sched = Scheduler(BlockManager(32, BS, prefix_caching=True), max_prefill_chunk=64)
    key = [None]
    sched.kv_key = lambda: key[0]
    sched.add(mk("a", range(13), salt="t1"))
    drain(sched)
    for rid, salt, want in (("b", "t2", 0), ("c", None, 0), ("d", "t1", 12)):
        s = mk(rid, range(13), salt=salt)
        sched.add(s)
        drain(sched)
        assert s.num_cached_tokens == want, rid
    key[0] = 0.5  # brownout on: KV computed before is not reused
    e = mk("e", range(13), salt="t1")
    sched.add(e)
    drain(sched)
    assert e.num_cached_tokens == 0
    # a sequence whose KV is computed under two keys registers nothing after the change
    f = mk("f", range(200, 209), max_tokens=12)
    sched.add(f)
    run_step(sched)
    key[0] = 0.25
    before = sched.bm.num_cached_blocks
    drain(sched)
    assert f.cache_key is None and sched.bm.num_cached_blocks == before
    # the exact model's KV (exact_kv_key) is read under every key; the exact key reads only its own
    sched.exact_kv_key = lambda: "exact"
    key[0] = "exact"
    sched.add(mk("g", range(300, 313)))
    drain(sched)
    key[0] = 0.125  # browned out: reads the exact KV, registers nothing of its own
    h = mk("h", range(300, 313))
    sched.add(h)
    drain(sched)
    assert h.num_cached_tokens == 12 and h.cache_key is None
    sched.add(mk("i", range(400, 413)))  # browned-out KV ...
    drain(sched)
    j = mk("j", range(400, 413))
    sched.add(j)
    drain(sched)
    assert j.num_cached_tokens == 12  # ... serves its own key
    key[0] = "exact"
    k = mk("k", range(400, 413))
    sched.add(k)
    drain(sched)
    assert k.num_cached_tokens == 0  # ... never the exact model


def test_drop_all_kv_forgets_the_cache():
    sched = Scheduler(BlockManager(16, BS, prefix_caching=True), max_prefill_chunk=64)
    sched.add(mk("a", range(9)))
    drain(sched)
    assert sched.bm.num_cached_blocks == 2
    sched.add(mk("b", range(9), max_tokens=3))
    run_step(sched)
    assert sched.drop_all_kv()[0].request_id == "b"
    assert sched.bm.num_cached_blocks == 0 and sched.bm.num_free == 16
    drain(sched)
    assert sched.stats()["finished"] == 2


def test_cache_aware_dispatch_rule():
    bm = BlockManager(32, BS, num_partitions=2, prefix_caching=True)
    busy = mk("busy", range(100, 104), max_tokens=26)  # load 4 + 26 = 30 on partition 0
    bm.allocate(busy, 4, partition=0)
    # 40 tokens, 8 of them cached on p0: p0 costs 30 + 32, p1 costs 0 + 40 -> p1
    assert choose_cached_instance(bm, [busy], 40, [2, 0], chunk=64) == 1
    # 40 tokens, 32 of them (8 blocks) cached on p0: p0 costs 30 + 8, p1 costs 40 -> p0
    assert choose_cached_instance(bm, [busy], 40, [8, 0], chunk=64) == 0
    assert choose_cached_instance(bm, [busy], 40, [0, 3], chunk=64) == 1


def prefills(batch):
    return [(s.request_id, st, e) for s, st, e in batch.prefills]


def test_a_prefix_still_being_computed_is_waited_for_not_recomputed():
    """``b`` and ``c`` arrive with ``a``, sharing its 3 full blocks (chunks of 4 tokens): they wait while
    ``a`` computes them (other work runs), then take them from the cache and compute their own tails
    only. Without the cache everyone computes everything."""
    shared = list(range(12))

    def run(prefix_caching):
        sched = Scheduler(BlockManager(32, BS, prefix_caching=prefix_caching), max_prefill_chunk=4)
        other = mk("other", range(100, 103), max_tokens=6)
        sched.add(other)
        run_step(sched)  # a decode that keeps running while b and c wait
        seqs = [mk(r, shared + [50 + i, 60 + i]) for i, r in enumerate("abc")]
        for s in seqs:
            sched.add(s)
        steps = [run_step(sched) for _ in range(3)]
        assert all(b.decodes == [other] for b in steps)
        steps = [prefills(b) for b in steps]
        drain(sched)
        return sched, seqs, steps

    sched, (a, b, c), steps = run(True)
    assert steps == [[("a", 0, 4)], [("a", 4, 8)], [("a", 8, 12)]]  # b, c wait; "other" decodes meanwhile
    assert b.num_cached_tokens == c.num_cached_tokens == 12 and a.num_cached_tokens == 0
    assert b.num_prefix_waits == c.num_prefix_waits == 3 and sched.stats()["prefix_cache_waits"] == 6
    plain, _, plain_steps = run(False)
    assert plain_steps[0] == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]
    assert sched.stats()["prefill_tokens"] == 3 + 14 + 2 + 2 < plain.stats()["prefill_tokens"] == 3 + 3 * 14


def test_nobody_waits_on_an_aborted_or_stalled_prefill_and_the_wait_is_bounded():
    shared = list(range(12))
    sched = Scheduler(BlockManager(32, BS, prefix_caching=True), max_prefill_chunk=4)
    a, b = mk("a", shared + [50]), mk("b", shared + [51])
    sched.add(a)
    sched.add(b)
    assert prefills(run_step(sched)) == [("a", 0, 4)]
    sched.abort("a")  # b was waiting for a's blocks: they are not pending any more
    assert prefills(run_step(sched)) == [("b", 4, 8)] and b.num_cached_tokens == 4
    drain(sched)
    # a prefill the policy leaves out (keep-KV preempted) is not computing its blocks: no one waits on it
    hold = set()
    fcfs = FCFSPolicy()
    policy = SimpleNamespace(order=lambda q, b: [s for s in fcfs.order(q, b) if s.request_id not in hold])
    policy.victim, policy.pause_at_layer = fcfs.victim, fcfs.pause_at_layer
    sched = Scheduler(BlockManager(32, BS, prefix_caching=True), policy=policy, max_prefill_chunk=4)
    a, b = mk("a", shared + [50]), mk("b", shared + [51])
    sched.add(a)
    run_step(sched)
    hold.add("a")
    sched.add(b)
    assert prefills(run_step(sched)) == []  # a ran last step: b waits for it once
    assert a.status is SequenceStatus.PREEMPTED
    assert prefills(run_step(sched)) == [("b", 4, 8)] and b.num_prefix_waits == 1
    hold.clear()
    drain(sched)
    # the wait is bounded: after max_prefix_wait_steps steps it computes the prefix itself
    sched = Scheduler(BlockManager(32, BS, prefix_caching=True), max_prefill_chunk=4, max_prefix_wait_steps=1)
    a, b = mk("a", shared + [50]), mk("b", shared + [51])
    sched.add(a)
    sched.add(b)
    assert prefills(run_step(sched)) == [("a", 0, 4)]
    assert prefills(run_step(sched)) == [("a", 4, 8), ("b", 4, 8)] and b.num_prefix_waits == 1


@pytest.mark.slow
def test_soak_every_read_position_holds_its_own_tokens():
    """Random arrivals of prompts that share prefixes with each other, a cache small enough to evict and
    recompute-preempt: before every step, every position a scheduled sequence has as computed holds the
    KV written for exactly its tokens up to that position (the fake KV of a slot is its token prefix)."""
    rng = random.Random(0)
    bm = BlockManager(14, BS, prefix_caching=True)
    sched = Scheduler(bm, max_batch_tokens=24, max_num_seqs=6, max_prefill_chunk=10)
    kv: dict[int, tuple] = {}
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(3)]
    pending = []
    for i in range(30):
        stem = rng.choice(stems)
        pending.append(
            mk(
                f"r{i}",
                stem[: rng.randrange(1, 17)] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))],
                max_tokens=rng.randrange(1, 14),
            )
        )
    for _ in range(2000):
        while pending and rng.random() < 0.7:
            sched.add(pending.pop())
        if not sched.has_work() and not pending:
            break
        batch = sched.schedule()
        for seq in batch.seqs:
            ids = seq.all_ids
            for p in range(seq.num_computed):
                slot = bm.slot_mapping(seq, p, p + 1)[0]
                assert kv.get(slot) == tuple(ids[: p + 1]), (seq, p)
        new = {}
        items = list(batch.prefills) + [(s, s.num_tokens - 1, s.num_tokens) for s in batch.decodes]
        for seq, start, end in items:
            ids = seq.all_ids
            for p in range(start, end):
                slot = bm.slot_mapping(seq, p, p + 1)[0]
                assert slot // BS not in bm._hash_of, f"{seq.request_id} writes cached block {slot // BS}"
                kv[slot] = tuple(ids[: p + 1])
            if end == seq.num_tokens:
                new[seq.request_id] = hash(tuple(ids)) % 50
        sched.postprocess(batch, new)
    assert not sched.has_work() and not pending
    assert sched.stats()["prefix_cache_hits"] > 0 and bm.num_evictions > 0
    assert sum(sched.preemptions["recompute"].values()) > 0 and sched.stats()["prefix_cache_waits"] > 0
