"""Per-token decode latency (TPOT) of an MoE model on a layout of GPUs, from a roofline of its parts.

JANUS (arXiv:2512.13525, section 2.2) measures that an MoE layer is memory-bound and its time grows
linearly with the number of experts each GPU activates (Takeaway #2), while attention time depends
on the batch and context per attention instance. Per layer and decode step:

* attention (per attention instance, batch ``b``): read the layer's non-expert weights and the batch's
  KV cache, or its FLOPs if that is longer, plus a launch overhead;
* MoE (per expert instance): ``activated experts x bytes per expert`` at memory bandwidth (or the
  expert FLOPs), plus a launch overhead. Activated experts per instance: the expected number of
  distinct experts ``T`` tokens choose, ``E (1 - (1 - k/E)^T)``, spread evenly by AEBS ("balanced")
  or as unevenly as random scheduling leaves them (expected maximum of a balls-in-bins load);
* A2E + E2A: ``hops x alpha + bytes / bandwidth`` with the two-phase scheme's hops (one send per
  expert node) or direct m-to-n hops.

A monolithic deployment of N GPUs (JANUS's SGLang baseline: attention data-parallel, each group
tensor-parallel over as few GPUs as let the weights fit; experts sharded over all GPUs) runs both
on every GPU with an all-to-all in between. Parameters are GPU-shaped (H100: 3.35 TB/s, 989 TFLOP/s, 80 GB;
DeepSeek-V2's footprint from JANUS Table 1: 421 GB of experts in 472 GB).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    memory_bandwidth: float  # bytes/s actually reached by decode kernels
    flops: float  # FLOP/s actually reached
    memory: float  # bytes per GPU usable for weights and KV
    link_bandwidth: float  # bytes/s between nodes (per GPU)
    link_alpha: float  # seconds per message
    gpus_per_node: int = 8
    launch_overhead: float = 20e-6  # seconds per layer part


H100 = Hardware(
    "H100 SXM (80 GB)",
    memory_bandwidth=0.8 * 3.35e12,
    flops=0.5 * 989e12,
    memory=72e9,
    link_bandwidth=50e9,
    link_alpha=10e-6,
)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    moe_layers: int
    hidden: int
    experts: int
    top_k: int
    expert_bytes_total: float  # all routed experts of all layers
    other_bytes_total: float  # everything else (attention, shared experts, embeddings)
    kv_bytes_per_token_layer: float
    dtype_bytes: int = 2

    @property
    def expert_bytes(self) -> float:
        """One expert of one layer."""
        return self.expert_bytes_total / (self.experts * self.moe_layers)

    @property
    def other_bytes_per_layer(self) -> float:
        return self.other_bytes_total / self.layers


# JANUS Table 1 (DS-V2: 421 GB of experts, 472 GB total) and DeepSeek-V2's config (60 layers, the
# first dense; hidden 5120; 160 routed experts top-6; MLA cache of 512 + 64 values per token and layer).
DEEPSEEK_V2 = ModelShape(
    "DeepSeek-V2",
    layers=60,
    moe_layers=59,
    hidden=5120,
    experts=160,
    top_k=6,
    expert_bytes_total=421e9,
    other_bytes_total=51e9,
    kv_bytes_per_token_layer=576 * 2,
)


@runtime_checkable
class DisaggregatedPerf(Protocol):
    """What the scaling controller needs of a performance model of disaggregated layouts: the TPOT
    of a decode step and the sequences the KV cache holds. ``PerfModel`` (roofline) and
    ``fitted.FittedPerfModel`` (fitted from measurements on the mesh) implement it."""

    def tpot_disaggregated(
        self, batch: float, context: float, attention: int, experts: int, balanced: bool = True, two_phase: bool = True
    ) -> float: ...

    def kv_capacity(self, attention: int, context: float) -> float: ...


def distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` tokens choose (top-k of E, uniformly)."""
    return experts * (1 - (1 - top_k / experts) ** tokens) if tokens > 0 else 0.0


def activated_per_instance(
    experts: int, top_k: int, tokens: float, instances: int, cap: float, balanced: bool
) -> float:
    """Experts the busiest of ``instances`` expert instances runs in one layer (at most ``cap``, the
    experts an instance holds): an even share of the distinct experts under AEBS (``balanced``),
    the expected maximum of a balls-in-bins load under random scheduling."""
    mean = distinct_experts(experts, top_k, tokens) / instances
    if balanced:  # AEBS: replicas let every instance run an even share
        return min(cap, math.ceil(mean - 1e-9))
    spread = math.sqrt(2 * mean * max(math.log(instances), 1e-9)) if instances > 1 else 0.0
    return min(cap, mean + spread)


