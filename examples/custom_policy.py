"""A user-defined scheduling policy: shortest-prompt-first (run: python examples/custom_policy.py)."""

from types import SimpleNamespace

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.policies import Budget, Policy, Queues, arrival_key
from jaxmoe.engine.scheduler import Scheduler
from jaxmoe.engine.sequence import Sequence


class ShortestPromptFirst(Policy):
    """Running decodes first (arrival order) so no stream stalls; then prefills
    with the fewest tokens left to compute (SJF lowers mean TTFT). Priority-blind."""

    name = "shortest_prompt_first"

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        decodes = sorted(queues.ls_decode + queues.be_decode, key=arrival_key)
        prefills = sorted(queues.ls_prefill + queues.be_prefill, key=lambda s: (s.num_uncomputed, arrival_key(s)))
        return decodes + prefills

    def victim(self, candidates: list[Sequence]) -> Sequence:
        # Out of KV blocks: evict whoever holds the most (frees memory fastest).
        return max(candidates, key=lambda s: (len(s.block_table), arrival_key(s)))


def demo() -> list[str]:
    """Three prompts, one slot: returns request ids in order of their first token."""
    sched = Scheduler(BlockManager(64, 16), ShortestPromptFirst(), max_batch_tokens=64, max_num_seqs=1)
    for rid, n in [("long", 40), ("short", 3), ("mid", 10)]:
        sched.add(Sequence(rid, list(range(n)), SimpleNamespace(max_tokens=2)))
    first = []
    while sched.has_work():
        batch = sched.schedule()
        tokens = {s.request_id: 7 for s, _, end in batch.prefills if end == s.num_tokens}
        tokens.update({s.request_id: 7 for s in batch.decodes})
        first += [rid for rid in tokens if not sched.get(rid).output_ids]
        sched.postprocess(batch, tokens)
    return first


if __name__ == "__main__":
    print("first-token order:", demo())  # ['short', 'mid', 'long']
