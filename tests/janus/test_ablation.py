"""JANUS Fig. 10's ablation variants (``jaxmoe.janus.scaling.ablation``): base (direct transfers, random
replica scheduling), +two-phase transfers, +AEBS give the same greedy tokens, and the variants
really differ in what they run (transfer strategy and hops, scheduling policy)."""

from __future__ import annotations

import pytest

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe import LLM, SamplingParams
from jaxmoe.mesh import load_mesh
from jaxmoe.janus.scaling.ablation import VARIANTS, build_variant

BASE = load_mesh("meshes/cpu-8.yaml")
ENGINE = dict(dtype="float32", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=16, max_batch_tokens=64)
PROMPTS = [[5, 9, 11, 40, 2], [7, 3, 8], [100, 101, 102, 103, 104, 105, 106]]


@pytest.mark.slow
def test_variants_give_the_same_greedy_tokens(checkpoint_dir):
    path = str(checkpoint_dir("mixtral"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, strategies, hops = {}, {}, {}
    for variant in VARIANTS:
        llm = build_variant(path, BASE, 4, 4, variant, **ENGINE)  # attention node 0, experts node 1
        outs = llm.generate(PROMPTS, params)
        tokens[variant] = [o.token_ids for o in outs]
        stats = next(iter(llm.executor.transfer_stats().values()))
        strategies[variant], hops[variant] = stats["strategy"], stats["transfers_per_step"]
        assert LiveRescaler.of(llm.engine).executor_kwargs["replica_policy"] == VARIANTS[variant][1]
    assert tokens["base"] == tokens["+2pc"] == tokens["+2pc+lb"]
    assert all(len(t) == 8 for t in tokens["base"])
    assert strategies["base"] == "direct" and strategies["+2pc"].startswith("two_phase")
    assert hops["+2pc"] < hops["base"]


@pytest.mark.slow
def test_bad_variant_and_replica_policy_are_named():
    with pytest.raises(ValueError, match="variant must be one of"):
        build_variant("tiny-random", BASE, 2, 6, "fast")
    with pytest.raises(ValueError, match="replica_policy must be one of .* got 'balanced'"):
        LLM("tiny-random", mesh="meshes/cpu-8.yaml", executor_kwargs={"replica_policy": "balanced"}, num_blocks=16)
