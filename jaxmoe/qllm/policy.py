"""QLLM's batch selection (arXiv:2503.09304, Sec. 3.2): the scheduling policy that puts
latency-sensitive work first, the engine's ``"qllm"`` policy (``engine.policies.POLICIES``)."""

from __future__ import annotations

from jaxmoe.engine.policies import Budget, Policy, Queues
from jaxmoe.engine.sequence import Sequence


class QLLMPolicy(Policy):
    """QLLM's batch selection (qllm.txt Sec. 3.2, "Batch selection logic").

    Our copy of the paper contains Algorithm 1 only as the prose that explains
    it (its pseudocode listing is missing), so this follows that prose line by
    line; the quotes below are verbatim. "Maximum batch size" maps to our
    budget (``max_num_seqs`` and ``max_batch_tokens``); "fill" = the
    scheduler's greedy packing in the returned order.

    Where the prose is silent -- which BE jobs "some BE jobs" (lines 6-7) are --
    we use the rule the paper states for BE work elsewhere, "prioritizing
    decode over prefill" (lines 16-19). Note that lines 10-14 admit only BE
    *decode* jobs next to LS decodes: a BE prompt does not start prefilling
    while LS jobs are decoding and none is prefilling (the paper lists
    starvation as a known limitation). ``be_prefill_with_ls_decode=True``
    relaxes exactly that one rule.
    """

    name = "qllm"

    def __init__(self, be_prefill_with_ls_decode: bool = False):
        self.be_prefill_with_ls_decode = be_prefill_with_ls_decode

    def order(self, queues: Queues, budget: Budget) -> list[Sequence]:
        q = queues
        if q.ls_prefill:
            # "The algorithm prioritizes filling the batch first with LS jobs
            #  at the decode stage (lines 2-3). If a maximum-sized batch cannot
            #  be created, it prioritizes LS jobs in the prefill stage to
            #  produce more LS jobs in the decode stage (lines 4-5). The
            #  algorithm also attempts to add some BE jobs to fill the batch if
            #  possible (lines 6-7)."
            return q.ls_decode + q.ls_prefill + q.be_decode + q.be_prefill
        if q.ls_decode:
            # "If there are no LS jobs at the prefill stage, the algorithm
            #  simply executes the LS jobs at the decode stage, filling the
            #  batch with BE jobs at the decode stage (lines 10-14)."
            extra = q.be_prefill if self.be_prefill_with_ls_decode else []
            return q.ls_decode + q.be_decode + extra
        # "If there are no LS jobs, it simply executes BE jobs, prioritizing
        #  decode over prefill (lines 16-19)."
        return q.be_decode + q.be_prefill
