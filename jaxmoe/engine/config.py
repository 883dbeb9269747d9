"""``EngineConfig``: the engine's settings (KV cache, batch budget, scheduling policy, the expert-FFN
implementation, pause points of a step run layer by layer), checked when built. The features'
settings are their own sections of ``jaxmoe.assembly.RuntimeConfig``."""

from __future__ import annotations

import dataclasses

DETERMINISTIC_ROW_TOKENS = 16  # deterministic mode without the invariant CPU kernels: tokens of every row
# the expert-FFN forms deterministic mode runs: the batch-invariant CPU kernels, or the fixed-shape dense form
DETERMINISTIC_EXPERT_IMPLS = ("auto", "cpu_kernel_invariant", "dense")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 1024  # disaggregated: rounded up to a multiple of the attention instances
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_waiting: int = 1024
    max_model_len: int | None = None  # default: the model's max_position
    max_prefill_chunk: int = 512  # tokens of one prefill chunk (longer prompts are chunked)
    policy: str = "qllm"  # "qllm" | "fcfs" | "module:Class" | a SchedulingPolicy object (engine.policies)
    expert_impl: str = "auto"  # the expert-FFN implementation (jaxmoe.pallas_kernels.expert_ffn.IMPLS)
    # a step run layer by layer (a layer hook pauses it): layers between two pause points, i.e. per program
    # (1: after every layer). None: 1, except where QLLM's layer preemption is on by default (no explicit
    # ``layer_preemption``, no per-expert queues): there it is measured at warm-up (``qllm.granularity``: the finest granularity
    # whose steps cost at most 2 % more than the fused step's, else step-level preemption)
    pause_every: int | None = None
    # automatic prefix caching: full KV blocks are kept by a hash of their tokens and prefix and shared
    # by later sequences with the same prefix (engine.prefix_cache, BlockManager)
    prefix_caching: bool = True
    # batch-invariant mode: a request's results do not depend on what it is batched with, how its prompt is
    # chunked or whether its prefix came from the cache. Where the CPU kernels take the model (expert_impl
    # "auto" on CPU: "cpu_kernel_invariant", ``assembly.deterministic_expert_impl``) every matmul, the expert FFN
    # and attention sum each token's terms in an order fixed by the weights' shapes, so the ordinary bucketed
    # shapes run; elsewhere ("dense") every program call has one shape (max_num_seqs rows per attention
    # instance, rounded up to a power of two, of DETERMINISTIC_ROW_TOKENS tokens; prefill chunks of at most that
    # many), the experts run as one dense einsum and attention in its XLA form (engine.model_runner)
    deterministic: bool = False
    # async scheduling (vLLM's name): step N+1 is dispatched before step N's tokens are read, and step N's
    # stops, detokenization and outputs run while step N+1 runs; steps that need step N's tokens on the host
    # first run synchronously (``engine.engine``)
    async_scheduling: bool = False

    def __post_init__(self):
        every = self.pause_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"pause_every must be a positive integer or None (measured), got {every!r}")
        if self.deterministic and self.expert_impl not in DETERMINISTIC_EXPERT_IMPLS:
            raise ValueError(
                f"deterministic mode runs expert_impl 'cpu_kernel_invariant' or 'dense' (or 'auto'), "
                f"got expert_impl={self.expert_impl!r}"
            )
