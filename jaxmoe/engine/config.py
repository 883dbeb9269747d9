"""``EngineConfig``: the engine's settings (KV cache, batch budget, scheduling policy, the expert-FFN
implementation, pause points of a step run layer by layer), checked when built. The features'
settings are their own sections of ``jaxmoe.assembly.RuntimeConfig``."""

from __future__ import annotations

import dataclasses


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

    def __post_init__(self):
        every = self.pause_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"pause_every must be a positive integer, got {every!r}")
