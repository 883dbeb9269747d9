"""Serving-time weight quantization on the disaggregated executor (``LLM(path, mesh=...,
quantization="int8" | "fp8")``, 8 CPU devices): the greedy tokens (and logprobs) of the monolithic
executor with the same quantization; the routed experts held quantized on the expert sub-mesh at
<= 0.55x the bytes of bf16, on instances of one device and on instances that split the FFN columns;
a re-placement and live re-scaling's expert re-shard move each slot's scales with its values, and the
re-placement keeps the tokens; the layouts it does not take are refused naming the field."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.checkpoint.model import load_model
from jaxmoe.janus.reshard import build_rescaled, rescaled_spec
from jaxmoe.mesh import MeshConfigError
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.expert_ffn.panels import Panels, plain
from jaxmoe.quantization import Quantized

MESH = "meshes/cpu-8.yaml"
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)
PROMPTS = [[7, 21, 33, 5, 90, 17, 64, 12, 48, 101, 9], [11, 3, 77, 29, 54]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
CASES = [
    ("tiny-random", "int8", False, MESH),  # D, F multiples of 16: the CPU kernel reads the int8 slots in place
    ("qwen3_moe", "fp8", True, MESH),  # fp8 blocks (dequantized per expert) and quantized attention projections
    # 2 devices per expert instance: each holds half of every slot's columns and their int8 scales
    ("mixtral", "int8", False, "meshes/cpu-8-tp2x2.yaml"),
]


def _generate(llm):
    out = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in out], np.array([[lp.logprob for lp in o.logprobs] for o in out])


def _path(checkpoint_dir, family):
    return family if family == "tiny-random" else checkpoint_dir(family)


def _expert_mesh_bytes(executor) -> tuple[int, int]:
    """(bytes of the routed-expert slot arrays on the expert devices, the same weights' bytes in bf16)."""
    devices = set(executor.sub.experts.devices.flat)
    held = bf16 = 0
    for layer in executor.params["layers"]:
        for k in ("w_gate", "w_up", "w_down"):
            if k not in layer.get("moe", {}):
                continue
            w = layer["moe"][k]
            assert isinstance(w, Quantized)
            for a in jax.tree.leaves(w):  # values (plain or column panels) and scales
                assert {s.device for s in a.addressable_shards} <= devices
                held += sum(s.data.nbytes for s in a.addressable_shards)
            bf16 += math.prod(w.shape) * 2
    return held, bf16


@pytest.mark.slow
@pytest.mark.parametrize("family,method,attention,mesh", CASES, ids=["-".join(map(str, c[:3])) for c in CASES])
def test_disaggregated_equals_monolithic_with_the_same_quantization(checkpoint_dir, family, method, attention, mesh):
    path = _path(checkpoint_dir, family)
    kw = dict(dtype="float32", quantization=method, quantize_attention=attention, **ENGINE)
    mono, dis = LLM(path, **kw), LLM(path, mesh=mesh, **kw)
    tokens, logprobs = _generate(dis)
    want_tokens, want_logprobs = _generate(mono)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
    held, bf16 = _expert_mesh_bytes(dis.executor)
    gate = next(ly for ly in dis.executor.params["layers"] if "moe" in ly)["moe"]["w_gate"]
    if mesh == MESH:
        assert held <= 0.55 * bf16, held / bf16
        # int8 slots the CPU kernel takes: stored as column panels, the layout it reads fastest
        assert isinstance(gate.q, Panels) == (family == "tiny-random" and cpu_kernel.available())
    else:  # each device of an expert instance: half the columns of its slots' values and scales
        for a in (gate.q, gate.scale):
            assert a.addressable_shards[0].data.shape[-1] * 2 == a.shape[-1]
    layer = next(ly for ly in dis.executor.params["layers"] if "attn" in ly)
    assert isinstance(layer["attn"]["o" if "o" in layer["attn"] else "q"], Quantized) == attention


def _assert_slots_hold(executor, placement, logical):
    """Slot s of MoE layer 1 holds expert placement[s]'s int8 values and scales (zeros when unused)."""
    for k in ("w_gate", "w_down"):
        slots = executor.params["layers"][1]["moe"][k]
        for s, e in enumerate(placement):
            for got, want in ((plain(slots.q), logical[k].q), (slots.scale, logical[k].scale)):
                np.testing.assert_array_equal(np.asarray(got[s]), np.asarray(want[e]) if e >= 0 else 0)


@pytest.mark.slow
def test_replacement_and_rescale_move_the_scales_with_their_weights(checkpoint_dir):
    path = checkpoint_dir("mixtral")
    dis = LLM(path, mesh=MESH, dtype="float32", quantization="int8", **ENGINE)
    ex = dis.executor
    want, _ = _generate(dis)  # the monolithic tokens: test_disaggregated_equals_monolithic_...
    logical = load_model(path, "float32", "int8")[1]["layers"][1]["moe"]
    C, old = ex.slots_per_instance, ex.placement()
    shifted = old[C:] + old[:C]  # every slot's expert now on the next instance
    assert ex.set_placement(shifted) > 0
    _assert_slots_hold(ex, shifted, logical)
    assert _generate(dis)[0] == want
    # live re-scaling's expert re-shard (2a6e -> 1a7e): 28 slots from the 24, scales alongside
    new, stats = build_rescaled(ex, rescaled_spec(ex.sub.spec, 1, 7), ENGINE["num_blocks"] * ENGINE["block_size"])
    assert new.num_expert_instances == 7 and stats.expert_slots_copied > 0
    _assert_slots_hold(new, new.placement(1), logical)


@pytest.mark.parametrize(
    "mesh,method,attention,field",
    [
        ("meshes/cpu-8-tp2x2.yaml", "fp8", False, "experts.devices_per_instance: 2"),
        ("meshes/cpu-8-tp2.yaml", "int8", True, "attention.devices_per_instance: 2"),
    ],
)
def test_split_instances_are_refused_naming_the_field(checkpoint_dir, mesh, method, attention, field):
    """fp8 blocks that a split of the FFN columns would cut, and quantized projections split by heads."""
    with pytest.raises(MeshConfigError, match=f"{field}: quantized"):
        LLM(checkpoint_dir("mixtral"), dtype="float32", mesh=mesh, quantization=method, quantize_attention=attention)
