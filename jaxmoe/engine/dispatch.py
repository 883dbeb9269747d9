"""Which attention instance a new sequence goes to: the least loaded one (JANUS-style dispatch).

With m attention instances the KV cache has m partitions (``BlockManager``) and a sequence's
partition is its attention instance for its whole life. A sequence's *load* is the tokens it still
has to compute: prompt tokens without KV (its queued prefill) plus output tokens still to generate
(``max_tokens`` minus those generated; 1 when it has no limit). An instance's load is the sum over
the unfinished sequences that hold blocks on it, running or waiting (tokens in flight plus its
queue). A new sequence goes to the instance with the least load among those whose free blocks hold
its first chunk (ties: more free blocks, then the lower id); when none has room, to the one with
the most free blocks (which may then evict or shrink the chunk, as before).

Cache-aware dispatch (prefix caching: each instance caches the blocks of its own sequences): when
some instance holds cached blocks of a new sequence's tokens, it goes to the instance with the
least *load plus the tokens it would still compute there* -- its tokens minus the cached prefix it
would read there -- among those with room for its first chunk (``choose_cached_instance``; ties:
the longer cached prefix, more free blocks, the lower id). So the instance holding the longest
cached prefix wins unless its load exceeds another instance's by more than the extra tokens the
cache saves there: a repeated 1024-token prompt stays where it is cached until that instance has
1024 more tokens of work queued than the least-loaded one.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.sequence import Sequence


def sequence_load(seq: Sequence) -> int:
    """Tokens ``seq`` still has to compute: prompt tokens without KV + outputs still to generate."""
    prefill = max(0, seq.num_prompt_tokens - seq.num_computed)
    limit = seq.max_tokens
    decode = 1 if limit is None else max(0, limit - seq.num_output_tokens)
    return prefill + decode


def instance_loads(bm: BlockManager, seqs: Iterable[Sequence]) -> list[int]:
    """Load of every partition (attention instance) of ``bm``: the sum of its sequences' loads."""
    loads = [0] * bm.num_partitions
    for seq in seqs:
        p = bm.partition_of(seq)
        if p is not None and not seq.is_finished:
            loads[p] += sequence_load(seq)
    return loads


def choose_instance(bm: BlockManager, seqs: Iterable[Sequence], blocks: int) -> int | None:
    """The partition for a new sequence whose first chunk needs ``blocks`` blocks: the least loaded
    with room for it; None when no partition has room (``BlockManager``'s default then applies)."""
    if bm.num_partitions == 1:
        return None
    loads = instance_loads(bm, seqs)
    fits = [p for p in range(bm.num_partitions) if bm.num_free_in(p) >= blocks]
    if not fits:
        return None
    return min(fits, key=lambda p: (loads[p], -bm.num_free_in(p), p))


def choose_cached_instance(
    bm: BlockManager, seqs: Iterable[Sequence], num_tokens: int, cached_blocks: list[int], chunk: int
) -> int | None:
    """The partition for a new sequence of ``num_tokens`` tokens, ``cached_blocks[p]`` of whose
    leading blocks partition p has cached, whose first chunk computes up to ``chunk`` tokens: the
    least load + tokens left to compute there, among those with room (see the module doc); None
    when none has room."""
    if bm.num_partitions == 1:
        return 0
    loads = instance_loads(bm, seqs)
    bs = bm.block_size

    def room(p: int) -> bool:
        start = cached_blocks[p] * bs
        return bm.num_free_in(p) >= bm.blocks_for(min(num_tokens, start + chunk)) - cached_blocks[p]

    fits = [p for p in range(bm.num_partitions) if room(p)]
    if not fits:
        return None
    return min(
        fits,
        key=lambda p: (loads[p] + num_tokens - cached_blocks[p] * bs, -cached_blocks[p], -bm.num_free_in(p), p),
    )