class PerfModel:
    def __init__(self, model: ModelShape = DEEPSEEK_V2, hw: Hardware = H100):
        self.model, self.hw = model, hw

    # -- parts ---------------------------------------------------------------------------------
    def attention_s(self, batch: float, context: float) -> float:
        """One layer's attention (+ shared experts) on one instance for ``batch`` sequences."""
        m, hw = self.model, self.hw
        read = m.other_bytes_per_layer + batch * context * m.kv_bytes_per_token_layer
        flops = 2 * batch * m.other_bytes_per_layer / m.dtype_bytes
        return hw.launch_overhead + max(read / hw.memory_bandwidth, flops / hw.flops)

    def distinct_experts(self, tokens: float) -> float:
        return distinct_experts(self.model.experts, self.model.top_k, tokens)

    def activated_per_instance(self, tokens: float, instances: int, balanced: bool) -> float:
        """Experts the busiest instance runs in one layer."""
        m = self.model
        return activated_per_instance(m.experts, m.top_k, tokens, instances, m.experts / instances, balanced)

    def moe_s(self, tokens: float, instances: int, balanced: bool = True) -> float:
        m, hw = self.model, self.hw
        act = self.activated_per_instance(tokens, instances, balanced)
        flops = 2 * 3 * tokens * m.top_k * m.hidden * (m.expert_bytes / (3 * m.hidden * m.dtype_bytes)) / instances
        return hw.launch_overhead + max(act * m.expert_bytes / hw.memory_bandwidth, flops / hw.flops)

    def transfer_s(self, tokens: float, senders: int, receivers: int, two_phase: bool = True) -> float:
        """A2E + E2A of one layer: activations out, results back."""
        hw = self.hw
        nbytes = tokens * self.model.hidden * self.model.dtype_bytes
        nodes = math.ceil(receivers / hw.gpus_per_node)
        hops = nodes if two_phase else receivers
        per_sender = nbytes / max(senders, 1)
        return 2 * (hops * hw.link_alpha + hops * per_sender / hw.link_bandwidth)

    # -- a step ----------------------------------------------------------------------------------
    def tpot_disaggregated(
        self, batch: float, context: float, attention: int, experts: int, balanced: bool = True, two_phase: bool = True
    ) -> float:
        m = self.model
        per_layer_attn = self.attention_s(batch / attention, context)
        per_moe = self.moe_s(batch, experts, balanced) + self.transfer_s(batch, attention, experts, two_phase)
        return m.layers * per_layer_attn + m.moe_layers * per_moe

    def tpot_monolithic(self, batch: float, context: float, gpus: int) -> float:
        """SGLang-style deployment of ``gpus`` GPUs as JANUS's baseline (section 1: the attention
        side's data parallelism configured to match expert parallelism): ``gpus / tp`` attention
        groups, data-parallel, each tensor-parallel over ``tp = monolithic_tp(gpus)`` GPUs (its
        weights split, two all-reduces per layer; the MLA latent KV cache cannot be split over
        heads, so every GPU of a group reads all of its group's cache), experts sharded over all
        GPUs, an all-to-all before and after the experts."""
        m, hw = self.model, self.hw
        tp = self.monolithic_tp(gpus)
        b = batch / (gpus // tp)
        read = m.other_bytes_per_layer / tp + b * context * m.kv_bytes_per_token_layer
        flops = 2 * b * m.other_bytes_per_layer / m.dtype_bytes / tp
        attn = hw.launch_overhead + max(read / hw.memory_bandwidth, flops / hw.flops) + 2 * (tp > 1) * hw.link_alpha
        moe = self.moe_s(batch, gpus, balanced=False)
        nbytes = batch * m.hidden * m.dtype_bytes / gpus
        all_to_all = 2 * (max(gpus // hw.gpus_per_node - 1, 1) * hw.link_alpha + nbytes / hw.link_bandwidth)
        return m.layers * attn + m.moe_layers * (moe + all_to_all)

    # -- memory ----------------------------------------------------------------------------------
    def min_expert_instances(self) -> int:
        return math.ceil(self.model.expert_bytes_total / self.hw.memory)

    def kv_capacity(self, attention: int, context: float) -> float:
        """Sequences of ``context`` tokens the attention instances' memory holds."""
        m = self.model
        free = self.hw.memory - m.other_bytes_total
        return attention * free / (context * m.kv_bytes_per_token_layer * m.layers)

    def monolithic_tp(self, gpus: int) -> int:
        """The least tensor parallelism of the attention groups (1, 2, 4, ... up to a node) with
        which every GPU holds its attention share and its expert shard."""
        m, tp = self.model, 1
        while (
            tp < min(self.hw.gpus_per_node, gpus)
            and gpus * (self.hw.memory - m.other_bytes_total / tp) < m.expert_bytes_total
        ):
            tp *= 2
        return tp

    def monolithic_capacity(self, gpus: int, context: float) -> float:
        """Sequences the KV cache holds: the GPUs' memory less the experts and each GPU's attention
        share; each group's cache is held by all ``tp`` GPUs of the group."""
        m = self.model
        tp = self.monolithic_tp(gpus)
        free = gpus * (self.hw.memory - m.other_bytes_total / tp) - m.expert_bytes_total
        return max(free, 0.0) / (context * m.kv_bytes_per_token_layer * m.layers * tp)
