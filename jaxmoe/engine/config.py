"""``EngineConfig``: the engine's settings (KV cache, batch budget, scheduling policy, the expert-FFN
implementation, pause points of a step run layer by layer), checked when built. The features'
settings are their own sections of ``jaxmoe.assembly.RuntimeConfig``."""

from __future__ import annotations

import dataclasses

DETERMINISTIC_ROW_TOKENS = 16  # deterministic mode: tokens of every row of every program call


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
    # (1: after every layer; bench/qllm.py measured one-layer programs no slower than the fused step)
    pause_every: int = 1
    # automatic prefix caching: full KV blocks are kept by a hash of their tokens and prefix and shared
    # by later sequences with the same prefix (engine.prefix_cache, BlockManager)
    prefix_caching: bool = True
    # batch-invariant mode: every program call has one shape (max_num_seqs rows per attention instance, rounded
    # up to a power of two, of DETERMINISTIC_ROW_TOKENS tokens; prefill chunks of at most that many tokens), the
    # experts run as one dense einsum and attention in its XLA form, so a request's results do not depend on what
    # it is batched with, how its prompt is chunked or whether its prefix came from the cache (engine.model_runner)
    deterministic: bool = False

    def __post_init__(self):
        every = self.pause_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"pause_every must be a positive integer, got {every!r}")
        if self.deterministic:
            if self.expert_impl not in ("auto", "dense"):
                raise ValueError(f"deterministic mode runs expert_impl='dense', got expert_impl={self.expert_impl!r}")
            object.__setattr__(self, "expert_impl", "dense")
            object.__setattr__(self, "max_prefill_chunk", min(self.max_prefill_chunk, DETERMINISTIC_ROW_TOKENS))
