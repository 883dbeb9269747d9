"""Both executors satisfy the declared engine <-> executor contract (``runtime.executor.Executor``)."""

from __future__ import annotations

import inspect

import pytest

from jaxmoe import LLM
from jaxmoe.pallas_kernels.expert_ffn import IMPLS as EXPERT_IMPLS
from jaxmoe.runtime.disaggregated import DisaggregatedExecutor
from jaxmoe.models.routing import TopKRouting
from jaxmoe.runtime.executor import Executor, LowersAhead, ReplicaPlacement, Routed
from jaxmoe.runtime.monolithic import MonolithicExecutor


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, "meshes/cpu-8.yaml"])
def test_executors_implement_the_protocol(mesh):
    llm = LLM("tiny-random", dtype="float32", num_blocks=32, block_size=8, **({"mesh": mesh} if mesh else {}))
    ex = llm.executor
    assert isinstance(ex, Executor)
    assert isinstance(ex, DisaggregatedExecutor if mesh else MonolithicExecutor)
    assert ex.num_attention == (2 if mesh else 1) and ex.num_cache_slots >= 32 * 8
    assert ex.num_cache_slots % (ex.num_attention * ex.block_size) == 0
    kv = ex.kv_layout  # the one statement of where KV lives
    assert (kv.num_instances, kv.block_size, kv.num_slots) == (ex.num_attention, 8, ex.num_cache_slots)
    assert llm.engine.block_manager.layout == kv and llm.engine.runner.kv == kv
    assert ex.expert_impl in EXPERT_IMPLS
    params = inspect.signature(ex.forward).parameters
    assert list(params)[:3] == ["tokens", "batch", "logits_index"] and "between_layers" in params
    counts = ex.expert_activation_counts()
    assert counts is None if mesh is None else len(counts) == llm.cfg.num_moe_layers
    assert "layers" in ex.params
    # capabilities: replica placement on a mesh, an expert routing (top-k by default, no state) on both
    assert isinstance(ex, ReplicaPlacement) == bool(mesh)
    assert isinstance(ex, Routed) and ex.routing == TopKRouting() and ex.routing_state is None
    # the fused step lowers ahead (warm-up compiles it on a pool); the disaggregated one warms by running
    assert isinstance(ex, LowersAhead) == (mesh is None)
